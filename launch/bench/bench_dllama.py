#!/usr/bin/env python3
"""Benchmark (not a test): distributed-llama (b4rtaz/distributed-llama: tensor parallelism, every layer split over
the nodes, synchronised over TCP) beside pipeinfer and llama.cpp RPC on the same two emulated hosts, 1 thread each.

    python launch/bench/bench_dllama.py [--rounds 3] [-n 128] [--rate 1gbit] [--systems dllama,llama-rpc,iterative,...]
        [--config LABEL=ARGS ...] [--dllama BIN] [--dllama-model M.m] [--dllama-tokenizer T.t]
        [--out results/bench_dllama.csv]

Needs root and iproute2 (launch/cluster/netns-cluster.sh: hosts h0 and h1 on a bridge, links shaped to --rate).
distributed-llama is not part of this project and is not built here: --dllama names a `dllama` binary built from its
own source (its Makefile), --dllama-model/--dllama-tokenizer its .m model and .t tokenizer made by its converters
(converter/convert-hf.py, convert-tokenizer-hf.py). Its converter takes the Hugging Face model types llama, mistral,
qwen3 and qwen3_moe; Qwen2 (the default target here) has q/k/v biases that no distributed-llama architecture has, so
the model it runs here is Qwen2.5-Coder-1.5B's own tensors (the GGUF dequantized) converted as a Llama: the same
shapes and the same work per token, without the biases (so its text is not the others'; its speed is comparable).
Its limits: 1, 2, 4... nodes, no more than the model's KV heads (2 here), q40 weights need a q80 buffer.

Systems (every run 2 hosts x 1 thread unless said otherwise):
- `dllama`: `dllama worker --nthreads 1` on h1 and `dllama inference --workers h1 --nthreads 1 --buffer-float-type q80
  --temperature 0` on h0; its rate is its own "Prediction tokens/s" (the -n decode steps after the prompt).
- `dllama-one`: the root alone on h0 (1 host x 1 thread: the ceiling of its split).
- `llama-rpc`: llama-completion on h0 with ggml-rpc-server on h1 (launch/bench/bench_peers.py's run).
- `iterative`, `speculative`, `pipeinfer`: `pipeinfer generate --mode M` on 2 ranks, one per host (the default
  Qwen2.5-Coder-1.5B Q4_K_M; the draft, Gemma 3 270M, in a thread of rank 0), bench_peers.py's command.
- `--config LABEL=ARGS` (repeatable): another pipeinfer configuration on the same 2 ranks: bench_peers.py's
  `generate --mode iterative` command with ARGS appended (a later --mode or -m overrides), e.g.
  `--config group="--tensor-parallel 2"` or `--config q4_0="-m /path/q4_0.gguf"`.
Every system generates -n tokens greedily for the same prompt (bench_peers.py's README prompt with the target's chat
template; distributed-llama gets the templated text as its prompt). Rates are decode rates after the prompt
(pipeinfer's gen_tokens_per_s, llama.cpp's eval time, distributed-llama's prediction time). Each round runs every
configuration once, in an order that rotates from round to round, on one netns cluster that is taken down at the end
of the round (also on failure or interruption). Writes one CSV row per (round, label) and then one `median` row per
label with its ratios to dllama and llama-rpc; prints the best pipeinfer configuration over dllama. When
distributed-llama cannot run here, one line says why and its published scaling is printed instead.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import shlex
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # launch/: the shared harness
sys.path.insert(0, str(Path(__file__).resolve().parent))      # bench/: bench_peers.py's runs
import bench_peers  # noqa: E402
from harness import CLUSTER, MPIEXEC, ROOT, write_csv  # noqa: E402
from quiet import run_quietly  # noqa: E402

SYSTEMS = ("dllama", "llama-rpc", "iterative", "speculative", "pipeinfer")
PIPEINFER_MODES = ("iterative", "speculative", "pipeinfer")
H0, H1 = "h0", "h1"
H1_ADDR = "10.77.0.2"  # netns-cluster.sh: host hI is 10.77.0.(I+1)
PUBLISHED = ("distributed-llama's published scaling (Llama 2 70B Q4_0, c3d-highcpu-30 VMs): 910 / 501 / 293 ms per "
             "token on 1 / 2 / 4 VMs (1.82x / 3.11x the 1-VM speed)")
DLLAMA_DIR = Path(os.environ.get("DLLAMA_DIR", "/work/dllama-src"))
DLLAMA_MODELS = Path(os.environ.get("DLLAMA_MODELS", "/work/dllama-models"))
PRED = re.compile(r"Prediction\s+nTokens:\s*(\d+)\s+tokens/s:\s*([0-9.]+)\s*\(([0-9.]+) ms/tok\)")
EVAL_N = re.compile(r"Evaluation\s+nBatches:\s*\d+\s+nTokens:\s*(\d+)")
PRED_LINE = re.compile(r"Pred\s*(\d+) ms Sync\s*(\d+) ms \| Sent\s*(\d+) kB Recv\s*(\d+) kB \| ?(.*)")


class Unavailable(Exception):
    """A configuration that cannot run here; its message is the one-line reason."""


# ------------------------------------------------------------------------------------------ distributed-llama
class Dllama:
    def __init__(self, binary: Path, model: Path, tokenizer: Path, port: int, n: int):
        self.binary, self.model, self.tokenizer, self.port, self.n = binary, model, tokenizer, port, n
        self.prompt_tokens: int | None = None  # its own count of the prompt's tokens (its BPE, not llama.cpp's)

    def check(self) -> None:
        """Raise Unavailable with the reason when distributed-llama cannot run here."""
        for what, path in (("binary", self.binary), ("model", self.model), ("tokenizer", self.tokenizer)):
            if not path.is_file():
                raise Unavailable(f"no distributed-llama {what} at {path} (pass --dllama, --dllama-model, "
                                  "--dllama-tokenizer; its converter does not take Qwen2, see the module doc)")

    def root_cmd(self, prompt: str, steps: int, workers: bool) -> list[str]:
        cmd = [str(self.binary), "inference", "--model", str(self.model), "--tokenizer", str(self.tokenizer),
               "--buffer-float-type", "q80", "--nthreads", "1", "--max-seq-len", str(bench_peers.N_CTX),
               "--temperature", "0", "--seed", "0", "--steps", str(steps), "--prompt", prompt]
        return cmd + (["--workers", f"{H1_ADDR}:{self.port}"] if workers else [])

    def probe(self, prompt: str) -> None:
        """Load the model once on this machine alone and learn how many tokens its tokenizer makes of the prompt
        (--steps counts the prompt's tokens too)."""
        for steps in (32, len(prompt.encode()) + 3):  # a prompt of B bytes has at most B + 2 of its tokens
            proc = subprocess.run(self.root_cmd(prompt, steps, workers=False), capture_output=True, text=True,
                                  timeout=600)
            if "greater than the number of steps" not in proc.stdout:
                break
        m = EVAL_N.search(proc.stdout)
        if proc.returncode != 0 or not m:
            raise Unavailable("distributed-llama could not run the model: "
                              + _last_line(proc.stdout + proc.stderr, f"exit status {proc.returncode}"))
        self.prompt_tokens = int(m.group(1)) + 1

    def worker(self) -> subprocess.Popen:
        cmd = ["ip", "netns", "exec", H1, str(self.binary), "worker", "--host", H1_ADDR, "--port", str(self.port),
               "--nthreads", "1"]
        log = tempfile.TemporaryFile()
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)
        proc.log = log  # type: ignore[attr-defined]
        t_end = time.monotonic() + 20
        while not _listening(proc.pid, self.port):
            if proc.poll() is not None or time.monotonic() > t_end:
                _stop(proc)
                log.seek(0)
                raise Unavailable("the distributed-llama worker did not listen on "
                                  f"{H1_ADDR}:{self.port}: " + _last_line(log.read().decode(errors="replace"), "?"))
            time.sleep(0.1)
        return proc

    def run(self, prompt: str, hosts: int) -> dict:
        steps = self.n + self.prompt_tokens - 1  # the decode steps after the prompt's last token is the first
        cmd = ["ip", "netns", "exec", H0] + self.root_cmd(prompt, steps, workers=hosts == 2)
        worker = self.worker() if hosts == 2 else None
        try:
            proc, pct = run_quietly(cmd)
        finally:
            if worker is not None:
                _stop(worker)
        m = PRED.search(proc.stdout)
        if proc.returncode != 0 or not m:
            raise Unavailable("distributed-llama failed: " + _last_line(proc.stdout + proc.stderr,
                                                                       f"exit status {proc.returncode}"))
        tokens, ms = int(m.group(1)), float(m.group(3))
        steps_kb = [int(s) + int(r) for _, _, s, r, _ in PRED_LINE.findall(proc.stdout)]
        return {"tokens": tokens, "seconds": tokens * ms / 1e3, "tokens_per_s": 1e3 / ms, "foreign_cpu_pct": pct,
                "kb_per_token": statistics.median(steps_kb) if steps_kb else "",
                "text": "".join(p for *_, p in PRED_LINE.findall(proc.stdout))}


