#!/usr/bin/env python3
"""Load test (not a unit test) of `pipeinfer serve`: loopback only, bounded, stops by itself.

    python launch/bench/serve_load.py [--requests 64] [--clients 8] [--max-tokens 16] [--out results/serve_load.csv]
                                      [--config '--parallel 1' --config ''] [-- SERVE ARGS...]
    python launch/bench/serve_load.py --sweep 1,2,4,8 --requests-per-client 4 --out results/serve_sweep.csv
    python launch/bench/serve_load.py --config '--np 3' --kill-rank 1 --kill-after 10 --out results/serve_lost_rank.csv
    python launch/bench/serve_load.py --netns 3 --config '--hostfile {hosts} --stall-timeout 10' --kill-rank 2 \
                                --fault cut --out results/serve_netcut.csv
    python launch/bench/serve_load.py --config=--no-webui --config '{watch}' --rounds 2 --out results/serve_page.csv
    python launch/bench/serve_load.py --config '--np 3' --clients 16 --duration 1200 --kill-rank 1 --kill-after 400 \
        --kill-after 800 --rss-every 10 --max-tokens 32 --out results/soak.csv     # a 20-minute soak
    python launch/bench/serve_load.py --netns 3 --config '--hostfile {hosts} --stall-timeout 10 {own-disks}' \
        --config '--hostfile {hosts} --stall-timeout 10 {model-on-h0}' --kill-rank 2 --fault cut \
        --out results/serve_lost_weights.csv

`{watch}` in a config: while each load runs, a headless chromium (selenium, Debian's chromium-driver) shows the
server's page, which polls /state every second, and /metrics is scraped every second: what watching the server
costs, against a config without it (the browser shares the machine's cores). `{poll}`: the same requests (/state
and /metrics each second) from a thread, without a browser: what the server itself pays.

--duration S keeps the clients asking for S seconds; --rss-every samples the server's and rank 0's resident memory
and fails the run when rank 0's grew 5% or more over a process's life after --warmup (a soak).

A config with --np or --hostfile starts a supervised server (no mpiexec: it runs the pipeline's job itself);
--kill-rank R injects --fault into rank R of that job --kill-after seconds into each load: `kill` (SIGKILL),
`stop` (SIGSTOP: a frozen rank, found by the stall timeout) or `cut` (its emulated host's link taken down,
--netns only), and the summary says how long the streams paused (every request must still complete with its
reference answer). --netns N runs the configs on N emulated hosts (launch/cluster/netns-cluster.sh: root, iproute2;
`{hosts}` in a config is their hostfile, h0 first; the supervisor reaches them through PIPEINFER_MPI_ARGS).
`{own-disks}` in a config gives each emulated host a fresh disk of its own (its own stage files and weights cache:
a re-form writes new stage files, as on real hosts), `{model-on-h0}` the same with the model on h0 only (the
other hosts get their layers over the network, and a re-form moves only the layers a host lacks).

For each --config in turn (default: `--parallel 1`, today's one-at-a-time server, then the default) starts
`mpiexec -n 2 pipeinfer serve` on a free loopback port (default model and draft, 1 thread per rank; SERVE ARGS
replace those), then:
1. (first server only) asks each (prompt, seed) of the mix once, alone: the reference answers;
2. runs --requests requests from --clients concurrent clients with the `openai` package: a third streaming,
   a third not, a third disconnecting after the first piece of generated text (with --sweep: for each client
   count, clients x --requests-per-client requests, streaming and not);
3. checks that every completed request's text equals the reference for its prompt and seed and that no
   request is lost, prints p50/p95 latency and tokens/s and their ratios to the first config's measured in
   the same run, writes one CSV row per request, one summary row per (config, load), and stops the server.
"""
from __future__ import annotations

import argparse
import contextlib
import csv
import http.client
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # launch/: the shared harness
from harness import (CLUSTER, MPIEXEC, ROOT, free_port, headless_chromium, new_tag, rank_pids, tagged_env, write_csv)  # noqa: E402


PROMPTS = [
    "Write a Python function that checks whether a number is prime.",
    "Explain what a hash map is in two sentences.",
    "Write a shell command that counts the lines of every .py file in a directory.",
    "What is the difference between a list and a tuple in Python?",
]
SEEDS = [(0.0, 0), (0.7, 1)]  # (temperature, seed): greedy, and a seeded sample


