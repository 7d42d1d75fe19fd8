"""Constraints, biases and log-probabilities on the real Qwen2.5-Coder-1.5B: 20 JSON-schema answers through the real
`openai` client on 2 ranks in every mode (and 6 three at once) equal the one-process constrained answer and
validate with jsonschema; their log-probabilities are the same in every mode and equal
llama-cpp-python's own (to 1e-4)."""
from __future__ import annotations

import json
import subprocess
import sys

import pytest

from helpers import MPIEXEC, ROOT, real_model
from pipeinfer.core.config import PROMPT_CHUNK

pytestmark = [pytest.mark.real, pytest.mark.mpi, pytest.mark.slow]  # 4-8 min: the 1.5B model on 2 cores, 5 jobs

SCHEMAS = [
    {"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
     "required": ["name", "age"]},
    {"type": "array", "items": {"type": "integer"}, "minItems": 2, "maxItems": 4},
    {"type": "object", "properties": {"color": {"enum": ["red", "green", "blue"]}}, "required": ["color"]},
    {"type": "object", "properties": {"point": {"type": "object", "properties": {"x": {"type": "number"},
                                                                                  "y": {"type": "number"}},
                                                "required": ["x", "y"]}}, "required": ["point"]},
    {"type": "object", "properties": {"ok": {"type": "boolean"}, "tags": {"type": "array", "items": {"type": "string"},
                                                                           "maxItems": 2}},
     "required": ["ok", "tags"]},
    {"type": "string", "enum": ["yes", "no"]},
    {"type": "object", "properties": {"city": {"type": "string"}, "population": {"type": "integer", "minimum": 0}},
     "required": ["city", "population"]},
    {"type": "array", "items": {"enum": ["python", "c", "rust", "go"]}, "minItems": 1, "maxItems": 3},
    {"type": "object", "properties": {"title": {"type": "string"}, "year": {"type": "integer"},
                                      "authors": {"type": "array", "items": {"type": "string"}, "maxItems": 2}},
     "required": ["title", "year", "authors"]},
    {"type": "object", "properties": {"valid": {"type": "boolean"}, "reason": {"type": "string"}},
     "required": ["valid"]},
    {"type": "integer", "minimum": 1, "maximum": 10},
    {"type": "object", "properties": {"function": {"type": "string"}, "args": {"type": "array",
                                                                            "items": {"type": "string"}}},
     "required": ["function", "args"]},
    {"type": "object", "properties": {"status": {"enum": ["open", "closed"]}, "priority": {"type": "integer"}},
     "required": ["status", "priority"]},
    {"type": "array", "items": {"type": "object", "properties": {"k": {"type": "string"}, "v": {"type": "number"}},
                                "required": ["k", "v"]}, "maxItems": 2},
    {"type": "object", "properties": {"language": {"type": "string"}, "typed": {"type": "boolean"},
                                      "since": {"type": "integer"}}, "required": ["language", "typed"]},
    {"type": "number"},
    {"type": "object", "properties": {"user": {"type": "object", "properties": {"id": {"type": "integer"},
                                                                                "email": {"type": "string"}},
                                               "required": ["id"]}}, "required": ["user"]},
    {"type": "array", "items": {"type": "boolean"}, "minItems": 3, "maxItems": 3},
    {"type": "object", "properties": {"answer": {"type": "string", "maxLength": 20}}, "required": ["answer"]},
    {"type": "object", "properties": {"min": {"type": "integer"}, "max": {"type": "integer"},
                                      "unit": {"enum": ["ms", "s"]}}, "required": ["min", "max", "unit"]},
]
QUESTIONS = ["Describe a programmer.", "Give a few small numbers.", "Pick a color.", "Give a point in the plane.",
             "Is Python typed? Add tags.", "Is water wet?", "Name a big city and its population.",
             "Which languages compile to machine code?", "Describe a famous programming book.",
             "Is 17 a prime number? Say why.", "Rate Python from 1 to 10.", "Call a function that adds two numbers.",
             "Describe an open bug of high priority.", "Give two key-value pairs.", "Describe the Rust language.",
             "What is pi to three decimals?", "Describe a user of a website.", "Which of these are true: 1<2, "
             "2<1, 3<4?", "What is the capital of France?", "How long does a disk seek take?"]