def _listening(pid: int, port: int) -> bool:
    """Whether the process's network namespace has a TCP socket listening on port (/proc/PID/net/tcp is the
    namespace's own table)."""
    try:
        rows = Path(f"/proc/{pid}/net/tcp").read_text().splitlines()[1:]
    except OSError:
        return False
    return any(r.split()[1].endswith(f":{port:04X}") and r.split()[3] == "0A" for r in rows)


def _stop(proc: subprocess.Popen) -> None:
    proc.terminate()
    try:
        proc.wait(timeout=10)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


def _interrupted(*_) -> None:
    raise KeyboardInterrupt  # not SystemExit, which a failed run raises (bench_peers.py) and which is caught below


def _error_line(text: str, default: str) -> str:
    """The exception line of the last traceback in text (what went wrong), else its last line."""
    lines = [ln.strip() for ln in text.splitlines() if ln.strip()]
    for ln in reversed(lines):
        if re.match(r"^[\w.]*(Error|Exception|Interrupt)\b", ln):
            return ln[:300]
    return _last_line(text, default)


def _last_line(text: str, default: str) -> str:
    lines = [ln.strip() for ln in text.splitlines() if ln.strip()]
    return lines[-1][:300] if lines else default


# ------------------------------------------------------------------------------------- pipeinfer and llama.cpp
def pipeinfer_run(base_mode: str, extra: list[str], n: int) -> dict:
    """`pipeinfer generate` on 2 ranks, one on each host (bench_peers.py's command, extra arguments appended)."""
    hostfile = Path(tempfile.mkstemp(prefix="bench-dllama-", suffix=".hosts")[1])
    hostfile.write_text(f"{H0}:1\n{H1}:1\n")
    cmd = [MPIEXEC, "-iface", "brpi", "-f", str(hostfile), "-launcher", "ssh", "-launcher-exec",
           str(CLUSTER / "netns-exec"), "-genv", "UCX_TLS", "tcp", "-genv", "FI_PROVIDER", "tcp",
           "-n", "2"] + bench_peers.pipeinfer_cmd(base_mode, n) + extra
    try:
        proc, pct = run_quietly(cmd)
    finally:
        hostfile.unlink()
    if proc.returncode != 0:
        log = Path(tempfile.mkstemp(prefix="bench-dllama-failed-", suffix=".log")[1])
        log.write_text(f"{shlex.join(cmd)}\n\n{proc.stderr}")
        raise Unavailable(f"pipeinfer {shlex.join(extra) or base_mode} failed ({proc.returncode}): "
                          f"{_error_line(proc.stderr, f'exit status {proc.returncode}')} (stderr: {log})")
    tps, text = bench_peers.pipeinfer_result(proc)
    stats = json.loads(proc.stdout.strip().splitlines()[-1])["stats"]
    tokens = max(1, int(stats.get("n_generated", n)) - 1)  # its rate: the tokens after the first
    return {"tokens": tokens, "seconds": tokens / tps, "tokens_per_s": tps, "foreign_cpu_pct": pct,
            "acceptance_rate": round(stats.get("acceptance_rate", 0.0), 3), "text": text}


