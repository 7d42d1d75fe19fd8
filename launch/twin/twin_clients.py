#!/usr/bin/env python3
"""Benchmark in simulation: a server under load, with the real scheduler (decide/scheduler.py) on the twin.

    python launch/twin/twin_clients.py [--profile results/twin_profile_2ranks.json] [--n-prompt 16] [-n 128]

The cluster is twin_scaling.py's 70B-class one (this machine's profile scaled to a Llama-70B shape at Q4_K_M,
every host like the profiled rank 0, an even layer split, 1 Gbit/s links of 100 us, the draft on a host of its
own) with 8 and 32 stages. 1, 2, 4, ..., 64 closed-loop clients (each sends its next request when its last
answer is complete; `--waves` requests per client) are served by three schedules:

    pipeinfer-1   one generation at a time, PipeInfer (--parallel 1): the latency of one request alone
    interleave    --mode iterative, --parallel as serve's default (2 per stage, at most 64): one token per
                  generation in flight, no speculation
    default       --mode pipeinfer, the same --parallel: interleaving, and the drafter lent where a stage would idle

Each row: the server's throughput (completion tokens / makespan), its fraction of the stages' limit
(sim.throughput_limit: every stage busy with single-token decodes), and the fraction of the *workload's* limit,
which also charges each request's prompt at its batch cost on the bottleneck stage (the stages cannot decode
while they process prompts; the limit above does not count that work), p50/p95 latency (sent to last token)
and TTFT, and the bottleneck stage's busy share. `--prompt-check P` adds rows of P-token prompts and as many
output tokens at clients = stages and 2 x stages, to show what prompt work costs. Writes the CSV, a PNG beside it, and prints a table.
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # launch/: the shared harness
from harness import ROOT, on_path, write_csv  # noqa: E402

on_path("twin")

from twin_scaling import BPW_Q4_K_M, LLAMA_70B  # noqa: E402

from pipeinfer.decide.genconfig import GenConfig  # noqa: E402
from pipeinfer.decide.batching import default_parallel  # noqa: E402
from pipeinfer.twin.cluster import Cluster, Link  # noqa: E402
from pipeinfer.twin.plan import Shape, build_cluster, load_profile  # noqa: E402
from pipeinfer.twin.sim import simulate_clients  # noqa: E402

STAGES = (8, 32)
CLIENTS = (1, 2, 4, 8, 16, 32, 64)
SCHEDULES = ("pipeinfer-1", "interleave", "default")


def cluster_70b(prof: dict, n_stages: int, profiled: tuple[float, float]) -> Cluster:
    layer_scale = LLAMA_70B.active_params_per_layer * BPW_Q4_K_M / 8 / profiled[0]
    out_scale = LLAMA_70B.output_bytes / profiled[1]
    shape = Shape(hosts=n_stages, n_layer=LLAMA_70B.n_layer, n_embd=LLAMA_70B.n_embd, layer_scale=layer_scale,
                  out_scale=out_scale, link=Link(100e-6, 1e9 / 8), draft_on="own")
    return build_cluster(prof, shape)


def workload_limit(cluster: Cluster, n_prompt: int, n_predict: int) -> float:
    """Completion tokens/s with the bottleneck stage always busy on this workload: per request its prompt (one
    batch of n_prompt tokens, as alone; its run gives the first token) and n_predict - 1 single-token decodes."""
    chunks = [n_prompt]
    per_request_s = []
    for r, st in enumerate(cluster.stages):
        n_runs = len(chunks) + n_predict - 1
        head_ms = 2 * cluster.head_overhead_ms * n_runs if r == 0 else 0.0
        per_request_s.append((sum(st.ms(c) for c in chunks) + (n_predict - 1) * st.ms(1) + head_ms) / 1e3)
    return n_predict / max(per_request_s)


def run_one(cluster: Cluster, n_stages: int, schedule: str, n_clients: int, args, n_prompt: int, n_predict: int,
            n_parallel: int | None = None) -> dict:
    mode = "iterative" if schedule == "interleave" else "pipeinfer"
    parallel = n_parallel or (1 if schedule == "pipeinfer-1" else default_parallel(n_stages))
    draft_max = 1 if mode == "iterative" else args.draft_max
    gen = GenConfig(mode=mode, n_predict=n_predict, draft_max=draft_max, p_recovery=None,
                    stop_at_eos=False)
    t0 = time.perf_counter()
    res = simulate_clients(cluster, gen, n_clients=n_clients, n_requests=max(4, args.waves * n_clients),
                           n_prompt=n_prompt, n_parallel=parallel, agreement=args.agreement, seed=args.seed)
    busy = max(st["t_busy_s"] for st in res.stages[1:]) / res.makespan_s
    wl = workload_limit(cluster, n_prompt, n_predict)
    return {"stages": n_stages, "clients": n_clients, "schedule": schedule, "parallel": parallel,
            "n_prompt": n_prompt, "n_predict": n_predict, "requests": len(res.requests),
            "tokens_per_s": round(res.tokens_per_s, 4), "limit_tokens_per_s": round(res.limit_tokens_per_s, 4),
            "fraction_of_limit": round(res.fraction_of_limit, 4), "workload_limit_tokens_per_s": round(wl, 4),
            "fraction_of_workload_limit": round(res.tokens_per_s / wl, 4),
            "p50_latency_s": round(res.p50_latency_s, 2), "p95_latency_s": round(res.p95_latency_s, 2),
            "p50_ttft_s": round(res.ttft_pct_s(50), 2), "bottleneck_busy": round(busy, 4),
            "compactions": res.sched.n_compactions, "simulation_s": round(time.perf_counter() - t0, 2)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--profile", default=str(ROOT / "results" / "twin_profile_2ranks.json"))
    ap.add_argument("--model", default=None, help="the profiled GGUF [default: the installed qwen2.5-coder-1.5b]")
    ap.add_argument("--n-prompt", type=int, default=16)
    ap.add_argument("-n", "--n-predict", type=int, default=128)
    ap.add_argument("--waves", type=int, default=2, help="requests per client (at least 4 requests in all)")
    ap.add_argument("--agreement", type=float, default=0.7)
    ap.add_argument("--draft-max", type=int, default=None, help="[default: the profile's exact batch limit]")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--prompt-check", type=int, default=64, help="prompt-heavy rows' prompt and output tokens (0: none)")
    ap.add_argument("--out", default=str(ROOT / "results" / "twin_clients.csv"))
    args = ap.parse_args()
    prof = load_profile(args.profile)
    args.draft_max = args.draft_max or int(prof.get("exact_batch", 3))
    from pipeinfer.engine.models import resolve_model
    from pipeinfer.twin.profile import weight_bytes
    profiled = weight_bytes(Path(args.model) if args.model else resolve_model("qwen2.5-coder-1.5b"))
    rows, t0 = [], time.perf_counter()
    for n_stages in STAGES:
        cluster = cluster_70b(prof, n_stages, profiled)
        for n_clients in CLIENTS:
            for schedule in SCHEDULES:
                rows.append(run_one(cluster, n_stages, schedule, n_clients, args, args.n_prompt, args.n_predict))
                print_row(rows[-1])
        if args.prompt_check:
            n = args.prompt_check
            for n_clients in (n_stages, 2 * n_stages):
                for schedule in ("interleave", "default"):
                    rows.append(run_one(cluster, n_stages, schedule, n_clients, args, n, n))
                    print_row(rows[-1])
    out = Path(args.out)
    write_csv(out, rows)
    main_rows = [r for r in rows if r["n_prompt"] == args.n_prompt and r["n_predict"] == args.n_predict
                 and r["parallel"] in (1, default_parallel(r["stages"]))]
    plot(main_rows, out.with_suffix(".png"), args)
    print(f"wrote {out} and {out.with_suffix('.png')} ({time.perf_counter() - t0:.0f} s of simulation)")


def print_row(r: dict) -> None:
    print(f"{r['stages']:>2} stages {r['clients']:>2} clients {r['schedule']:<11} P={r['parallel']:<2} "
          f"prompt {r['n_prompt']:>3} + {r['n_predict']:>3}: {r['tokens_per_s']:7.3f} tok/s = "
          f"{100 * r['fraction_of_limit']:5.1f}% of limit ({100 * r['fraction_of_workload_limit']:5.1f}% of the "
          f"workload's), p50 {r['p50_latency_s']:8.1f} s, p95 {r['p95_latency_s']:8.1f} s, TTFT p50 "
          f"{r['p50_ttft_s']:7.1f} s, bottleneck busy {100 * r['bottleneck_busy']:5.1f}%  [{r['simulation_s']} s]",
          flush=True)


def plot(rows: list[dict], path: Path, args) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, axes = plt.subplots(len(STAGES), 2, figsize=(12, 4.2 * len(STAGES)), squeeze=False)
    styles = {"pipeinfer-1": ("tab:blue", ":"), "interleave": ("black", "--"), "default": ("tab:green", "-")}
    for (ax_t, ax_l), n_stages in zip(axes, STAGES):
        for schedule in SCHEDULES:
            pts = [r for r in rows if r["stages"] == n_stages and r["schedule"] == schedule]
            color, ls = styles[schedule]
            xs = [r["clients"] for r in pts]
            ax_t.plot(xs, [100 * r["fraction_of_limit"] for r in pts], ls, marker="o", color=color, label=schedule)
            ax_l.plot(xs, [r["p50_latency_s"] for r in pts], ls, marker="o", color=color, label=f"{schedule} p50")
            ax_l.plot(xs, [r["p95_latency_s"] for r in pts], ls, marker="x", color=color, alpha=0.5,
                      label=f"{schedule} p95")
        limit = next(r["limit_tokens_per_s"] for r in rows if r["stages"] == n_stages)
        ax_t.axhline(90, color="grey", lw=0.8)
        ax_t.axvline(n_stages, color="grey", lw=0.8, ls=":")
        ax_t.set(title=f"{n_stages} stages: throughput (limit {limit:.2f} tokens/s)", ylabel="% of the stages' limit",
                 ylim=(0, 105))
        ax_l.set(title=f"{n_stages} stages: latency (sent to last token)", ylabel="s", yscale="log")
        for ax in (ax_t, ax_l):
            ax.set(xlabel="closed-loop clients", xscale="log")
            ax.set_xticks(CLIENTS, [str(c) for c in CLIENTS])
            ax.minorticks_off()
            ax.grid(alpha=0.3)
            ax.legend(fontsize=7)
    fig.suptitle(f"Digital twin, 70B-class Q4_K_M, {args.n_prompt}-token prompts, {args.n_predict} tokens per answer, "
                 f"agreement {args.agreement:g}, draft on its own host", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    main()
