"""How messages name a rank: the host it runs on, and 'rank R (host H, pid P)'."""
from __future__ import annotations

import os
import socket
from collections.abc import Sequence


def host_name() -> str:
    """This rank's host: $PIPEINFER_HOST where a launcher sets it (the emulated cluster's namespaces share
    one hostname), else the hostname."""
    return os.environ.get("PIPEINFER_HOST") or socket.gethostname()


def who(rank: int, hosts: Sequence[tuple[str, int]]) -> str:
    """'rank R (host H, pid P)', from every rank's (host, pid) in rank order."""
    host, pid = hosts[rank]
    return f"rank {rank} (host {host}, pid {pid})"
