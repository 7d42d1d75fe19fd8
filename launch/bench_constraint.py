#!/usr/bin/env python3
"""Benchmark (not a test): what a JSON-schema constraint costs, side by side in one run.

    python launch/bench_constraint.py [-n 96] [--repeats 3] [--mode pipeinfer]

The default Qwen2.5-Coder-1.5B target on 2 ranks x 1 thread (this machine has 2 cores) with the default Gemma 3
270M draft beside rank 0, one pipeline for the whole run: for each prompt (asking for JSON) and each repeat, the
free request and the constrained one (response_format json_schema, strict) follow each other, so both see the
same machine. Prints generation tokens/s of each and the ratio constrained / free (goal: >= 0.95), the
acceptance of each, and writes results/bench_constraint.csv.
"""
from __future__ import annotations

import argparse
import csv
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
BIN = Path(sys.executable).parent

SCHEMA = {"type": "object", "properties": {
    "name": {"type": "string"}, "language": {"enum": ["python", "c", "rust", "go"]},
    "functions": {"type": "array", "items": {"type": "object", "properties": {
        "name": {"type": "string"}, "args": {"type": "array", "items": {"type": "string"}},
        "returns": {"type": "string"}}, "required": ["name", "args", "returns"]}}},
    "required": ["name", "language", "functions"]}
QUESTIONS = [
    "Describe a small Python module for parsing CSV files: its name, language and three functions.",
    "Describe a Rust crate for reading INI files: its name, language and three functions.",
    "Describe a C library for a ring buffer: its name, language and four functions.",
]


def worker(spec_path: str) -> None:
    """Every rank of the job: one session, the requests in order; rank 0 prints a JSON line per answer."""
    from pipeinfer.core.config import Config
    from pipeinfer.core.decoding import Constraint, Decoding
    from pipeinfer.ranks.startup import open_session
    spec = json.loads(Path(spec_path).read_text())
    session = open_session(Config.from_json(spec["config"]))
    if session is None:
        return
    try:
        constraint = Decoding(Constraint("json_schema", json.dumps(SCHEMA), strict=True))
        for req in spec["requests"]:
            stats = session.generate(req["prompt"], n_predict=req["n"], prompt_text=req["text"], chat=True,
                                     decoding=constraint if req["constrained"] else Decoding())
            print("ANSWER " + json.dumps({**{k: req[k] for k in ("q", "repeat", "constrained")},
                                          "n": stats.n_generated, "tokens_per_s": stats.gen_tokens_per_s,
                                          "acceptance": stats.acceptance_rate}), flush=True)
    finally:
        session.close()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("-n", type=int, default=96)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--mode", default="pipeinfer")
    ap.add_argument("--worker", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        return worker(args.worker)
    from pipeinfer.core.config import Config
    from pipeinfer.engine.models import resolve_model
    from pipeinfer.engine.tokenizer import Tokenizer, apply_chat
    model, draft = str(resolve_model("qwen2.5-coder-1.5b")), str(resolve_model("gemma3-270m"))
    config = Config(model, mode=args.mode, threads="1", draft=draft, drafter="model", draft_at="thread",
                    n_ctx=2048, parallel=1)
    tok = Tokenizer(model)
    requests = []
    for q, text in enumerate(QUESTIONS):
        prompt = tok.encode(apply_chat(tok, text + " Answer in JSON."))
        for r in range(args.repeats):
            for constrained in ((False, True) if r % 2 == 0 else (True, False)):  # alternate who goes first
                requests.append({"q": q, "repeat": r, "constrained": constrained, "prompt": prompt, "n": args.n,
                                 "text": text})
    with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as f:
        json.dump({"config": config.to_json(), "requests": requests}, f)
    cmd = [str(BIN / "mpiexec"), "-n", "2", sys.executable, "-m", "mpi4py", __file__, "--worker", f.name]
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=3000)
    os.unlink(f.name)
    if p.returncode != 0:
        sys.exit(f"bench_constraint: the job failed:\n{p.stderr[-2000:]}")
    rows = [json.loads(line[7:]) for line in p.stdout.splitlines() if line.startswith("ANSWER ")]
    out = ROOT / "results" / "bench_constraint.csv"
    with open(out, "w", newline="") as fh:
        w = csv.DictWriter(fh, fieldnames=list(rows[0]))
        w.writeheader()
        w.writerows(rows)
    free = [r for r in rows if not r["constrained"]]
    con = [r for r in rows if r["constrained"]]
    mean = lambda rs, k: sum(r[k] for r in rs) / len(rs)  # noqa: E731
    ratios = [c["tokens_per_s"] / f["tokens_per_s"] for f, c in
              zip(sorted(free, key=lambda r: (r["q"], r["repeat"])), sorted(con, key=lambda r: (r["q"], r["repeat"])))]
    print(f"{args.mode}, 2 ranks x 1 thread, Gemma draft beside rank 0, {len(free)} pairs of {args.n} max tokens")
    print(f"free:        {mean(free, 'tokens_per_s'):6.2f} tokens/s, acceptance {mean(free, 'acceptance'):.0%}")
    print(f"constrained: {mean(con, 'tokens_per_s'):6.2f} tokens/s, acceptance {mean(con, 'acceptance'):.0%}")
    print(f"constrained / free, per pair: mean {sum(ratios) / len(ratios):.3f} (min {min(ratios):.3f}, "
          f"max {max(ratios):.3f}); rows in {out.relative_to(ROOT)}")


if __name__ == "__main__":
    main()
