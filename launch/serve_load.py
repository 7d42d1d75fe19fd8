#!/usr/bin/env python3
"""Load test (not a unit test) of `pipeinfer serve`: loopback only, bounded, stops by itself.

    python launch/serve_load.py [--requests 64] [--clients 8] [--max-tokens 16] [--out results/serve_load.csv]
                                [-- SERVE ARGS...]

Starts `mpiexec -n 2 pipeinfer serve` on a free loopback port (default model and draft, 1 thread per rank;
SERVE ARGS replace those), then:
1. asks each (prompt, seed) of the mix once, alone: the reference answers;
2. runs --requests requests from --clients concurrent clients with the `openai` package: a third streaming,
   a third not, a third disconnecting after the first piece of generated text;
3. checks that every completed request's text equals the reference for its prompt and seed and that no
   request is lost, prints p50/p95 latency and tokens/s, writes one CSV row per request and a summary, and
   stops the server.
"""
from __future__ import annotations

import argparse
import csv
import http.client
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
PROMPTS = [
    "Write a Python function that checks whether a number is prime.",
    "Explain what a hash map is in two sentences.",
    "Write a shell command that counts the lines of every .py file in a directory.",
    "What is the difference between a list and a tuple in Python?",
]
SEEDS = [(0.0, 0), (0.7, 1)]  # (temperature, seed): greedy, and a seeded sample


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(port: int, serve_args: list[str], log_path: Path) -> subprocess.Popen:
    mpiexec = str(Path(sys.executable).parent / "mpiexec")
    cmd = [mpiexec, "-n", "2", sys.executable, "-m", "mpi4py", "-m", "pipeinfer", "serve", "--host", "127.0.0.1",
           "--port", str(port)] + serve_args
    proc = subprocess.Popen(cmd, stdout=open(log_path, "w"), stderr=subprocess.STDOUT, start_new_session=True)
    deadline = time.monotonic() + 600
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"the server exited with {proc.returncode}; see {log_path}")
        try:
            conn = http.client.HTTPConnection("127.0.0.1", port, timeout=5)
            conn.request("GET", "/health")
            if conn.getresponse().status == 200:
                return proc
        except OSError:
            time.sleep(0.5)
    stop_server(proc)
    raise SystemExit("the server did not come up in 600 s")


