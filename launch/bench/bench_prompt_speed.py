#!/usr/bin/env python3
"""Benchmark (not a test): the prompt speed of an uncached ~2,000-token prompt on the 2-rank pipeline against one
process, and what the 63-token prompt chunks cost against 512-token batches, measured side by side in one run.

    python launch/bench/bench_prompt_speed.py [--prompt-tokens 2000] [--repeats 3] [-n 4]
                                              [--variants 2x1,1x2,1x2-c512,1x1] [--quiet]
                                              [--profile results/twin_profile_2ranks.json]
                                              [--out results/bench_prompt_speed.csv]
    python launch/bench/bench_prompt_speed.py --prompt-tokens 500 --repeats 1      # smoke, ~1-2 min

Every run is one `pipeinfer generate --mode iterative -n N --ignore-eos --json -q` of the same prompt (no chat
template: ~--prompt-tokens tokens of this repository's files at HEAD, launch/bench/bench_prompt_cache.py's excerpts),
a fresh process each time, so nothing is cached (the stats' n_cached is checked to be 0). Iterative mode: no draft
model is loaded, and a prompt is processed the same way in every mode (non-speculative chunk runs). The variants
(ranks x threads <= 2, this machine's cores):

    2x1        mpiexec -n 2 pipeinfer generate --threads 1    the pipeline, --prompt-chunk 63 (the default)
    1x2        pipeinfer generate --threads 2                 one process, the default 63-token chunks
    1x2-c512   pipeinfer generate --threads 2 --prompt-chunk 512   one process, 512-token batches (no cache reuse)
    1x1        pipeinfer generate --threads 1                 one process on one core: the twin's "one stage"
    2x1-c512   mpiexec -n 2 ... --threads 1 --prompt-chunk 512 (not in the default list)

Prompt speed is the stats' pp_tokens_per_s: (prompt tokens - cached) / (time the prompt's logits gave the first
token - start of prompt processing), on rank 0. The variants alternate, each repeat in a rotated order (none always
first); --quiet waits for a quiet machine before each run and measures again when other processes used more than
5% of a core during it (launch/quiet.py); without it the foreign CPU is recorded for each run (a column).

Printed (medians over the repeats): each variant's prompt tokens/s, and the ratios 2x1 / 1x2 (the pipeline on the
machine's 2 cores against one process using both), 1x2 / 1x2-c512 (what 63-token chunks cost), 2x1 / 1x1 (two
stages against one, one core each). When the digital twin offers a prompt-speed prediction
(pipeinfer.twin.plan.prompt_speedup), rows from it: this machine's --profile, 2 stages against 1 (every host like
the profiled rank 0: to compare with the measured 2x1 / 1x1), and a 70B-class model (launch/twin/twin_scaling.py's
Llama-70B Q4_K_M shape, Gigabit links of 100 us, as launch/twin/twin_clients.py) on 8 stages against one host holding
it all, at 63- and 512-token chunks. Appends the runs, the medians, the ratios and the twin's rows to OUT (a `kind`
column: run, median, ratio, twin), writes OUT.txt (the printed summary) and draws OUT.png (tokens/s per variant;
the ratios, measured and the twin's).
"""
from __future__ import annotations

import argparse
import csv
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # launch/: the shared harness
from harness import MPIEXEC, ROOT, on_path  # noqa: E402

# this tree's pipeinfer, here and in every process started (the venv's editable install may point at another copy);
# the twin's 70B-class shape from twin/twin_scaling.py
on_path("bench", "twin", pythonpath=True)
from bench_prompt_cache import DEFAULT_MODEL, excerpt, source_files, tokenizer  # noqa: E402
from quiet import _Meter, run_quietly  # noqa: E402

VARIANTS = {  # name: (ranks, threads per rank, --prompt-chunk or None for the default[, --layer-split])
    "2x1": (2, 1, None),
    "2x1-even": (2, 1, None, "even"),
    "1x2": (1, 2, None),
    "1x2-c512": (1, 2, 512),
    "1x1": (1, 1, None),
    "2x1-c512": (2, 1, 512),
}
DESCRIBE = {
    "2x1": "2 ranks x 1 thread, 63-token chunks",
    "2x1-even": "2 ranks x 1 thread, 63-token chunks, --layer-split even (14 + 14 layers)",
    "1x2": "1 process x 2 threads, 63-token chunks",
    "1x2-c512": "1 process x 2 threads, --prompt-chunk 512",
    "1x1": "1 process x 1 thread, 63-token chunks",
    "2x1-c512": "2 ranks x 1 thread, --prompt-chunk 512",
}
RATIOS = (("2x1", "1x2", "2-rank / 1-process (2 threads) prompt tokens/s"),
          ("1x2", "1x2-c512", "1 process: 63-token chunks / 512-token chunks"),
          ("2x1", "1x1", "2 stages / 1 stage, 1 core each (the twin's comparison)"),
          ("2x1-even", "1x2", "2-rank even split / 1-process (2 threads) prompt tokens/s"),
          ("2x1-c512", "1x2-c512", "2-rank / 1-process at 512-token chunks"))


