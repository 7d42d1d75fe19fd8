"""Several generations at once on real stages (llama.cpp, mpiexec): `generate --prompts FILE` runs every
prompt of a file through one pipeline, interleaved (decide/scheduler.py); each answer must equal the answer
`pipeinfer generate` gives that prompt alone, whatever shared the stages' KV caches and batches with it."""
import json

import pytest

from helpers import cli
from pipeinfer.decide.batching import default_parallel

pytestmark = pytest.mark.mpi

# (text, n_predict, temp, seed): different lengths, greedy and seeded samples
JOBS = [("ba ki lo", 20, 0.0, 0), ("lo lo ba ki", 9, 1.5, 3), ("ki", 14, 0.0, 0), ("ba ba ba lo ki lo", 17, 0.9, 11),
        ("lo ki", 6, 0.0, 0)]


def alone(models, text: str, n: int, temp: float, seed: int) -> list[int]:
    p = cli(["generate", "-m", str(models["q8"]), "-p", text, "--no-chat", "-n", str(n), "--temp", str(temp),
             "--seed", str(seed), "--mode", "iterative", "--json", "-q"], n=2)
    assert p.returncode == 0, p.stderr[-2000:]
    return json.loads(p.stdout)["tokens"]


@pytest.fixture(scope="module")
def references(models):
    return [alone(models, *job) for job in JOBS]


def write_jobs(path) -> None:
    lines = [JOBS[0][0]]  # a plain line: the command line's -n, --temp, --seed
    lines += [json.dumps({"prompt": t, "n_predict": n, "temp": temp, "seed": seed}) for t, n, temp, seed in JOBS[1:]]
    path.write_text("\n".join(lines) + "\n\n")


@pytest.mark.parametrize("n_ranks, mode, parallel", [
    (2, "pipeinfer", None), (2, "iterative", "3"), (3, "pipeinfer", "2"), (3, "iterative", None)])
def test_batch_answers_equal_single_answers(models, references, tmp_path, n_ranks, mode, parallel):
    f = tmp_path / "prompts.jsonl"
    write_jobs(f)
    results = tmp_path / "rows.csv"
    args = ["generate", "-m", str(models["q8"]), "--prompts", str(f), "--no-chat", "-n", "20", "--mode", mode,
            "-c", "256", "--results", str(results)]
    if mode == "pipeinfer":
        args += ["--draft", str(models["draft60"]), "--draft-at", "head"]
    if parallel:
        args += ["--parallel", parallel]
    p = cli(args, n=n_ranks, timeout=300)
    assert p.returncode == 0, p.stderr[-3000:]
    answers = {a["index"]: a for a in map(json.loads, p.stdout.splitlines())}
    assert sorted(answers) == list(range(len(JOBS)))
    for i, ref in enumerate(references):
        assert answers[i]["tokens"] == ref, (i, JOBS[i])
        assert answers[i]["n_generated"] == JOBS[i][1]
    want = f"{len(JOBS)} prompts, {parallel or default_parallel(n_ranks, batching=True)} at once"
    assert want in p.stderr, p.stderr[-2000:]
    from pipeinfer.core.results import read_results
    rows = read_results(results)
    assert sorted(r["prompt_name"] for r in rows) == sorted(f"prompts:{i}" for i in range(len(JOBS)))


def test_bad_prompts_file_is_one_line_error(models, tmp_path):
    f = tmp_path / "bad.jsonl"
    f.write_text('ba ki\n{"prompt": 3}\n')
    p = cli(["generate", "-m", str(models["q8"]), "--prompts", str(f), "--mode", "iterative"], n=2)
    assert p.returncode != 0
    assert "line 2: not a prompt" in p.stderr and "Traceback" not in p.stderr, p.stderr[-2000:]


def test_compaction_and_admission_under_a_small_context(models, references, tmp_path):
    """A context that holds about two requests at once: the others wait for cells, slots are repacked
    (COMPACT keeps every live canonical sequence), and every answer is still exact."""
    f = tmp_path / "prompts.jsonl"
    write_jobs(f)
    p = cli(["generate", "-m", str(models["q8"]), "--prompts", str(f), "--no-chat", "-n", "20", "--mode", "pipeinfer",
             "--draft", str(models["draft60"]), "--draft-at", "head", "-c", "96", "--parallel", "4", "--draft-max", "2",
             "--max-in-flight", "2"], n=2, timeout=300)
    assert p.returncode == 0, p.stderr[-3000:]
    answers = {a["index"]: a["tokens"] for a in map(json.loads, p.stdout.splitlines())}
    assert [answers[i] for i in range(len(JOBS))] == references
    summary = p.stderr.splitlines()[-1]
    waits = int(summary.split(" rounds waiting for KV cells")[0].rsplit(" ", 1)[1])
    compactions = int(summary.split(" compactions")[0].rsplit(" ", 1)[1])
    assert waits > 0 and compactions > 0, summary


@pytest.mark.parametrize("mode", ["iterative", "pipeinfer"])
def test_replayed_answers_go_on_as_the_uninterrupted_ones(models, references, tmp_path, mode):
    """A request resumed from the tokens it had streamed (JSON key "replay", as the supervisor resumes one after
    a lost host): on real stages the rest of its answer equals the uninterrupted answer, greedy and seeded."""
    lines = []
    for (text, n, temp, seed), ref in zip(JOBS[:4], references):
        for cut in (1, n // 2, n - 1):
            lines.append(json.dumps({"prompt": text, "n_predict": n - cut, "temp": temp, "seed": seed,
                                     "replay": ref[:cut], "cut": cut}))
    f = tmp_path / "resume.jsonl"
    f.write_text("\n".join(lines) + "\n")
    args = ["generate", "-m", str(models["q8"]), "--prompts", str(f), "--no-chat", "--mode", mode, "-c", "512"]
    if mode == "pipeinfer":
        args += ["--draft", str(models["draft60"]), "--draft-at", "head"]
    p = cli(args, n=2, timeout=300)
    assert p.returncode == 0, p.stderr[-3000:]
    answers = {a["index"]: a["tokens"] for a in map(json.loads, p.stdout.splitlines())}
    k = 0
    for (text, n, temp, seed), ref in zip(JOBS[:4], references):
        for cut in (1, n // 2, n - 1):
            assert answers[k] == ref[cut:], (text, cut)
            k += 1