def llama_rpc_run(bins: Path, model: str, prompt: str, n: int, rate: str) -> dict:
    tps, text, pct = bench_peers.run_one("llama-rpc", rate, bins, model, prompt, n)
    return {"tokens": n - 1, "seconds": (n - 1) / tps, "tokens_per_s": tps, "foreign_cpu_pct": pct, "text": text}


# ---------------------------------------------------------------------------------------------------- report
def summarize(rows: list[dict], labels: list[str]) -> list[dict]:
    med = {}
    for lab in labels:
        ok = [r for r in rows if r["label"] == lab and r["tokens_per_s"] != ""]
        if ok:
            med[lab] = {k: statistics.median(r[k] for r in ok) for k in ("tokens", "seconds", "tokens_per_s")}
            med[lab]["runs"] = len(ok)
    out = []
    for lab, m in med.items():
        out.append({"label": lab, "round": "median", "tokens": m["tokens"], "seconds": round(m["seconds"], 3),
                    "tokens_per_s": round(m["tokens_per_s"], 3),
                    "vs_dllama": round(m["tokens_per_s"] / med["dllama"]["tokens_per_s"], 3) if "dllama" in med else "",
                    "vs_llama_rpc": round(m["tokens_per_s"] / med["llama-rpc"]["tokens_per_s"], 3)
                    if "llama-rpc" in med else "", "note": f"median of {m['runs']} runs"})
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("-n", type=int, default=128, help="tokens to generate")
    ap.add_argument("--rate", default="1gbit", help="the emulated links' rate (netns-cluster.sh NETNS_RATE)")
    ap.add_argument("--systems", default=",".join(SYSTEMS),
                    help=f"of {', '.join(SYSTEMS + ('dllama-one',))}")
    ap.add_argument("--config", action="append", default=[], metavar="LABEL=ARGS",
                    help="another pipeinfer configuration on the 2 hosts: ARGS appended to `generate --mode iterative`")
    ap.add_argument("--dllama", type=Path, default=DLLAMA_DIR / "dllama", help="distributed-llama's dllama binary")
    ap.add_argument("--dllama-model", type=Path,
                    default=DLLAMA_MODELS / "dllama_model_qwen2.5-coder-1.5b-as-llama_q40.m")
    ap.add_argument("--dllama-tokenizer", type=Path, default=DLLAMA_MODELS / "dllama_tokenizer_qwen2.5-coder-1.5b.t")
    ap.add_argument("--dllama-port", type=int, default=9999)
    ap.add_argument("--out", default=str(ROOT / "results" / "bench_dllama.csv"))
    args = ap.parse_args()

    systems = [s for s in args.systems.split(",") if s]
    for s in systems:
        if s not in SYSTEMS + ("dllama-one",):
            ap.error(f"unknown system {s}")
    configs: dict[str, list[str]] = {}
    for c in args.config:
        label, sep, rest = c.partition("=")
        if not sep or not label or label in SYSTEMS + ("dllama-one",):
            ap.error(f"--config takes LABEL=ARGS with a new label, got {c!r}")
        configs[label] = shlex.split(rest)
    labels = systems + list(configs)

    from pipeinfer.engine.models import DEFAULT_TARGET, resolve_model
    model = str(resolve_model(DEFAULT_TARGET))
    prompt = bench_peers.chat_prompt(model)
    bins = bench_peers.llama_bin() if "llama-rpc" in labels else None

    failed: dict[str, str] = {}  # label -> why it cannot run; it is skipped from then on
    failures: dict[str, list[str]] = {}  # label -> its failed runs
    dl = Dllama(args.dllama, args.dllama_model, args.dllama_tokenizer, args.dllama_port, args.n)
    if {"dllama", "dllama-one"} & set(labels):
        try:
            dl.check()
            dl.probe(prompt)
            print(f"dllama: {args.dllama} ({args.dllama_model.name}); its tokenizer makes {dl.prompt_tokens} tokens "
                  f"of the prompt", flush=True)
        except Unavailable as e:
            for lab in ("dllama", "dllama-one"):
                if lab in labels:
                    failed[lab] = str(e)
            print(f"dllama: not measured: {e}", flush=True)

    # a signal ends the run through the finally blocks below: the cluster is always taken down
    signal.signal(signal.SIGTERM, _interrupted)
    started = time.strftime("%Y-%m-%dT%H:%M:%S%z")
    print(f"started {started}; {args.rounds} rounds of {', '.join(labels)} on 2 hosts x 1 thread over {args.rate} "
          f"links, -n {args.n}", flush=True)
    rows: list[dict] = []
    for rnd in range(args.rounds):
        order = labels[rnd % len(labels):] + labels[:rnd % len(labels)]
        try:
            bench_peers.netns(args.rate, "up", "2")
        except subprocess.CalledProcessError as e:  # a failed `up` removes what it made (netns-cluster.sh)
            raise SystemExit(f"the emulated cluster did not come up: {_last_line(e.stderr or '', str(e))}")
        try:
            for lab in order:
                if lab in failed:
                    continue
                t0 = time.strftime("%H:%M:%S")
                try:
                    if lab == "dllama":
                        r = dl.run(prompt, hosts=2)
                    elif lab == "dllama-one":
                        r = dl.run(prompt, hosts=1)
                    elif lab == "llama-rpc":
                        r = llama_rpc_run(bins, model, prompt, args.n, args.rate)
                    elif lab in PIPEINFER_MODES:
                        r = pipeinfer_run(lab, [], args.n)
                    else:
                        r = pipeinfer_run("iterative", configs[lab], args.n)
                except (Unavailable, SystemExit) as e:
                    why = str(e).strip().splitlines()[-1] if str(e).strip() else repr(e)
                    failures.setdefault(lab, []).append(f"round {rnd}: {why}")
                    if len(failures[lab]) >= 2:  # once may be a passing fault; twice, and it is left out
                        failed[lab] = why
                    print(f"round {rnd} {lab:14s} not measured: {why}", flush=True)
                    continue
                row = {"label": lab, "round": rnd, "tokens": r["tokens"], "seconds": round(r["seconds"], 3),
                       "tokens_per_s": round(r["tokens_per_s"], 3), "vs_dllama": "", "vs_llama_rpc": "",
                       "acceptance_rate": r.get("acceptance_rate", ""), "kb_per_token": r.get("kb_per_token", ""),
                       "foreign_cpu_pct": round(r["foreign_cpu_pct"], 1), "started": t0,
                       "note": "", "text": r["text"]}
                rows.append(row)
                print(f"round {rnd} {lab:14s} {row['tokens_per_s']:6.2f} tokens/s ({row['tokens']} tokens in "
                      f"{row['seconds']:.2f} s)", flush=True)
        finally:
            bench_peers.netns(args.rate, "down", "2")

    # texts: pipeinfer and llama.cpp on the same model should agree; distributed-llama's model lacks the biases
    by_text: dict[str, list[str]] = {}
    for r in rows:
        by_text.setdefault(r["text"], []).append(f"{r['label']}/{r['round']}")
    summary = summarize(rows, labels)
    measured = {s["label"] for s in summary}
    for lab in labels:
        if lab in measured and lab in failures:
            next(s for s in summary if s["label"] == lab)["note"] += f"; {len(failures[lab])} failed runs: " + \
                " | ".join(failures[lab])
        elif lab not in measured:
            why = failed.get(lab) or " | ".join(failures.get(lab, [])) or "not run"
            summary.append({"label": lab, "round": "median", "note": f"not measured: {why}"})
    fields = ["label", "round", "tokens", "seconds", "tokens_per_s", "vs_dllama", "vs_llama_rpc", "acceptance_rate",
              "kb_per_token", "foreign_cpu_pct", "started", "note"]
    out = Path(args.out)
    write_csv(out, rows + summary, fields, extrasaction="ignore", restval="")
    print(f"\nmedians (2 hosts x 1 thread, {args.rate}; started {started}):")
    for s in summary:
        if s.get("tokens_per_s", "") == "":
            print(f"  {s['label']:14s} {s['note']}")
            continue
        print(f"  {s['label']:14s} {s['tokens_per_s']:7.2f} tokens/s   vs dllama {s['vs_dllama'] or '-':>6}   "
              f"vs llama-rpc {s['vs_llama_rpc'] or '-':>6}")
    med = {s["label"]: s["tokens_per_s"] for s in summary if s.get("tokens_per_s", "") != ""}
    ours = {lab: v for lab, v in med.items() if lab in PIPEINFER_MODES or lab in configs}
    if ours and "dllama" in med:
        best = max(ours, key=ours.get)
        print(f"pipeinfer's best ({best}) / dllama: {ours[best]:.2f} / {med['dllama']:.2f} = "
              f"{ours[best] / med['dllama']:.2f}x")
    elif "dllama" in labels and "dllama" not in med:
        print("dllama: " + next(s["note"] for s in summary if s["label"] == "dllama"))
        print(PUBLISHED)
    print("texts: " + "; ".join(" ".join(v[:4]) + (" ..." if len(v) > 4 else "") for v in by_text.values())
          + f"  ({len(by_text)} distinct)")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