def start_server(port: int, serve_args: list[str], log_path: Path, tag: str,
                 pythonpath: str | None = None) -> subprocess.Popen:
    """The server, its processes (and its supervised job's) tagged `tag` in their environment (kill_later finds its ranks by it);
    with `pythonpath`, the pipeinfer package of that checkout."""
    cmd = [MPIEXEC, "-n", "2", sys.executable, "-m", "mpi4py", "-m", "pipeinfer", "serve", "--host", "127.0.0.1",
           "--port", str(port)] + serve_args
    if supervised(serve_args):  # a supervised server starts its pipeline's job itself (supervisor/supervisor.py)
        cmd = [sys.executable, "-m", "pipeinfer", "serve", "--host", "127.0.0.1", "--port", str(port)] + serve_args
    # `python -m` puts the working directory first on the path: another checkout's runs from there
    proc = subprocess.Popen(cmd, stdout=open(log_path, "w"), stderr=subprocess.STDOUT, start_new_session=True,
                            env=tagged_env(tag, **({"PYTHONPATH": pythonpath} if pythonpath else {})), cwd=pythonpath)
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


def ask(client, model: str, port: int, prompt: str, temp: float, seed: int, how: str, max_tokens: int) -> dict:
    """One request: plain, streamed, or streamed and hung up after the first piece of text ("disconnect")."""
    kw = dict(model=model, messages=[{"role": "user", "content": prompt}], max_tokens=max_tokens,
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
                PIECES_AT.append(time.monotonic())
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


MIX = [(p, t, s) for p in PROMPTS for t, s in SEEDS]
PIECES_AT: list[float] = []  # when each streamed piece arrived (time.monotonic), every request


def kill_later(tag: str, rank: int, after_s: float, fault: dict, how: str = "kill") -> threading.Timer:
    """Inject `how` (kill, stop, cut) into rank `rank` of the supervised job of the server tagged `tag` `after_s`
    seconds from now; `fault` gets when, and the pid of a stopped rank (to be killed at the end)."""
    def inject() -> None:
        pid = rank_pids(tag, attached=True).get(rank)
        if pid is None:
            return
        if how == "cut":  # the root side of host h<rank>'s veth pair (one rank per emulated host)
            subprocess.run(["ip", "link", "set", f"pi-h{rank}", "down"], check=True)
        else:
            os.kill(pid, signal.SIGSTOP if how == "stop" else signal.SIGKILL)
            fault["stopped"] = pid if how == "stop" else None
        fault["t_kill"] = time.monotonic()
        print(f"{how}: rank {rank} (pid {pid}) {after_s:.0f} s into the load", flush=True)
    timer = threading.Timer(after_s, inject)
    timer.start()
    return timer


def supervised(serve_args: list[str]) -> bool:
    return "--np" in serve_args or "--hostfile" in serve_args


@contextlib.contextmanager
def watching(port: int, how: str | None):
    """While the block runs: `browser`, a headless chromium on the server's page (which polls /state every second)
    and a /metrics scrape every second; `poll`, the same requests from a thread (what the server pays, without a
    browser sharing its cores); None, nothing."""
    if how is None:
        yield
        return
    stop = threading.Event()

    def get(path: str) -> None:
        with contextlib.suppress(OSError):
            conn = http.client.HTTPConnection("127.0.0.1", port, timeout=5)
            conn.request("GET", path)
            conn.getresponse().read()
            conn.close()

    def scrape() -> None:
        while not stop.wait(1.0):
            for path in ("/metrics",) if how == "browser" else ("/state", "/metrics"):
                get(path)
    scraper = threading.Thread(target=scrape, daemon=True)
    if how == "poll":
        get("/")
        scraper.start()
        try:
            yield
        finally:
            stop.set()
        return
    browser = headless_chromium()
    try:
        browser.get(f"http://127.0.0.1:{port}/")
        scraper.start()
        yield
    finally:
        stop.set()
        browser.quit()


def rss_mb(pid: int | None) -> float | None:
    try:
        line = next(ln for ln in Path(f"/proc/{pid}/status").read_text().splitlines() if ln.startswith("VmRSS:"))
        return int(line.split()[1]) / 1024
    except (OSError, StopIteration, TypeError):
        return None


@contextlib.contextmanager
def rss_sampler(server_pid: int, tag: str, every_s: float | None, samples: list):
    """While the block runs, every `every_s` seconds: (time, server's RSS, rank 0's pid and RSS) into samples."""
    if not every_s:
        yield
        return
    stop, t0 = threading.Event(), time.monotonic()

    def sample() -> None:
        while not stop.wait(every_s):
            rank0 = rank_pids(tag, attached=True).get(0)
            samples.append((time.monotonic() - t0, rss_mb(server_pid), rank0, rss_mb(rank0)))
    th = threading.Thread(target=sample, daemon=True)
    th.start()
    try:
        yield
    finally:
        stop.set()
        th.join()


def rss_growth(samples: list, warmup_s: float) -> dict:
    """After warm-up: the server's RSS growth (last / first sample), and rank 0's over the life of each of its
    processes (a re-formed job has a new rank 0; its own warm-up is the first warmup_s of its life), the largest."""
    after = [s for s in samples if s[0] >= warmup_s and s[1]]
    out = {"server_rss_growth": round(after[-1][1] / after[0][1] - 1, 4) if len(after) > 1 else None}
    growth = []
    for pid in dict.fromkeys(s[2] for s in samples if s[2]):
        mine = [s for s in samples if s[2] == pid and s[3]]
        life = [s for s in mine if s[0] - mine[0][0] >= warmup_s]
        if len(life) > 1:
            growth.append(life[-1][3] / life[0][3] - 1)
    out["rank0_rss_growth"] = round(max(growth), 4) if growth else None
    out["rank0_processes"] = len({s[2] for s in samples if s[2]})
    return out


def run_load(serve_args: list[str], log_path: Path, loads: list[tuple[int, int]], max_tokens: int,
             kinds: tuple[str, ...], reference: dict | None, kill: tuple[int, list[float], str] | None = None,
             watch: str | None = None, duration_s: float | None = None, rss_every_s: float | None = None,
             warmup_s: float = 120.0) -> tuple[list[dict], list[dict], dict]:
    """One server with these options; for each (clients, requests) in `loads` a burst of requests (with duration_s:
    the clients keep asking until then). Returns the per-request rows, one summary per load, and the reference
    answers (asked alone, first)."""
    port, tag = free_port(), new_tag()
    proc = start_server(port, serve_args, log_path, tag)
    from openai import OpenAI
    client = OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="none", max_retries=0, timeout=600)
    model = client.models.list().data[0].id
    rows, summaries, lock = [], [], threading.Lock()
    try:
        if reference is None:
            reference = {m: ask(client, model, port, *m, "plain", max_tokens)["text"] for m in MIX}
            print(f"reference answers: {len(reference)} (prompt, temperature, seed) alone", flush=True)
        for n_clients, n_requests in loads:
            jobs = [(MIX[i % len(MIX)], kinds[i % len(kinds)]) for i in range(n_requests)]
            burst: list[dict] = []

            deadline = time.monotonic() + duration_s if duration_s else None

            def one(i: int) -> None:
                if deadline is not None and time.monotonic() >= deadline:
                    return
                (prompt, temp, seed), how = jobs[i]
                try:
                    r = ask(client, model, port, prompt, temp, seed, how, max_tokens)
                    status = "ok" if how == "disconnect" or r["text"] == reference[(prompt, temp, seed)] else "differs"
                except Exception as e:  # a lost request: counted, not hidden
                    r, status = {"text": None, "tokens": 0, "latency_s": float("nan"), "first_s": None}, f"error: {e}"
                with lock:
                    burst.append({"serve_args": " ".join(serve_args), "clients": n_clients, "request": i, "kind": how,
                                  "prompt": PROMPTS.index(prompt), "temperature": temp, "seed": seed, "status": status,
                                  "completion_tokens": r["tokens"], "latency_s": round(r["latency_s"], 3),
                                  "first_piece_s": round(r["first_s"], 3) if r["first_s"] else ""})

            t0 = time.perf_counter()
            fault: dict = {}
            timers = [kill_later(tag, kill[0], after, fault, kill[2]) for after in kill[1]] \
                if kill and supervised(serve_args) else []
            samples: list = []
            with watching(port, watch), rss_sampler(proc.pid, tag, rss_every_s, samples), \
                    ThreadPoolExecutor(n_clients) as pool:
                list(pool.map(one, range(n_requests)))
            wall = time.perf_counter() - t0
            for timer in timers:
                timer.cancel()
            burst.sort(key=lambda r: r["request"])
            rows += burst
            summaries.append(summarize(burst, wall, n_clients, serve_args))
            if "t_kill" in fault:  # the longest pause of the streams from the kill on (pieces already sent still
                times = [fault["t_kill"]] + sorted(t for t in PIECES_AT if t > fault["t_kill"])  # arrive first)
                summaries[-1]["stall_s"] = round(max(b - a for a, b in zip(times, times[1:])), 2) if times[1:] else None
                summaries[-1]["line"] += (f"; rank {kill[0]} {kill[2]} at {', '.join(f'{k:.0f}' for k in kill[1])} s: "
                                          f"the streams paused {summaries[-1]['stall_s']} s at most (after the last)")
            if samples:
                summaries[-1].update(rss_growth(samples, warmup_s))
                summaries[-1]["line"] += (f"; after {warmup_s:.0f} s of warm-up the server's RSS grew "
                                          f"{summaries[-1]['server_rss_growth']}, rank 0's "
                                          f"{summaries[-1]['rank0_rss_growth']} "
                                          f"({summaries[-1]['rank0_processes']} rank-0 processes)")
                log_path.with_suffix(".rss.csv").write_text("t_s,server_rss_mb,rank0_pid,rank0_rss_mb\n" + "".join(
                    ",".join("" if x is None else f"{x:.1f}" if isinstance(x, float) else str(x) for x in smp) + "\n"
                    for smp in samples))
            if fault.get("stopped"):  # the frozen rank, if the failed job's teardown left it behind
                with contextlib.suppress(ProcessLookupError):
                    os.kill(fault["stopped"], signal.SIGKILL)
            print(summaries[-1]["line"], flush=True)
        health = json.loads(urlopen_health(port))
        for s in summaries:
            s["queue_empty"] = health.get("queued") == 0
    finally:
        rc = stop_server(proc)
    for s in summaries:
        s["server_exit"] = rc
    return rows, summaries, reference


