#!/usr/bin/env python3
"""Benchmark (not a test): the exact batch limit and the decode cost by batch size for each `--kernels`
setting, on the real models, in one process, settings interleaved.

    python launch/bench/bench_kernels.py [--threads 1,2] [--models qwen2.5-coder-1.5b,gemma3-270m] [--out results/bench_kernels.csv]

For each model, thread count and kernel setting: the exact batch limit as pipeinfer measures it at load
(kernels.probe_exact_batch: batches of 1..8 against one row at a time), and the median time of one
decode call of b = 1..8 tokens after a 64-token context (ms per call and per token).
"""
from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # launch/: the shared harness
from harness import ROOT, write_csv  # noqa: E402



def decode_ms(eng, n_ctx_tokens: int, b: int, repeats: int) -> float:
    from pipeinfer.core.protocol import Batch, kv_ops, rm
    rng = np.random.default_rng(b)
    times = []
    for _ in range(repeats):
        toks = rng.integers(0, eng.n_vocab, b, dtype=np.int32)
        batch = Batch(toks, np.arange(n_ctx_tokens, n_ctx_tokens + b, dtype=np.int32), [[0]] * b,
                      np.ones(b, dtype=np.int32), kv_ops())
        t0 = time.perf_counter()
        eng.decode(batch)
        times.append((time.perf_counter() - t0) * 1e3)
        eng.apply_kv_ops(kv_ops(rm(0, n_ctx_tokens)))
    return float(np.median(times))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--threads", default="1,2")
    ap.add_argument("--models", default="qwen2.5-coder-1.5b,gemma3-270m")
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--out", default=str(ROOT / "results" / "bench_kernels.csv"))
    args = ap.parse_args()
    from pipeinfer.engine.kernels import KERNELS, probe_exact_batch
    from pipeinfer.engine.models import resolve_model
    from pipeinfer.core.protocol import Batch, kv_ops
    from pipeinfer.engine.stage import StageEngine
    rows = []
    for name in args.models.split(","):
        path = str(resolve_model(name))
        for threads in map(int, args.threads.split(",")):
            for kernels in KERNELS:
                with StageEngine(path, n_ctx=256, n_batch=64, n_seq_max=1, n_threads=threads,
                                 n_threads_batch=threads, embd_input=False, capture_hidden=False,
                                 kernels=kernels) as eng:
                    limit = probe_exact_batch(eng)
                    ctx = np.arange(64, dtype=np.int32) % eng.n_vocab
                    eng.decode(Batch(ctx, np.arange(64, dtype=np.int32), [[0]] * 64,
                                     np.eye(1, 64, 63, dtype=np.int32)[0], kv_ops()))
                    ms = {b: decode_ms(eng, 64, b, args.repeats) for b in range(1, 9)}
                row = {"timestamp": time.strftime("%Y-%m-%dT%H:%M:%S"), "machine": f"{os.cpu_count()} cores",
                       "model": name, "threads": threads, "kernels": kernels, "exact_batch_limit": limit,
                       **{f"ms_b{b}": round(v, 2) for b, v in ms.items()}}
                rows.append(row)
                print(f"{name:20s} {threads}t {kernels:9s} exact to {limit}: "
                      + ", ".join(f"b{b} {v:.1f} ms" for b, v in ms.items()), flush=True)
    out = Path(args.out)
    write_csv(out, rows)
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
