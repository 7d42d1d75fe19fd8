#!/usr/bin/env python3
"""Benchmark (not a test): iterative and PipeInfer tokens/s on 2 ranks locally and over the emulated
Ethernet cluster (launch/cluster/netns-cluster.sh) at 1 Gbit/s and 100 Mbit/s, each beside the MPI ping-pong
bandwidth and latency measured in the same run. Needs root and iproute2 for the shaped rows.

    python launch/bench/bench_network.py [-n 64] [--prompt-name code] [--repeats 3] [--draft-at thread|rank]
                                         [--out results/bench_network.csv]

2 ranks x 1 thread (this machine has 2 cores), the default Qwen2.5-Coder-1.5B target, PipeInfer with its
default draft (Gemma 3 270M) in a thread of rank 0, or with --draft-at rank on a host of its own (3 hosts: the
paper's layout; the draft link's bytes are reported too). --repeats R measures every (links, mode) once per round, in the same order, for
R rounds, and compares medians (one run moves by 8-15% on this shared host). Writes the CSV (one row per
run) and results/bench_network.png (medians).
"""
from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # launch/: the shared harness
from charts import grouped_bars  # noqa: E402
from harness import CLUSTER, MPIEXEC, ROOT, write_csv  # noqa: E402

BIN = Path(sys.executable).parent
PROBE = re.compile(r"bandwidth ([0-9.]+) Mbit/s .*latency ([0-9.]+) us")


def generate_args(mode: str, n: int, prompt_name: str, draft_at: str) -> list[str]:
    beside = ["--draft-at", draft_at] if mode == "pipeinfer" else []
    return [sys.executable, "-m", "mpi4py", "-m", "pipeinfer", "generate", "--prompt-name", prompt_name, "-n", str(n),
            "--mode", mode, "-t", "1", "--ignore-eos", "--json", "-q"] + beside


def n_hosts(mode: str, draft_at: str) -> int:
    """2 target ranks, and the draft's own with --draft-at rank (PipeInfer only)."""
    return 3 if mode == "pipeinfer" and draft_at == "rank" else 2


def run_local(mode: str, n: int, prompt_name: str, draft_at: str) -> tuple[dict, tuple[float, float]]:
    probe = subprocess.run([MPIEXEC, "-n", "2", sys.executable, "-m", "mpi4py", "-m", "pipeinfer.wire.netprobe"],
                           capture_output=True, text=True, check=True).stdout
    p = subprocess.run([MPIEXEC, "-n", str(n_hosts(mode, draft_at))] + generate_args(mode, n, prompt_name, draft_at),
                       capture_output=True, text=True, check=True)
    return json.loads(p.stdout.strip().splitlines()[-1]), _probe(probe)


def run_shaped(rate: str, mode: str, n: int, prompt_name: str, draft_at: str) -> tuple[dict, tuple[float, float]]:
    env = dict(os.environ, NETNS_RATE=rate, MPIEXEC=MPIEXEC, PATH=f"{BIN}{os.pathsep}{os.environ['PATH']}")
    p = subprocess.run(["bash", str(CLUSTER / "netns-cluster.sh"), "run", str(n_hosts(mode, draft_at)), "--"]
                       + generate_args(mode, n, prompt_name, draft_at), capture_output=True, text=True, env=env)
    if p.returncode != 0:
        raise SystemExit(f"netns run at {rate} failed ({p.returncode}):\n{p.stderr[-3000:]}")
    return json.loads(p.stdout.strip().splitlines()[-1]), _probe(p.stderr)


def _probe(text: str) -> tuple[float, float]:
    m = PROBE.search(text)
    if not m:
        raise SystemExit(f"no ping-pong line in:\n{text[-2000:]}")
    return float(m.group(1)), float(m.group(2))


def plot(rows: list[dict], out: Path, draft_at: str) -> None:
    settings = list(dict.fromkeys(r["network"] for r in rows))
    modes = list(dict.fromkeys(r["mode"] for r in rows))
    labels = []
    for s in settings:
        r = next(r for r in rows if r["network"] == s)
        labels.append(f"{s}\nMPI ping-pong {r['pingpong_mbit_s']:.0f} Mbit/s\n{r['pingpong_latency_us']:.0f} us")
    where = "the draft on a third host" if draft_at == "rank" else "the draft in a thread of rank 0"
    grouped_bars(out, settings, modes, lambda s, mode: statistics.median(
                     r["gen_tokens_per_s"] for r in rows if r["network"] == s and r["mode"] == mode),
                 ylabel="generation tokens/s (median)", group_labels=labels, figsize=(7, 4), bar_labels=True,
                 xtick_kw={"fontsize": 8}, ylim_top=1.25 * max(r["gen_tokens_per_s"] for r in rows),  # legend room
                 title=f"Qwen2.5-Coder-1.5B on 2 ranks x 1 thread ({where}): local vs emulated links", title_size=9,
                 dpi=120)

def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("-n", type=int, default=64)
    ap.add_argument("--prompt-name", default="code")
    ap.add_argument("--modes", default="iterative,pipeinfer")
    ap.add_argument("--rates", default="1gbit,100mbit")
    ap.add_argument("--repeats", type=int, default=1)
    ap.add_argument("--draft-at", choices=["thread", "rank"], default="thread", help="where PipeInfer's draft runs")
    ap.add_argument("--out", default=str(ROOT / "results" / "bench_network.csv"))
    args = ap.parse_args()
    networks, modes = ["local"] + args.rates.split(","), args.modes.split(",")
    rows = []
    for rnd in range(args.repeats):
        for network in networks:
            for mode in modes:
                if network == "local":
                    res, (mbit, lat) = run_local(mode, args.n, args.prompt_name, args.draft_at)
                else:
                    res, (mbit, lat) = run_shaped(network, mode, args.n, args.prompt_name, args.draft_at)
                s = res["stats"]
                row = {"timestamp": time.strftime("%Y-%m-%dT%H:%M:%S"), "round": rnd, "network": network,
                       "mode": mode, "hosts": n_hosts(mode, args.draft_at), "n": args.n, "prompt": args.prompt_name,
                       "gen_tokens_per_s": round(s["gen_tokens_per_s"], 3),
                       "acceptance_rate": round(s["acceptance_rate"], 3), "ttft_s": round(s["ttft_s"], 4),
                       "pingpong_mbit_s": mbit, "pingpong_latency_us": lat, "tokens": len(res["tokens"]),
                       "bytes_per_token_per_link": " ".join(f"{b:.0f}" for b in s.get("bytes_per_token", [])),
                       "draft_link_bytes_per_token": " ".join(f"{b:.0f}" for b in s.get("draft_bytes_per_token", [])),
                       "first_tokens": " ".join(map(str, res["tokens"][:8]))}
                rows.append(row)
                print({k: v for k, v in row.items() if k != "first_tokens"}, flush=True)
    med = {(net, mode): statistics.median(r["gen_tokens_per_s"] for r in rows if (r["network"], r["mode"]) == (net, mode))
           for net in networks for mode in modes}
    for mode in modes:
        base = med[("local", mode)]
        print(f"{mode} (median of {args.repeats}): " + ", ".join(
            f"{net} {med[(net, mode)]:.2f} tok/s ({med[(net, mode)] / base:.2f}x local)" for net in networks))
    out = Path(args.out)
    write_csv(out, rows)
    plot(rows, out.with_suffix(".png"), args.draft_at)
    print(f"wrote {out} and {out.with_suffix('.png')}")


if __name__ == "__main__":
    main()
