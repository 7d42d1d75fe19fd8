#!/usr/bin/env python3
"""Benchmark (not a test): the twin's prediction for trees beside a measured tree run, on 3 ranks sharing this
machine's 2 cores.

    python launch/twin_trees_validate.py [-n 128] [--ranks 3] [--out results/twin_trees_validation.csv]

1. profiles the ranks (`pipeinfer profile -t 1`: stage costs by batch size on each rank, how ranks sharing a
   machine slow each other, the Gemma draft's cost per token),
2. measures iterative, then PipeInfer with the replay instrument (agreement 0.7, the runner-up right in 0.6 of
   the misses, Gemma 3 270M's compute per draft token) as a chain and as trees (--max-branches 2, every runner-up
   a sibling: --micro-batch fixed, --draft-max 2, -ps 0), the draft at the head (the twin's head placement), on
   the real Qwen2.5-Coder-1.5B; every run's tokens must be iterative's,
3. simulates each run with the real scheduler on the profile (same reference tokens, same draws) and writes
   predicted beside measured tokens/s.
Ranks x threads = 3 on 2 cores: the profile measures the slowdown and the twin applies it (cluster.py).
"""
from __future__ import annotations

import argparse
import csv
import json
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "launch"))
BIN = Path(sys.executable).parent

from pipeinfer.ranks.head import GenConfig  # noqa: E402
from pipeinfer.twin.plan import Shape, build_cluster, load_profile  # noqa: E402
from pipeinfer.twin.sim import simulate  # noqa: E402
from quiet import run_quietly  # noqa: E402

AGREEMENT, RUNNER_UP = 0.7, 0.6
VARIANTS = {  # label: (generate arguments, the twin's GenConfig fields)
    "chain": ([], dict(draft_max=2, adaptive_draft=False)),
    "trees": (["--max-branches", "2", "-ps", "0"], dict(p_split=0.0, draft_max=2, max_branches=2,
                                                       adaptive_draft=False)),
}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("-n", type=int, default=128)
    ap.add_argument("--ranks", type=int, default=3)
    ap.add_argument("--out", default=str(ROOT / "results" / "twin_trees_validation.csv"))
    args = ap.parse_args()
    pi = [str(BIN / "mpiexec"), "-n", str(args.ranks), sys.executable, "-m", "mpi4py", "-m", "pipeinfer"]

    def run(cli: list[str]) -> tuple[str, float]:
        p, foreign = run_quietly(pi + cli, cwd=ROOT)
        if p.returncode != 0:
            raise SystemExit(f"pipeinfer {' '.join(cli)} failed ({p.returncode}):\n{p.stderr[-3000:]}")
        return p.stdout, foreign

    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        prof_path, ref = Path(tmp) / "profile.json", Path(tmp) / "ref.json"
        print(f"profiling {args.ranks} ranks x 1 thread ...", flush=True)
        run(["profile", "-t", "1", "-o", str(prof_path)])
        prof = load_profile(str(prof_path))
        base = ["generate", "--prompt-name", "code", "-n", str(args.n), "-t", "1", "--ignore-eos", "--json", "-q"]
        out, foreign = run(base + ["--mode", "iterative"])
        ref.write_text(out.strip().splitlines()[-1])
        it = json.loads(ref.read_text())
        reference = list(it["prompt_tokens"]) + list(it["tokens"])
        cluster = build_cluster(prof, Shape(draft_ms=prof["draft"]["ms_per_token"]))
        gen_it = GenConfig(mode="iterative", n_predict=args.n, draft_max=1, p_recovery=None,
                           stop_at_eos=False)
        pred_it = simulate(cluster, gen_it, reference=reference, n_prompt=len(it["prompt_tokens"])).stats
        rows.append(row("iterative", it["stats"], pred_it, foreign, True))
        for label, (extra, fields) in VARIANTS.items():
            out, foreign = run(base + ["--mode", "pipeinfer", "--draft-at", "head", "--drafter", "replay",
                                       "--replay-ref", str(ref), "--replay-accuracy", str(AGREEMENT),
                                       "--replay-runner-up", str(RUNNER_UP), "--draft", "gemma3-270m",
                                       "--micro-batch", "fixed", "--draft-max", "2"] + extra)
            got = json.loads(out.strip().splitlines()[-1])
            gen = GenConfig(mode="pipeinfer", n_predict=args.n, p_recovery=None, stop_at_eos=False, **fields)
            pred = simulate(cluster, gen, agreement=AGREEMENT, reference=reference, n_prompt=len(it["prompt_tokens"]),
                            runner_up=RUNNER_UP).stats
            rows.append(row(label, got["stats"], pred, foreign, got["tokens"] == it["tokens"]))
    out_path = Path(args.out)
    with out_path.open("w", newline="") as f:
        w = csv.DictWriter(f, list(rows[0]))
        w.writeheader()
        w.writerows(rows)
    for r in rows:
        print(f"{r['variant']:<10} measured {r['measured_tokens_per_s']:6.2f}  predicted {r['predicted_tokens_per_s']:6.2f} "
              f"tokens/s ({r['error_pct']:+.1f}%)  siblings {r['measured_siblings']} measured, {r['predicted_siblings']} "
              f"predicted; exact {r['exact']}; other work {r['foreign_cpu_pct']}% of a core")
    print(f"wrote {out_path} ({args.ranks} ranks x 1 thread on this machine's 2 cores, {args.n} tokens)")


def row(label: str, meas: dict, pred, foreign: float, exact: bool) -> dict:
    m, p = meas["gen_tokens_per_s"], pred.gen_tokens_per_s
    return {"variant": label, "measured_tokens_per_s": round(m, 3), "predicted_tokens_per_s": round(p, 3),
            "error_pct": round(100 * (p - m) / m, 1), "measured_siblings": meas.get("n_siblings", 0),
            "predicted_siblings": pred.n_siblings, "measured_siblings_right": meas.get("n_siblings_right", 0),
            "predicted_siblings_right": pred.n_siblings_right, "measured_runs": meas["n_runs"],
            "predicted_runs": pred.n_runs, "foreign_cpu_pct": round(foreign, 1), "exact": exact}


if __name__ == "__main__":
    main()
