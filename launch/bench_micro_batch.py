#!/usr/bin/env python3
"""Benchmark (not a test): PipeInfer's micro-batch size, fixed at --draft-max against --micro-batch auto,
beside iterative and synchronous speculative inference, side by side in one run.

    python launch/bench_micro_batch.py [-n 128] [--prompt-name code] [--out results/bench_micro_batch.csv]

2 ranks x 1 thread (this machine has 2 cores), the default Qwen2.5-Coder-1.5B target; drafters: the replay
instrument at agreement 0.5, 0.7, 0.9 (Gemma 3 270M's compute per draft token) and the Gemma 3 270M draft.
Each run is timed while the machine is otherwise quiet (launch/quiet.py). Prints each speed as a ratio of
iterative's and of speculative's.
"""
from __future__ import annotations

import argparse
import csv
import json
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "launch"))
from quiet import run_quietly  # noqa: E402

BIN = Path(sys.executable).parent
PI = [str(BIN / "mpiexec"), "-n", "2", sys.executable, "-m", "mpi4py", "-m", "pipeinfer"]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("-n", type=int, default=128)
    ap.add_argument("--prompt-name", default="code")
    ap.add_argument("--out", default=str(ROOT / "results" / "bench_micro_batch.csv"))
    args = ap.parse_args()
    base = ["generate", "--prompt-name", args.prompt_name, "-n", str(args.n), "-t", "1", "--ignore-eos", "--json", "-q",
            "--draft-at", "head"]  # the draft in series (bench_draft_layout.py compares the placements)
    rows = []

    def run(label: str, extra: list[str]) -> dict:
        p, foreign = run_quietly(PI + base + extra, cwd=ROOT)
        if p.returncode != 0:
            raise SystemExit(f"{label} failed ({p.returncode}):\n{p.stderr[-3000:]}")
        out = json.loads(p.stdout.strip().splitlines()[-1])
        s = out["stats"]
        rows.append({"config": label, "tokens_per_s": round(s["gen_tokens_per_s"], 3), "ttft_s": round(s["ttft_s"], 3),
                     "acceptance": round(s["acceptance_rate"], 3), "runs": s["n_runs"], "cancelled": s["n_cancelled"],
                     "micro_batch_sizes": json.dumps(s.get("draft_len_hist", {})), "foreign_cpu_pct": round(foreign, 1)})
        print(f"{label:<34} {s['gen_tokens_per_s']:6.2f} tokens/s", flush=True)
        return out

    with tempfile.TemporaryDirectory() as tmp:
        ref = Path(tmp) / "ref.json"
        ref.write_text(json.dumps(run("iterative", ["--mode", "iterative"])))
        for d in ("0.5", "0.7", "0.9", "gemma"):
            drafter = (["--draft", "gemma3-270m"] if d == "gemma" else
                       ["--drafter", "replay", "--replay-ref", str(ref), "--replay-accuracy", d, "--draft", "gemma3-270m"])
            run(f"speculative {d}", ["--mode", "speculative"] + drafter)
            run(f"pipeinfer {d} fixed", ["--mode", "pipeinfer", "--micro-batch", "fixed"] + drafter)
            run(f"pipeinfer {d} auto", ["--mode", "pipeinfer", "--micro-batch", "auto"] + drafter)
    it = rows[0]["tokens_per_s"]
    for r in rows:
        r["vs_iterative"] = round(r["tokens_per_s"] / it, 3)
    for k in range(1, len(rows), 3):
        sp = rows[k]["tokens_per_s"]
        for r in rows[k:k + 3]:
            r["vs_speculative"] = round(r["tokens_per_s"] / sp, 3)
    out = Path(args.out)
    with out.open("w", newline="") as f:
        w = csv.DictWriter(f, list(rows[-1]))
        w.writeheader()
        w.writerows(rows)
    print(f"\n{'config':<28} tokens/s  x iterative  x speculative  micro-batch sizes")
    for r in rows:
        print(f"{r['config']:<28} {r['tokens_per_s']:8.2f}  {r['vs_iterative']:11.2f}  {r.get('vs_speculative', ''):>13}  "
              f"{r['micro_batch_sizes']}")
    print(f"wrote {out} (2 ranks x 1 thread)")


if __name__ == "__main__":
    main()
