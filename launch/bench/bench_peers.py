#!/usr/bin/env python3
"""Benchmark (not a test): pipeinfer against what a user would run instead to split a model over two machines,
llama.cpp's RPC mode, side by side in one run, locally and over the emulated Ethernet cluster.

    python launch/bench/bench_peers.py [--rounds 3] [-n 128] [--networks local,1gbit] [--out results/bench_peers.csv]

The llama.cpp programs are built from the llama.cpp that the installed llama-cpp-python was built from: its
sdist (`pip download --no-binary :all: llama-cpp-python==VERSION`, the same version as installed) carries it
in vendor/llama.cpp; `ggml-rpc-server` and `llama-completion` are built there with `-DGGML_RPC=ON` and otherwise
llama.cpp's defaults (Release, native CPU; on a CPU with AMX, without it: see llama_bin), once, and cached in
~/.cache/pipeinfer/peers/ (about 10 minutes on 2 cores the first time).

Systems (2 cores here: every process has 1 thread, 2 processes at most beside the draft thread):
- `llama-one`: llama-completion, one process (no split: the ceiling of a split).
- `llama-rpc`: llama-completion with `--rpc` to a ggml-rpc-server and `-ngl K+1`: the last K layers on the
  server, the others and the output head in the client (llama.cpp keeps the output on the host below -ngl 29);
  the same layers per machine as pipeinfer's default 2-rank split (`--layer-split balanced`: 17 + 11 layers of
  Qwen2.5-Coder-1.5B; pipeinfer runs the output head on rank 1, so its ranks take equal times per token, while
  neither system overlaps them in single-stream decoding).
- `iterative`, `speculative`, `pipeinfer`: `pipeinfer generate` on 2 ranks (mpiexec), iterative, synchronous
  speculative and the default PipeInfer (both with the default Gemma draft in a thread of rank 0).
Every system generates -n tokens greedily for the README's prompt (chat template applied; EOS ignored) with a
4096-cell context, flash attention and 512-token batches, and the texts must be identical (`same_text`).

Speeds are decode rates after the prompt: llama.cpp's own `eval time` line (n-1 single-token decodes; its
sampling time added, since pipeinfer's rate includes picking the token) and pipeinfer's `gen_tokens_per_s`
(n-1 tokens from the first token to the last). Every round runs every (network, system) once, in an order that
rotates from round to round; medians over rounds and their ratios to `llama-rpc` on the same network are printed
and written as `*_summary.csv`; every run is a row of the CSV. The `1gbit` network: launch/cluster/netns-cluster.sh,
two hosts (root and iproute2 needed), the RPC server on h1 and the client on h0, or one pipeinfer rank on each.
Each run waits for a quiet machine (launch/quiet.py).
"""
from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from importlib import metadata
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # launch/: the shared harness
from charts import grouped_bars  # noqa: E402
from harness import CLUSTER, MPIEXEC, ROOT, write_csv  # noqa: E402
from quiet import run_quietly  # noqa: E402

BIN = Path(sys.executable).parent
PROMPT = "Write a Python function that checks whether a number is prime."
SYSTEMS = ("llama-one", "llama-rpc", "iterative", "speculative", "pipeinfer")
RPC_PORT = 50052
N_CTX = 4096
EVAL = re.compile(r"eval time =\s*([0-9.]+) ms /\s*(\d+) runs")
SAMPLE = re.compile(r"sampling time =\s*([0-9.]+) ms")


# ------------------------------------------------------------------------------------------------ the build
PEER_TARGETS = ("ggml-rpc-server", "llama-completion", "llama-server")