def make_prompt(tok, n_tokens: int) -> tuple[str, str]:
    """~n_tokens tokens of excerpts of the repository at HEAD (the same text every run of a commit)."""
    commit, files = source_files()
    parts, i = [], 0
    while True:
        parts.append(excerpt(tok, files, i, 400)[1])
        text = "\n\n".join(parts)
        if len(tok.encode(text)) >= n_tokens or i > 100:
            break
        i += 1
    ids = tok.encode(text, add_special=False)[:n_tokens]
    return commit, tok.decode(ids)


def run_once(variant: str, prompt_file: str, n_predict: int, quiet: bool, model: str | None) -> dict:
    ranks, threads, chunk, *split = VARIANTS[variant]
    cmd = [sys.executable, "-m", "mpi4py", "-m", "pipeinfer", "generate", "-f", prompt_file, "--no-chat",
           "-n", str(n_predict), "--mode", "iterative", "-t", str(threads), "--ignore-eos", "--json", "-q"]
    cmd += ["--prompt-chunk", str(chunk)] if chunk else []
    cmd += ["--layer-split", split[0]] if split else []
    cmd += ["-m", model] if model else []
    if ranks > 1:
        cmd = [MPIEXEC, "-n", str(ranks)] + cmd
    t0 = time.perf_counter()
    if quiet:
        proc, foreign = run_quietly(cmd, timeout=900)
    else:
        with _Meter() as m:
            proc = subprocess.run(cmd, capture_output=True, text=True, timeout=900)
        foreign = 100 * m.cpu_s / max(1e-9, time.perf_counter() - t0)
    wall = time.perf_counter() - t0
    if proc.returncode != 0:
        raise SystemExit(f"{variant}: exit {proc.returncode}\n{' '.join(cmd)}\n{proc.stdout[-2000:]}\n"
                         f"{proc.stderr[-3000:]}")
    res = json.loads(proc.stdout.strip().splitlines()[-1])
    st = res["stats"]
    return {"variant": variant, "describe": DESCRIBE[variant], "ranks": ranks, "threads": threads,
            "prompt_chunk": chunk or 63, "n_prompt": st["n_prompt"], "n_cached": st.get("n_cached", 0),
            "prompt_s": round(st["t_prompt_done_s"] - st["t_start_s"], 4),
            "pp_tokens_per_s": round(st["pp_tokens_per_s"], 3), "n_runs": st.get("n_runs", ""),
            "process_s": round(wall, 2), "foreign_cpu_pct": round(foreign, 1),
            "tokens": " ".join(map(str, res["tokens"]))}


def twin_rows(profile: str, n_prompt: int, model: str | None) -> tuple[list[dict], str]:
    """The twin's prompt-speed predictions, if it has them (pipeinfer.twin.plan.prompt_speedup); else why not."""
    try:
        from pipeinfer.twin import plan
    except ImportError as e:
        return [], f"no twin ({e})"
    fn = getattr(plan, "prompt_speedup", None)
    if fn is None:
        return [], "the twin has no prompt_speedup (pipeinfer/twin/plan.py)"
    if not Path(profile).exists():
        return [], f"no profile at {profile} (`pipeinfer profile`)"
    try:
        from twin_scaling import BPW_Q4_K_M, LLAMA_70B

        from pipeinfer.engine.models import resolve_model
        from pipeinfer.twin.cluster import Link
        from pipeinfer.twin.plan import Shape, load_profile
        from pipeinfer.twin.profile import weight_bytes
        prof = load_profile(profile)
        profiled = weight_bytes(Path(model) if model else resolve_model(DEFAULT_MODEL))
        llama_70b = Shape(n_layer=LLAMA_70B.n_layer, n_embd=LLAMA_70B.n_embd,
                          layer_scale=LLAMA_70B.active_params_per_layer * BPW_Q4_K_M / 8 / profiled[0],
                          out_scale=LLAMA_70B.output_bytes / profiled[1], link=Link(100e-6, 1e9 / 8))
        cases = [("this machine's profile: 2 stages / 1 (1 core each)", 2, Shape()),
                 ("70B-class Q4_K_M: 8 stages / 1 host (1 core each, 1 Gbit/s links)", 8, llama_70b)]
        rows = []
        for label, n_stages, shape in cases:
            for chunk in (63, 512):
                r = fn(prof, n_stages, n_prompt=n_prompt, shape=shape, chunk=chunk)
                rows.append({"kind": "twin", "variant": f"twin {n_stages} stages, chunk {chunk}", "describe": label,
                             "ranks": n_stages, "prompt_chunk": chunk, "n_prompt": n_prompt,
                             "pp_tokens_per_s": round(r.tokens_per_s, 3),
                             "one_stage_tokens_per_s": round(r.one_stage_tokens_per_s, 3),
                             "ratio": round(r.speedup, 3)})
        return rows, ""
    except Exception as e:  # noqa: BLE001 (the twin's API is young: say why, keep the measurements)
        return [], f"the twin's prompt_speedup failed: {type(e).__name__}: {e}"