N_MIXED = 6  # schemas also run three at once beside free requests (the cost of the real model on 2 cores)
N_PREDICT = 48


def _requests(model: str) -> list[dict]:
    from pipeinfer.engine.tokenizer import Tokenizer, apply_chat
    tok = Tokenizer(model)
    out = []
    for schema, q in zip(SCHEMAS, QUESTIONS):
        prompt = tok.encode(apply_chat(tok, f"{q} Answer in JSON with this schema: {json.dumps(schema)}"))
        constraint = {"kind": "json_schema", "text": json.dumps(schema), "strict": True}
        out.append({"prompt": prompt, "n": N_PREDICT, "decoding": {"constraint": constraint, "top_logprobs": 2},
                    "question": f"{q} Answer in JSON with this schema: {json.dumps(schema)}", "schema": schema})
    tok.close()
    return out


def _run(n: int, config: dict, requests: list[dict], tmp_path, at_once: bool = False) -> list[dict]:
    spec = tmp_path / f"spec-{n}-{config['mode']}-{at_once}.json"
    spec.write_text(json.dumps({"config": config, "requests": requests, "at_once": at_once}))
    cmd = [MPIEXEC, "-n", str(n), sys.executable, "-m", "mpi4py", str(ROOT / "tests" / "mpi_requests.py"), f"@{spec}"]
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=540)
    assert p.returncode == 0, p.stderr[-3000:]
    return [json.loads(line[len("ANSWER "):]) for line in p.stdout.splitlines() if line.startswith("ANSWER ")]


def _served(model: str, mode: str, requests: list[dict], log) -> list[dict]:
    """The requests through the real `openai` client to `pipeinfer serve` on 2 ranks in `mode`, one at a time:
    each answer's text and its log-probabilities."""
    from openai import OpenAI

    from helpers import Server
    srv = Server(["-m", model, "--mode", mode, "--drafter", "ngram", "-t", "1", "-c", "1024", "--alias", "qwen",
                  "--parallel", "1"], 2, log)
    try:
        client = OpenAI(base_url=srv.base_url, api_key="none", max_retries=0, timeout=300)
        out = []
        for req in requests:
            r = client.chat.completions.create(
                model="qwen", messages=[{"role": "user", "content": req["question"]}], max_tokens=N_PREDICT,
                response_format={"type": "json_schema", "json_schema": {"name": "answer", "strict": True,
                                                                        "schema": req["schema"]}},
                logprobs=True, top_logprobs=2)
            c = r.choices[0]
            out.append({"text": c.message.content, "logprobs": [e.logprob for e in c.logprobs.content]})
    finally:
        code = srv.stop()
    assert code == 0 and "Traceback" not in srv.text(), srv.text()[-3000:]
    return out


@pytest.fixture(scope="module")
def answers(tmp_path_factory):
    """The one-process reference (tests/mpi_requests.py on 1 rank, iterative) of every schema; the server's answers
    on 2 ranks in every mode (PipeInfer, synchronous speculative, iterative); and the first N_MIXED three at once on
    one 2-rank pipeline beside free biased requests."""
    model = real_model("qwen2.5-coder-1.5b")
    tmp = tmp_path_factory.mktemp("decoding")
    requests = _requests(model)
    base = {"model": model, "threads": "1", "ctx_size": 1024, "parallel": 1, "drafter": "ngram", "draft": None,
            "draft_at": "head"}
    return model, requests, {
        "one process": _run(1, {**base, "mode": "iterative"}, requests, tmp),
        "pipeinfer": _served(model, "pipeinfer", requests, tmp / "pipeinfer.log"),
        "speculative": _served(model, "speculative", requests, tmp / "speculative.log"),
        "iterative": _served(model, "iterative", requests, tmp / "iterative.log"),
        "parallel": _run(2, {**base, "mode": "pipeinfer", "parallel": 3}, _mixed(requests[:N_MIXED]), tmp,
                         at_once=True),
    }


def _mixed(requests: list[dict]) -> list[dict]:
    """The constrained requests with a free one (the same prompt, no constraint) after every second one."""
    out = []
    for i, req in enumerate(requests):
        out.append(req)
        if i % 2:
            out.append({**req, "decoding": {"logit_bias": [[req["prompt"][-1], -3.0]], "presence_penalty": 0.4}})
    return out


