#!/usr/bin/env python3
"""Benchmark (not a test): many users at once, pipeinfer against what a user would serve with instead, side by side.

    python launch/bench/bench_serving.py [--clients 1,8,16] [--rounds 1] [--systems ...] [--out results/bench_serving]
                                         [--temperature T] [--baseline PATH]

The load (issue 53's): N clients in a closed loop (each sends its next request when its last one ended), 3 requests
per client (4 for one client), ~60-token code prompts (the same list for every system, in the same order),
32 greedy tokens each (EOS ignored), POST /v1/completions. Completion tokens/s is every request's completion tokens
over the load's wall time; latency is each request's, p50 and p95. With --temperature T every request samples at T
with a seed of its own (each prompt's seed is the same from load to load and system to system, so its answer is too).

Systems (2 cores: every process 1 thread, except the one-process server's 2):
- `llama-server`: llama.cpp's server, one process x 2 threads, `--parallel N` (continuous batching), flash
  attention: what the same two cores serve without a split.
- `llama-rpc`: llama-server x 1 thread with `--rpc` to a ggml-rpc-server x 1 thread that holds the layers
  pipeinfer's default split gives rank 1: the split a user would run with llama.cpp.
- `pipeinfer`: `mpiexec -n 2 pipeinfer serve -t 1` with its defaults (requests batched into shared decodes up to
  the stages' exact limit, --batch-rows auto).
- `pipeinfer-unbatched`: the same with `--batch-rows 1 --parallel 4` (one request's token per decode: the
  scheduler before batching).
- `pipeinfer-tiled`: the same with `--kernels tiled --parallel 32` (every multiply through llama.cpp's tiled kernel,
  exact to 32 rows; every request admitted at once up to 32 clients; the default 63-token prompt chunks, which
  served 1.14x the tokens/s of 16-token ones at 16 clients: docs/benchmarks.md).
- `pipeinfer-tiled-solo`: `pipeinfer-tiled` with `--draft-rides never` (the draft's rows never ride the users'
  decodes; not run unless named): what riding buys.
- `pipeinfer-fast`: the same with `--kernels fast --parallel 32` (batches of up to 16 rows; not exact).
- `--system NAME=SYSTEM ARGS`: one more, a pipeinfer system above with more serve options (compared with its
  numerics' group: the last `--kernels` given decides).
- `SYSTEM@base` (e.g. `pipeinfer@base`): a pipeinfer system above run from another checkout (--baseline PATH, e.g.
  a `git worktree` of main): a change measured against what it changes, side by side, its answers checked against
  the others'.
The llama.cpp programs are built from the llama.cpp that llama-cpp-python vendors (launch/bench/bench_peers.llama_bin).
Every round runs every (clients, system) once, the systems' order rotating from round to round; medians over rounds
and the ratios to llama-server and llama-rpc are printed and written to OUT_summary.csv, every load to OUT.csv.
pipeinfer's answers are checked against each other (each request's text must be the same under every exact
pipeinfer system of the same numerics and every load: the same kernels and prompt chunk, since `tiled` multiplies
otherwise than `repack` and a prompt's cells depend on its chunks).
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # launch/: the shared harness
from harness import ROOT, free_port, new_tag, on_path, write_csv  # noqa: E402

on_path("bench")
from bench_peers import llama_bin, ngl_same_split  # noqa: E402
from serve_load import start_server, stop_server  # noqa: E402

N_PREDICT = 32
N_CTX = 8192
SYSTEMS = ("llama-server", "llama-rpc", "pipeinfer", "pipeinfer-unbatched", "pipeinfer-tiled", "pipeinfer-fast")
BASE = "@base"  # a pipeinfer system's name + BASE: the same system run from the --baseline checkout
PIPEINFER_ARGS = {"pipeinfer": [], "pipeinfer-unbatched": ["--batch-rows", "1", "--parallel", "4"],
                  "pipeinfer-tiled": ["--kernels", "tiled", "--parallel", "32"],
                  "pipeinfer-tiled-solo": ["--kernels", "tiled", "--parallel", "32", "--draft-rides", "never"],
                  "pipeinfer-fast": ["--kernels", "fast", "--parallel", "32"]}



def numerics(args: list[str]) -> tuple[str, str] | None:
    """The numerics a pipeinfer system's answers have: its kernels, prompt chunk (a prompt's cells depend on both) and
    tensor groups (a group adds its partial sums in another order); None where they are not exact (--kernels fast)."""
    def last(flag: str, default: str) -> str:
        return next((args[i + 1] for i in range(len(args) - 2, -1, -1) if args[i] == flag), default)
    kernels = last("--kernels", "repack")
    groups = last("--groups", last("--tensor-parallel", last("-tp", "1")))
    return None if kernels == "fast" else (kernels, last("--prompt-chunk", "63"), groups)


# exact systems of the same numerics: each request's answer is one text under every system of a group and every load
EXACT = {name: n for name, args in PIPEINFER_ARGS.items() if (n := numerics(args)) is not None}

SNIPPETS = [
    "def quicksort(arr):\n    # sort a list of integers in place, using the last element as the pivot",
    "class LRUCache:\n    \"\"\"A least-recently-used cache with a fixed capacity.\"\"\"\n    def __init__(self, capacity):",
    "import numpy as np\n\ndef softmax(x, axis=-1):\n    \"\"\"Numerically stable softmax along an axis.\"\"\"",
    "// debounce: call fn at most once per `wait` milliseconds, after the calls stop\nfunction debounce(fn, wait) {",
    "-- the ten customers with the highest total order value in 2024\nSELECT c.name, SUM(o.total) AS spent\nFROM",
    "def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number, computed iteratively in O(n) time.\"\"\"",
    "#include <stdio.h>\n/* read integers from stdin until EOF and print their sum and their mean */\nint main(void) {",
    "def merge_sort(xs):\n    \"\"\"Return a sorted copy of xs using top-down merge sort.\"\"\"",
    "import pandas as pd\n\n# load sales.csv, keep the rows of 2024 and sum the revenue per region\ndf =",
    "class Stack:\n    \"\"\"A stack backed by a Python list, with push, pop, peek and is_empty.\"\"\"",
    "def binary_search(arr, target):\n    \"\"\"Index of target in the sorted list arr, or -1 when it is absent.\"\"\"",
    "// Rust: parse a comma-separated line of integers into a Vec<i64>, skipping blanks\nfn parse_line(line: &str)",
    "def levenshtein(a: str, b: str) -> int:\n    \"\"\"The edit distance between a and b (insertions, deletions, substitutions).\"\"\"",
    "package main\n\nimport \"fmt\"\n\n// print the first 20 prime numbers, one per line\nfunc main() {",
    "def flatten(nested):\n    \"\"\"Flatten arbitrarily nested lists of integers into one flat list.\"\"\"",
    "import re\n\ndef is_valid_email(address: str) -> bool:\n    \"\"\"A simple check that an address looks like user@host.tld.\"\"\"",
    "#!/bin/bash\n# back up every .conf file under /etc into a dated tar.gz in /var/backups\n",
    "def matrix_multiply(a, b):\n    \"\"\"Multiply two matrices given as lists of rows, without numpy.\"\"\"",
    "class Node:\n    def __init__(self, value, left=None, right=None):\n        self.value, self.left, self.right = value, left, right\n\ndef height(node):",
    "async function fetchJson(url, retries = 3) {\n  // fetch a URL and parse its JSON body, retrying on network errors",
    "def word_count(path):\n    \"\"\"Count how often each word occurs in a text file, case-insensitively.\"\"\"",
    "from dataclasses import dataclass\n\n@dataclass\nclass Point:\n    x: float\n    y: float\n\n    def distance_to(self, other):",
    "def dijkstra(graph, source):\n    \"\"\"Shortest distances from source in a graph given as {node: [(neighbour, weight)]}.\"\"\"",
    "def rle_encode(s: str) -> str:\n    \"\"\"Run-length encode a string: 'aaabcc' becomes 'a3b1c2'.\"\"\"",
]


def requests_for(n_clients: int) -> list[str]:
    n = 4 if n_clients == 1 else 3 * n_clients
    return [SNIPPETS[i % len(SNIPPETS)] for i in range(n)]


TEMPERATURE = 0.0  # --temperature


def complete(port: int, prompt: str) -> dict:
    sampled = {"temperature": TEMPERATURE, "seed": 1000 + SNIPPETS.index(prompt) if prompt in SNIPPETS else 0}
    body = json.dumps({"model": "m", "prompt": prompt, "max_tokens": N_PREDICT, "ignore_eos": True,
                       "cache_prompt": False, **(sampled if TEMPERATURE > 0 else {"temperature": 0})}).encode()
    req = urllib.request.Request(f"http://127.0.0.1:{port}/v1/completions", body, {"Content-Type": "application/json"})
    t0 = time.perf_counter()
    with urllib.request.urlopen(req, timeout=1800) as r:
        out = json.loads(r.read())
    return {"text": out["choices"][0]["text"], "tokens": out["usage"]["completion_tokens"],
            "latency_s": time.perf_counter() - t0}


def closed_loop(port: int, n_clients: int, prompts: list[str]) -> tuple[list[dict], float]:
    """Every prompt answered, n_clients at a time, each client sending its next when its last ended."""
    answers: dict[int, dict] = {}
    todo = list(enumerate(prompts))
    lock = threading.Lock()

    def client() -> None:
        while True:
            with lock:
                if not todo:
                    return
                i, p = todo.pop(0)
            answers[i] = complete(port, p)
    t0 = time.perf_counter()
    threads = [threading.Thread(target=client) for _ in range(n_clients)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return [answers[i] for i in range(len(prompts))], time.perf_counter() - t0


class LlamaServer:
    """llama-server (and, for llama-rpc, a ggml-rpc-server beside it) on a free loopback port."""

    def __init__(self, bins: Path, model: str, system: str, n_clients: int, log: Path):
        self.port, self.procs = free_port(), []
        common = ["-m", model, "--host", "127.0.0.1", "--port", str(self.port), "-c", str(N_CTX), "-b", "512",
                  "-fa", "on", "--parallel", str(max(1, n_clients)), "--no-webui"]
        out = open(log, "w")
        if system == "llama-rpc":
            rpc_port = free_port()
            self.procs.append(subprocess.Popen([str(bins / "ggml-rpc-server"), "-H", "127.0.0.1", "-p", str(rpc_port),
                                                "-t", "1"], stdout=out, stderr=subprocess.STDOUT))
            time.sleep(1.0)
            cmd = [str(bins / "llama-server"), *common, "-t", "1", "-tb", "1", "--rpc", f"127.0.0.1:{rpc_port}",
                   "-ngl", str(ngl_same_split(model))]
        else:
            cmd = [str(bins / "llama-server"), *common, "-t", "2", "-tb", "2"]
        self.procs.append(subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT))
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline:
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{self.port}/health", timeout=5) as r:
                    if r.status == 200:
                        return
            except OSError:
                time.sleep(0.5)
        self.stop()
        raise SystemExit(f"{system} did not come up; see {log}")

    def stop(self) -> None:
        for p in reversed(self.procs):
            p.terminate()
            try:
                p.wait(timeout=30)
            except subprocess.TimeoutExpired:
                p.kill()


def run_one(system: str, n_clients: int, bins: Path | None, model: str, work: Path, baseline: str | None) -> dict:
    prompts = requests_for(n_clients)
    log = work / f"{system}-{n_clients}.log"
    if system.startswith("llama"):
        server = LlamaServer(bins, model, system, n_clients, log)
        try:
            complete(server.port, "def warm_up():")
            answers, wall_s = closed_loop(server.port, n_clients, prompts)
        finally:
            server.stop()
    else:
        port = free_port()
        args = ["-t", "1", "-c", str(N_CTX), "--ignore-eos", "--alias", "m", "--max-queue", "128",  # as llama-server,
                *PIPEINFER_ARGS[system.removesuffix(BASE)]]                                     # queue every client
        proc = start_server(port, args, log, new_tag(), pythonpath=baseline if system.endswith(BASE) else None)
        try:
            complete(port, "def warm_up():")
            answers, wall_s = closed_loop(port, n_clients, prompts)
        finally:
            stop_server(proc)
    lat = sorted(a["latency_s"] for a in answers)
    tokens = sum(a["tokens"] for a in answers)
    return {"system": system, "clients": n_clients, "requests": len(prompts), "completion_tokens": tokens,
            "wall_s": round(wall_s, 2), "tokens_per_s": round(tokens / wall_s, 2),
            "p50_s": round(statistics.median(lat), 2), "p95_s": round(lat[min(len(lat) - 1, int(0.95 * len(lat)))], 2),
            "texts": [a["text"] for a in answers]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--clients", default="1,8,16")
    ap.add_argument("--rounds", type=int, default=1)
    ap.add_argument("--systems", default=",".join(SYSTEMS))
    ap.add_argument("--out", default=str(ROOT / "results" / "bench_serving"))
    ap.add_argument("--temperature", type=float, default=0.0)
    ap.add_argument("--baseline", help="a checkout of pipeinfer to run as the system pipeinfer-baseline")
    ap.add_argument("--system", action="append", default=[], metavar="NAME=SYSTEM ARGS",
                    help="one more pipeinfer system: a name, a pipeinfer system it extends and serve options, e.g. "
                         "'tiled-c32=pipeinfer-tiled --prompt-chunk 32' (name it in --systems)")
    a = ap.parse_args()
    for spec in a.system:
        name, _, rest = spec.partition("=")
        base, *extra = rest.split()
        if not name or base not in PIPEINFER_ARGS:
            raise SystemExit(f"--system {spec!r}: NAME=SYSTEM [serve options], SYSTEM one of {', '.join(PIPEINFER_ARGS)}")
        PIPEINFER_ARGS[name] = PIPEINFER_ARGS[base] + extra
        if (n := numerics(PIPEINFER_ARGS[name])) is not None:
            EXACT[name] = n
    global TEMPERATURE
    TEMPERATURE = a.temperature
    if any(s.endswith(BASE) for s in a.systems.split(",")) != bool(a.baseline):
        raise SystemExit(f"--baseline PATH and systems named SYSTEM{BASE} go together")
    from pipeinfer.engine.models import DEFAULT_TARGET, resolve_model
    model = str(resolve_model(DEFAULT_TARGET))
    systems = a.systems.split(",")
    bins = llama_bin() if any(s.startswith("llama") for s in systems) else None
    work = Path(tempfile.mkdtemp(prefix="pipeinfer-bench-serving-"))  # the servers' logs
    print(f"servers' logs in {work}", file=sys.stderr)
    rows: list[dict] = []
    for r in range(a.rounds):
        order = systems[r % len(systems):] + systems[:r % len(systems)]
        for n in map(int, a.clients.split(",")):
            for system in order:
                row = run_one(system, n, bins, model, work, a.baseline)
                row["round"] = r
                rows.append(row)
                print(f"round {r} {system:20s} {n:3d} clients: {row['tokens_per_s']:6.2f} tokens/s, p50 "
                      f"{row['p50_s']:.2f} s, p95 {row['p95_s']:.2f} s", flush=True)
    texts: dict[tuple[int, str], str] = {}
    for row in rows:  # every exact pipeinfer answer is the same, whatever the system (of its numerics) and the load
        if row["system"].removesuffix(BASE) in EXACT:
            for i, t in enumerate(row.pop("texts")):
                key = (i % len(SNIPPETS), EXACT[row["system"].removesuffix(BASE)])
                if texts.setdefault(key, t) != t:
                    raise SystemExit(f"{row['system']} at {row['clients']} clients answered prompt {key[0]} otherwise")
        else:
            row.pop("texts")
    write_csv(a.out + ".csv", rows)
    summary = []
    for n in map(int, a.clients.split(",")):
        med = {s: {k: statistics.median(r[k] for r in rows if r["system"] == s and r["clients"] == n)
                   for k in ("tokens_per_s", "p50_s", "p95_s")} for s in systems}
        for s in systems:
            row = {"clients": n, "system": s, **{k: round(v, 2) for k, v in med[s].items()}}
            for peer in ("llama-server", "llama-rpc"):
                if peer in med:
                    row[f"x_{peer}"] = round(med[s]["tokens_per_s"] / med[peer]["tokens_per_s"], 2)
            summary.append(row)
            print(json.dumps(row), flush=True)
    write_csv(a.out + "_summary.csv", summary)
    print(f"exact: every pipeinfer answer the same under every load ({len(texts)} prompts); rows in {a.out}.csv",
          file=sys.stderr)


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    main()
