#!/usr/bin/env python3
"""Benchmark (not a test): drafting on one 2-core host, pipeinfer beside llama.cpp's own speculative decoding with the
same pair, side by side in one run.

    python launch/bench/bench_spec_peers.py [--rounds 2] [-n 128] [--out results/bench_spec_peers.csv]

The target is Qwen2.5-Coder-1.5B, the draft its sibling Qwen2.5-Coder-0.5B (the same vocabulary, which llama.cpp's
drafting needs); the README's prompt with the chat template, 128 greedy tokens, EOS ignored, a 4096-cell context.
llama.cpp's programs are built from the llama.cpp that llama-cpp-python vendors (bench_peers.llama_bin), with its
defaults:
- `llama-one`: llama-completion, one process on both cores (-t 2), no draft;
- `llama-speculative`: the speculative example, -t 2, the draft beside the target in one process (its default draft
  settings, greedy);
- `llama-server -md`: llama-server with --model-draft, -t 2, one /completion request (its default draft settings);
- `pipeinfer iterative`, `pipeinfer + 0.5B`, `pipeinfer + Gemma`: `pipeinfer generate` on 2 ranks x 1 thread, the draft
  in a thread sharing rank 0's core (the Gemma draft through text translation).
Speeds are decode rates after the prompt, each system's own: llama-completion's eval line, llama-speculative's
"decoded ... speed", llama-server's timings.predicted_per_second, pipeinfer's gen_tokens_per_s. Every round runs every
system once, in an order that rotates; medians and ratios to llama-one; every run a row of the CSV.
"""
from __future__ import annotations

import argparse
import json
import re
import statistics
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # launch/: the shared harness
sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_peers import N_CTX, PROMPT, chat_prompt, llama_bin, llama_cmd, llama_result  # noqa: E402
from harness import MPIEXEC, ROOT, free_port, write_csv  # noqa: E402
from quiet import run_quietly, wait_quiet  # noqa: E402

SYSTEMS = ("llama-one", "llama-speculative", "llama-server -md", "pipeinfer iterative", "pipeinfer + 0.5B",
           "pipeinfer + Gemma")
DECODED = re.compile(r"decoded\s+(\d+) tokens in\s+([0-9.]+) seconds, speed:\s+([0-9.]+) t/s")
ACCEPT = re.compile(r"accept\s+=\s+([0-9.]+)%")


def llama_speculative(bins: Path, target: str, draft: str, prompt: str, n: int) -> dict:
    cmd = [str(bins / "llama-speculative"), "-m", target, "-md", draft, "-p", prompt, "-n", str(n), "-t", "2",
           "-tb", "2", "-c", str(N_CTX), "-fa", "on", "--temp", "0", "--ignore-eos", "--seed", "0"]
    proc, pct = run_quietly(cmd)
    m, a = DECODED.search(proc.stderr), ACCEPT.search(proc.stderr)
    if proc.returncode != 0 or not m:
        raise SystemExit(f"llama-speculative failed ({proc.returncode}):\n{proc.stderr[-3000:]}")
    return {"tokens_per_s": float(m.group(3)), "acceptance": float(a.group(1)) / 100 if a else "", "foreign_pct": pct}


