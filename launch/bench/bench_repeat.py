#!/usr/bin/env python3
"""Benchmark (not a test): the headline configurations, interleaved and repeated, medians side by side.

    BENCH_PAUSE_OTHERS=1 python launch/bench/bench_repeat.py [-n 128] [--prompts code,story] [--repeats 3]

One configuration measured once moves by 8-15% within minutes on this project's shared 2-core host, as
much as the differences the goals ask about. This runs every configuration of a prompt once per round,
in the same order, for --repeats rounds (iterative, then PipeInfer with the Gemma draft beside the
pipeline, with the replay instrument at 0.9 and at 0.3), and reports each one's median tokens/s and
median TTFT against iterative's median (and every round's own ratio). Default target on 2 ranks x 1
thread. Writes results/bench_repeat.csv (one row per run; `exact`: its tokens are iterative's of round 0).

--config 'LABEL=ARGS' (repeatable) measures these PipeInfer configurations instead of the headline ones, each
ARGS appended to `generate --mode pipeinfer` ({ref} stands for the replay instrument's reference), e.g.
    --config 'even=--draft gemma3-270m --draft-at thread' \
    --config '0.33=--draft gemma3-270m --draft-at thread --layer-split 0.33,0.67'

--baseline PATH runs every configuration from that checkout too (a `git worktree` of what a change changes),
labelled LABEL@base, right beside this checkout's in every round (which goes first alternating), each compared
with its own checkout's iterative.
"""
from __future__ import annotations

import argparse
import json
import os
import shlex
import statistics
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # launch/: the shared harness
from harness import ROOT, pipeinfer_cmd, write_csv  # noqa: E402
from quiet import run_quietly  # noqa: E402

PIPEINFER = pipeinfer_cmd(2)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("-n", type=int, default=128)
    ap.add_argument("--prompts", default="code,story")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--draft-at", default="thread", help="where PipeInfer's draft runs (head | thread)")
    ap.add_argument("--config", action="append", default=[], metavar="LABEL=ARGS",
                    help="a PipeInfer configuration to measure instead of the headline ones (repeatable)")
    ap.add_argument("--out", default=str(ROOT / "results" / "bench_repeat.csv"))
    ap.add_argument("--baseline", metavar="PATH", help="another checkout: every configuration also run from it (LABEL@base)")
    args = ap.parse_args()
    rows: list[dict] = []
    reference: dict[str, list[int]] = {}  # prompt -> iterative's tokens in round 0 (every run must match them)

    def run(prompt: str, rnd: int, label: str, extra: list[str]) -> dict:
        out = None
        sides = [None, args.baseline] if args.baseline else [None]
        for where in sides[rnd % len(sides):] + sides[:rnd % len(sides)]:  # the checkout going first alternates
            o = run_one(prompt, rnd, label + ("@base" if where else ""), extra, where)
            out = o if where is None else out
        return out

    def run_one(prompt: str, rnd: int, label: str, extra: list[str], where: str | None) -> dict:
        cmd = PIPEINFER + ["generate", "--prompt-name", prompt, "-n", str(args.n), "-t", "1", "--ignore-eos",
                           "--json", "-q"] + extra
        # `python -m` puts the working directory first on the path: another checkout's runs from there
        p, foreign = run_quietly(cmd, cwd=where or ROOT, env=dict(os.environ, PYTHONPATH=where) if where else None)
        if p.returncode != 0:
            raise SystemExit(f"{prompt} {label} failed ({p.returncode}):\n{p.stderr[-3000:]}")
        out = json.loads(p.stdout.strip().splitlines()[-1])
        s = out["stats"]
        exact = out["tokens"] == reference.setdefault(prompt, out["tokens"])
        rows.append({"prompt": prompt, "round": rnd, "config": label, "tokens_per_s": round(s["gen_tokens_per_s"], 3),
                     "ttft_s": round(s["ttft_s"], 4), "acceptance": round(s["acceptance_rate"], 3),
                     "runs": s["n_runs"], "micro_batch_sizes": json.dumps(s.get("draft_len_hist", {})),
                     "siblings": s.get("n_siblings", 0), "siblings_right": s.get("n_siblings_right", 0),
                     "foreign_cpu_pct": round(foreign, 1), "exact": exact})
        print(f"{prompt:<13} round {rnd}  {label:<26} {s['gen_tokens_per_s']:6.2f} tokens/s  "
              f"ttft {s['ttft_s'] * 1e3:6.1f} ms  acceptance {s['acceptance_rate']:.2f}"
              f"{'' if exact else '  OUTPUT DIFFERS FROM ITERATIVE'}", flush=True)
        return out

    pi = ["--mode", "pipeinfer", "--draft-at", args.draft_at]
    configs = [(label, ["--mode", "pipeinfer"] + shlex.split(extra))
               for label, _, extra in (c.partition("=") for c in args.config)]
    with tempfile.TemporaryDirectory() as tmp:
        for prompt in args.prompts.split(","):
            ref = Path(tmp) / f"{prompt}.json"
            for rnd in range(args.repeats):
                out = run(prompt, rnd, "iterative", ["--mode", "iterative"])
                if rnd == 0:
                    ref.write_text(json.dumps(out))
                for label, cmd in configs:
                    run(prompt, rnd, label, [a.replace("{ref}", str(ref)) for a in cmd])
                if configs:
                    continue
                run(prompt, rnd, f"pipeinfer gemma @{args.draft_at}", pi + ["--draft", "gemma3-270m"])
                for acc in ("0.9", "0.3"):
                    run(prompt, rnd, f"pipeinfer replay {acc} @{args.draft_at}",
                        pi + ["--drafter", "replay", "--replay-ref", str(ref), "--replay-accuracy", acc,
                              "--draft", "gemma3-270m"])
    out = Path(args.out)
    write_csv(out, rows, list(rows[-1]))
    print(f"\n{'prompt':<13} {'config':<26} median tok/s  x iterative (rounds)      median TTFT x it.")
    for prompt in dict.fromkeys(r["prompt"] for r in rows):
        mine = [r for r in rows if r["prompt"] == prompt]
        for cfg in dict.fromkeys(r["config"] for r in mine):
            it = [r for r in mine if r["config"] == "iterative" + ("@base" if cfg.endswith("@base") else "")]
            it_tps = statistics.median(r["tokens_per_s"] for r in it)
            it_ttft = statistics.median(r["ttft_s"] for r in it)
            runs = [r for r in mine if r["config"] == cfg]
            tps = statistics.median(r["tokens_per_s"] for r in runs)
            per_round = [r["tokens_per_s"] / next(i["tokens_per_s"] for i in it if i["round"] == r["round"]) for r in runs]
            ttft = statistics.median(r["ttft_s"] for r in runs)
            print(f"{prompt:<13} {cfg:<26} {tps:12.2f}  {tps / it_tps:5.2f}x ({', '.join(f'{x:.2f}' for x in per_round)})"
                  f"{'':>4} {ttft / it_ttft if it_ttft else 0:5.2f}x")
    n_exact = sum(r["exact"] for r in rows)
    print(f"wrote {out} (2 ranks x 1 thread, {args.repeats} interleaved rounds per prompt; "
          f"{n_exact} of {len(rows)} runs gave iterative's tokens)")


if __name__ == "__main__":
    main()