def llama_bin(targets: tuple[str, ...] = PEER_TARGETS) -> Path:
    """The directory holding the llama.cpp programs `targets` (ggml-rpc-server, llama-completion, llama-server, or an
    example's: llama-speculative) built from the installed llama-cpp-python's vendored llama.cpp (built once, cached
    by version)."""
    version = metadata.version("llama_cpp_python")
    home = Path(os.environ.get("PIPEINFER_CACHE", Path.home() / ".cache" / "pipeinfer")) / "peers"
    src = home / f"llama_cpp_python-{version}" / "vendor" / "llama.cpp"
    # On a CPU with AMX, -march=native makes llama.cpp put the weights in its AMX buffer, whose matmul crashed
    # (SIGSEGV) on the default model at the first prompt; pipeinfer never uses it (engine/kernels.py), so the
    # peers are built without it and run the same repacked kernels (GCC keeps explicit -mno-* over -march)
    from pipeinfer.engine.kernels import cpu_flags_line
    no_amx = "amx_int8" in cpu_flags_line().split()
    build = src / ("build-noamx" if no_amx else "build")
    out = build / "bin"
    if all((out / t).exists() for t in targets):
        return out
    home.mkdir(parents=True, exist_ok=True)
    if not src.is_dir():
        with tempfile.TemporaryDirectory() as tmp:
            print(f"downloading llama-cpp-python {version}'s sdist (its vendored llama.cpp) ...", flush=True)
            subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:",
                            f"llama-cpp-python=={version}", "-d", tmp], check=True, capture_output=True)
            sdist = next(Path(tmp).glob("llama_cpp_python-*.tar.gz"))
            subprocess.run(["tar", "xzf", str(sdist), "-C", str(home)], check=True)
    print(f"building {', '.join(targets)} in {build}{' without AMX' if no_amx else ''} (once; ~10 min on 2 cores) ...",
          flush=True)
    gen = ["-G", "Ninja"] if shutil.which("ninja") else []
    flags = "-mno-amx-tile -mno-amx-int8 -mno-amx-bf16"
    amx = [f"-DCMAKE_C_FLAGS={flags}", f"-DCMAKE_CXX_FLAGS={flags}"] if no_amx else []
    subprocess.run(["cmake", "-S", str(src), "-B", str(build), *gen, "-DCMAKE_BUILD_TYPE=Release",
                    "-DGGML_RPC=ON", "-DLLAMA_BUILD_TESTS=OFF",
                    f"-DLLAMA_BUILD_EXAMPLES={'ON' if set(targets) - set(PEER_TARGETS) else 'OFF'}",
                    "-DLLAMA_BUILD_SERVER=ON", "-DLLAMA_CURL=OFF", "-DLLAMA_OPENSSL=OFF", "-DLLAMA_BUILD_APP=OFF",
                    *amx], check=True, capture_output=True)
    subprocess.run(["cmake", "--build", str(build), "-j", str(os.cpu_count() or 2),
                    "--target", *targets], check=True, capture_output=True)
    return out


# ----------------------------------------------------------------------------------------------- the systems
def chat_prompt(model: str) -> str:
    """The README's prompt with the target's chat template, as pipeinfer's `-p` applies it."""
    from pipeinfer.engine.tokenizer import Tokenizer, apply_chat
    tok = Tokenizer(model)
    try:
        return apply_chat(tok, PROMPT)
    finally:
        tok.close()


def llama_cmd(bins: Path, model: str, prompt: str, n: int, rpc: str | None, threads: int = 1) -> list[str]:
    cmd = [str(bins / "llama-completion"), "-m", model, "-p", prompt, "-n", str(n), "-t", str(threads),
           "-tb", str(threads),
           "-c", str(N_CTX), "-b", "512", "-fa", "on", "--temp", "0", "--ignore-eos", "-no-cnv",
           "--no-display-prompt", "--seed", "0"]
    return cmd + (["--rpc", rpc, "-ngl", str(ngl_same_split(model))] if rpc else [])


def ngl_same_split(model: str) -> int:
    """llama.cpp's -ngl that puts on the RPC server the layers pipeinfer's default split gives rank 1: llama.cpp
    offloads the last NGL-1 layers (the output stays on the client below NGL = layers + 1)."""
    from pipeinfer.core.topology import plan_layers
    from pipeinfer.engine.stagefile import layer_costs
    per_layer, tail = layer_costs(model)
    return plan_layers(None, len(per_layer), 2, per_layer, tail)[1].n_layers + 1


