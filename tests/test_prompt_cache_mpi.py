"""The prompt cache on real stages (llama.cpp, mpiexec, synthetic GGUFs): a conversation's later turns start from
the earlier ones' cells on every stage and answer exactly what each turn gets cold (alone, no cache), whatever ran
beside them; per-prompt cache_prompt false; a context too small to keep every entry."""
import json

import pytest

from helpers import cli

pytestmark = pytest.mark.mpi

WORDS = "ba ki lo ba lo ki ki ba lo lo ba ki".split()


def turns() -> list[tuple[str, int, float, int]]:
    """(text, n_predict, temp, seed): three turns of a conversation, two of another, a shared head."""
    head = " ".join(WORDS * 3)
    a1 = head + " lo ki ba"
    a2 = a1 + " ki ki lo ba ba lo ki lo"
    a3 = a2 + " ba lo lo ki"
    b1 = head + " ki ba ba"
    b2 = b1 + " lo lo ki ba ki"
    return [(a1, 12, 0.0, 0), (b1, 10, 0.9, 5), (a2, 14, 0.0, 0), (b2, 9, 0.9, 7), (a3, 11, 1.2, 3)]


def chunk_args(chunk: int) -> list[str]:
    return ["--prompt-chunk", str(chunk), "--no-chat", "-c", "1024"]


def alone(models, text, n, temp, seed, chunk) -> list[int]:
    p = cli(["generate", "-m", str(models["q8"]), "-p", text, "-n", str(n), "--temp", str(temp), "--seed", str(seed),
             "--mode", "iterative", "--json", "-q", "--cache-prompt", "off"] + chunk_args(chunk), n=2)
    assert p.returncode == 0, p.stderr[-2000:]
    return json.loads(p.stdout)["tokens"]


def batch(models, tmp_path, jobs, extra, n_ranks=2, chunk=8) -> dict[int, dict]:
    f = tmp_path / "turns.jsonl"
    f.write_text("\n".join(json.dumps({"prompt": t, "n_predict": n, "temp": temp, "seed": seed, **more})
                           for t, n, temp, seed, more in jobs) + "\n")
    p = cli(["generate", "-m", str(models["q8"]), "--prompts", str(f), "-n", "20"] + chunk_args(chunk) + extra,
            n=n_ranks, timeout=300)
    assert p.returncode == 0, p.stderr[-3000:]
    return {a["index"]: a for a in map(json.loads, p.stdout.splitlines())}


@pytest.fixture(scope="module")
def cold(models):
    return [alone(models, *job, chunk=8) for job in turns()]


@pytest.mark.parametrize("n_ranks, mode, parallel", [(2, "iterative", "1"), (2, "pipeinfer", "1"),
                                                     (3, "pipeinfer", "3")])
def test_turns_from_the_cache_equal_their_cold_answers(models, cold, tmp_path, n_ranks, mode, parallel):
    extra = ["--mode", mode, "--parallel", parallel]
    if mode == "pipeinfer":
        extra += ["--draft", str(models["draft60"]), "--draft-at", "head"]
    answers = batch(models, tmp_path, [(*job, {}) for job in turns()], extra, n_ranks)
    for i, ref in enumerate(cold):
        assert answers[i]["tokens"] == ref, i
    if parallel == "1":  # one at a time: every turn after the first of its conversation starts from the cache
        assert [answers[i]["n_cached"] > 0 for i in range(5)] == [False, True, True, True, True]
        assert answers[2]["n_cached"] >= answers[1]["n_cached"]
    else:
        assert sum(a["n_cached"] for a in answers.values()) > 0


def test_cache_prompt_false_per_prompt_and_off_for_the_command(models, cold, tmp_path):
    jobs = [(*job, {"cache_prompt": i != 2}) for i, job in enumerate(turns())]
    answers = batch(models, tmp_path, jobs, ["--mode", "iterative", "--parallel", "1"])
    assert [answers[i]["tokens"] for i in range(5)] == cold
    assert answers[2]["n_cached"] == 0 and answers[1]["n_cached"] > 0
    off = batch(models, tmp_path, [(*job, {}) for job in turns()], ["--mode", "iterative", "--cache-prompt", "off"])
    assert [off[i]["tokens"] for i in range(5)] == cold and all(a["n_cached"] == 0 for a in off.values())


def test_a_context_that_cannot_keep_every_entry_evicts_and_stays_exact(models, cold, tmp_path):
    """-c 320 holds one turn (about 200 prompt tokens) and little more: entries go (least recently used first) at the
    compactions before each newcomer, and every answer is still its cold one."""
    f_jobs = [(*job, {}) for job in turns()]
    answers = batch(models, tmp_path, f_jobs, ["--mode", "pipeinfer", "--draft", str(models["draft60"]),
                                               "--draft-at", "head", "--parallel", "2", "-c", "320"])
    assert [answers[i]["tokens"] for i in range(5)] == cold


def test_a_served_conversation_starts_its_next_turn_after_the_last_answer(models, tmp_path):
    """An idle server decodes the last answer again in whole chunks (Scheduler.idle_work): the next turn (token
    ids, so that nothing is tokenized across the turns' boundary) reuses the whole history but its last partial
    chunk, the usage says so, and the answer is the cold one."""
    from helpers import Server, mpirun, wait_until
    from pipeinfer.engine.tokenizer import Tokenizer
    tok = Tokenizer(str(models["q8"]))
    ids1 = tok.encode(turns()[0][0])

    def cold(ids, n):
        return mpirun(2, {"model": str(models["q8"]), "prompt": ids, "n": n, "prompt_chunk": 8,
                          "cache_prompt": False})["tokens"]
    answer1 = cold(ids1, 40)
    ids2 = ids1 + answer1 + tok.encode(" ba ki", add_special=False)
    answer2 = cold(ids2, 12)
    held = len(ids1) + len(answer1) - 1  # the last token is emitted, never decoded
    srv = Server(["-m", str(models["q8"]), "--mode", "iterative", "--prompt-chunk", "8", "-c", "1024",
                  "--ignore-eos"], 2, tmp_path / "srv.log")
    try:
        status, _, raw = srv.request("POST", "/v1/completions", {"model": "t-q8", "prompt": ids1, "max_tokens": 40})
        assert status == 200 and json.loads(raw)["choices"][0]["text"] == tok.decode(answer1), raw
        wait_until(lambda: srv.health()["prompt_cache"]["tokens"] == held // 8 * 8, 60, lambda: str(srv.health()))
        status, _, raw = srv.request("POST", "/v1/completions", {"model": "t-q8", "prompt": ids2, "max_tokens": 12})
        assert status == 200, raw
        second = json.loads(raw)
        assert second["usage"]["prompt_tokens_details"]["cached_tokens"] == held // 8 * 8 > len(ids1) // 8 * 8
        assert second["choices"][0]["text"] == tok.decode(answer2)
    finally:
        tok.close()
        assert srv.stop() == 0, srv.text()[-3000:]
