#!/usr/bin/env python3
"""Measurement (not a test): how far a tensor group's logits are from one process's, teacher-forced.

    python launch/bench/group_agreement.py [--prompts code,story,encyclopedia] [-n 512] [--group 2]
                                          [--out results/group_agreement.csv]

A group re-associates float sums (each member's partial sums are added in member order, engine/group_sums.py), so
its logits are not one process's bits. For each named prompt this takes one process's greedy answer (`generate -n N`
on the default Qwen2.5-Coder-1.5B), then decodes prompt + answer teacher-forced, in chunks of 32 rows, once on one
process and once on a group of --group ranks (under mpiexec, each member its slice); at every answer position it
compares the two rows: whether their top-1 tokens agree, and the largest |logit difference|. Prints and writes one
row per prompt. `--against threads` compares one process on 1 thread with one process on 2 threads instead (no
group): how far a change of thread count alone moves the same rows, for scale.
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # launch/: the shared harness
from harness import MPIEXEC, ROOT, write_csv  # noqa: E402

CHUNK = 32


def logits_of(engine, embedder, tokens: list[int]) -> np.ndarray:
    """f32[len(tokens), n_vocab]: every row's logits, the sequence decoded from position 0 in chunks of CHUNK."""
    from pipeinfer.core.protocol import Batch
    out = []
    for a in range(0, len(tokens), CHUNK):
        part = np.array(tokens[a:a + CHUNK], dtype=np.int32)
        if a == 0:
            engine.clear_kv()
        out.append(np.array(engine.decode(Batch.chain(part, a), embedder(part))))
    return np.concatenate(out)


def worker(answers: Path, group_size: int, against: str = "group") -> None:
    """Under mpiexec -n group_size: rank 0 decodes one process's rows alone, then every rank its slice (against
    "threads": rank 0 alone, then on 2 threads)."""
    from mpi4py import MPI

    from pipeinfer.engine.group_sums import PartialSums
    from pipeinfer.engine.models import resolve_model
    from pipeinfer.engine.slices import Slice, ensure_slice_file
    from pipeinfer.engine.stage import StageEngine, TokenEmbedder
    from pipeinfer.ranks.group import exchange_over
    from pipeinfer.wire.transport import polite_barrier
    comm = MPI.COMM_WORLD
    rank = comm.Get_rank()
    model = str(resolve_model("qwen2.5-coder-1.5b"))
    runs = json.loads(answers.read_text())
    embedder = TokenEmbedder(model)
    params = dict(n_ctx=2048, n_batch=CHUNK, n_seq_max=2, n_threads=1, n_threads_batch=1, embd_input=True,
                  capture_hidden=False)
    whole = {}
    if rank == 0:
        with StageEngine(model, **params) as engine:
            whole = {name: logits_of(engine, embedder, r["prompt"] + r["answer"]) for name, r in runs.items()}
    polite_barrier(comm)
    path = ensure_slice_file(model, 0, 28, True, Slice(rank, (1.0,) * group_size))
    rows = []
    if against == "threads":
        engine = StageEngine(model, **(params | dict(n_threads=2, n_threads_batch=2)))
    else:
        engine = StageEngine(path, **params, sums=PartialSums(exchange_over(comm)))
    with engine:
        for name, r in runs.items():
            if against == "threads":
                parts = logits_of(engine, embedder, r["prompt"] + r["answer"])
            else:
                parts = _group_logits(engine, embedder, r["prompt"] + r["answer"], comm)
            if rank == 0:
                n_p, n_a = len(r["prompt"]), len(r["answer"])
                a, b = whole[name][n_p - 1:n_p + n_a - 1], parts[n_p - 1:n_p + n_a - 1]  # rows that predict the answer
                rows.append({"prompt": name, "positions": n_a,
                             "top1_agreement": round(float((a.argmax(1) == b.argmax(1)).mean()), 4),
                             "max_abs_logit_diff": round(float(np.abs(a - b).max()), 4),
                             "group_matches_answer": round(float((b.argmax(1) == np.array(r["answer"])).mean()), 4)})
    if rank == 0:
        print("ROWS " + json.dumps(rows))


def _group_logits(engine, embedder, tokens: list[int], comm) -> np.ndarray | None:
    """The group's rows (rank 0: every member's vocabulary rows side by side; else None)."""
    from pipeinfer.core.protocol import Batch
    out = []
    for a in range(0, len(tokens), CHUNK):
        part = np.array(tokens[a:a + CHUNK], dtype=np.int32)
        if a == 0:
            engine.clear_kv()
        engine.sums.begin()
        mine = np.ascontiguousarray(engine.decode(Batch.chain(part, a), embedder(part)))
        every = comm.gather(mine, root=0)
        if comm.Get_rank() == 0:
            out.append(np.concatenate(every, axis=1))
    return np.concatenate(out) if out else None


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--prompts", default="code,story,encyclopedia")
    ap.add_argument("-n", type=int, default=512)
    ap.add_argument("--group", type=int, default=2)
    ap.add_argument("--out", default=str(ROOT / "results" / "group_agreement.csv"))
    ap.add_argument("--against", choices=["group", "threads"], default="group")
    ap.add_argument("--worker", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        return worker(Path(args.worker), args.group, args.against)
    if args.against == "threads":
        args.group = 1
    runs = {}
    for name in args.prompts.split(","):
        p = subprocess.run([sys.executable, "-m", "pipeinfer", "generate", "--prompt-name", name, "-n", str(args.n),
                            "-t", "2", "--ignore-eos", "--json", "-q"], capture_output=True, text=True, cwd=ROOT)
        if p.returncode != 0:
            raise SystemExit(f"generate {name} failed:\n{p.stderr[-2000:]}")
        out = json.loads(p.stdout.strip().splitlines()[-1])
        runs[name] = {"prompt": out["prompt_tokens"], "answer": out["tokens"]}
    with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as f:
        json.dump(runs, f)
    p = subprocess.run([MPIEXEC, "-n", str(args.group), sys.executable, str(Path(__file__).resolve()),
                        "--worker", f.name, "--group", str(args.group), "--against", args.against],
                       capture_output=True, text=True, cwd=ROOT)
    Path(f.name).unlink()
    line = next((x for x in p.stdout.splitlines() if x.startswith("ROWS ")), None)
    if p.returncode != 0 or line is None:
        raise SystemExit(f"the group's run failed ({p.returncode}):\n{p.stderr[-3000:]}")
    rows = json.loads(line[5:])
    for r in rows:
        print(f"{r['prompt']:<13} {r['positions']} positions: top-1 agreement {r['top1_agreement']:.4f}, "
              f"largest |logit difference| {r['max_abs_logit_diff']:.3f}")
    write_csv(args.out, rows, list(rows[0]))
    what = "2 threads" if args.against == "threads" else f"a group of {args.group}"
    print(f"wrote {args.out} ({what} against one process on 1 thread, teacher-forced, chunks of {CHUNK})")


if __name__ == "__main__":
    main()
