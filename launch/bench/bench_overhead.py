#!/usr/bin/env python3
"""Benchmark (not a test): what a pipeline stage costs beyond llama.cpp's own decode, and what that does to the
2-rank iterative pipeline, for this checkout and an earlier commit side by side in one run.

    python launch/bench/bench_overhead.py [--baseline REF] [--rounds 3] [-n 128] [--reps 40] [--out results/bench_overhead.csv]

Versions: `baseline` (REF, default HEAD, exported with `git archive` and imported through PYTHONPATH), `current-4k`
(this working tree with PIPEINFER_HUGE_PAGES=0: the weights stay in llama.cpp's file mapping, in 4 KiB pages, as
before; it tells the split's own costs from the huge pages) and `current` (this working tree). Every round runs
every version once, in an order that rotates from round to round (no version always runs after the same one);
medians over the rounds are printed, and every measurement is a row of the CSV (long format: part, version,
round, metric, value).

- `stage` (one process, 1 thread): the default model split in two halves; per decode of one token on top of 64
  positions, interleaved `--reps` times: llama_decode alone on a plain context of the same loaded model (no
  callback, nothing read back); the same with a callback that only counts (how many graph nodes llama.cpp asks
  about, and what calling into Python for each costs); and what the stage does: StageEngine.decode with the
  capture on the first half; on the last half the decode and the token after the output row (logits and arg-max).
- `pipeline`: `mpiexec -n 2 python -m pipeinfer generate --mode iterative -n N --ignore-eos -t 1` on the README's
  prompt: tokens/s of a plain run, then a run with timestamps around each step on both ranks (one clock), giving
  medians per token of each rank's decode, the head's and the stage's Python work around it, each hop (from the
  sender's Isend returning to the receiver having the header), and the CPU a waiting rank burns.
- `default` (not run unless asked: `--parts default`): the same without `--mode iterative`, i.e. PipeInfer with
  the Gemma draft beside the pipeline; tokens/s and acceptance.
Every run's tokens must be the first run's (`exact`).
Each run waits until the machine is otherwise quiet (launch/quiet.py; `foreign_cpu_pct`: other processes' CPU
during it, in % of a core).
"""
from __future__ import annotations

import argparse
import csv
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # launch/: the shared harness
from harness import MPIEXEC, ROOT  # noqa: E402

PROMPT = "Write a Python function that checks whether a number is prime."
VERSIONS = ("baseline", "current-4k", "current")
N_FILL = 64  # positions in the KV cache before the timed decode


# ---------------------------------------------------------------- stage part: runs in the version's own pipeinfer
def _plain_context(llama_cpp, model, n_embd: int, callback=None):
    """decode(rows, pos0) and forget(pos0) on a new llama.cpp context of an already loaded stage model."""
    import numpy as np
    cp = llama_cpp.llama_context_default_params()
    cp.n_ctx, cp.n_batch, cp.n_ubatch, cp.n_seq_max = 256, N_FILL, N_FILL, 1
    cp.n_threads = cp.n_threads_batch = 1
    cp.kv_unified, cp.no_perf = True, True
    cp.flash_attn_type = llama_cpp.LLAMA_FLASH_ATTN_TYPE_ENABLED  # as the stage's (--kernels repack)
    if callback is not None:
        cp.cb_eval = callback
    ctx = llama_cpp.llama_init_from_model(model, cp)
    batch = llama_cpp.llama_batch_init(N_FILL, n_embd, 1)

    def decode(rows, pos0: int) -> None:
        np.ctypeslib.as_array(batch.embd, shape=(len(rows), n_embd))[:] = rows
        for i in range(len(rows)):
            batch.pos[i], batch.n_seq_id[i], batch.seq_id[i][0], batch.logits[i] = pos0 + i, 1, 0, 1
        batch.n_tokens = len(rows)
        if llama_cpp.llama_decode(ctx, batch) != 0:
            raise RuntimeError("llama_decode failed")

    def forget(pos0: int) -> None:
        llama_cpp.llama_memory_seq_rm(llama_cpp.llama_get_memory(ctx), 0, pos0, -1)
    return decode, forget


