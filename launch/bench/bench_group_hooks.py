#!/usr/bin/env python3
"""Benchmark (not a test): what a tensor group's exchanges cost the engine, apart from the link.

    python launch/bench/bench_group_hooks.py [-n 64] [--rounds 3] [-t 1]

One process decodes the default Qwen2.5-Coder-1.5B, written as a group of one (engine/slices.py: the same file a
member loads), -n single-token decodes, alternately without partial sums and with them (every `attn_out` and
`ffn_out` node stopped through cb_eval, read, handed to an exchange that returns it, added and written back: what a
member does but for MPI). The difference over the exchanges made is the engine's cost per exchange, the part of a
group's time the digital twin prices beside the link's latency (twin/groups.py). Prints the medians.
"""
from __future__ import annotations

import argparse
import statistics
import time

import numpy as np


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("-n", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("-t", "--threads", type=int, default=1)
    args = ap.parse_args()
    from pipeinfer.core.protocol import Batch
    from pipeinfer.engine.group_sums import PartialSums
    from pipeinfer.engine.models import resolve_model
    from pipeinfer.engine.slices import Slice, ensure_slice_file
    from pipeinfer.engine.stage import StageEngine, TokenEmbedder
    model = resolve_model("qwen2.5-coder-1.5b")
    path = ensure_slice_file(model, 0, 28, True, Slice(0, (1.0,)))
    x = TokenEmbedder(model)(np.array([576], dtype=np.int32))
    sums = PartialSums(lambda mine: mine[None])
    params = dict(n_ctx=512, n_batch=8, n_seq_max=2, n_threads=args.threads, n_threads_batch=args.threads,
                  embd_input=True, capture_hidden=False)
    engines = {"without": StageEngine(path, **params), "with": StageEngine(path, **params, sums=sums)}
    times: dict[str, list[float]] = {k: [] for k in engines}
    for _ in range(args.rounds):
        for name, engine in engines.items():
            engine.clear_kv()
            before = sums.n_exchanges
            t0 = time.perf_counter()
            for pos in range(args.n):
                if engine.sums is not None:
                    engine.sums.begin()
                engine.decode(Batch.chain([576], pos), x)
            times[name].append((time.perf_counter() - t0) / args.n)
            per_decode = (sums.n_exchanges - before) / args.n
    per_token = {k: statistics.median(v) * 1e3 for k, v in times.items()}
    cost_us = (per_token["with"] - per_token["without"]) * 1e3 / per_decode
    print(f"decode without partial sums {per_token['without']:.2f} ms, with {per_token['with']:.2f} ms "
          f"({per_decode:.0f} exchanges a decode, {args.threads} thread(s), medians of {args.rounds} rounds): "
          f"{cost_us:.1f} us an exchange")
    for engine in engines.values():
        engine.close()


if __name__ == "__main__":
    main()
