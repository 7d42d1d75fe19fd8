#!/usr/bin/env python3
"""Benchmark in simulation: deep pipelines with the chain and with trees (the draft's runner-ups as siblings), on
the 70B-class model of twin_scaling.py, one client and several.

    python launch/twin/twin_trees.py --profile results/twin_profile_2ranks.json [-n 256] [--out results/twin_trees.csv]

Hosts like the profiled rank 0 (one thread), 1 Gbit/s links, the draft on a host of its own; a draft right with
probability 0.7 or 0.9 whose runner-up, where it is wrong, is the target's token with probability 0.6. Variants:

- chain, in-flight 8: the chain with the old fixed limit of 8 speculative runs in flight
- chain: the chain with the default limit (kvplan.in_flight_limit: the stages + 2, at least 8)
- trees allowed: --max-branches 4, the default micro-batch rule deciding chain length and siblings (decide/shape.py)
- trees forced: every runner-up a sibling (--micro-batch fixed, --draft-max 2, -ps 0): what siblings cost where
  the rule declines them
- chain, 16-row prompt chunks: the chain with --prompt-chunk 16 (iterative keeps 63): a newcomer's prompt stalls
  the tokens behind it for less (docs/speculation.md)
- limit: the chain's limit S r / (r + S), r = 1 / (1 - agreement) the mean run of right drafts (each miss throws
  away about S launches)

Writes the CSV and a plot beside it (speedup over iterative by host count).
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # launch/: the shared harness
from harness import ROOT, on_path, write_csv  # noqa: E402

on_path("twin")

from pipeinfer.decide.genconfig import GenConfig  # noqa: E402
from pipeinfer.twin.cluster import Link  # noqa: E402
from pipeinfer.twin.plan import Shape, build_cluster, load_profile  # noqa: E402
from pipeinfer.twin.sim import simulate, simulate_clients  # noqa: E402
from twin_scaling import BPW_Q4_K_M, LLAMA_70B  # noqa: E402

HOSTS = (2, 4, 8, 16, 32)
AGREEMENTS = (0.7, 0.9)
RUNNER_UP = 0.6
VARIANTS = ("chain, in-flight 8", "chain", "trees allowed", "trees forced", "chain, 16-row prompt chunks")


def gen_for(variant: str, limit: int, n: int) -> tuple[GenConfig, int | None]:
    """(the head's settings, --max-in-flight) of a variant."""
    if variant == "trees forced":
        return GenConfig(mode="pipeinfer", n_predict=n, p_split=0.0, draft_max=2, max_branches=2, p_recovery=None,
                         stop_at_eos=False, adaptive_draft=False), None
    branches = 4 if variant == "trees allowed" else 1
    return GenConfig(mode="pipeinfer", n_predict=n, draft_max=limit, max_branches=branches, p_recovery=None,
                     stop_at_eos=False, prompt_chunk=16 if "16-row" in variant else 63), \
        8 if variant == "chain, in-flight 8" else None


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--profile", required=True)
    ap.add_argument("-n", type=int, default=256)
    ap.add_argument("--clients", default="4,8", help="the many-users rows: closed-loop clients (comma-separated)")
    ap.add_argument("--out", default=str(ROOT / "results" / "twin_trees.csv"))
    args = ap.parse_args()
    prof = load_profile(args.profile)
    from pipeinfer.engine.models import resolve_model
    from pipeinfer.twin.profile import weight_bytes
    profiled = weight_bytes(resolve_model("qwen2.5-coder-1.5b"))
    m = LLAMA_70B
    layer_scale = m.active_params_per_layer * BPW_Q4_K_M / 8 / profiled[0]
    out_scale = m.output_bytes / profiled[1]
    limit = int(prof.get("exact_batch", 3))
    many = [int(c) for c in args.clients.split(",")]
    rows, t0 = [], time.perf_counter()
    for hosts in HOSTS:
        cluster = build_cluster(prof, Shape(hosts=hosts, n_layer=m.n_layer, n_embd=m.n_embd, layer_scale=layer_scale,
                                            out_scale=out_scale, link=Link(100e-6, 1e9 / 8), draft_on="own"))
        for clients in (1, *many):
            base = GenConfig(mode="iterative", n_predict=args.n, draft_max=1, p_recovery=None,
                             stop_at_eos=False)
            it = rate(cluster, base, None, clients, 0.9, args.n)
            for agreement in AGREEMENTS:
                r = 1 / (1 - agreement)
                for variant in VARIANTS:
                    gen, mif = gen_for(variant, limit, args.n)
                    tps, st = rate(cluster, gen, mif, clients, agreement, args.n, stats=True)
                    rows.append({"hosts": hosts, "clients": clients, "agreement": agreement, "variant": variant,
                                 "tokens_per_s": round(tps, 4), "speedup_vs_iterative": round(tps / it, 3),
                                 "chain_limit": round(hosts * r / (r + hosts), 3) if clients == 1 else "",
                                 "siblings": st.get("n_siblings", 0), "siblings_right": st.get("n_siblings_right", 0)})
                    print(f"{hosts:>2} hosts, {clients} client(s), agreement {agreement}: {variant:<20} "
                          f"{rows[-1]['speedup_vs_iterative']:.2f}x iterative"
                          + (f" (chain limit {rows[-1]['chain_limit']})" if clients == 1 else "")
                          + (f", siblings {rows[-1]['siblings']} ({rows[-1]['siblings_right']} right)"
                             if rows[-1]["siblings"] else ""), flush=True)
    out = Path(args.out)
    write_csv(out, rows)
    plot(rows, out.with_suffix(".png"), many)
    print(f"wrote {out} and {out.with_suffix('.png')} ({time.perf_counter() - t0:.0f} s of simulation)")


def rate(cluster, gen: GenConfig, max_in_flight: int | None, clients: int, agreement: float, n: int,
         stats: bool = False):
    """Tokens/s of one generation (clients == 1) or of `clients` closed-loop clients, 2 requests each."""
    if clients == 1:
        res = simulate(cluster, gen, agreement=agreement, max_in_flight=max_in_flight, runner_up=RUNNER_UP)
        tps, st = res.stats.gen_tokens_per_s, vars(res.stats)
    else:
        res = simulate_clients(cluster, gen, n_clients=clients, n_requests=2 * clients, n_parallel=clients,
                               agreement=agreement, max_in_flight=max_in_flight, runner_up=RUNNER_UP)
        tps, st = res.tokens_per_s, {}
    return (tps, st) if stats else tps


def plot(rows: list[dict], path: Path, many: list[int]) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import matplotlib.ticker
    fig, axes = plt.subplots(1, 1 + len(many), figsize=(6 * (1 + len(many)), 4.5))
    styles = {"chain, in-flight 8": ":", "chain": "-", "trees allowed": "--", "trees forced": "-.",
              "chain, 16-row prompt chunks": (0, (1, 4))}
    for ax, clients in zip(axes, (1, *many)):
        for agreement, color in zip(AGREEMENTS, ("tab:orange", "tab:green")):
            for variant in VARIANTS:
                pts = [r for r in rows if r["clients"] == clients and r["agreement"] == agreement and r["variant"] == variant]
                ax.plot([r["hosts"] for r in pts], [r["speedup_vs_iterative"] for r in pts], linestyle=styles[variant], marker="o",
                        color=color, label=f"{variant}, agreement {agreement}")
            if clients == 1:
                pts = [r for r in rows if r["clients"] == 1 and r["agreement"] == agreement and r["variant"] == "chain"]
                ax.plot([r["hosts"] for r in pts], [r["chain_limit"] for r in pts], color=color, alpha=0.3, lw=6,
                        label=f"chain limit, agreement {agreement}")
        ax.set(title=f"{'one client' if clients == 1 else f'{clients} clients'}: PipeInfer / iterative",
               xlabel="hosts (pipeline stages)", ylabel="speedup", xscale="log")
        ax.set_xticks(HOSTS, [str(h) for h in HOSTS])
        ax.xaxis.set_minor_formatter(matplotlib.ticker.NullFormatter())
        ax.grid(alpha=0.3)
        ax.legend(fontsize=6)
    fig.suptitle("Digital twin, 70B-class model: chain and trees (runner-ups as siblings), hosts like this machine's core",
                 fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    main()
