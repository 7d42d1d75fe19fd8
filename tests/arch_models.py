"""A program, not a test module: write synth_arch.py's models at a size, with each one's greedy reference, for
launch/bench/bench_recurrent.py (the benchmarks run the tests' writers as programs and never import them).

    python tests/arch_models.py --size small --names llama,lfm2,granitehybrid --prompt 1,5,9 -n 136 --out DIR

Writes DIR/{size}-{name}.gguf and DIR/{size}-{name}.json ({"prompt_tokens": [...], "tokens": the greedy reference}).
"""
from __future__ import annotations

import argparse
import importlib.util
import json
import re
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE.parent), str(HERE)]

# n_embd, heads, kv heads, head size, n_ff, vocabulary (the vocabulary stays the tests': one sequence per token builds
# the codebook, and llama.cpp holds 256 sequences at most)
SIZES = {"tiny": (64, 4, 2, 16, 128, 256), "small": (512, 8, 2, 64, 1536, 256)}


def synth_arch_at(size: str):
    """synth_arch.py with its dimensions set to SIZES[size] (its builders read them at import)."""
    src = (HERE / "synth_arch.py").read_text()
    line = "E, H, KV, HD, FF, V = " + ", ".join(map(str, SIZES[size]))
    src, n = re.subn(r"^E, H, KV, HD, FF, V = .*$", line, src, count=1, flags=re.M)
    assert n == 1, "tests/synth_arch.py's dimensions line moved"
    spec = importlib.util.spec_from_loader(f"synth_arch_{size}", loader=None)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod  # dataclasses look their module up
    exec(compile(src, f"synth_arch[{size}]", "exec"), mod.__dict__)
    return mod


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--size", choices=sorted(SIZES), required=True)
    ap.add_argument("--names", required=True)
    ap.add_argument("--prompt", required=True, help="token ids, comma-separated")
    ap.add_argument("-n", type=int, required=True)
    ap.add_argument("--out", required=True)
    a = ap.parse_args()
    from synth import reference_greedy
    sa, prompt = synth_arch_at(a.size), [int(t) for t in a.prompt.split(",")]
    for name in a.names.split(","):
        path = sa.make_arch_gguf(Path(a.out) / f"{a.size}-{name}.gguf", name)
        ref = reference_greedy(path, prompt, a.n)
        (Path(a.out) / f"{a.size}-{name}.json").write_text(json.dumps({"prompt_tokens": prompt, "tokens": ref}))
        print(path, flush=True)


if __name__ == "__main__":
    main()
