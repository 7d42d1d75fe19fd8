#!/usr/bin/env python3
"""Benchmark (not a test): generation tokens/s of llama-cpp-python alone, pipeinfer on one process, and
pipeinfer's 2-rank iterative pipeline, on the real Qwen2.5-Coder-1.5B, measured side by side in one run.

    python launch/bench_iterative.py [-n 128] [--repeats 3] [--out results/bench_iterative.csv]

- llama-cpp-python with its own default kernels (repacked weights, no flash attention): what a user would
  otherwise run; and with pipeinfer's default kernels (repacked weights + flash attention), whose output
  pipeinfer must equal token for token;
- pipeinfer on one process at 2 threads and at 1 thread (default `--kernels repack`), against
  llama-cpp-python's defaults at the same thread count;
- the 2-rank iterative pipeline (1 thread per rank) with the default kernels and with `--kernels
  no-repack` (exact to larger batches, slower).
Ranks x threads <= 2 everywhere (this machine has 2 cores). Generation speed is (tokens - 1) / time after
the prompt's logits, for all. Runs are interleaved so drift on a shared machine hits all alike; medians
are printed with the ratios and rows appended to the CSV.
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


def bench_llama_cpp_python(model: str, prompt: list[int], n: int, threads: int, flash: bool) -> tuple[float, list[int]]:
    import llama_cpp

    from pipeinfer.engine.kernels import UNUSED_EXTRA_BUFFERS, drop_extra_buffer_types
    # on a CPU with AMX llama.cpp's AMX buffer crashed at the prompt (engine/kernels.py): the same kernels as pipeinfer
    drop_extra_buffer_types(UNUSED_EXTRA_BUFFERS)
    kw = {"flash_attn": True} if flash else {}
    llm = llama_cpp.Llama(model_path=model, n_ctx=len(prompt) + n + 8, n_batch=512, n_threads=threads,
                          n_threads_batch=threads, verbose=False, **kw)
    llm.eval(prompt)
    ctx, n_vocab = llm._ctx.ctx, llm.n_vocab()
    t = int(np.argmax(np.ctypeslib.as_array(llama_cpp.llama_get_logits_ith(ctx, -1), shape=(n_vocab,))))
    out = [t]
    t0 = time.perf_counter()
    for _ in range(n - 1):
        llm.eval([t])
        t = int(np.argmax(np.ctypeslib.as_array(llama_cpp.llama_get_logits_ith(ctx, -1), shape=(n_vocab,))))
        out.append(t)
    dt = time.perf_counter() - t0
    llm.close()
    return (n - 1) / dt, out


def bench_pipeinfer(model: str, prompt_file: str, n: int, ranks: int, threads: str, kernels: str = "repack") -> dict:
    cmd = [sys.executable, "-m", "mpi4py", "-m", "pipeinfer", "generate", "-m", model, "-f", prompt_file,
           "-n", str(n), "--mode", "iterative", "-t", threads, "--kernels", kernels, "--ignore-eos", "--json", "-q"]
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

    from pipeinfer.core.files import read_prompt_file
    from pipeinfer.engine.tokenizer import apply_chat
    from pipeinfer.engine.models import resolve_model
    from pipeinfer.engine.tokenizer import Tokenizer
    model = str(resolve_model("qwen2.5-coder-1.5b"))
    text, chat = read_prompt_file(args.prompt)
    tok = Tokenizer(model)
    prompt = tok.encode(apply_chat(tok, text) if chat else text)

    rows = []
    for rep in range(args.repeats):  # interleaved, so drift on a shared machine hits all alike
        lcp2, _ = bench_llama_cpp_python(model, prompt, args.n, threads=2, flash=False)
        lcp1, _ = bench_llama_cpp_python(model, prompt, args.n, threads=1, flash=False)
        lcp_same, same_tokens = bench_llama_cpp_python(model, prompt, args.n, threads=2, flash=True)
        one2 = bench_pipeinfer(model, args.prompt, args.n, 1, "2")
        one1 = bench_pipeinfer(model, args.prompt, args.n, 1, "1")
        two = bench_pipeinfer(model, args.prompt, args.n, 2, "1")
        two_old = bench_pipeinfer(model, args.prompt, args.n, 2, "1", kernels="no-repack")
        for name, res in (("1 rank x 2 threads", one2), ("1 rank x 1 thread", one1), ("2 ranks", two)):
            assert res["tokens"] == same_tokens, f"pipeinfer {name} differs from llama-cpp-python at its kernels"
        r = {"repeat": rep, "n_prompt": len(prompt), "n": args.n,
             "llama_cpp_python_2t_tps": round(lcp2, 3),
             "llama_cpp_python_1t_tps": round(lcp1, 3),
             "llama_cpp_python_2t_flash_tps": round(lcp_same, 3),
             "pipeinfer_1rank_2t_tps": round(one2["stats"]["gen_tokens_per_s"], 3),
             "pipeinfer_1rank_1t_tps": round(one1["stats"]["gen_tokens_per_s"], 3),
             "pipeinfer_2rank_iterative_tps": round(two["stats"]["gen_tokens_per_s"], 3),
             "pipeinfer_2rank_iterative_norepack_tps": round(two_old["stats"]["gen_tokens_per_s"], 3),
             "exact_batch_limit": min(two["stats"]["exact_batch"]),
             "exact_batch_limit_norepack": min(two_old["stats"]["exact_batch"])}
        rows.append(r)
        print(r, flush=True)
    med = {k: float(np.median([r[k] for r in rows])) for k in rows[0] if k.endswith("_tps")}
    print("median tokens/s: " + ", ".join(f"{k[:-4]} {v:.2f}" for k, v in med.items()))
    print("output: pipeinfer (1 rank at 1 and 2 threads, 2 ranks) identical to llama-cpp-python with repacked "
          "weights + flash attention, every repeat")
    print(f"ratio 1 rank x 2 threads / llama-cpp-python defaults at 2 threads = "
          f"{med['pipeinfer_1rank_2t_tps'] / med['llama_cpp_python_2t_tps']:.3f} (goal >= 0.97)")
    print(f"ratio 1 rank x 1 thread / llama-cpp-python defaults at 1 thread = "
          f"{med['pipeinfer_1rank_1t_tps'] / med['llama_cpp_python_1t_tps']:.3f} (goal >= 0.97)")
    print(f"ratio 2-rank iterative, --kernels repack / --kernels no-repack = "
          f"{med['pipeinfer_2rank_iterative_tps'] / med['pipeinfer_2rank_iterative_norepack_tps']:.3f} (goal >= 1.35)")
    print(f"ratio 2-rank / 1 rank x 2 threads = {med['pipeinfer_2rank_iterative_tps'] / med['pipeinfer_1rank_2t_tps']:.3f} "
          f"(2 ranks x 1 thread vs 1 rank x 2 threads on 2 cores)")
    print(f"exact batch limit: {rows[0]['exact_batch_limit']} (repack), {rows[0]['exact_batch_limit_norepack']} (no-repack)")
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    if out.exists() and not out.read_text().startswith("timestamp,machine," + ",".join(rows[0])):
        out.rename(out.with_suffix(".old.csv"))  # an earlier layout of columns: keep it aside
    new = not out.exists()
    with open(out, "a", newline="") as f:
        w = csv.DictWriter(f, fieldnames=["timestamp", "machine"] + list(rows[0]))
        if new:
            w.writeheader()
        for r in rows:
            w.writerow({"timestamp": time.strftime("%Y-%m-%dT%H:%M:%S"), "machine": f"{os.cpu_count()} cores", **r})


if __name__ == "__main__":
    main()
