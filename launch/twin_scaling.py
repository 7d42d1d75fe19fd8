#!/usr/bin/env python3
"""Benchmark in simulation: the three modes on 2..32 hosts for a 70B-class model, with the digital twin.

    python launch/twin_scaling.py --profile PROFILE.json [-n 256] [--out results/twin_scaling.csv]

The profile (`pipeinfer profile`) is this machine's, measured on Qwen2.5-Coder-1.5B Q4_K_M; the twin
scales its layer model to a Llama-2/3-70B-shaped model at Q4_K_M (80 layers, hidden 8192, 64 query / 8
KV heads, FFN 28672, output 8192 x 128256 at Q6_K) by weight bytes, which is what a memory-bound CPU
decode costs in proportion to (README, Digital twin: scaling a profile):

    layer_scale = bytes per layer (70B) / bytes per layer (profiled model, read from its GGUF)
    out_scale   = bytes of the output projection (70B) / (profiled model)

Every host is like the profiled rank 0 (one thread); links are Gigabit Ethernet (1 Gbit/s, 100 us one
way); the draft (Gemma 3 270M's measured cost per token) runs on a host of its own. Writes the CSV,
results/twin_scaling.png (tokens/s and speedups by host count, one line per agreement) and prints
each stage's busy share for 8 hosts at 0.9 agreement.
"""
from __future__ import annotations

import argparse
import csv
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from pipeinfer.spec.drafter import Cutoffs  # noqa: E402
from pipeinfer.ranks.head import GenConfig  # noqa: E402
from pipeinfer.twin.plan import Shape, build_cluster, load_profile, stage_table  # noqa: E402
from pipeinfer.twin.cluster import Link  # noqa: E402
from pipeinfer.twin.sim import simulate  # noqa: E402

# Llama-70B shape at Q4_K_M (bits per weight of the whole file: 42.5 GB / 70.6 B parameters)
N_LAYER_70B, N_EMBD_70B = 80, 8192
PARAMS_PER_LAYER_70B = 2 * 8192 * 8192 + 2 * 8192 * 1024 + 3 * 8192 * 28672
BPW_Q4_K_M = 4.82
OUTPUT_BYTES_70B = 8192 * 128256 * 6.5625 / 8   # Q6_K
HOSTS = (2, 4, 8, 16, 32)
AGREEMENTS = (0.5, 0.7, 0.9)
MODES = ("iterative", "speculative", "pipeinfer")


