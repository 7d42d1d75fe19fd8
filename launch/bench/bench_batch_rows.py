#!/usr/bin/env python3
"""Measurement (not a test): what batching users costs and which batches keep every row exact, per kernel setting.

    python launch/bench/bench_batch_rows.py [-m MODEL] [--kernels repack,no-repack,tiled] [--rows 1,2,3,4,5,6,7,8,12,16,24,32,48,64]
                                            [--threads 1] [--out results/bench_batch_rows.csv]

For each kernel setting (engine/kernels.py), on the whole model in one process:
- exact: whether a decode of B rows, each the next token of its own sequence (B users in one batch), gives every
  row bit for bit its logits decoded alone (kernels.probe_rows_across_sequences), for every B of --rows;
- ms: the median time of such a decode (B sequences with 64 cells each, then one row each), and rows_x, rows per
  second against one row's.
One CSV row per (kernels, B); a table on stdout. The stages of a pipeline run the same kernels on fewer layers.
"""
from __future__ import annotations

import argparse
import csv
import statistics
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # launch/: the shared harness
from harness import ROOT, write_csv  # noqa: E402

N_CELLS = 64  # each sequence's cells before its timed row (a short prompt's worth)


def time_rows(engine, sizes: list[int], n_repeat: int = 4) -> dict[int, float]:
    """Median ms of a decode of B rows, one per sequence, each after N_CELLS cells of its own."""
    from pipeinfer.core.protocol import Batch, kv_ops, rm
    rng = np.random.default_rng(0)
    n_seqs = max(sizes)
    engine.clear_kv()
    for s in range(n_seqs):
        out = np.zeros(N_CELLS, dtype=np.int32)
        out[-1] = 1
        toks = rng.integers(0, engine.n_vocab, N_CELLS).astype(np.int32)
        engine.decode(Batch(toks, np.arange(N_CELLS, dtype=np.int32), [[s]] * N_CELLS, out, kv_ops()))
    ms = {}
    for b in sizes:
        times = []
        for _ in range(n_repeat + 1):
            toks = rng.integers(0, engine.n_vocab, b).astype(np.int32)
            batch = Batch(toks, np.full(b, N_CELLS, dtype=np.int32), [[s] for s in range(b)],
                          np.ones(b, dtype=np.int32), kv_ops())
            t0 = time.perf_counter()
            engine.decode(batch)
            times.append((time.perf_counter() - t0) * 1e3)
            engine.apply_kv_ops(kv_ops(*[rm(s, N_CELLS, -1) for s in range(b)]))
        ms[b] = statistics.median(times[1:])  # the first is a warm-up
    engine.clear_kv()
    return ms


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("-m", "--model", default=None)
    ap.add_argument("--kernels", default="repack,no-repack,tiled")
    ap.add_argument("--rows", default="1,2,3,4,5,6,7,8,12,16,24,32,48,64")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--out", default=str(ROOT / "results" / "bench_batch_rows.csv"))
    a = ap.parse_args()
    from pipeinfer.engine.kernels import numerics_id, probe_rows_across_sequences
    from pipeinfer.engine.models import DEFAULT_TARGET, resolve_model
    from pipeinfer.engine.stage import StageEngine
    model = str(resolve_model(a.model or DEFAULT_TARGET))
    sizes = [int(x) for x in a.rows.split(",")]
    rows = []
    settings = a.kernels.split(",")
    if len(settings) > 1:  # one process per setting: ggml reads `tiled`'s switch once, at a process's first multiply
        for kernels in settings:
            out = Path(a.out).with_suffix(f".{kernels}.part")
            subprocess.run([sys.executable, __file__, "-m", model, "--kernels", kernels, "--rows", a.rows,
                            "--threads", str(a.threads), "--out", str(out)], check=True)
            with open(out, newline="") as f:
                rows += list(csv.DictReader(f))
            out.unlink()
        settings = []
    for kernels in settings:
        with StageEngine(model, n_ctx=8192, n_batch=512, n_seq_max=max(sizes), n_threads=a.threads,
                         n_threads_batch=a.threads, embd_input=False, capture_hidden=False, kernels=kernels) as e:
            exact = probe_rows_across_sequences(e, sizes)
            ms = time_rows(e, sizes)
        for b in sizes:
            rows.append({"model": Path(model).name, "kernels": kernels, "threads": a.threads, "rows": b,
                         "exact": exact[b], "ms": round(ms[b], 1), "rows_x": round(b * ms[1] / ms[b], 2),
                         "build": numerics_id()})
            print(f"{kernels:10s} {b:3d} rows: {'exact' if exact[b] else 'DIFFERS':7s} {ms[b]:8.1f} ms  "
                  f"{b * ms[1] / ms[b]:5.2f}x one row's rows/s", flush=True)
    write_csv(a.out, rows)


if __name__ == "__main__":
    main()