def stop_server(proc: subprocess.Popen) -> int:
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGINT)
        try:
            proc.wait(timeout=120)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    return proc.returncode


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--requests", type=int, default=64)
    ap.add_argument("--clients", type=int, default=8)
    ap.add_argument("--max-tokens", type=int, default=16)
    ap.add_argument("--out", default=str(ROOT / "results" / "serve_load.csv"))
    ap.add_argument("serve_args", nargs="*", help="pipeinfer serve options [default: -t 1 -c 2048]")
    args = ap.parse_args()
    serve_args = args.serve_args or ["-t", "1", "-c", "2048"]
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    port = free_port()
    proc = start_server(port, serve_args, out.with_suffix(".server.log"))
    from openai import OpenAI
    client = OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="none", max_retries=0, timeout=600)
    model = client.models.list().data[0].id
    try:
        def ask(prompt: str, temp: float, seed: int, how: str) -> dict:
            kw = dict(model=model, messages=[{"role": "user", "content": prompt}], max_tokens=args.max_tokens,
                      temperature=temp, seed=seed)
            t0 = time.perf_counter()
            if how == "plain":
                r = client.chat.completions.create(**kw)
                return {"text": r.choices[0].message.content, "tokens": r.usage.completion_tokens,
                        "latency_s": time.perf_counter() - t0, "first_s": time.perf_counter() - t0}
            if how == "stream":
                parts, first, n = [], None, 0
                for ch in client.chat.completions.create(stream=True, stream_options={"include_usage": True}, **kw):
                    if ch.choices and ch.choices[0].delta.content:
                        first = first or time.perf_counter() - t0
                        parts.append(ch.choices[0].delta.content)
                    if ch.usage:
                        n = ch.usage.completion_tokens
                return {"text": "".join(parts), "tokens": n, "latency_s": time.perf_counter() - t0, "first_s": first}
            conn = http.client.HTTPConnection("127.0.0.1", port, timeout=600)  # "disconnect"
            conn.request("POST", "/v1/chat/completions", body=json.dumps(dict(kw, stream=True, max_tokens=256)),
                         headers={"Content-Type": "application/json"})
            resp = conn.getresponse()
            first = None
            while first is None:  # read up to the first generated text, then hang up mid-stream
                line = resp.fp.readline()
                if not line:
                    break
                if line.startswith(b"data: {"):
                    choices = json.loads(line[6:]).get("choices") or [{}]
                    if choices[0].get("delta", {}).get("content"):
                        first = time.perf_counter() - t0
            conn.sock.shutdown(socket.SHUT_RDWR)
            conn.close()
            return {"text": None, "tokens": 0, "latency_s": time.perf_counter() - t0, "first_s": first}

        mix = [(p, t, s) for p in PROMPTS for t, s in SEEDS]
        reference = {m: ask(*m, "plain")["text"] for m in mix}
        print(f"reference answers: {len(reference)} (prompt, temperature, seed) alone", flush=True)

        jobs = [(mix[i % len(mix)], ("plain", "stream", "disconnect")[i % 3]) for i in range(args.requests)]
        rows, lock = [], threading.Lock()

        def one(i: int) -> None:
            (prompt, temp, seed), how = jobs[i]
            try:
                r = ask(prompt, temp, seed, how)
                status = "ok" if how == "disconnect" or r["text"] == reference[(prompt, temp, seed)] else "differs"
            except Exception as e:  # a lost request: counted, not hidden
                r, status = {"text": None, "tokens": 0, "latency_s": float("nan"), "first_s": None}, f"error: {e}"
            with lock:
                rows.append({"request": i, "kind": how, "prompt": PROMPTS.index(prompt), "temperature": temp,
                             "seed": seed, "status": status, "completion_tokens": r["tokens"],
                             "latency_s": round(r["latency_s"], 3),
                             "first_piece_s": round(r["first_s"], 3) if r["first_s"] else ""})

        t0 = time.perf_counter()
        with ThreadPoolExecutor(args.clients) as pool:
            list(pool.map(one, range(args.requests)))
        wall = time.perf_counter() - t0
        health = json.loads(urlopen_health(port))
    finally:
        rc = stop_server(proc)
    rows.sort(key=lambda r: r["request"])
    done = [r for r in rows if r["kind"] != "disconnect"]
    lat = np.array([r["latency_s"] for r in done])
    n_tokens = sum(r["completion_tokens"] for r in done)
    bad = [r for r in rows if r["status"] != "ok"]
    summary = (f"{args.requests} requests from {args.clients} clients ({len(done)} completed, "
               f"{args.requests - len(done)} disconnected mid-stream) in {wall:.1f} s; "
               f"latency p50 {np.percentile(lat, 50):.2f} s, p95 {np.percentile(lat, 95):.2f} s; "
               f"{n_tokens / wall:.2f} completion tokens/s overall; "
               f"{len(bad)} lost or different from the single-request answer; queue empty at the end: "
               f"{health.get('queued') == 0}; server exit code {rc}; serve args: {' '.join(serve_args)}")
    print(summary)
    with open(out, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(rows[0]))
        w.writeheader()
        w.writerows(rows)
    out.with_suffix(".txt").write_text(summary + "\n")
    print(f"wrote {out}")
    if bad or rc != 0:
        raise SystemExit(f"FAILED: {bad[:3]} (server exit {rc})")


def urlopen_health(port: int) -> bytes:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
    conn.request("GET", "/health")
    return conn.getresponse().read()


if __name__ == "__main__":
    main()
