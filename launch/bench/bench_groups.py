#!/usr/bin/env python3
"""Benchmark (not a test): one stream on a tensor group of 2 ranks against the 2-stage pipeline and one process,
on this host and across the emulated 1 Gbit/s link, interleaved rounds, medians side by side.

    python launch/bench/bench_groups.py [-n 128] [--prompts code,story] [--repeats 3] [--links local,1gbit]
                                        [--out results/bench_groups.csv]

Every configuration of a prompt runs once per round, in the same order (one run moves by 8-15% on this shared
host): `generate -t 2` on one process (the limit of one stream on these 2 cores), the 2-stage pipeline's iterative
and PipeInfer (Gemma 3 270M beside rank 0), and a group of 2 ranks (`--tensor-parallel 2`) iterative and PipeInfer;
2 ranks x 1 thread everywhere. `1gbit` runs the 2-rank configurations on two network namespaces linked at 1 Gbit/s
(launch/cluster/netns-cluster.sh: needs root; MPI forced onto TCP). Prints each configuration's median tokens/s
and its ratio to the pipeline's iterative and to one process, and whether its tokens are one process's; writes
the CSV (one row per run).
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # launch/: the shared harness
from harness import CLUSTER, MPIEXEC, ROOT, write_csv  # noqa: E402
from quiet import run_quietly  # noqa: E402

BIN = Path(sys.executable).parent
PIPE_PI = ["--mode", "pipeinfer", "--draft", "gemma3-270m"]
CONFIGS = [  # (label, ranks, arguments after `generate`)
    ("one process -t 2", 1, ["--mode", "iterative", "-t", "2"]),
    ("pipeline iterative", 2, ["--mode", "iterative", "-t", "1"]),
    ("pipeline pipeinfer", 2, PIPE_PI + ["-t", "1"]),
    ("group iterative", 2, ["--mode", "iterative", "-t", "1", "--tensor-parallel", "2"]),
    ("group pipeinfer", 2, PIPE_PI + ["-t", "1", "--tensor-parallel", "2"]),
]


def command(link: str, ranks: int, args: list[str], prompt: str, n: int) -> tuple[list[str], dict | None]:
    gen = [sys.executable, "-m", "mpi4py", "-m", "pipeinfer", "generate", "--prompt-name", prompt, "-n", str(n),
           "--ignore-eos", "--json", "-q"] + args
    if link == "local":
        return ([MPIEXEC, "-n", str(ranks)] if ranks > 1 else []) + gen, None
    env = dict(os.environ, NETNS_RATE=link, MPIEXEC=MPIEXEC,
               PATH=f"{BIN}{os.pathsep}{os.environ['PATH']}")
    return ["bash", str(CLUSTER / "netns-cluster.sh"), "run", str(ranks), "--"] + gen, env


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("-n", type=int, default=128)
    ap.add_argument("--prompts", default="code,story")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--links", default="local,1gbit", help="local and/or shaped links (1gbit, 100mbit)")
    ap.add_argument("--out", default=str(ROOT / "results" / "bench_groups.csv"))
    args = ap.parse_args()
    rows: list[dict] = []
    one: dict[str, list[int]] = {}  # prompt -> one process's tokens
    for prompt in args.prompts.split(","):
        for rnd in range(args.repeats):
            for link in args.links.split(","):
                for label, ranks, extra in CONFIGS:
                    if link != "local" and ranks == 1:
                        continue
                    cmd, env = command(link, ranks, extra, prompt, args.n)
                    p, foreign = run_quietly(cmd, cwd=ROOT, env=env)
                    if p.returncode != 0:
                        raise SystemExit(f"{prompt} {label} over {link} failed ({p.returncode}):\n{p.stderr[-3000:]}")
                    out = json.loads(p.stdout.strip().splitlines()[-1])
                    s = out["stats"]
                    if ranks == 1:
                        one[prompt] = out["tokens"]
                    same = out["tokens"] == one.get(prompt)
                    agree = sum(a == b for a, b in zip(out["tokens"], one.get(prompt, []))) / max(len(out["tokens"]), 1)
                    rows.append({"prompt": prompt, "round": rnd, "link": link, "config": label,
                                 "tokens_per_s": round(s["gen_tokens_per_s"], 3), "ttft_s": round(s["ttft_s"], 4),
                                 "acceptance": round(s["acceptance_rate"], 3), "same_tokens_as_one_process": same,
                                 "prefix_agreement": round(agree, 3), "foreign_cpu_pct": round(foreign, 1)})
                    print(f"{prompt:<7} round {rnd} {link:<6} {label:<20} {s['gen_tokens_per_s']:6.2f} tokens/s"
                          f"{'' if same else '  (not one process tokens)'}", flush=True)
    out = Path(args.out)
    write_csv(out, rows, list(rows[-1]))
    print(f"\n{'prompt':<7} {'link':<6} {'config':<20} median tok/s   x pipeline iterative   x one process -t 2")
    for prompt in dict.fromkeys(r["prompt"] for r in rows):
        local_one = [r["tokens_per_s"] for r in rows if r["prompt"] == prompt and r["config"] == "one process -t 2"]
        for link in dict.fromkeys(r["link"] for r in rows):
            mine = [r for r in rows if r["prompt"] == prompt and r["link"] == link]
            base = statistics.median(r["tokens_per_s"] for r in mine if r["config"] == "pipeline iterative")
            for cfg in dict.fromkeys(r["config"] for r in mine):
                tps = statistics.median(r["tokens_per_s"] for r in mine if r["config"] == cfg)
                vs_one = f"{tps / statistics.median(local_one):.2f}x" if local_one else "-"
                print(f"{prompt:<7} {link:<6} {cfg:<20} {tps:12.2f}   {tps / base:8.2f}x {vs_one:>20}")
    print(f"wrote {out} (2 ranks x 1 thread, one process 1 x 2 threads; {args.repeats} interleaved rounds)")


if __name__ == "__main__":
    main()