def plot(runs: list[dict], med: dict, trows: list[dict], png: Path, title: str) -> None:
    """Left: each variant's prompt tokens/s (bar: median, dots: runs); right: the speedups, measured and the twin's."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4.2), gridspec_kw={"width_ratios": [1.2, 1]})
    names = list(med)
    ax1.bar(range(len(names)), [med[v] for v in names], color="tab:blue", alpha=0.6)
    for i, v in enumerate(names):
        ys = [r["pp_tokens_per_s"] for r in runs if r["variant"] == v]
        ax1.scatter([i] * len(ys), ys, color="k", s=12, zorder=3)
        ax1.annotate(f"{med[v]:.0f}", (i, med[v]), ha="center", va="bottom", fontsize=8)
    ax1.set_xticks(range(len(names)), [DESCRIBE[v].replace(", ", "\n") for v in names], fontsize=7)
    ax1.set_ylabel("uncached prompt tokens/s")
    ax1.set_title("measured (bar: median, dots: runs)", fontsize=9)
    bars = [(f"{a}\n/ {b}", med[a] / med[b]) for a, b, _ in RATIOS if a in med and b in med]
    bars += [(f"twin {r['ranks']} st.\nchunk {r['prompt_chunk']}", r["ratio"]) for r in trows]
    if bars:
        ax2.bar(range(len(bars)), [x for _, x in bars],
                color=["tab:blue"] * (len(bars) - len(trows)) + ["tab:orange"] * len(trows), alpha=0.7)
        for i, (_, x) in enumerate(bars):
            ax2.annotate(f"x{x:.2f}", (i, x), ha="center", va="bottom", fontsize=8)
        ax2.set_xticks(range(len(bars)), [n for n, _ in bars], fontsize=7)
        ax2.axhline(1.0, color="gray", lw=0.8)
    ax2.set_title("ratios of prompt tokens/s (blue: measured, orange: the twin)", fontsize=9)
    for ax in (ax1, ax2):
        ax.grid(axis="y", alpha=0.3)
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(png, dpi=120)
    plt.close(fig)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--prompt-tokens", type=int, default=2000)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("-n", "--n-predict", type=int, default=4)
    ap.add_argument("--variants", default="2x1,1x2,1x2-c512,1x1", help=f"of {', '.join(VARIANTS)}")
    ap.add_argument("--quiet", action="store_true", help="wait for a quiet machine before each run (launch/quiet.py)")
    ap.add_argument("--model", default=None, help=f"target GGUF [default: {DEFAULT_MODEL}]")
    ap.add_argument("--profile", default=str(ROOT / "results" / "twin_profile_2ranks.json"),
                    help="the twin's profile of this machine (for the twin's rows)")
    ap.add_argument("--out", default=str(ROOT / "results" / "bench_prompt_speed.csv"))
    args = ap.parse_args()
    variants = args.variants.split(",")
    if unknown := [v for v in variants if v not in VARIANTS]:
        ap.error(f"--variants: unknown {unknown}")

    tok = tokenizer(args.model or DEFAULT_MODEL)
    commit, text = make_prompt(tok, args.prompt_tokens)
    tok.close()
    stamp = time.strftime("%Y-%m-%dT%H:%M:%S")
    runs: list[dict] = []
    with tempfile.TemporaryDirectory() as d:
        prompt_file = str(Path(d) / "prompt.txt")
        Path(prompt_file).write_text(text)
        print(f"prompt: ~{args.prompt_tokens} tokens of {commit[:12]}'s files, no chat template; -n "
              f"{args.n_predict}, --mode iterative; {args.repeats} repeats of {', '.join(variants)}", flush=True)
        for rep in range(args.repeats):
            for v in variants[rep % len(variants):] + variants[:rep % len(variants)]:
                r = run_once(v, prompt_file, args.n_predict, args.quiet, args.model)
                r.update(kind="run", repeat=rep)
                runs.append(r)
                print(f"  repeat {rep} {v:9s} {r['n_prompt']} prompt tokens in {r['prompt_s']:.2f} s: "
                      f"{r['pp_tokens_per_s']:.1f} tokens/s (process {r['process_s']:.1f} s, foreign CPU "
                      f"{r['foreign_cpu_pct']:.0f}% of a core)", flush=True)
    bad = [r for r in runs if r["n_cached"]]
    med = {v: float(np.median([r["pp_tokens_per_s"] for r in runs if r["variant"] == v])) for v in variants}
    rows = [{"kind": "median", "variant": v, "describe": DESCRIBE[v], "ranks": VARIANTS[v][0],
             "threads": VARIANTS[v][1], "prompt_chunk": VARIANTS[v][2] or 63, "n_prompt": runs[0]["n_prompt"],
             "pp_tokens_per_s": round(med[v], 3), "repeat": args.repeats} for v in variants]
    lines = [f"{'variant':10s} {'prompt tokens/s (median)':>25s}  what"]
    lines += [f"{v:10s} {med[v]:25.1f}  {DESCRIBE[v]}" for v in variants]
    for a, b, what in RATIOS:
        if a in med and b in med:
            x = med[a] / med[b]
            rows.append({"kind": "ratio", "variant": f"{a} / {b}", "describe": what, "ratio": round(x, 3),
                         "n_prompt": runs[0]["n_prompt"]})
            lines.append(f"ratio {a} / {b} = {x:.3f}  ({what})")
    same = {r["tokens"] for r in runs}
    if len(same) == 1:
        lines.append(f"generated tokens: identical in every run ({args.n_predict} tokens, greedy)")
    else:
        lines.append(f"generated tokens: {len(same)} different sequences ({args.n_predict}, greedy): " + "; ".join(
            f"{v}: {sorted({r['tokens'] for r in runs if r['variant'] == v})}" for v in variants))
    trows, why = twin_rows(args.profile, runs[0]["n_prompt"], args.model)
    if trows:
        lines.append("the digital twin (pipeinfer.twin.plan.prompt_speedup), uncached prompt tokens/s, S stages / one:")
        lines += [f"  {r['describe']}, chunk {r['prompt_chunk']}: {r['pp_tokens_per_s']:.2f} / "
                  f"{r['one_stage_tokens_per_s']:.2f} tokens/s = x{r['ratio']:.3f}" for r in trows]
        if "2x1" in med and "1x1" in med:
            lines.append(f"  measured here, 2x1 / 1x1 at 63-token chunks: x{med['2x1'] / med['1x1']:.3f}")
    else:
        lines.append(f"twin: no prediction ({why})")
    if bad:
        lines.append(f"WARNING: {len(bad)} runs took prompt tokens from a cache (n_cached > 0): not uncached")
    print("\n".join(lines))

    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    cols = ["timestamp", "machine", "source_commit", "kind", "variant", "describe", "repeat", "ranks", "threads",
            "prompt_chunk", "n_prompt", "n_cached", "prompt_s", "pp_tokens_per_s", "one_stage_tokens_per_s", "ratio",
            "n_runs", "process_s", "foreign_cpu_pct", "tokens"]
    new = not out.exists()
    with open(out, "a", newline="") as f:
        w = csv.DictWriter(f, fieldnames=cols, restval="")
        if new:
            w.writeheader()
        for r in runs + rows + trows:
            w.writerow({"timestamp": stamp, "machine": f"{os.cpu_count()} cores", "source_commit": commit, **r})
    out.with_suffix(".txt").write_text("\n".join(lines) + "\n")
    plot(runs, med, trows, out.with_suffix(".png"),
         f"Uncached {runs[0]['n_prompt']}-token prompt, pipeinfer generate --mode iterative, "
         f"{args.repeats} repeat{'s' if args.repeats > 1 else ''} ({commit[:8]})")
    print(f"appended to {out}; wrote {out.with_suffix('.txt')}, {out.with_suffix('.png')}")
    if bad:
        raise SystemExit(1)


if __name__ == "__main__":
    main()