def llama_result(proc: subprocess.CompletedProcess) -> tuple[float, str]:
    """tokens/s over llama.cpp's own decode and sampling times, and the generated text."""
    ev, sa = EVAL.findall(proc.stderr), SAMPLE.search(proc.stderr)
    if proc.returncode != 0 or not ev or not sa:
        raise SystemExit(f"llama-completion failed ({proc.returncode}):\n{proc.stderr[-3000:]}")
    eval_ms, runs = float(ev[-1][0]), int(ev[-1][1])  # the last "eval time" (the first is the prompt's)
    text = proc.stdout[:-2] if proc.stdout.endswith("\n\n") else proc.stdout  # it ends its output with "\n\n"
    return runs / ((eval_ms + float(sa.group(1))) / 1e3), text


def pipeinfer_cmd(mode: str, n: int) -> list[str]:
    return [sys.executable, "-m", "mpi4py", "-m", "pipeinfer", "generate", "-p", PROMPT, "-n", str(n),
            "--mode", mode, "-t", "1", "-c", str(N_CTX), "--ignore-eos", "--json", "-q"]


def pipeinfer_result(proc: subprocess.CompletedProcess) -> tuple[float, str]:
    if proc.returncode != 0:
        raise SystemExit(f"pipeinfer failed ({proc.returncode}):\n{proc.stderr[-3000:]}")
    res = json.loads(proc.stdout.strip().splitlines()[-1])
    return res["stats"]["gen_tokens_per_s"], res["text"]


def netns(rate: str, *args: str) -> None:
    env = dict(os.environ, NETNS_RATE=rate, MPIEXEC=MPIEXEC, PATH=f"{BIN}{os.pathsep}{os.environ['PATH']}")
    subprocess.run(["bash", str(CLUSTER / "netns-cluster.sh"), *args], check=True, env=env,
                   capture_output=True, text=True)