def profiled_bytes(model_path: Path) -> tuple[float, float]:
    """Bytes per layer and of the output projection of the profiled GGUF."""
    from pipeinfer.engine.ggufheader import read_header
    h = read_header(model_path)
    blk = sum(t.nbytes for n, t in h.tensors.items() if n.startswith("blk."))
    n_layer = 1 + max(int(n.split(".")[1]) for n in h.tensors if n.startswith("blk."))
    out = h.tensors.get("output.weight") or h.tensors["token_embd.weight"]
    return blk / n_layer, out.nbytes


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--profile", required=True)
    ap.add_argument("--model", default=None, help="the profiled GGUF [default: the installed qwen2.5-coder-1.5b]")
    ap.add_argument("-n", type=int, default=256)
    ap.add_argument("--out", default=str(ROOT / "results" / "twin_scaling.csv"))
    args = ap.parse_args()
    prof = load_profile(args.profile)
    from pipeinfer.engine.models import resolve_model
    layer_bytes, out_bytes = profiled_bytes(Path(args.model) if args.model else resolve_model("qwen2.5-coder-1.5b"))
    layer_scale = PARAMS_PER_LAYER_70B * BPW_Q4_K_M / 8 / layer_bytes
    out_scale = OUTPUT_BYTES_70B / out_bytes
    print(f"scaling {prof['model']['path']} to a 70B-class model: per layer x{layer_scale:.2f}, output x{out_scale:.2f}; "
          f"draft {prof['draft']['ms_per_token']:.1f} ms/token on its own host; 1 Gbit/s, 100 us links")
    link = Link(100e-6, 1e9 / 8)
    limit = int(prof.get("exact_batch", 3))
    rows, t0 = [], time.perf_counter()
    for hosts in HOSTS:
        shape = Shape(hosts=hosts, n_layer=N_LAYER_70B, n_embd=N_EMBD_70B, layer_scale=layer_scale,
                      out_scale=out_scale, link=link, draft_on="own")
        for agreement in AGREEMENTS:
            speeds = {}
            for mode in MODES:
                draft_max = {"iterative": 1, "speculative": max(1, limit - 1), "pipeinfer": limit}[mode]
                gen = GenConfig(mode=mode, n_predict=args.n, cut=Cutoffs(0.5, 0.1, draft_max, 1), p_recovery=None,
                                stop_at_eos=False)
                t1 = time.perf_counter()
                res = simulate(build_cluster(prof, shape), gen, agreement=agreement, max_in_flight=max(8, hosts + 2))
                s = res.stats
                speeds[mode] = s.gen_tokens_per_s
                busy = [st["t_busy_s"] / max(1e-9, st["t_busy_s"] + st["t_idle_s"]) for st in res.stages]
                rows.append({"hosts": hosts, "agreement": agreement, "mode": mode, "draft_max": draft_max,
                             "tokens_per_s": round(s.gen_tokens_per_s, 4), "ttft_s": round(s.ttft_s, 3),
                             "acceptance": round(s.acceptance_rate, 3), "runs": s.n_runs, "cancelled": s.n_cancelled,
                             "mean_stage_busy": round(sum(busy[1:]) / max(1, len(busy) - 1), 3),
                             "simulation_s": round(time.perf_counter() - t1, 2)})
                if hosts == 8 and agreement == 0.9 and mode == "pipeinfer":
                    print("8 hosts, agreement 0.9, pipeinfer: each stage's busy and idle time")
                    print(stage_table(res))
            for r in rows[-3:]:
                r["speedup_vs_iterative"] = round(r["tokens_per_s"] / speeds["iterative"], 3)
                r["speedup_vs_speculative"] = round(r["tokens_per_s"] / speeds["speculative"], 3)
            print(f"{hosts:>2} hosts, agreement {agreement}: " + ", ".join(f"{m} {speeds[m]:.3f}" for m in MODES)
                  + f" tokens/s; pipeinfer {speeds['pipeinfer'] / speeds['iterative']:.2f}x iterative, "
                  f"{speeds['pipeinfer'] / speeds['speculative']:.2f}x speculative", flush=True)
    out = Path(args.out)
    with out.open("w", newline="") as f:
        w = csv.DictWriter(f, list(rows[0]))
        w.writeheader()
        w.writerows(rows)
    plot(rows, out.with_suffix(".png"))
    print(f"wrote {out} and {out.with_suffix('.png')} ({time.perf_counter() - t0:.1f} s of simulation, "
          f"{len(rows)} generations of {args.n} tokens)")


def plot(rows: list[dict], path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import matplotlib.ticker
    fig, axes = plt.subplots(1, 3, figsize=(15, 4.5))
    styles = {"iterative": ":", "speculative": "--", "pipeinfer": "-"}
    for agreement, color in zip(AGREEMENTS, ("tab:red", "tab:orange", "tab:green")):
        sel = [r for r in rows if r["agreement"] == agreement]
        for mode in MODES:
            pts = [r for r in sel if r["mode"] == mode]
            if mode == "iterative" and agreement != AGREEMENTS[0]:
                continue  # iterative does not depend on the agreement
            axes[0].plot([r["hosts"] for r in pts], [r["tokens_per_s"] for r in pts], styles[mode], marker="o",
                         color="black" if mode == "iterative" else color,
                         label="iterative" if mode == "iterative" else f"{mode}, agreement {agreement}")
        pts = [r for r in sel if r["mode"] == "pipeinfer"]
        axes[1].plot([r["hosts"] for r in pts], [r["speedup_vs_iterative"] for r in pts], marker="o", color=color,
                     label=f"agreement {agreement}")
        axes[2].plot([r["hosts"] for r in pts], [r["speedup_vs_speculative"] for r in pts], marker="o", color=color,
                     label=f"agreement {agreement}")
    axes[0].set(title="generation speed (70B-class, Q4_K_M)", ylabel="tokens/s", yscale="log")
    axes[1].set(title="PipeInfer / iterative", ylabel="speedup")
    axes[2].set(title="PipeInfer / synchronous speculative", ylabel="speedup")
    for ax in axes:
        ax.set(xlabel="hosts (pipeline stages)", xscale="log")
        ax.set_xticks(HOSTS, [str(h) for h in HOSTS])
        ax.xaxis.set_minor_formatter(matplotlib.ticker.NullFormatter())
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    fig.suptitle("Digital twin: hosts like this machine's core, 1 Gbit/s links, draft on its own host", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    main()