def llama_server_md(bins: Path, target: str, draft: str, prompt: str, n: int) -> dict:
    port = free_port()
    cmd = [str(bins / "llama-server"), "-m", target, "-md", draft, "--spec-type", "draft-simple", "-t", "2", "-tb", "2",
           "-c", str(N_CTX),
           "-fa", "on", "--port", str(port), "--host", "127.0.0.1", "-np", "1"]
    server = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        url = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 120
        while True:
            if server.poll() is not None:
                raise SystemExit(f"llama-server exited with {server.returncode}:\n{server.stderr.read()[-3000:]}")
            try:
                with urllib.request.urlopen(f"{url}/health", timeout=2) as r:
                    if r.status == 200:
                        break
            except OSError:
                pass
            if time.monotonic() > deadline:
                raise SystemExit("llama-server did not become healthy in 120 s")
            time.sleep(0.5)
        wait_quiet()
        body = json.dumps({"prompt": prompt, "n_predict": n, "temperature": 0, "ignore_eos": True,
                           "cache_prompt": False}).encode()
        req = urllib.request.Request(f"{url}/completion", body, {"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=600) as r:
            res = json.loads(r.read())
    finally:
        server.terminate()
        server.wait(timeout=30)
    t = res["timings"]
    drafted, accepted = t.get("draft_n") or 0, t.get("draft_n_accepted") or 0
    return {"tokens_per_s": float(t["predicted_per_second"]),
            "acceptance": round(accepted / drafted, 3) if drafted else "", "foreign_pct": ""}


def pipeinfer_run(args: list[str], n: int) -> dict:
    cmd = [MPIEXEC, "-n", "2", sys.executable, "-m", "mpi4py", "-m", "pipeinfer", "generate", "-p", PROMPT, "-n",
           str(n), "-t", "1", "-c", str(N_CTX), "--ignore-eos", "--json", "-q", *args]
    proc, pct = run_quietly(cmd)
    if proc.returncode != 0:
        raise SystemExit(f"pipeinfer failed ({proc.returncode}):\n{proc.stderr[-3000:]}")
    s = json.loads(proc.stdout.strip().splitlines()[-1])["stats"]
    return {"tokens_per_s": s["gen_tokens_per_s"], "acceptance": round(s["acceptance_rate"], 3) if s["n_drafted"]
            else "", "foreign_pct": pct}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("-n", type=int, default=128)
    ap.add_argument("--out", default=str(ROOT / "results" / "bench_spec_peers.csv"))
    args = ap.parse_args()
    from pipeinfer.engine.models import resolve_model
    target, draft = str(resolve_model("qwen2.5-coder-1.5b")), str(resolve_model("qwen2.5-coder-0.5b"))
    bins = llama_bin(("llama-completion", "llama-server", "llama-speculative"))
    prompt = chat_prompt(target)
    runs = {
        "llama-one": lambda: dict(zip(("tokens_per_s", "text"), llama_result(run_quietly(
            llama_cmd(bins, target, prompt, args.n, None, threads=2))[0]))),
        "llama-speculative": lambda: llama_speculative(bins, target, draft, prompt, args.n),
        "llama-server -md": lambda: llama_server_md(bins, target, draft, prompt, args.n),
        "pipeinfer iterative": lambda: pipeinfer_run(["--mode", "iterative"], args.n),
        "pipeinfer + 0.5B": lambda: pipeinfer_run(["--draft", "qwen2.5-coder-0.5b", "--draft-at", "thread"], args.n),
        "pipeinfer + Gemma": lambda: pipeinfer_run(["--draft", "gemma3-270m", "--draft-at", "thread"], args.n),
    }
    rows = []
    for rnd in range(args.rounds):
        order = SYSTEMS[rnd % len(SYSTEMS):] + SYSTEMS[:rnd % len(SYSTEMS)]
        for system in order:
            got = runs[system]()
            got.pop("text", None)
            rows.append({"round": rnd, "system": system, **got})
            print(f"round {rnd}  {system:<20} {got['tokens_per_s']:7.2f} tokens/s  acceptance {got.get('acceptance', '')}",
                  flush=True)
    write_csv(Path(args.out), rows, ["round", "system", "tokens_per_s", "acceptance", "foreign_pct"])
    base = statistics.median(r["tokens_per_s"] for r in rows if r["system"] == "llama-one")
    print(f"\n{'system':<22}{'median tokens/s':>16}{'x llama-one':>13}")
    for system in SYSTEMS:
        med = statistics.median(r["tokens_per_s"] for r in rows if r["system"] == system)
        print(f"{system:<22}{med:16.2f}{med / base:12.2f}x")
    print(f"wrote {args.out} (one host, 2 cores: llama.cpp 1 process x 2 threads, pipeinfer 2 ranks x 1 thread)")


if __name__ == "__main__":
    main()
