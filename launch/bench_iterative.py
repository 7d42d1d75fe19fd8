#!/usr/bin/env python3
"""Benchmark (not a test): generation tokens/s of llama-cpp-python alone, pipeinfer on one process, and
pipeinfer's 2-rank iterative pipeline, on the real Qwen2.5-Coder-1.5B, measured side by side in one run.

    python launch/bench_iterative.py [-n 128] [--repeats 3] [--out results/bench_iterative.csv]

pipeinfer runs with its batch-invariant kernels (flash attention, no weight repack) and, for the
like-for-like orchestration check, with --fast-kernels (llama-cpp-python's default weight layout).
Same total threads everywhere (2 on this 2-core machine: 2 threads in one process, 1 per rank with 2
ranks, so ranks x threads <= cores). Generation speed is (tokens - 1) / time after the prompt's logits,
for all three. Prints the ratios; appends rows to the CSV.
"""
from __future__ import annotations

import argparse
import csv
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent


def bench_llama_cpp_python(model: str, prompt: list[int], n: int, threads: int) -> float:
    import llama_cpp
    llm = llama_cpp.Llama(model_path=model, n_ctx=len(prompt) + n + 8, n_batch=512, n_threads=threads,
                          n_threads_batch=threads, verbose=False)
    llm.eval(prompt)
    ctx, n_vocab = llm._ctx.ctx, llm.n_vocab()
    t = int(np.argmax(np.ctypeslib.as_array(llama_cpp.llama_get_logits_ith(ctx, -1), shape=(n_vocab,))))
    t0 = time.perf_counter()
    for _ in range(n - 1):
        llm.eval([t])
        t = int(np.argmax(np.ctypeslib.as_array(llama_cpp.llama_get_logits_ith(ctx, -1), shape=(n_vocab,))))
    dt = time.perf_counter() - t0
    llm.close()
    return (n - 1) / dt


def bench_pipeinfer(model: str, prompt_file: str, n: int, ranks: int, threads: str, fast: bool = False) -> dict:
    cmd = [sys.executable, "-m", "mpi4py", "-m", "pipeinfer", "generate", "-m", model, "-f", prompt_file,
           "-n", str(n), "--mode", "iterative", "-t", threads, "--ignore-eos", "--json", "-q"]
    if fast:
        cmd.append("--fast-kernels")
    if ranks > 1:
        mpiexec = str(Path(sys.executable).parent / "mpiexec")
        cmd = [mpiexec, "-n", str(ranks)] + cmd
    p = subprocess.run(cmd, capture_output=True, text=True, check=True)
    return json.loads(p.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("-n", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--prompt", default=str(ROOT / "prompts" / "code.txt"))
    ap.add_argument("--out", default=str(ROOT / "results" / "bench_iterative.csv"))
    args = ap.parse_args()

    from pipeinfer.cli import apply_chat, read_prompt_file
    from pipeinfer.models import resolve_model
    from pipeinfer.tokenizer import Tokenizer
    model = str(resolve_model("qwen2.5-coder-1.5b"))
    text, chat = read_prompt_file(args.prompt)
    tok = Tokenizer(model)
    prompt = tok.encode(apply_chat(tok, text) if chat else text)

    rows = []
    for rep in range(args.repeats):  # interleaved, so drift on a shared machine hits all three alike
        lcp = bench_llama_cpp_python(model, prompt, args.n, threads=2)
        one = bench_pipeinfer(model, args.prompt, args.n, 1, "2")
        one_fast = bench_pipeinfer(model, args.prompt, args.n, 1, "2", fast=True)
        two = bench_pipeinfer(model, args.prompt, args.n, 2, "1")
        assert one["tokens"] == two["tokens"], "1-rank and 2-rank outputs differ"
        r = {"repeat": rep, "n_prompt": len(prompt), "n": args.n,
             "llama_cpp_python_tps": round(lcp, 3),
             "pipeinfer_1rank_tps": round(one["stats"]["gen_tokens_per_s"], 3),
             "pipeinfer_1rank_fast_kernels_tps": round(one_fast["stats"]["gen_tokens_per_s"], 3),
             "pipeinfer_2rank_iterative_tps": round(two["stats"]["gen_tokens_per_s"], 3)}
        rows.append(r)
        print(r, flush=True)
    med = {k: float(np.median([r[k] for r in rows])) for k in rows[0] if k.endswith("_tps")}
    print(f"median tokens/s: llama-cpp-python {med['llama_cpp_python_tps']:.2f}, "
          f"pipeinfer 1 rank {med['pipeinfer_1rank_tps']:.2f}, 2-rank iterative {med['pipeinfer_2rank_iterative_tps']:.2f}")
    print(f"ratio 1-rank / llama-cpp-python = {med['pipeinfer_1rank_tps'] / med['llama_cpp_python_tps']:.3f} (goal >= 0.95; "
          f"pipeinfer uses batch-invariant kernels, llama-cpp-python its defaults)")
    print(f"ratio 1-rank --fast-kernels / llama-cpp-python = "
          f"{med['pipeinfer_1rank_fast_kernels_tps'] / med['llama_cpp_python_tps']:.3f} (same kernels as llama-cpp-python)")
    print(f"ratio 2-rank / 1-rank = {med['pipeinfer_2rank_iterative_tps'] / med['pipeinfer_1rank_tps']:.3f} "
          f"(2 ranks x 1 thread vs 1 rank x 2 threads on 2 cores)")
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    new = not out.exists()
    with open(out, "a", newline="") as f:
        w = csv.DictWriter(f, fieldnames=["timestamp", "machine"] + list(rows[0]))
        if new:
            w.writeheader()
        for r in rows:
            w.writerow({"timestamp": time.strftime("%Y-%m-%dT%H:%M:%S"), "machine": f"{os.cpu_count()} cores", **r})


if __name__ == "__main__":
    main()