def test_json_schema_answers_are_exact_in_every_mode_and_valid(answers):
    """The server's answers (the real openai client) equal the one-process constrained answers in every mode, and
    every answer the model ended validates against its schema."""
    import jsonschema

    from pipeinfer.engine.tokenizer import Tokenizer
    model, requests, by_mode = answers
    ref = by_mode["one process"]
    assert len(ref) == len(SCHEMAS)
    tok = Tokenizer(model)
    want = [tok.decode(a["tokens"]) for a in ref]
    for mode in ("pipeinfer", "speculative", "iterative"):
        assert [a["text"] for a in by_mode[mode]] == want[:len(by_mode[mode])], mode
    finished = 0
    for schema, a, text in zip(SCHEMAS, ref, want):
        if len(a["tokens"]) < N_PREDICT:  # ended by the model (EOS): the whole answer is there
            jsonschema.validate(json.loads(text), schema)
            finished += 1
    tok.close()
    assert finished >= len(SCHEMAS) - 2, finished
    constrained_at_once = [a for req, a in zip(_mixed(requests[:N_MIXED]), by_mode["parallel"])
                           if "constraint" in req["decoding"]]
    for ours, one in zip(constrained_at_once, ref):
        n = _before_a_near_tie(one)
        assert ours["tokens"][:n] == one["tokens"][:n]


def _before_a_near_tie(answer: dict, gap: float = 0.01) -> int:
    """Tokens of an answer before the first position whose two most likely tokens are within `gap` in
    log-probability: three at once, a newcomer's prompt (64+ tokens) lands at another cell offset than alone, and
    llama.cpp's tiled flash attention then moves the real model's logits (tests/test_stage_engine.py; docs/serving.md, Many
    users): equality holds up to a near tie."""
    for i, lp in enumerate(answer["logprobs"]):
        if len(lp["top"]) > 1 and lp["top"][0][1] - lp["top"][1][1] < gap:
            return i
    return len(answer["tokens"])


def test_logprobs_are_the_same_in_every_mode(answers):
    """The log-probabilities the server reports for each answer token are the one-process run's, on 2 ranks in
    every mode: the rows verification used are the same rows, whichever run held them."""
    _, _, by_mode = answers
    for mode in ("pipeinfer", "speculative", "iterative"):
        for ours, ref in zip(by_mode[mode], by_mode["one process"]):
            assert ours["logprobs"] == pytest.approx([lp["logprob"] for lp in ref["logprobs"]], abs=1e-4), mode


def test_logprobs_equal_llama_cpp_pythons_own(answers):
    """Ours (the last stage's; the same on 2 ranks in every mode, above) against llama-cpp-python's own Llama on the
    same file and kernels (--kernels repack: flash attention on, the repacked weights, the cache types of
    engine/kernels.kv_cache_types), decoding the prompt and then our answer a token at a time as the one-process run
    does: the log-softmax of its raw logits."""
    import llama_cpp
    import numpy as np
    from llama_cpp import Llama

    from pipeinfer.engine.kernels import UNUSED_EXTRA_BUFFERS, drop_extra_buffer_types, kv_cache_types
    model, requests, by_mode = answers
    drop_extra_buffer_types(UNUSED_EXTRA_BUFFERS)
    type_k, type_v = kv_cache_types("repack")
    llm = Llama(model, n_ctx=1024, n_threads=1, n_batch=PROMPT_CHUNK, n_ubatch=PROMPT_CHUNK, flash_attn=True,
                type_k=type_k, type_v=type_v, verbose=False)  # the prompt in pipeinfer's chunks
    for req, ans in list(zip(requests, by_mode["one process"]))[:2]:
        prompt, tokens = req["prompt"], ans["tokens"][:12]
        llm.reset()
        for i, chunk in enumerate([prompt] + [[t] for t in tokens[:-1]]):
            llm.eval(chunk)
            logits = np.ctypeslib.as_array(llama_cpp.llama_get_logits_ith(llm._ctx.ctx, -1), shape=(llm.n_vocab(),))
            theirs = Llama.logits_to_logprobs(logits.copy())
            lp = ans["logprobs"][i]
            assert lp["token"] == tokens[i]
            assert lp["logprob"] == pytest.approx(float(theirs[tokens[i]]), abs=1e-4), i
            for alt, alt_lp in lp["top"]:
                assert alt_lp == pytest.approx(float(theirs[alt]), abs=1e-4), i
