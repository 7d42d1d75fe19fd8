#!/usr/bin/env python3
"""Benchmark in simulation: the three modes on 2..32 hosts for a 70B-class model and a 30B-A3B-class
mixture-of-experts model, with the digital twin.

    python launch/twin/twin_scaling.py --profile PROFILE.json [-n 256] [--out results/twin_scaling.csv]

The profile (`pipeinfer profile`) is this machine's, measured on Qwen2.5-Coder-1.5B Q4_K_M; the twin
scales its layer model by weight bytes, which is what a memory-bound CPU decode costs in proportion to
(docs/twin.md, scaling a profile):

    layer_scale = bytes a token reads per layer (model) / bytes per layer (profiled model, from its GGUF)
    out_scale   = bytes of the output projection (model) / (profiled model)

- 70B: a Llama-2/3-70B shape at Q4_K_M (80 layers, hidden 8192, 64 query / 8 KV heads, FFN 28672, output
  8192 x 128256 at Q6_K).
- 30B-A3B: a Qwen3-30B-A3B shape at Q4_K_M (48 layers, hidden 2048, 32 query / 4 KV heads of 128, 128 experts
  of FFN 768 with 8 used per token, output 2048 x 151936 at Q6_K): a layer costs its active experts' bytes,
  about 57M of its 623M parameters (cluster.moe_params_per_layer), so it runs like a 3B dense model while it
  needs the memory of a 30B one.

Every host is like the profiled rank 0 (one thread); links are Gigabit Ethernet (1 Gbit/s, 100 us one
way); the draft (Gemma 3 270M's measured cost per token) runs on a host of its own. Writes the CSV (a
`model` column), results/twin_scaling.png for the 70B-class model and results/twin_scaling_30b-a3b.png for
the MoE one (tokens/s and speedups by host count, one line per agreement) and prints each stage's busy share
for 8 hosts at 0.9 agreement.
"""
from __future__ import annotations

import argparse
import sys
import time
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # launch/: the shared harness
from harness import ROOT, on_path, write_csv  # noqa: E402

on_path()

from pipeinfer.decide.genconfig import GenConfig  # noqa: E402
from pipeinfer.twin.plan import Shape, build_cluster, load_profile, stage_table  # noqa: E402
from pipeinfer.twin.cluster import Link, moe_params_per_layer  # noqa: E402
from pipeinfer.twin.sim import simulate  # noqa: E402

BPW_Q4_K_M = 4.82   # bits per weight of a whole Q4_K_M file (Llama-70B: 42.5 GB / 70.6 B parameters)
Q6_K_BYTES = 6.5625 / 8


@dataclass(frozen=True)
class ModelShape:
    label: str
    n_layer: int
    n_embd: int
    active_params_per_layer: int   # what one token reads per layer
    output_bytes: float


# Llama-70B: q, o 8192 x 8192; k, v 8192 x 1024; gate, up, down 8192 x 28672
LLAMA_70B = ModelShape("70B", 80, 8192, 2 * 8192 * 8192 + 2 * 8192 * 1024 + 3 * 8192 * 28672, 8192 * 128256 * Q6_K_BYTES)
# Qwen3-30B-A3B: 30.5B parameters, 3.3B active per token (embeddings and output included)
QWEN3_30B_A3B = ModelShape("30B-A3B", 48, 2048, moe_params_per_layer(2048, 32, 4, 128, 128, 8, 768)[1],
                           2048 * 151936 * Q6_K_BYTES)
SHAPES = (LLAMA_70B, QWEN3_30B_A3B)
HOSTS = (2, 4, 8, 16, 32)
AGREEMENTS = (0.5, 0.7, 0.9)
MODES = ("iterative", "speculative", "pipeinfer")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--profile", required=True)
    ap.add_argument("--model", default=None, help="the profiled GGUF [default: the installed qwen2.5-coder-1.5b]")
    ap.add_argument("-n", type=int, default=256)
    ap.add_argument("--out", default=str(ROOT / "results" / "twin_scaling.csv"))
    args = ap.parse_args()
    prof = load_profile(args.profile)
    from pipeinfer.engine.models import resolve_model
    from pipeinfer.twin.profile import weight_bytes
    profiled = weight_bytes(Path(args.model) if args.model else resolve_model("qwen2.5-coder-1.5b"))
    rows, t0 = [], time.perf_counter()
    for model in SHAPES:
        rows += scale_to(prof, model, profiled, args.n)
    out = Path(args.out)
    write_csv(out, rows)
    pngs = [out.with_suffix(".png") if m is LLAMA_70B else out.with_name(f"{out.stem}_{m.label.lower()}.png")
            for m in SHAPES]
    for model, png in zip(SHAPES, pngs):
        plot([r for r in rows if r["model"] == model.label], png, model.label)
    print(f"wrote {out}, {', '.join(map(str, pngs))} ({time.perf_counter() - t0:.1f} s of simulation, "
          f"{len(rows)} generations of {args.n} tokens)")


def scale_to(prof: dict, model: ModelShape, profiled: tuple[float, float], n_predict: int) -> list[dict]:
    """Every (hosts, agreement, mode) of HOSTS x AGREEMENTS x MODES for the profile scaled to `model`."""
    layer_scale = model.active_params_per_layer * BPW_Q4_K_M / 8 / profiled[0]
    out_scale = model.output_bytes / profiled[1]
    print(f"scaling {prof['model']['path']} to a {model.label}-class model: per layer x{layer_scale:.2f}, output "
          f"x{out_scale:.2f}; draft {prof['draft']['ms_per_token']:.1f} ms/token on its own host; 1 Gbit/s, 100 us links")
    link = Link(100e-6, 1e9 / 8)
    limit = int(prof.get("exact_batch", 3))
    rows = []
    for hosts in HOSTS:
        shape = Shape(hosts=hosts, n_layer=model.n_layer, n_embd=model.n_embd, layer_scale=layer_scale,
                      out_scale=out_scale, link=link, draft_on="own")
        for agreement in AGREEMENTS:
            speeds = {}
            for mode in MODES:
                draft_max = {"iterative": 1, "speculative": max(1, limit - 1), "pipeinfer": limit}[mode]
                gen = GenConfig(mode=mode, n_predict=n_predict, draft_max=draft_max, p_recovery=None,
                                stop_at_eos=False)
                t1 = time.perf_counter()
                res = simulate(build_cluster(prof, shape), gen, agreement=agreement)
                s = res.stats
                speeds[mode] = s.gen_tokens_per_s
                busy = [st["t_busy_s"] / max(1e-9, st["t_busy_s"] + st["t_idle_s"]) for st in res.stages]
                rows.append({"model": model.label, "hosts": hosts, "agreement": agreement, "mode": mode,
                             "draft_max": draft_max,
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
            print(f"{model.label}, {hosts:>2} hosts, agreement {agreement}: " + ", ".join(f"{m} {speeds[m]:.3f}" for m in MODES)
                  + f" tokens/s; pipeinfer {speeds['pipeinfer'] / speeds['iterative']:.2f}x iterative, "
                  f"{speeds['pipeinfer'] / speeds['speculative']:.2f}x speculative", flush=True)
    return rows


def plot(rows: list[dict], path: Path, label: str) -> None:
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
    axes[0].set(title=f"generation speed ({label}-class, Q4_K_M)", ylabel="tokens/s", yscale="log")
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
