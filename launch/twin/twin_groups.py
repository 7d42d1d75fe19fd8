#!/usr/bin/env python3
"""Tensor-parallel groups against distributed-llama's published Llama 2 70B Q4_0 figures on 1, 2 and 4 GCP
c3d-highcpu-30 VMs, and what the twin predicts pipeinfer does on the same VMs.

    python launch/twin/twin_groups.py [-n 64] [--link-mbit 16000] [--out results/twin_groups.csv]

The VMs are described as plan --machines reads them, `cores=15 mem=59 mem_bw=60 link=L`, with 50 us one-way links
(the comparison's of results/plan_distributed_llama.txt), the host model calibrated on the profile pipeinfer ships.
mem_bw=60 is the one number fitted: it makes one VM 922 ms a token against distributed-llama's 910. L: GCP gives a
c3d-highcpu-30 "up to 20 Gbps" of default egress (up to 50 with Tier_1); 16 Gbit/s assumed (the conservative end of
16-32 Gbit/s); the exchanges are latency-bound, so L hardly matters.

distributed-llama's figure, predicted: its 70B as ONE group of all the VMs (it is pure tensor parallelism) priced by
twin/groups.py with its own wire (groups.DISTRIBUTED_LLAMA): q80 buffers (8.5 bits a value, 8.5/32 of f32) in an
all-reduce of the partial sums twice a layer, MPICH's algorithm for that size (Rabenseifner's above 2 KiB), no polite
wait. `recursive doubling` prices every all-reduce by recursive doubling instead (log2 G steps of the whole message),
a lower bound of the same design. Published (its README at commit 8aa7e47, 2024-01-28): the time a token took, and its
split into the root's inference time (I) and network transfer time (T).

pipeinfer, predicted: the pipeline as plan searches it (iterative, speculative, PipeInfer; the profiled draft's
measured confidence, -n tokens), one group of all the VMs (--tensor-parallel N: iterative, and synchronous
speculation on its leader), every other layout of groups pipelined (twin/plan.py group_search: the twin's search with
each stage a group), and one VM alone (plan's arithmetic). break_even: the engine's own cost of one exchange (ms,
beside MPI: llama.cpp's graph split at the hooked node, the Python callback, the copies; groups.Wire.
exchange_overhead_ms, not measured) at which the fastest one-group configuration would take distributed-llama's time;
break_even_iterative: the same for one group without a draft.
"""
from __future__ import annotations

import argparse
import math
import statistics
import sys
import tempfile
from dataclasses import replace
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # launch/: the shared harness
from harness import ROOT, on_path, write_csv  # noqa: E402

on_path()

from pipeinfer.decide.genconfig import GenConfig  # noqa: E402
from pipeinfer.twin.groups import DISTRIBUTED_LLAMA, PIPEINFER, layouts, one_group_cost  # noqa: E402
from pipeinfer.twin.machines import N_CTX, named_target  # noqa: E402
from pipeinfer.twin.plan import (REFERENCE_PROFILE, describe, group_layout, group_search, load_profile,  # noqa: E402
                                 one_hosts, search)

VMS = (1, 2, 4)
# distributed-llama's README at 8aa7e47 (2024-01-28), Llama 2 70B Q4_0 with q80 buffers: ms a token (I, T)
PUBLISHED = {1: (909.69, 907.25, 1.75), 2: (501.38, 475.50, 25.00), 4: (293.06, 264.00, 28.50)}
LATENCY_US = 50.0
HOST = "c3d-{i} # pipeinfer: cores=15 mem=59 link={link:g} mem_bw=60\n"


def _ms(tokens_per_s: float) -> float:
    return round(1e3 / tokens_per_s, 1)


