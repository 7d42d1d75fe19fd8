"""The prompt cache and concurrent prompts on the real Qwen2.5-Coder-1.5B (2 ranks, mpiexec): a second chat turn
started from the first turn's cells, and a prompt decoded beside another generation, answer token for token what
each prompt gets alone with no cache. On a real model a row's bits depend on the batch it was decoded in and, from
64 rows on, on where its cells sit (tests/test_stage_engine.py): this is the check that the prompt's chunks and the
cached prefix hold exactly the cold run's bits."""
import json

import pytest

from helpers import cli, real_model

pytestmark = [pytest.mark.real, pytest.mark.mpi]

TURN1 = ("You are reviewing a pull request. The change adds a least-recently-used cache in front of a slow key-value "
         "store: a dictionary from keys to nodes of a doubly linked list, the most recent at the head, a capacity "
         "given at construction, and an eviction of the tail when a put would exceed it. The author also added a "
         "lock around every method so that several threads can share one cache, and a statistics counter of hits "
         "and misses that is reset every minute by a timer thread. Explain, in a few sentences, what could go wrong.")
MORE = ("\n\nThanks. Now write the get method of that cache in Python, with the lock, as short as you can.\n")


def generate(qwen, args, n=2, timeout=600):
    p = cli(["generate", "-m", qwen, "--no-chat", "--threads", "1", "-c", "1024", "--mode", "pipeinfer",
             "--drafter", "ngram"] + args, n=n, timeout=timeout)
    assert p.returncode == 0, p.stderr[-3000:]
    return p


def alone(qwen, text, n_predict) -> list[int]:
    p = generate(qwen, ["-p", text, "-n", str(n_predict), "--json", "-q", "--cache-prompt", "off"])
    return json.loads(p.stdout)["tokens"]


def test_a_second_turn_from_the_cache_and_a_prompt_beside_another_equal_their_cold_answers(tmp_path):
    qwen = real_model("qwen2.5-coder-1.5b")
    from pipeinfer.engine.tokenizer import Tokenizer
    tok = Tokenizer(qwen)
    first = alone(qwen, TURN1, 24)
    turn2 = TURN1 + tok.decode(first) + MORE
    other = "Write a haiku about a compiler that never finishes. " * 3
    tok.close()
    refs = {"turn1": first, "turn2": alone(qwen, turn2, 20), "other": alone(qwen, other, 20)}
    f = tmp_path / "prompts.jsonl"
    # turn 1 alone first; then turn 2 (from turn 1's entry) with the other prompt admitted beside it
    f.write_text("\n".join(json.dumps({"prompt": t, "n_predict": n})
                           for t, n in ((TURN1, 24), (turn2, 20), (other, 20))) + "\n")
    p = generate(qwen, ["--prompts", str(f), "--parallel", "1"])
    one = {a["index"]: a for a in map(json.loads, p.stdout.splitlines())}
    assert one[1]["n_cached"] >= 63 and one[0]["n_cached"] == 0
    p = generate(qwen, ["--prompts", str(f), "--parallel", "2"])
    two = {a["index"]: a for a in map(json.loads, p.stdout.splitlines())}
    for answers in (one, two):
        assert [answers[i]["tokens"] for i in range(3)] == [refs["turn1"], refs["turn2"], refs["other"]]