def summarize(burst: list[dict], wall_s: float, n_clients: int, serve_args: list[str]) -> dict:
    done = [r for r in burst if r["kind"] != "disconnect"]
    lat = np.array([r["latency_s"] for r in done])
    n_tokens = sum(r["completion_tokens"] for r in done)
    bad = [r for r in burst if r["status"] != "ok"]
    out = {"serve_args": " ".join(serve_args), "clients": n_clients, "requests": len(burst), "completed": len(done),
           "wall_s": round(wall_s, 2), "tokens_per_s": round(n_tokens / wall_s, 3),
           "p50_s": round(float(np.percentile(lat, 50)), 3), "p95_s": round(float(np.percentile(lat, 95)), 3),
           "bad": len(bad)}
    out["line"] = (f"[{out['serve_args']}] {len(burst)} requests from {n_clients} clients ({len(done)} completed) in "
                   f"{wall_s:.1f} s; latency p50 {out['p50_s']:.2f} s, p95 {out['p95_s']:.2f} s; "
                   f"{out['tokens_per_s']:.2f} completion tokens/s; {len(bad)} lost or different")
    return out


def plot_sweep(summary_csv: Path, png: Path) -> None:
    """Server tokens/s and p50 latency against concurrent clients, one line per config."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    rows = list(csv.DictReader(open(summary_csv)))
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(10, 4))
    for cfg in dict.fromkeys(r["serve_args"] for r in rows):
        mine = sorted((r for r in rows if r["serve_args"] == cfg), key=lambda r: int(r["clients"]))
        x = [int(r["clients"]) for r in mine]
        label = cfg.replace("-t 1 -c 2048", "").strip() or "default"
        ax1.plot(x, [float(r["tokens_per_s"]) for r in mine], marker="o", label=label)
        ax2.plot(x, [float(r["p50_s"]) for r in mine], marker="o", label=label)
    for ax, what in ((ax1, "completion tokens/s (server)"), (ax2, "p50 latency (s)")):
        ax.set_xscale("log", base=2)
        ax.set_xlabel("concurrent clients")
        ax.set_ylabel(what)
        ax.grid(alpha=0.3)
    ax1.legend()
    fig.suptitle("pipeinfer serve, 2 ranks x 1 thread on 2 cores (launch/bench/serve_load.py --sweep)")
    fig.tight_layout()
    fig.savefig(png, dpi=120)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--requests", type=int, default=64)
    ap.add_argument("--clients", type=int, default=8)
    ap.add_argument("--max-tokens", type=int, default=16)
    ap.add_argument("--sweep", default=None, help="client counts, e.g. 1,2,4,8: each with --requests-per-client")
    ap.add_argument("--requests-per-client", type=int, default=4)
    ap.add_argument("--config", action="append", default=None,
                    help="serve options of one server to compare (repeat) [default: '--parallel 1' and '' (the "
                         "default); with --sweep also '--mode iterative']")
    ap.add_argument("--out", default=str(ROOT / "results" / "serve_load.csv"))
    ap.add_argument("--replot", action="store_true", help="only redraw the sweep's PNG from OUT's summary CSV")
    ap.add_argument("--kill-rank", type=int, default=None,
                    help="supervised configs (--np): SIGKILL this rank of the pipeline's job during each load")
    ap.add_argument("--kill-after", type=float, action="append", default=None,
                    help="seconds into the load (repeat for more kills) [default: 10]")
    ap.add_argument("--duration", type=float, default=None,
                    help="with --clients: the clients keep asking for this many seconds (a soak) instead of --requests")
    ap.add_argument("--rss-every", type=float, default=None,
                    help="sample the server's and rank 0's resident memory this often (s); the summary says how much "
                         "each grew after --warmup")
    ap.add_argument("--warmup", type=float, default=120.0, help="with --rss-every: seconds before growth is counted")
    ap.add_argument("--fault", choices=["kill", "stop", "cut"], default="kill", help="what --kill-rank does")
    ap.add_argument("--rounds", type=int, default=1, help="run every config this many times, the order rotating; "
                    "ratios are medians over the rounds")
    ap.add_argument("--netns", type=int, default=None, help="run on this many emulated hosts ({hosts} in --config)")
    ap.add_argument("serve_args", nargs="*", help="options every server gets [default: -t 1 -c 2048]")
    args = ap.parse_args()
    common = args.serve_args or ["-t", "1", "-c", "2048"]
    configs = args.config or (["--parallel 1", "--mode iterative", ""] if args.sweep else ["--parallel 1", ""])
    if args.sweep:
        loads = [(int(c), int(c) * args.requests_per_client) for c in args.sweep.split(",")]
        kinds: tuple[str, ...] = ("plain", "stream")
    else:
        n_requests = 1_000_000 if args.duration else args.requests  # with --duration the clients stop by the clock
        loads, kinds = [(args.clients, n_requests)], ("plain", "stream", "disconnect")
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    if args.replot:
        return plot_sweep(out.with_name(out.stem + "_summary.csv"), out.with_suffix(".png"))
    if args.fault == "cut" and not args.netns:
        ap.error("--fault cut takes an emulated host's link down: give --netns N")
    rows, summaries, reference = [], [], None
    runs = [(rnd, configs[(rnd + i) % len(configs)]) for rnd in range(args.rounds) for i in range(len(configs))]
    for k, (rnd, config) in enumerate(runs):  # each round starts one config later: none always runs first
        kill = (args.kill_rank, args.kill_after or [10.0], args.fault) if args.kill_rank is not None else None
        disks = "h0" if "{model-on-h0}" in config else "own" if "{own-disks}" in config else None
        with emulated_hosts(args.netns, out.with_suffix(".hosts"), disks) as hosts:
            watch = "browser" if "{watch}" in config else "poll" if "{poll}" in config else None
            text = config.replace("{hosts}", str(hosts))
            for mark in ("{watch}", "{poll}", "{model-on-h0}", "{own-disks}"):
                text = text.replace(mark, "")
            serve_args = common + text.split()
            r, s, reference = run_load(serve_args, out.with_suffix(f".server{k}.log"), loads, args.max_tokens, kinds,
                                       reference, kill, watch, args.duration, args.rss_every, args.warmup)
        for x in r + s:
            x.update(round=rnd, config=config)
        rows += r
        summaries += s
    lines = [s.pop("line") for s in summaries]
    base = {(s["round"], s["clients"]): s for s in summaries if s["config"] == configs[0]}
    for s in summaries:
        b = base[(s["round"], s["clients"])]
        s["tokens_per_s_ratio"] = round(s["tokens_per_s"] / b["tokens_per_s"], 3) if b["tokens_per_s"] else None
        s["p50_ratio"] = round(s["p50_s"] / b["p50_s"], 3) if b["p50_s"] else None
    ratios = []
    for config in configs:
        for n_clients in dict.fromkeys(s["clients"] for s in summaries):
            mine = [s for s in summaries if (s["config"], s["clients"]) == (config, n_clients)]
            tps, p50 = (float(np.median([s[k] for s in mine])) for k in ("tokens_per_s_ratio", "p50_ratio"))
            ratios.append(f"[{' '.join(common)} {config}] {n_clients} clients: tokens/s x{tps:.3f}, p50 x{p50:.3f} of "
                          f"[{' '.join(common)} {configs[0]}]" + (f" (medians of {len(mine)} rounds)" if len(mine) > 1
                                                                   else ""))
    text = "\n".join(lines + ratios) + "\n"
    print("\n".join(ratios))
    write_csv(out, rows)
    write_csv(out.with_name(out.stem + "_summary.csv"), summaries, list(dict.fromkeys(k for x in summaries for k in x)),
              restval="")
    out.with_suffix(".txt").write_text(text)
    if args.sweep:
        plot_sweep(out.with_name(out.stem + "_summary.csv"), out.with_suffix(".png"))
    print(f"wrote {out}, {out.with_name(out.stem + '_summary.csv')}, {out.with_suffix('.txt')}")
    bad = [s for s in summaries if s["bad"] or s["server_exit"] != 0 or not s.get("queue_empty", True)
           or (s.get("rank0_rss_growth") or 0) >= 0.05]
    if bad:
        raise SystemExit(f"FAILED: {bad}")


@contextlib.contextmanager
def emulated_hosts(n: int | None, hostfile: Path, disks: str | None = None):
    """n hosts of the emulated cluster for one server (up, then down whatever happens), their hostfile, and the
    launcher options that reach them in PIPEINFER_MPI_ARGS; nothing when n is None. disks: "own" gives every host a
    fresh disk view of its own (NETNS_DISKS: its own stage files and weights cache, the model on every host), "h0"
    the same with the model on h0 only (the others get their layers over the network: ranks/weights.py)."""
    if not n:
        yield None
        return
    if disks:
        folder = Path(tempfile.mkdtemp(prefix="pipeinfer-disks-", dir="/var/tmp"))
        os.environ["NETNS_DISKS"] = str(folder)
        if disks == "own":
            os.environ["NETNS_HIDE"] = ""
    try:
        with _emulated(n, hostfile) as hosts:
            yield hosts
    finally:
        if disks:
            os.environ.pop("NETNS_DISKS", None)
            os.environ.pop("NETNS_HIDE", None)
            shutil.rmtree(folder, ignore_errors=True)


@contextlib.contextmanager
def _emulated(n: int, hostfile: Path):
    script = ["bash", str(CLUSTER / "netns-cluster.sh")]
    env = dict(os.environ, PATH=f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}")
    subprocess.run(script + ["up", str(n)], check=True, env=env, capture_output=True)
    hostfile.write_text("".join(f"h{i}\n" for i in range(n)))
    os.environ["PIPEINFER_MPI_ARGS"] = (f"-iface brpi -launcher ssh -launcher-exec {CLUSTER}/netns-exec "
                                        "-genv UCX_TLS tcp -genv FI_PROVIDER tcp")
    try:
        yield hostfile
    finally:
        del os.environ["PIPEINFER_MPI_ARGS"]
        subprocess.run(script + ["down", str(n)], env=env, capture_output=True)
        hostfile.unlink(missing_ok=True)


def urlopen_health(port: int) -> bytes:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
    conn.request("GET", "/health")
    return conn.getresponse().read()


if __name__ == "__main__":
    main()
