#!/usr/bin/env python3
"""Benchmark (not a test): what per-token recurrent states cost (core/recurrent.py), beside a plain attention model.

    python launch/bench/bench_recurrent.py [--sizes small] [-n 128] [--accuracy 0.5,0.8,0.95] [--repeats 3]

Synthetic models of the tests' shapes (tests/synth_arch.py: lfm2, granitehybrid, and llama as the attention model of
the same dimensions) at each size, 6 layers, 2 ranks x 1 thread, the replay instrument proposing each model's own
greedy continuation right with probability --accuracy (so every model is offered the same drafts). Two
measurements, side by side in one run:

  1. one stage's decode of a 3-token micro-batch in-process: in one sequence (the attention layout, which cannot roll
     a recurrent state back) and in nested sequences (pipeinfer's layout for a recurrent model: one ubatch per token),
     against a one-token decode;
  2. generation on 2 ranks: iterative, and PipeInfer at each accuracy; tokens/s (accepted tokens per second of
     generation), the acceptance rate, and PipeInfer's speedup over the model's own iterative rate. The rollback's
     cost is the hybrid's speedup over the attention model's at the same accuracy, in three settings (--settings):
       fast    kernels `fast`: every model verifies micro-batches of 3 drafted tokens (fixed); the attention model's
               are then not exact (these f32 weights' exact batch limit is 1): the cheapest layout a plain model
               could run;
       exact   the default kernels, exact everywhere: the attention model's micro-batches (fixed) stay within its
               exact batch limit (kernels.py), the hybrids' take 3 nested tokens (each decoded alone);
       auto    the defaults: --micro-batch auto sizes every micro-batch by the stages' measured costs (a hybrid
               stage's are its nested decodes) and the running acceptance, --draft-max within the limit.

Writes results/bench_recurrent.csv (one row per run) and prints the summary.
"""
from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from itertools import product
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # launch/: the shared harness
from harness import MPIEXEC, ROOT, on_path, write_csv  # noqa: E402

on_path()
PROMPT = [1, 5, 9, 13, 22, 37, 41]
MODELS = ("llama", "lfm2", "granitehybrid")
def micro_batch_ms(path: str, n_fill: int = 64, repeats: int = 15) -> dict:
    """Median ms of one whole-model decode after n_fill prompt tokens: one token, 3 tokens in one sequence, 3 tokens
    in nested sequences (recurrent models only), each undone by whole-sequence removals."""
    from pipeinfer.core.protocol import Batch, cp, kv_ops, rm
    from pipeinfer.core.recurrent import chain_seq_ids
    from pipeinfer.engine.stage import StageEngine
    rng = np.random.default_rng(0)
    out = {}
    with StageEngine(path, n_ctx=256, n_batch=64, n_seq_max=8, n_threads=1, n_threads_batch=1, embd_input=False,
                     capture_hidden=False) as e:
        e.decode(Batch.chain(rng.integers(3, 250, n_fill).astype(np.int32), 0))
        layouts = {"one": [[1]], "chain3": [[1]] * 3}
        if e.recurrent:
            layouts["nested3"] = chain_seq_ids([1, 2, 3], 3)
        for name, ids in layouts.items():
            seqs = sorted({s for x in ids for s in x})
            times = []
            for k in range(repeats + 1):
                e.apply_kv_ops(kv_ops(*[cp(0, s, 0, n_fill) for s in seqs]))
                b = Batch(rng.integers(3, 250, len(ids)).astype(np.int32),
                          np.arange(n_fill, n_fill + len(ids), dtype=np.int32), ids, np.ones(len(ids), np.int32),
                          kv_ops())
                t0 = time.perf_counter()
                e.decode(b)
                times.append((time.perf_counter() - t0) * 1e3)
                e.apply_kv_ops(kv_ops(*[rm(s) for s in seqs]))
            out[name] = statistics.median(times[1:])
    return out