def _stage_variants(llama_cpp, eng, last: bool, counting_cb) -> dict:
    """name -> (one timed decode of one row at position N_FILL, undo it), every context filled alike first."""
    import numpy as np

    from pipeinfer.core.protocol import Batch, kv_ops, rm
    from pipeinfer.core.verify import row_tokens
    from pipeinfer.core.sampling import SamplingParams, one_sampling
    rng = np.random.default_rng(0)
    fill = rng.standard_normal((N_FILL, eng.n_embd), dtype=np.float32) * 0.1
    row = rng.standard_normal((1, eng.n_embd), dtype=np.float32) * 0.1
    step, sp = Batch.chain(np.zeros(1, np.int32), N_FILL), SamplingParams()
    alone, forget_alone = _plain_context(llama_cpp, eng.model, eng.n_embd)
    if last and hasattr(eng, "decode_tokens"):
        def stage(): eng.decode_tokens(step, row, one_sampling(sp))
    elif last:
        def stage(): row_tokens(eng.decode(step, row), step.output_pos, sp)
    else:
        def stage(): eng.decode(step, row)
    alone(fill, 0)
    eng.decode(Batch.chain(np.zeros(N_FILL, np.int32), 0), fill)
    variants = {"llama_decode": (lambda: alone(row, N_FILL), lambda: forget_alone(N_FILL)),
                "stage": (stage, lambda: eng.apply_kv_ops(kv_ops(rm(0, N_FILL, -1))))}
    if not last:  # the capturing stage: what llama.cpp's calls into Python alone cost
        counted, forget_counted = _plain_context(llama_cpp, eng.model, eng.n_embd, counting_cb)
        counted(fill, 0)
        variants["counting_callback"] = (lambda: counted(row, N_FILL), lambda: forget_counted(N_FILL))
    return variants