def vm_row(n: int, prof: dict, n_predict: int, link_mbit: float, folder: Path) -> dict:
    target = named_target("70b-q4_0")
    hostfile = folder / f"c3d{n}.txt"
    hostfile.write_text("".join(HOST.format(i=i, link=link_mbit) for i in range(n)))
    d = describe(str(hostfile), target, prof, n_ctx=N_CTX, latency_us=LATENCY_US, draft_bytes=target.draft_bytes)
    cal, limit = d.calibration, int(d.profile.get("exact_batch", 3))
    ranks = [(r.machine, r.threads) for r in d.ranks if not r.draft]
    confidence = d.profile["draft"]["confidence"]
    agreement = statistics.mean(c[1] for c in confidence)
    published, inference, transfer = PUBLISHED[n]

    peer = one_group_cost(ranks, target, cal, LATENCY_US, DISTRIBUTED_LLAMA)
    peer_rd = one_group_cost(ranks, target, cal, LATENCY_US, DISTRIBUTED_LLAMA, short_bytes=math.inf)
    peer_ms, peer_rd_ms = peer.total_ms + cal.head_overhead_ms, peer_rd.total_ms + cal.head_overhead_ms
    row = {"vms": n, "dllama_published_ms": published, "dllama_inference_ms": inference,
           "dllama_transfer_ms": transfer, "twin_dllama_ms": round(peer_ms, 1),
           "twin_dllama_error_pct": round(100 * (peer_ms / published - 1), 1),
           "twin_dllama_compute_ms": round(peer.compute_ms, 1), "twin_dllama_comm_ms": round(peer.comm_ms, 1),
           "twin_dllama_recursive_doubling_ms": round(peer_rd_ms, 1),
           "twin_dllama_recursive_doubling_error_pct": round(100 * (peer_rd_ms / published - 1), 1)}

    alone = one_hosts(d, agreement=agreement, exact_limit=limit)[0]
    configs = {"one VM alone, iterative": 1e3 / alone.tokens_per_s,
               f"one VM alone, speculative (--draft-max {alone.draft_max})": 1e3 / alone.spec_tokens_per_s}
    row.update(alone_iterative_ms=_ms(alone.tokens_per_s), alone_speculative_ms=_ms(alone.spec_tokens_per_s),
               pipeline_iterative_ms="", pipeline_speculative_ms="", pipeline_pipeinfer_ms="",
               one_group_iterative_ms="", one_group_speculative_ms="", best_mix="", best_mix_ms="")
    if n >= 2:
        best = search(d.profile, agreement=0.7, n_predict=n_predict, exact_limit=limit, draft_own_host=False,
                      base=GenConfig(stop_at_eos=False), places=("head",), split_ok=d.split_ok, confidence=confidence)
        for mode, c in best.items():
            row[f"pipeline_{mode}_ms"] = _ms(c.tokens_per_s)
            configs[f"pipeline, {mode}"] = 1e3 / c.tokens_per_s
        mixes = []
        for sizes in layouts(n):
            lay = group_layout(d, sizes)
            res = group_search(d, lay, agreement=agreement, n_predict=n_predict, exact_limit=limit,
                               confidence=confidence)
            if lay.one_group:
                row["one_group_iterative_ms"] = _ms(res.best["iterative"].tokens_per_s)
                row["one_group_speculative_ms"] = _ms(res.best["speculative"].tokens_per_s)
            for mode, c in res.best.items():
                configs[f"{lay.option}, {mode}"] = 1e3 / c.tokens_per_s
                if not lay.one_group:
                    mixes.append((1e3 / c.tokens_per_s, f"{lay.option} --layer-split "
                                  f"{','.join(map(str, lay.counts))}, {mode}"))
        if mixes:
            ms, label = min(mixes)
            row.update(best_mix=label, best_mix_ms=round(ms, 1))
    label, ms = min(configs.items(), key=lambda kv: kv[1])
    row.update(best_config=label, best_ms=round(ms, 1), best_vs_dllama=round(published / ms, 2))
    row["break_even_exchange_overhead_ms"] = _break_even(d, n, published, agreement, limit, confidence, n_predict)
    # one group, iterative: the engine's cost per exchange at which it takes distributed-llama's time (linear: 2 x
    # n_layers exchanges a token)
    row["break_even_iterative_ms"] = (round((published - row["one_group_iterative_ms"]) / (2 * target.n_layer), 3)
                                      if n >= 2 else "")
    return row


def _break_even(d, n: int, published: float, agreement: float, limit: int, confidence, n_predict: int) -> str:
    """The engine's own cost of one exchange (ms) at which the fastest one-group configuration takes `published` ms
    a token (bisection; '' for one VM, or where it is slower already)."""
    if n < 2:
        return ""

    def best_ms(overhead: float) -> float:
        lay = group_layout(d, (n,), replace(PIPEINFER, exchange_overhead_ms=overhead))
        res = group_search(d, lay, agreement=agreement, n_predict=n_predict, exact_limit=limit, confidence=confidence)
        return 1e3 / res.win.tokens_per_s

    if best_ms(0.0) >= published:
        return ""
    lo, hi = 0.0, 1.0
    while best_ms(hi) < published:
        hi *= 2
    for _ in range(40):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if best_ms(mid) < published else (lo, mid)
    return round(hi, 3)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("-n", "--n-predict", type=int, default=64, help="tokens of each simulated generation")
    ap.add_argument("--link-mbit", type=float, default=16000.0, help="each VM's link (Mbit/s)")
    ap.add_argument("--out", default=str(ROOT / "results" / "twin_groups.csv"))
    args = ap.parse_args()
    prof = load_profile(str(REFERENCE_PROFILE))
    with tempfile.TemporaryDirectory() as tmp:
        rows = [vm_row(n, prof, args.n_predict, args.link_mbit, Path(tmp)) for n in VMS]
    write_csv(args.out, rows)
    print(f"Llama 2 70B Q4_0 on c3d-highcpu-30 VMs (mem_bw=60, {args.link_mbit:g} Mbit/s, {LATENCY_US:g} us), "
          f"ms per token")
    print(f"{'VMs':>3}  {'distributed-llama':>17}  {'twin of it':>16}  {'(rec. doubling)':>16}  {'pipeline it.':>12}  "
          f"{'pipeinfer':>9}  {'1 group it.':>11}  {'1 group spec.':>13}  best")
    for r in rows:
        peer = f"{r['twin_dllama_ms']:>8} ({r['twin_dllama_error_pct']:+5.1f}%)"
        lower = f"{r['twin_dllama_recursive_doubling_ms']:>7} ({r['twin_dllama_recursive_doubling_error_pct']:+5.1f}%)"
        ours = (f"{r['pipeline_iterative_ms']!s:>12}  {r['pipeline_pipeinfer_ms']!s:>9}  "
                f"{r['one_group_iterative_ms']!s:>11}  {r['one_group_speculative_ms']!s:>13}")
        print(f"{r['vms']:>3}  {r['dllama_published_ms']:>17}  {peer}  {lower}  {ours}  {r['best_ms']} ms: "
              f"{r['best_config']} ({r['best_vs_dllama']}x distributed-llama)")
        if r["best_mix"]:
            print(f"{'':>5}best mix: {r['best_mix']}, {r['best_mix_ms']} ms")
        if r["break_even_exchange_overhead_ms"] != "":
            print(f"{'':>5}margin: an exchange may cost the engine {r['break_even_exchange_overhead_ms']} ms beside "
                  f"MPI ({r['break_even_iterative_ms']} ms without a draft) before one group takes "
                  f"distributed-llama's time")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