class RpcServer:
    """A ggml-rpc-server for one run: locally on 127.0.0.1, or in host h1 of the emulated cluster."""

    def __init__(self, bins: Path, shaped: bool):
        self.host = "10.77.0.2" if shaped else "127.0.0.1"
        cmd = [str(bins / "ggml-rpc-server"), "-H", self.host, "-p", str(RPC_PORT), "-t", "1"]
        self.proc = subprocess.Popen((["ip", "netns", "exec", "h1"] if shaped else []) + cmd,
                                     stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        time.sleep(1.0)  # it listens at once; the client retries nothing
        if self.proc.poll() is not None:
            raise SystemExit(f"ggml-rpc-server exited with {self.proc.returncode}")

    def __enter__(self) -> str:
        return f"{self.host}:{RPC_PORT}"

    def __exit__(self, *exc) -> None:
        self.proc.terminate()
        self.proc.wait(timeout=30)


def run_one(system: str, network: str, bins: Path, model: str, prompt: str, n: int) -> tuple[float, str, float]:
    """(tokens/s, text, foreign CPU %) of one run."""
    shaped = network != "local"
    if system.startswith("llama"):
        if system == "llama-one":
            cmd = llama_cmd(bins, model, prompt, n, None)
            proc, pct = run_quietly(["ip", "netns", "exec", "h0"] + cmd if shaped else cmd)
            return (*llama_result(proc), pct)
        with RpcServer(bins, shaped) as endpoint:
            cmd = llama_cmd(bins, model, prompt, n, endpoint)
            proc, pct = run_quietly(["ip", "netns", "exec", "h0"] + cmd if shaped else cmd)
        return (*llama_result(proc), pct)
    if shaped:
        hostfile = Path(tempfile.mkstemp(suffix=".hosts")[1])
        hostfile.write_text("h0:1\nh1:1\n")
        cmd = [MPIEXEC, "-iface", "brpi", "-f", str(hostfile), "-launcher", "ssh", "-launcher-exec",
               str(CLUSTER / "netns-exec"), "-genv", "UCX_TLS", "tcp", "-genv", "FI_PROVIDER", "tcp",
               "-n", "2"] + pipeinfer_cmd(system, n)
        try:
            proc, pct = run_quietly(cmd)
        finally:
            hostfile.unlink()
    else:
        proc, pct = run_quietly([MPIEXEC, "-n", "2"] + pipeinfer_cmd(system, n))
    return (*pipeinfer_result(proc), pct)


# ---------------------------------------------------------------------------------------------------- report
def summarize(rows: list[dict], networks: list[str], systems: list[str]) -> list[dict]:
    out = []
    for net in networks:
        med = {s: statistics.median(r["tokens_per_s"] for r in rows if (r["network"], r["system"]) == (net, s))
               for s in systems if any((r["network"], r["system"]) == (net, s) for r in rows)}
        for s, v in med.items():
            out.append({"network": net, "system": s, "median_tokens_per_s": round(v, 3),
                        "vs_llama_rpc": round(v / med["llama-rpc"], 3) if "llama-rpc" in med else "",
                        "vs_iterative": round(v / med["iterative"], 3) if "iterative" in med else "",
                        "runs": sum(1 for r in rows if (r["network"], r["system"]) == (net, s))})
    return out


def plot(summary: list[dict], out: Path) -> None:
    networks = list(dict.fromkeys(r["network"] for r in summary))
    systems = list(dict.fromkeys(r["system"] for r in summary))
    median = {(r["network"], r["system"]): r["median_tokens_per_s"] for r in summary}
    grouped_bars(out, systems, networks, lambda s, net: median.get((net, s), 0), ylabel="tokens/s (median)",
                 title="Qwen2.5-Coder-1.5B over 2 machines: llama.cpp RPC vs pipeinfer (2 cores, 1 thread each)")

def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("-n", type=int, default=128)
    ap.add_argument("--networks", default="local,1gbit", help="local and/or netns link rates (e.g. 1gbit)")
    ap.add_argument("--systems", default=",".join(SYSTEMS))
    ap.add_argument("--out", default=str(ROOT / "results" / "bench_peers.csv"))
    args = ap.parse_args()
    from pipeinfer.engine.models import DEFAULT_TARGET, resolve_model
    model = str(resolve_model(DEFAULT_TARGET))
    bins, prompt = llama_bin(), chat_prompt(model)
    networks, systems = args.networks.split(","), args.systems.split(",")
    pairs = [(net, s) for net in networks for s in systems if not (net != "local" and s == "llama-one")]
    rows: list[dict] = []
    out = Path(args.out)
    for rnd in range(args.rounds):
        order = pairs[rnd % len(pairs):] + pairs[:rnd % len(pairs)]
        for net in dict.fromkeys(n for n, _ in order):  # one netns cluster per network and round
            if net != "local":
                netns(net, "up", "2")
            try:
                for _, system in [p for p in order if p[0] == net]:
                    tps, text, pct = run_one(system, net, bins, model, prompt, args.n)
                    rows.append({"round": rnd, "network": net, "system": system, "tokens_per_s": round(tps, 3),
                                 "foreign_cpu_pct": round(pct, 1), "text": text})
                    print(f"round {rnd} {net:6s} {system:12s} {tps:6.2f} tokens/s", flush=True)
            finally:
                if net != "local":
                    netns(net, "down", "2")
    reference = rows[0]["text"]
    for r in rows:
        r["same_text"] = r["text"] == reference
    fields = ["round", "network", "system", "tokens_per_s", "foreign_cpu_pct", "same_text"]
    write_csv(out, rows, fields, extrasaction="ignore")
    summary = summarize(rows, networks, systems)
    write_csv(out.with_name(out.stem + "_summary.csv"), summary)
    plot(summary, out.with_suffix(".png"))
    for r in summary:
        print(f"{r['network']:6s} {r['system']:12s} {r['median_tokens_per_s']:7.2f} tokens/s  "
              f"vs llama-rpc {r['vs_llama_rpc']}  vs iterative {r['vs_iterative']}")
    differ = [f"{r['network']}/{r['system']}/round {r['round']}" for r in rows if not r["same_text"]]
    print("texts: all identical" if not differ else f"texts DIFFER: {', '.join(differ)}")
    sys.exit(1 if differ else 0)


if __name__ == "__main__":
    main()