def _stage_timings(model_name: str, reps: int) -> dict:
    """ms per one-token decode of each half of the model (medians over reps), callback calls per decode."""
    import llama_cpp

    from pipeinfer.engine.models import resolve_model
    from pipeinfer.engine.stage import StageEngine
    from pipeinfer.engine.stagefile import ensure_stage_file, read_info
    model = str(resolve_model(model_name))
    n_layer, out, calls = read_info(model).n_layer, {}, [0]

    def count(tensor, ask, user_data) -> bool:
        calls[0] += 1
        return not ask
    counting_cb = llama_cpp.ggml_backend_sched_eval_callback(count)
    for half, a, b, last in (("first", 0, n_layer // 2, False), ("last", n_layer // 2, n_layer, True)):
        path = ensure_stage_file(model, a, b, with_vocab=last)
        t0 = time.perf_counter()
        eng = StageEngine(path, n_ctx=256, n_batch=N_FILL, n_seq_max=1, n_threads=1, n_threads_batch=1,
                          embd_input=True, capture_hidden=not last)
        out[f"{half}_load_s"] = round(time.perf_counter() - t0, 3)
        variants = _stage_variants(llama_cpp, eng, last, counting_cb)
        times: dict[str, list[float]] = {k: [] for k in variants}
        for rep in range(reps + 1):  # the first round warms up
            for name, (run, undo) in variants.items():
                calls[0] = 0
                t0 = time.perf_counter()
                run()
                if rep:
                    times[name].append((time.perf_counter() - t0) * 1e3)
                undo()
                if name == "counting_callback":
                    out[f"{half}_callback_calls"] = calls[0]
        out.update({f"{half}_{name}_ms": round(statistics.median(v), 3) for name, v in times.items()})
        out[f"{half}_huge_page_mib"] = getattr(eng, "huge_page_bytes", 0) >> 20
        eng.close()
    return out


# ---------------------------------------------------------------- pipeline part: a rank with timestamps
def _trace_rank(out_dir: str, cli_args: list[str]) -> None:
    """Run `pipeinfer CLI_ARGS` on this rank, recording (event, seconds, CPU seconds, kind) around each step."""
    import resource

    from mpi4py import MPI

    import pipeinfer.engine.stage as stage
    import pipeinfer.ranks.pipeline as pipeline
    import pipeinfer.wire.transport as transport
    events: list[tuple[str, float, float, str]] = []

    def wrap(cls, name: str, tag: str, kind=lambda result, args: "") -> None:
        inner = getattr(cls, name)

        def timed(*args, **kw):
            u = resource.getrusage(resource.RUSAGE_SELF)
            events.append((tag + ">", time.perf_counter(), u.ru_utime + u.ru_stime, ""))
            result = inner(*args, **kw)
            u = resource.getrusage(resource.RUSAGE_SELF)
            events.append((tag + "<", time.perf_counter(), u.ru_utime + u.ru_stime, kind(result, args)))
            return result
        setattr(cls, name, timed)
    wrap(stage.StageEngine, "decode", "decode")
    if hasattr(stage.StageEngine, "decode_tokens"):
        wrap(stage.StageEngine, "decode_tokens", "decode")
    wrap(transport.Transport, "wait_header", "wait", lambda hdr, args: hdr.kind.name)
    wrap(transport.Transport, "send", "send", lambda result, args: args[2].kind.name)
    wrap(pipeline.Pipeline, "launch", "launch")
    wrap(pipeline.Pipeline, "next_result", "result")
    from pipeinfer.cli.main import entry
    sys.argv = ["pipeinfer", *cli_args]
    try:
        entry()
    finally:
        with open(Path(out_dir) / f"rank{MPI.COMM_WORLD.Get_rank()}.json", "w") as f:
            json.dump(events, f)


def _runs_of_head(events: list) -> list[dict]:
    """Per launched run on rank 0: launch, its decode, the DECODE send, the RESULT header noticed, the result."""
    runs: list[dict] = []
    waiting = 0  # index of the oldest run without its result
    for tag, t, _, kind in events:
        if tag == "launch>":
            runs.append({"launch": t})
        elif runs and tag == "decode>" and "decoded" not in runs[-1]:
            runs[-1]["decode"] = t
        elif runs and tag == "decode<" and "decoded" not in runs[-1]:
            runs[-1]["decoded"] = t
        elif runs and tag == "send<" and kind == "DECODE":
            runs[-1]["sent"] = t
        elif tag == "wait<" and kind == "RESULT" and waiting < len(runs):
            runs[waiting]["noticed"] = t
        elif tag == "result<" and waiting < len(runs):
            runs[waiting]["done"] = t
            waiting += 1
    return runs


def _runs_of_stage(events: list) -> list[dict]:
    """Per DECODE transaction on the last rank: header noticed, decode, result sent."""
    runs: list[dict] = []
    for tag, t, _, kind in events:
        if tag == "wait<" and kind == "DECODE":
            runs.append({"noticed": t})
        elif runs and tag == "decode>":
            runs[-1]["decode"] = t
        elif runs and tag == "decode<":
            runs[-1]["decoded"] = t
        elif runs and tag == "send<" and kind == "RESULT":
            runs[-1]["sent"] = t
    return runs


def _waiting_cpu_pct(events: list, t_from: float) -> float:
    """CPU a rank used while it waited for a header after t_from, in % of the time it waited."""
    cpu = wall = 0.0
    for (tag, t, c, _), (tag2, t2, c2, _) in zip(events, events[1:]):
        if tag == "wait>" and tag2 == "wait<" and t >= t_from:
            cpu, wall = cpu + c2 - c, wall + t2 - t
    return 100 * cpu / wall if wall else 0.0


def trace_metrics(head_events: list, stage_events: list) -> dict:
    """Medians per generated token (ms) of each step of a 2-rank iterative run, from both ranks' events."""
    head, stage = _runs_of_head(head_events), _runs_of_stage(stage_events)
    steps: dict[str, list[float]] = {}
    for i in range(1, min(len(head), len(stage)) - 1):  # the prompt's run and the last one left out
        h, s, nxt, prev = head[i], stage[i], head[i + 1], head[i - 1]
        for name, value in (("head_before_decode", h["decode"] - h["launch"]), ("stage0_decode", h["decoded"] - h["decode"]),
                            ("head_send", h["sent"] - h["decoded"]), ("hop_0to1", s["noticed"] - h["sent"]),
                            ("stage1_before_decode", s["decode"] - s["noticed"]),
                            ("stage1_decode", s["decoded"] - s["decode"]), ("stage1_send", s["sent"] - s["decoded"]),
                            ("hop_1to0", h["noticed"] - s["sent"]), ("head_result", h["done"] - h["noticed"]),
                            ("head_next_launch", nxt["launch"] - h["done"]), ("token_period", h["done"] - prev["done"])):
            steps.setdefault(name, []).append(value * 1e3)
    out = {f"{k}_ms": round(statistics.median(v), 3) for k, v in steps.items()}
    out["python_per_token_ms"] = round(sum(out[f"{k}_ms"] for k in ("head_before_decode", "head_send", "stage1_before_decode",
                                                                     "stage1_send", "head_result", "head_next_launch")), 3)
    out["hops_per_token_ms"] = round(out["hop_0to1_ms"] + out["hop_1to0_ms"], 3)
    t0 = head[1]["launch"] if len(head) > 1 else 0.0
    out["rank0_waiting_cpu_pct"] = round(_waiting_cpu_pct(head_events, t0), 1)
    out["rank1_waiting_cpu_pct"] = round(_waiting_cpu_pct(stage_events, t0), 1)
    return out


# ---------------------------------------------------------------- the runs
def _env(version: str, baseline_dir: Path) -> dict:
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PIPEINFER_HUGE_PAGES")}
    if version == "baseline":
        env["PYTHONPATH"] = str(baseline_dir)
    if version == "current-4k":
        env["PIPEINFER_HUGE_PAGES"] = "0"
    return env


def _generate_cmd(n: int, traced_dir: str | None, iterative: bool = True) -> list[str]:
    mode = ["--mode", "iterative"] if iterative else []  # else the default: PipeInfer, the Gemma draft beside
    gen = ["generate", *mode, "-n", str(n), "--ignore-eos", "-t", "1", "-p", PROMPT, "--json", "-q"]
    if traced_dir is None:
        return [MPIEXEC, "-n", "2", sys.executable, "-m", "pipeinfer", *gen]
    return [MPIEXEC, "-n", "2", sys.executable, str(Path(__file__).resolve()), "--trace-rank", traced_dir, "--", *gen]


def run_version(part: str, version: str, args, baseline_dir: Path, work: Path) -> tuple[dict, float]:
    """One measurement of one version (a subprocess whose imports are that version's), and the foreign CPU."""
    from quiet import run_quietly
    env = _env(version, baseline_dir)
    if part == "stage":
        cmd = [sys.executable, str(Path(__file__).resolve()), "--stage-worker", json.dumps([args.model, args.reps])]
        proc, foreign = run_quietly(cmd, env=env, cwd=work)
        if proc.returncode != 0:
            raise SystemExit(f"{version} stage timings failed:\n{proc.stderr[-3000:]}")
        return json.loads(proc.stdout.strip().splitlines()[-1]), foreign
    traced = str(work / f"trace-{version}") if part == "traced" else None
    if traced:
        Path(traced).mkdir(exist_ok=True)
    proc, foreign = run_quietly(_generate_cmd(args.n, traced, iterative=part != "default"), env=env, cwd=work)
    if proc.returncode != 0:
        raise SystemExit(f"{version} {part} run failed:\n{proc.stderr[-3000:]}")
    res = json.loads(proc.stdout.strip().splitlines()[-1])
    out = {"tokens_per_s": round(res["stats"]["gen_tokens_per_s"], 3), "tokens": res["tokens"]}
    if part == "default":
        out["acceptance"] = round(res["stats"]["acceptance_rate"], 3)
    if traced:
        head, stage = (json.load(open(Path(traced) / f"rank{r}.json")) for r in (0, 1))
        out.update(trace_metrics(head, stage))
    return out, foreign


def _export_baseline(ref: str, into: Path) -> str:
    """`git archive REF` of the package into `into` (nothing in the working tree changes); the commit's hash."""
    commit = subprocess.run(["git", "rev-parse", "--short", ref], cwd=ROOT, capture_output=True, text=True, check=True).stdout.strip()
    tar = subprocess.run(["git", "archive", ref, "pipeinfer", "prompts"], cwd=ROOT, capture_output=True, check=True).stdout
    subprocess.run(["tar", "-x", "-C", str(into)], input=tar, check=True)
    return commit


def _summary(rows: list[dict]) -> None:
    """Medians over the rounds, one line per (part, metric), versions side by side."""
    keys = sorted({(r["part"], r["metric"]) for r in rows}, key=lambda k: (k[0] != "stage", k[0], k[1]))
    print(f"\n{'part':9s} {'metric':34s} " + " ".join(f"{v:>11s}" for v in VERSIONS))
    for part, metric in keys:
        med = [statistics.median([r["value"] for r in rows if (r["part"], r["metric"], r["version"]) == (part, metric, v)] or [float("nan")])
               for v in VERSIONS]
        print(f"{part:9s} {metric:34s} " + " ".join(f"{m:11.3f}" for m in med))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--baseline", default="HEAD", help="git ref of the code to compare with (default HEAD)")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("-n", type=int, default=128)
    ap.add_argument("--reps", type=int, default=40, help="decodes per variant in the stage part")
    ap.add_argument("--model", default="qwen2.5-coder-1.5b")
    ap.add_argument("--parts", default="stage,pipeline,traced")
    ap.add_argument("--out", default=str(ROOT / "results" / "bench_overhead.csv"))
    args = ap.parse_args()
    work = Path(tempfile.mkdtemp(prefix="bench_overhead."))
    baseline_dir = work / "baseline"
    baseline_dir.mkdir()
    commit = _export_baseline(args.baseline, baseline_dir)
    rows, first_tokens = [], None
    for rnd in range(args.rounds):
        for part in args.parts.split(","):
            for version in VERSIONS[rnd % len(VERSIONS):] + VERSIONS[:rnd % len(VERSIONS)]:
                got, foreign = run_version(part, version, args, baseline_dir, work)
                tokens = got.pop("tokens", None)
                if tokens is not None:
                    first_tokens = first_tokens or tokens
                    got["exact"] = int(tokens == first_tokens)
                print(f"round {rnd} {part:8s} {version:10s} {got} (other work: {foreign:.0f}% of a core)", flush=True)
                stamp = time.strftime("%Y-%m-%dT%H:%M:%S")
                rows += [{"timestamp": stamp, "machine": f"{os.cpu_count()} cores", "baseline": commit, "part": part,
                          "version": version, "round": rnd, "metric": k, "value": v, "foreign_cpu_pct": round(foreign, 1)}
                         for k, v in got.items()]
    _summary(rows)
    out = Path(args.out)
    new = not out.exists()
    with open(out, "a", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(rows[0]))
        if new:
            w.writeheader()
        w.writerows(rows)
    print(f"\n{len(rows)} rows appended to {out}")


if __name__ == "__main__":
    if len(sys.argv) > 2 and sys.argv[1] == "--stage-worker":
        print(json.dumps(_stage_timings(*json.loads(sys.argv[2]))))
    elif len(sys.argv) > 3 and sys.argv[1] == "--trace-rank":
        _trace_rank(sys.argv[2], sys.argv[4:])
    else:
        main()
