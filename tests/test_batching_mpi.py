"""Batching users on real stages (llama.cpp, mpiexec) with a K-quant synthetic model: several prompts through one
pipeline (PipeInfer mode, a poor draft at the head), whose decodes mix newcomers' prompt chunks, the running
generations' next tokens and the drafter holder's micro-batches (--draft-rides always: they ride whatever the
measured costs say); each answer must equal the one `pipeinfer generate` gives its prompt alone, decodes must have
been shared, and riders must have been cancelled while their shared decode was in flight (the draft is poor: its
rows are dropped at the head, the others' rows in the same decode carry on). How the scheduler shares and cancels
in every order is pinned on the toy pipeline (test_scheduler.py). The model is quantized by llama.cpp itself
(Q4_K/Q6_K rows multiply row by row, so batched rows can keep their bits; the tests' f32 and q8_0 models cannot)."""
import json
import re

import pytest

from helpers import cli
from synth import make_llama_gguf, quantize_gguf

pytestmark = pytest.mark.mpi

SHAPE = dict(n_layer=4, n_embd=256, n_head=4, n_head_kv=2, n_ff=512)
# (text, n_predict, temp, seed): prompts of several chunks of 2 tokens, greedy and seeded, ending at other times
JOBS = [("ba ki lo", 40, 0.0, 0), ("lo lo ba ki ba lo ki ki lo ba ba ki", 9, 0.0, 0), ("ki", 14, 1.2, 5),
        ("ba ba ba lo ki lo", 16, 0.0, 0), ("lo ki", 6, 0.8, 11), ("ki ki ba", 12, 0.0, 0)]
CHUNK = ["--prompt-chunk", "2"]  # within every kernels' exact limit: chunks may share decodes


@pytest.fixture(scope="module")
def q4k(tmp_path_factory):
    d = tmp_path_factory.mktemp("q4k")
    target = quantize_gguf(make_llama_gguf(d / "t-f32.gguf", **SHAPE), d / "t-q4k.gguf")
    draft = make_llama_gguf(d / "d.gguf", **SHAPE, perturb=1.0)  # a poor draft: its runs are rejected
    return target, draft


def alone(target, kernels: str, text: str, n: int, temp: float, seed: int) -> list[int]:
    p = cli(["generate", "-m", str(target), "-p", text, "--no-chat", "-n", str(n), "--temp", str(temp),
             "--seed", str(seed), "--mode", "iterative", "--kernels", kernels, *CHUNK, "--json", "-q"], n=2)
    assert p.returncode == 0, p.stderr[-2000:]
    return json.loads(p.stdout)["tokens"]


@pytest.mark.parametrize("kernels", ["repack", "tiled"])
def test_shared_decodes_of_prompts_next_tokens_and_drafts_keep_every_answer(q4k, tmp_path, kernels):
    target, draft = q4k
    f = tmp_path / "prompts.jsonl"
    f.write_text("".join(json.dumps({"prompt": t, "n_predict": n, "temp": temp, "seed": seed}) + "\n"
                         for t, n, temp, seed in JOBS))
    p = cli(["generate", "-m", str(target), "--prompts", str(f), "--no-chat", "--mode", "pipeinfer",
             "--draft", str(draft), "--draft-at", "head", "--kernels", kernels, *CHUNK, "-c", "512",
             "--parallel", str(len(JOBS)), "--draft-rides", "always"], n=2, timeout=300)
    assert p.returncode == 0, p.stderr[-3000:]
    answers = {a["index"]: a["tokens"] for a in map(json.loads, p.stdout.splitlines())}
    for i, job in enumerate(JOBS):
        assert answers[i] == alone(target, kernels, *job), (i, job)
    shared = re.search(r"(\d+) decodes carrying (\d+) requests' next tokens \(up to (\d+) per decode\)", p.stderr)
    assert shared, p.stderr[-2000:]
    n_runs, n_rows, cap = map(int, shared.groups())
    assert n_runs > 0 and n_rows >= 2 * n_runs and cap >= (32 if kernels == "tiled" else 2), shared.group(0)
    rides = re.search(r"(\d+) draft micro-batches riding them \((\d+) dropped when cancelled\)", p.stderr)
    assert rides, p.stderr[-2000:]
    assert int(rides.group(1)) > 0 and int(rides.group(2)) > 0, rides.group(0)
