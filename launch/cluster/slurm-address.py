#!/usr/bin/env python3
"""Where the Slurm service of slurm-serve.sbatch answers now: the address file it writes at every start (one line,
http://NODE:PORT) read, the server's /health asked, and its base URL printed for an OpenAI client.

    python launch/cluster/slurm-address.py [ADDRESS_FILE] [--wait SECONDS] [--tunnel LOGIN]

    export OPENAI_BASE_URL=$(python launch/cluster/slurm-address.py /group/pipeinfer-serve.address)
    python launch/cluster/slurm-address.py FILE --tunnel you@login1   # the ssh line for a laptop

ADDRESS_FILE: default $PIPEINFER_ADDRESS_FILE, else ./pipeinfer-serve.address. --wait: keep asking that long (the
job may be starting, or requeued and pending). Exit 1 with one line when the server does not answer. Only the
standard library: any Python 3 of the cluster runs it, without pipeinfer.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
import urllib.error
import urllib.parse
import urllib.request

DEFAULT_FILE = "pipeinfer-serve.address"
PENDING = "the job may be starting, or requeued and pending: squeue -n pipeinfer-serve"


def read_address(path: str) -> str:
    """The address file's http://HOST:PORT (ValueError when it holds anything else)."""
    with open(path) as f:
        text = f.read().strip()
    url = urllib.parse.urlsplit(text)
    if url.scheme not in ("http", "https") or not url.hostname or url.port is None or url.path not in ("", "/"):
        raise ValueError(f"{path} holds {text[:80]!r}, not http://HOST:PORT")
    return f"{url.scheme}://{url.netloc}"


def health(base: str, timeout: float = 5.0) -> dict | None:
    """The server's /health (None when it does not answer)."""
    try:
        with urllib.request.urlopen(base + "/health", timeout=timeout) as r:
            return json.loads(r.read())
    except (OSError, ValueError):
        return None


def tunnel_line(base: str, login: str) -> str:
    """The ssh line that brings the service to http://127.0.0.1:PORT through the login host."""
    url = urllib.parse.urlsplit(base)
    return f"ssh -N -L {url.port}:{url.hostname}:{url.port} {login}"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("address_file", nargs="?", default=os.environ.get("PIPEINFER_ADDRESS_FILE", DEFAULT_FILE))
    ap.add_argument("--wait", type=float, default=0.0, help="seconds to keep asking a server that does not answer")
    ap.add_argument("--tunnel", metavar="LOGIN", help="print the ssh tunnel line through LOGIN (user@login-host)")
    args = ap.parse_args(argv)
    deadline = time.monotonic() + args.wait
    while True:
        try:
            base = read_address(args.address_file)
        except (OSError, ValueError) as e:
            base, why = "", f"no address in {args.address_file}: {getattr(e, 'strerror', None) or e} ({PENDING})"
        else:
            why = None if health(base) is not None else f"{base} does not answer ({PENDING})"
        if why is None or time.monotonic() >= deadline:
            break
        time.sleep(min(5.0, max(0.1, deadline - time.monotonic())))
    if why is not None:
        print(f"slurm-address: {why}", file=sys.stderr)
        return 1
    print(tunnel_line(base, args.tunnel) if args.tunnel else base + "/v1")
    return 0


if __name__ == "__main__":
    sys.exit(main())