def generate(path: str, ref_json: Path, mode: str, accuracy: float, n: int, setting: str, attention: bool) -> dict:
    """One generation on 2 ranks in a --settings setting (the module docstring)."""
    cfg = {"model": path, "prompt": PROMPT, "n": n, "mode": mode, "drafter": "replay", "replay_ref": str(ref_json),
           "replay_accuracy": accuracy, "n_ctx": 1024, "kernels": "fast" if setting == "fast" else "repack",
           "micro_batch": "auto" if setting == "auto" else "fixed",
           # exact settings: an attention model's micro-batch within its exact batch limit (None: the largest)
           "draft_max": None if setting == "auto" or (setting == "exact" and attention) else 3}
    cmd = [MPIEXEC, "-n", "2", sys.executable, "-m", "mpi4py", str(ROOT / "tests" / "mpi_gen.py"), json.dumps(cfg)]
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=900)
    line = next((x for x in p.stdout.splitlines() if x.startswith("RESULT ")), None)
    if p.returncode != 0 or line is None:
        raise SystemExit(f"{path} {mode} failed ({p.returncode}):\n{p.stderr[-3000:]}")
    return json.loads(line[len("RESULT "):])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("-n", type=int, default=128)
    ap.add_argument("--sizes", default="small")
    ap.add_argument("--settings", default="fast,exact,auto")
    ap.add_argument("--accuracy", default="0.5,0.8,0.95")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--out", default=str(ROOT / "results" / "bench_recurrent.csv"))
    args = ap.parse_args()
    accs = [float(a) for a in args.accuracy.split(",")]
    rows, micro = [], []
    with tempfile.TemporaryDirectory(prefix="pipeinfer-bench-recurrent-") as d:
        import os
        os.environ["PIPEINFER_STAGE_CACHE"] = str(Path(d) / "stages")
        for size in args.sizes.split(","):
            # the tests' model writer, run as a program (launch/ never imports tests/)
            subprocess.run([sys.executable, str(ROOT / "tests" / "arch_models.py"), "--size", size, "--names",
                            ",".join(MODELS), "--prompt", ",".join(map(str, PROMPT)), "-n", str(args.n + 8),
                            "--out", d], check=True, stdout=subprocess.DEVNULL)
            paths = {}
            for name in MODELS:
                path = Path(d) / f"{size}-{name}.gguf"
                ref = json.loads((Path(d) / f"{size}-{name}.json").read_text())["tokens"]
                paths[name] = (str(path), Path(d) / f"{size}-{name}.json", ref[:args.n])
                ms = micro_batch_ms(str(path))
                micro.append({"size": size, "model": name, "mb": round(path.stat().st_size / 2**20, 1),
                              **{k: round(v, 3) for k, v in ms.items()}})
                print(f"[{size}] {name}: {micro[-1]}", flush=True)
            for rnd, setting, name in product(range(args.repeats), args.settings.split(","), MODELS):
                # every configuration once per round, in the same order
                path, ref_json, ref = paths[name]
                for mode, acc in [("iterative", 0.0)] + [("pipeinfer", a) for a in accs]:
                    out = generate(path, ref_json, mode, acc, args.n, setting, name == "llama")
                    s = out["stats"]
                    rows.append({"size": size, "setting": setting, "round": rnd, "model": name, "mode": mode,
                                 "accuracy": acc, "tokens_per_s": round(s["gen_tokens_per_s"], 2),
                                 "acceptance": round(s.get("acceptance_rate") or 0.0, 3),
                                 "spec_runs": s["n_spec_runs"], "cancelled": s["n_cancelled"],
                                 "exact_batch": min((x for x in s.get("exact_batch") or () if x), default=0), "exact": out["tokens"] == ref})
                    print(f"[{size} {setting} r{rnd}] {name:14s} {mode:9s} acc {acc:.2f}: "
                          f"{rows[-1]['tokens_per_s']:8.1f} "
                          f"tok/s, acceptance {rows[-1]['acceptance']:.2f}, exact {rows[-1]['exact']}", flush=True)
    write_csv(args.out, rows)
    summarize(rows, micro, accs)


def summarize(rows: list[dict], micro: list[dict], accs: list[float]) -> None:
    print("\none stage's decode (whole model, 1 thread, ms, medians): 1 token | 3 in one sequence | 3 nested")
    for m in micro:
        print(f"  {m['size']:5s} {m['model']:14s} {m['mb']:6.1f} MB  {m['one']:.3f} | {m['chain3']:.3f} | "
              f"{m.get('nested3', float('nan')):.3f}")
    med = {}
    for r in rows:
        med.setdefault((r["size"], r["setting"], r["model"], r["mode"], r["accuracy"]), []).append(r)
    print("\n2 ranks, medians over rounds: tokens/s (acceptance) and PipeInfer's speedup over the model's iterative; "
          "cost = the hybrid's speedup / the attention model's")
    for size, setting in dict.fromkeys((r["size"], r["setting"]) for r in rows):
        def tps(model, mode, acc, size=size, setting=setting):
            return statistics.median(r["tokens_per_s"] for r in med[size, setting, model, mode, acc])
        base = {m: tps(m, "iterative", 0.0) for m in MODELS}
        print(f"  [{size} {setting}] iterative: " + ", ".join(f"{m} {base[m]:.1f}" for m in MODELS))
        for acc in accs:
            parts = []
            for m in MODELS:
                acc_seen = statistics.median(r["acceptance"] for r in med[size, setting, m, "pipeinfer", acc])
                parts.append(f"{m} {tps(m, 'pipeinfer', acc):.1f} ({acc_seen:.2f}) "
                             f"x{tps(m, 'pipeinfer', acc) / base[m]:.2f}")
            attn = tps("llama", "pipeinfer", acc) / base["llama"]
            cost = ", ".join(f"{m} {tps(m, 'pipeinfer', acc) / base[m] / attn:.2f}" for m in MODELS[1:])
            print(f"  [{size} {setting}] accuracy {acc:.2f}: " + "; ".join(parts) + f"; cost: {cost}")
    print("  exact (tokens = the model's greedy reference): " + str(all(r["exact"] for r in rows)))


if __name__ == "__main__":
    main()
