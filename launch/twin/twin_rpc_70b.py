#!/usr/bin/env python3
"""A 70B-class model on 8 described hosts, many clients: `pipeinfer serve` in the twin (the real scheduler) beside
llama.cpp RPC's serial stages (llama-server batching every client's next token, its RPC stages one after another).

    python launch/twin/twin_rpc_70b.py [--clients 8 32 128] [-n 128] [--n-prompt 64] [--out results/twin_rpc_70b.csv]

The hosts: 8 x `cores=16 mem=64 mem_bw=60 link=1000` (twin/machines.py; the host model calibrated on the profile
pipeinfer ships), Llama-3-70B Q4_K_M (`--model-size 70b-q4_k_m`), 1 Gbit/s links of 100 us, the draft in rank 0.
pipeinfer rows: sim.simulate_clients with --parallel = the clients (at most 64), closed-loop clients, 2 requests
each, PipeInfer with batched users, at the exact batch limit (`exact`) and with `--kernels fast --batch-rows B`
(`fast-B`: exactness given up for bigger batches).

RPC rows, derived (no simulation): llama-server keeps N = clients sequences and decodes one batch per step holding
every sequence's next token and, on average, N x P / n rows of prompts (each request's P prompt tokens over its n
steps); the batch runs the stages one after another, each stage's activations crossing a link:

    step_s = sum over stages of stage_ms(R) + sum over links of (latency + R x n_embd x 4 bytes / bandwidth),
    R = N x (1 + P / n) rows;   tokens/s = N / step_s;   a request's latency ~ n x step_s

(stage_ms(R) is the described stage's cost of R rows: the weights streamed once for the batch, or the rows'
compute, whichever is slower; machines.Calibration.stage_ms).
"""
from __future__ import annotations

import argparse
import csv
import sys
from dataclasses import replace
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # launch/: the shared harness
from harness import ROOT, on_path  # noqa: E402

on_path()

from pipeinfer.decide.genconfig import GenConfig  # noqa: E402
from pipeinfer.decide.batching import MAX_PARALLEL  # noqa: E402
from pipeinfer.twin.cluster import cluster_from_profile  # noqa: E402
from pipeinfer.twin.machines import NAMED_TARGETS, Calibration, Machine, described_profile  # noqa: E402
from pipeinfer.twin.plan import REFERENCE_PROFILE, load_profile  # noqa: E402
from pipeinfer.twin.sim import simulate_clients  # noqa: E402

# rows/s of one decode of B rows, `llama-bench -p B -n 0 -t 1 -fa 1 --repack 0` on Qwen2.5-Coder-1.5B here (issue 53):
# cheaper rows than the profile's repacked kernels measure; --row-costs bench prices batches with them
BENCH_ROWS_PER_S = {1: 6.5, 2: 10.5, 4: 14.0, 8: 19.0, 16: 37.1, 32: 53.4, 64: 67.9}
HOST = dict(cores=16, mem_gib=64.0, mem_bw_gbps=60.0, disk_gib=500.0, link_mbit=1000.0)
LATENCY_US = 100.0


def bench_ratios(n: int = 64) -> list[float]:
    """Cost of b rows over one row, b = 1..n, interpolated in BENCH_ROWS_PER_S."""
    import numpy as np
    bs = sorted(BENCH_ROWS_PER_S)
    cost = [b / BENCH_ROWS_PER_S[b] / (1 / BENCH_ROWS_PER_S[1]) for b in bs]
    return [float(np.interp(b, bs, cost)) for b in range(1, n + 1)]


def rpc_row(cal: Calibration, ranks, target, n_clients: int, n_prompt: int, n_predict: int) -> dict:
    rows = n_clients * (1 + n_prompt / n_predict)
    stages = [r for r in ranks if not r.draft]
    compute_ms = sum(cal.stage_ms(r.machine, r.threads, target.active_stage_bytes(r.layers[1] - r.layers[0], r.last),
                                  max(1, round(rows))) for r in stages)
    link_ms = len(stages) * (LATENCY_US / 1e3 + rows * target.n_embd * 4 / (HOST["link_mbit"] * 1e6 / 8) * 1e3)
    step_s = (compute_ms + link_ms) / 1e3
    return {"system": "llama.cpp RPC (serial stages)", "clients": n_clients, "batch_rows": round(rows),
            "tokens_per_s": round(n_clients / step_s, 3), "p50_latency_s": round(n_predict * step_s, 1)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--clients", type=int, nargs="+", default=[8, 32, 128])
    ap.add_argument("--hosts", type=int, default=8)
    ap.add_argument("-n", "--n-predict", type=int, default=128)
    ap.add_argument("--n-prompt", type=int, default=64)
    ap.add_argument("--fast-rows", type=int, nargs="+", default=[16])
    ap.add_argument("--agreement", type=float, default=0.7)
    ap.add_argument("--profile", default=str(REFERENCE_PROFILE))
    ap.add_argument("--row-costs", choices=["measured", "bench"], default="measured",
                    help="what a batch of rows costs: the profile's (repacked kernels) or llama-bench's (--repack 0)")
    ap.add_argument("--out", default=str(ROOT / "results" / "twin_rpc_70b.csv"))
    a = ap.parse_args()
    prof = load_profile(a.profile)
    cal = Calibration.of(prof)
    if a.row_costs == "bench":
        ratios = bench_ratios()
        cal = replace(cal, batch_ratio=ratios, prompt_ratio=ratios[-1] / len(ratios))
    target = NAMED_TARGETS["70b-q4_k_m"]
    machines = [Machine(f"h{i}", **HOST) for i in range(a.hosts)]
    dprof, ranks = described_profile(machines, target, cal, prof, latency_us=LATENCY_US, draft_bytes=target.draft_bytes)
    cluster = cluster_from_profile(dprof)
    exact = int(dprof["exact_batch"])
    out = []
    for n_clients in a.clients:
        for label, rows in [("exact", exact)] + [(f"fast-{b}", b) for b in a.fast_rows]:
            gen = replace(GenConfig(stop_at_eos=False), mode="pipeinfer", n_predict=a.n_predict, p_recovery=None,
                          draft_max=exact, batch_rows=rows)
            res = simulate_clients(cluster, gen, n_clients=n_clients, n_requests=2 * n_clients, n_prompt=a.n_prompt,
                                   n_parallel=min(MAX_PARALLEL, n_clients), agreement=a.agreement)
            out.append({"row_costs": a.row_costs, "system": f"pipeinfer serve ({label})", "clients": n_clients,
                        "batch_rows": rows,
                        "tokens_per_s": round(res.tokens_per_s, 3), "p50_latency_s": round(res.p50_latency_s, 1)})
            print(out[-1], flush=True)
        out.append({"row_costs": a.row_costs, **rpc_row(cal, ranks, target, n_clients, a.n_prompt, a.n_predict)})
        print(out[-1], flush=True)
    path = Path(a.out)
    old = [r for r in csv.DictReader(path.open())] if path.exists() else []
    keep = [r for r in old if r["row_costs"] != a.row_costs]  # one file, each row-cost setting's latest rows
    with path.open("w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(out[0]))
        w.writeheader()
        w.writerows(keep + out)
    print(f"{'clients':>7}  {'system':<32} {'rows':>5} {'tokens/s':>9} {'p50 s':>8}")
    for r in out:
        print(f"{r['clients']:>7}  {r['system']:<32} {r['batch_rows']:>5} {r['tokens_per_s']:>9.2f} "
              f"{r['p50_latency_s']:>8.1f}")


if __name__ == "__main__":
    main()
