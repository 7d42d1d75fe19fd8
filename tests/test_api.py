"""The OpenAI surface of `pipeinfer serve` without ranks: the real app and generation thread over a fake head
session whose scheduler writes a deterministic answer (and its log-probabilities through on_logprobs). Requests to
jobs, every field's mapping and error, the prompt shapes, n, the log-probability shapes streamed and not, the
error shapes of unknown routes and methods, /tokenize and /detokenize; the `openai` package against it on a port."""
from __future__ import annotations

import json
import threading
import time
from types import SimpleNamespace

import pytest
from fastapi.testclient import TestClient

from api_fakes import ScriptedSession, serving

from pipeinfer.core.decoding import Constraint, Decoding, TokenLogprob
from pipeinfer.core.metrics import Stats
from pipeinfer.core.sampling import SamplingParams
from pipeinfer.decide.scheduler import Request
from pipeinfer.feeders.generator import Generator
from pipeinfer.frontend.app import ServeConfig, create_app
from pipeinfer.serving.job import TextEvent
from pipeinfer.serving.job import RequestError

N_VOCAB = 300
BOS = 299
WORDS = {256: "é".encode(), 257: " hello".encode(), 258: "日本".encode()}
N_CTX, DEFAULT_MAX = 512, 12


# ------------------------------------------------------------------------------------ the fakes
class FakeTokenizer:
    """Ids 0..255 are single bytes, 256.. a few words, 299 BOS (no text)."""
    n_vocab = N_VOCAB

    def piece(self, token: int) -> bytes:
        return WORDS.get(token, b"" if token == BOS else bytes([token % 256]))

    def encode(self, text: str, add_special: bool = True, parse_special: bool = True) -> list[int]:
        return ([BOS] if add_special else []) + list(text.encode())

    def decode(self, tokens: list[int]) -> str:
        return b"".join(self.piece(t) for t in tokens).decode("utf-8", errors="replace")


def answer_token(prompt: list[int], sp: SamplingParams, k: int) -> int:
    """The fake target's k-th answer token: a letter fixed by the prompt (and the seed when sampling), and every
    fifth position an "é" split over two byte tokens (0xC3 0xA9) or whole (token 256)."""
    if k % 5 == 3:
        return 0xC3 if (k // 5) % 2 == 0 else 256
    if k % 5 == 4 and (k // 5) % 2 == 0:
        return 0xA9
    salt = sp.seed * 3 if sp.temp > 0 else 0
    return ord("a") + (sum(prompt) * 7 + salt + k * 5) % 26


def answer_text(prompt: list[int], sp: SamplingParams, n: int) -> str:
    return FakeTokenizer().decode([answer_token(prompt, sp, k) for k in range(n)])


def logprob_of(token: int, k: int, top: int) -> TokenLogprob:
    lp = -0.1 * (k % 7 + 1)
    return TokenLogprob(token, lp, tuple(((token + d) % N_VOCAB, lp - d) for d in range(top)))


class FakeScheduler:
    """Each step gives every running request its next 1, 2 or 3 tokens (cycling), log-probabilities first."""

    def __init__(self):
        self.waiting: list = []
        self.running: list[tuple[Request, list[int]]] = []
        self.step_s = 0.0

    @property
    def busy(self) -> bool:
        return bool(self.running)

    def has_idle_work(self) -> bool:
        return False

    def idle_work(self) -> bool:
        return False

    def submit(self, req: Request) -> None:
        if len(req.prompt) > 400:
            raise ValueError("does not fit")
        self.running.append((req, []))

    def step(self) -> None:
        for req, out in list(self.running):
            if req.should_stop() or len(out) == req.n_predict:
                self.running.remove((req, out))
                req.on_done(out, Stats(n_prompt=len(req.prompt), n_generated=len(out)))
                continue
            ks = range(len(out), min(req.n_predict, len(out) + 1 + len(out) % 3))
            tokens = [answer_token(req.prompt, req.sampling, k) for k in ks]
            if req.decoding.top_logprobs is not None:
                req.on_logprobs([logprob_of(t, k, req.decoding.top_logprobs) for t, k in zip(tokens, ks)])
            out += tokens
            req.on_tokens(tokens)
        time.sleep(self.step_s)


class FakeSession(ScriptedSession):
    """What server.Generator uses of ranks/session.HeadSession (api_fakes.ScriptedSession's), over this module's
    fake tokenizer and scheduler; every Request it made kept."""

    def __init__(self):
        self.tok, self.sched, self.requests = FakeTokenizer(), FakeScheduler(), []


def chat_template(messages: list[dict]) -> str:
    return "".join(f"<{m['role']}>{m['content']}" for m in messages) + "<assistant>"


@pytest.fixture(scope="module")
def served():
    session = FakeSession()
    gen = Generator(session, max_queue=64, log=lambda _msg: None)
    gen.start()
    app = create_app(ServeConfig("fake", N_CTX, 4, DEFAULT_MAX), gen, session.tok, chat_template)
    with TestClient(app) as client:
        yield SimpleNamespace(client=client, session=session, app=app)
    gen.stop()


@pytest.fixture
def api(served):
    served.session.requests.clear()
    return served


def post(api, path: str, body: dict, status: int = 200) -> dict:
    r = api.client.post(path, json=body)
    assert r.status_code == status, r.text
    return r.json()


def complete(api, status: int = 200, **body) -> dict:
    return post(api, "/v1/completions", {"model": "fake", **body}, status)


def chat(api, status: int = 200, **body) -> dict:
    return post(api, "/v1/chat/completions", {"model": "fake", **body}, status)


def stream(api, path: str, body: dict) -> list[dict]:
    """A streamed answer's event objects, up to data: [DONE] (which must come)."""
    events = []
    with api.client.stream("POST", path, json={"model": "fake", "stream": True, **body}) as r:
        assert r.status_code == 200, r.read()
        for line in r.iter_lines():
            if line == "data: [DONE]":
                return events
            if line.startswith("data: "):
                events.append(json.loads(line[6:]))
    raise AssertionError(f"no [DONE] after {events}")


def ids(text: str) -> list[int]:
    return FakeTokenizer().encode(text)


GREEDY = SamplingParams()


def assert_error(body: dict, param: str | None, *, code: str | None = None, in_message: str = "") -> None:
    err = body["error"]
    assert set(err) == {"message", "type", "param", "code"}, err
    assert err["param"] == param and err["type"] == "invalid_request_error" and err["message"], err
    assert "\n" not in err["message"] and in_message in err["message"], err
    if code is not None:
        assert err["code"] == code, err


# ------------------------------------------------------------------------------------ requests to jobs
def test_a_completion_and_its_job(api):
    r = complete(api, prompt="ba ki", max_tokens=9)
    assert r["object"] == "text_completion" and r["id"].startswith("cmpl-") and r["model"] == "fake"
    assert r["choices"] == [{"index": 0, "text": answer_text(ids("ba ki"), GREEDY, 9), "finish_reason": "length",
                             "logprobs": None}]
    assert r["usage"] == {"prompt_tokens": 6, "completion_tokens": 9, "total_tokens": 15,
                          "prompt_tokens_details": {"cached_tokens": 0}}
    (req,) = api.session.requests
    assert (req.prompt, req.n_predict, req.sampling, req.prompt_text, req.chat) == (ids("ba ki"), 9, GREEDY,
                                                                                      "ba ki", False)
    assert req.decoding == Decoding() and req.on_logprobs is not None


def test_sampling_fields_reach_the_job(api):
    complete(api, prompt="x", max_tokens=3, temperature=0.7, top_p=0.9, top_k=40, seed=11, frequency_penalty=0.5,
             presence_penalty=-1.5, logit_bias={"5": -100, "3": 2.5})
    (req,) = api.session.requests
    assert req.sampling == SamplingParams(0.7, 40, 0.9, 11)
    assert req.decoding == Decoding(None, ((3, 2.5), (5, -100.0)), 0.5, -1.5, None)


def test_without_max_tokens_the_default_within_the_context(api):
    assert complete(api, prompt="x")["usage"]["completion_tokens"] == DEFAULT_MAX
    chat(api, messages=[{"role": "user", "content": "x"}], max_completion_tokens=5, max_tokens=7)
    assert api.session.requests[-1].n_predict == 5  # max_completion_tokens first


def test_chat_maps_messages_through_the_template(api):
    parts = [{"type": "text", "text": "hi "}, {"type": "text", "text": "you"}]
    r = chat(api, messages=[{"role": "developer", "content": "be brief"}, {"role": "user", "content": parts}],
             max_tokens=4)
    text = "<system>be brief<user>hi you<assistant>"
    assert r["choices"][0]["message"] == {"role": "assistant", "content": answer_text(ids(text), GREEDY, 4)}
    assert r["object"] == "chat.completion" and r["id"].startswith("chatcmpl-")
    (req,) = api.session.requests
    assert req.prompt == ids(text) and req.prompt_text == text and not req.chat
    chat(api, messages=[{"role": "user", "content": "hi"}], max_tokens=2)
    assert (api.session.requests[-1].prompt_text, api.session.requests[-1].chat) == ("hi", True)  # a lone user message


# ------------------------------------------------------------------------------------ prompt shapes and n
def test_a_list_of_prompts_is_one_choice_each_never_joined(api):
    r = complete(api, prompt=["ba", "ki lo", "x"], max_tokens=6)
    assert [c["index"] for c in r["choices"]] == [0, 1, 2]
    assert [c["text"] for c in r["choices"]] == [answer_text(ids(p), GREEDY, 6) for p in ("ba", "ki lo", "x")]
    assert sorted(q.prompt for q in api.session.requests) == sorted(ids(p) for p in ("ba", "ki lo", "x"))
    assert r["usage"] == {"prompt_tokens": 3 + 6 + 2, "completion_tokens": 18, "total_tokens": 29,
                          "prompt_tokens_details": {"cached_tokens": 0}}


def test_token_id_prompts(api):
    one = complete(api, prompt=[5, 256, 7], max_tokens=4)
    assert one["choices"][0]["text"] == answer_text([5, 256, 7], GREEDY, 4)
    assert api.session.requests[-1].prompt_text == FakeTokenizer().decode([5, 256, 7])
    many = complete(api, prompt=[[5, 6], [BOS, 9]], max_tokens=4)
    assert [c["text"] for c in many["choices"]] == [answer_text(p, GREEDY, 4) for p in ([5, 6], [BOS, 9])]
    assert many["usage"]["prompt_tokens"] == 4


@pytest.mark.parametrize("prompt, param, words", [
    ([], "prompt", "must be"), ([1, "a"], "prompt", "not a mix"), ({"a": 1}, "prompt", "must be"),
    (None, "prompt", "must be"), ([5, N_VOCAB], "prompt", f"token id {N_VOCAB} is not in the vocabulary"),
    ([5, -1], "prompt", "token id -1"), ([[5], [1, 2.5]], "prompt.1", "token ids"), ([[5], []], "prompt.1", "empty"),
    ([True, 2], "prompt", "not a mix"), ([[5], [N_VOCAB + 3]], "prompt.1", "not in the vocabulary"),
])
def test_bad_prompts_are_400_naming_the_prompt(api, prompt, param, words):
    assert_error(complete(api, 400, prompt=prompt, max_tokens=2), param, in_message=words)
    assert api.session.requests == []


def test_n_choices_each_with_its_seed(api):
    r = complete(api, prompt="ba", max_tokens=8, n=3, temperature=1.0, seed=5)
    assert [c["index"] for c in r["choices"]] == [0, 1, 2]
    for j, c in enumerate(r["choices"]):
        assert c["text"] == answer_text(ids("ba"), SamplingParams(1.0, 0, 1.0, 5 + j), 8)
    assert len({c["text"] for c in r["choices"]}) == 3
    assert r["usage"] == {"prompt_tokens": 3, "completion_tokens": 24, "total_tokens": 27,  # the prompt once
                          "prompt_tokens_details": {"cached_tokens": 0}}
    assert sorted(q.sampling.seed for q in api.session.requests) == [5, 6, 7]
    single = complete(api, prompt="ba", max_tokens=8, temperature=1.0, seed=6)
    assert single["choices"][0]["text"] == r["choices"][1]["text"]


@pytest.mark.parametrize("path, body", [
    ("/v1/completions", {"prompt": "ba", "n": 2, "max_tokens": 8}),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "Name a random animal."}], "n": 2,
                              "max_tokens": 8}),
    ("/v1/messages", {"messages": [{"role": "user", "content": "Name a random animal."}], "max_tokens": 8}),
    ("/v1/responses", {"input": "Name a random animal.", "max_output_tokens": 8}),
])
def test_a_sampled_request_without_a_seed_draws_a_new_one_and_names_it(api, path, body):
    """Every API: no seed, a fresh one per request, named in X-Seed (choice j samples with it + j)."""
    body = {"model": "fake", "temperature": 1.0, **body}
    seeds = []
    for _ in range(4):
        api.session.requests.clear()
        r = api.client.post(path, json=body)
        assert r.status_code == 200, r.text
        seeds.append(int(r.headers["x-seed"]))
        assert sorted(q.sampling.seed for q in api.session.requests) == [seeds[-1] + j for j in range(body.get("n", 1))]
    assert len(set(seeds)) == 4


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
def test_the_seed_drawn_for_a_request_reproduces_its_answer(api, path):
    body = {"model": "fake", "temperature": 1.0, "max_tokens": 8, "n": 2, "prompt": "ba",
            "messages": [{"role": "user", "content": "hi"}]}
    body.pop("prompt" if "chat" in path else "messages")
    first = api.client.post(path, json=body)
    seed = int(first.headers["x-seed"])
    again = api.client.post(path, json={**body, "seed": seed})
    assert int(again.headers["x-seed"]) == seed
    assert again.json()["choices"] == first.json()["choices"]


def test_prompts_times_n_are_indexed_prompt_major(api):
    r = complete(api, prompt=["ba", "ki"], max_tokens=5, n=2, temperature=1.0, seed=0)
    want = [answer_text(ids(p), SamplingParams(1.0, 0, 1.0, j), 5) for p in ("ba", "ki") for j in range(2)]
    assert [(c["index"], c["text"]) for c in r["choices"]] == list(enumerate(want))


def test_n_streams_interleaved_chunks_by_index(api):
    events = stream(api, "/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 10,
                                                  "n": 2, "temperature": 1.0, "seed": 3,
                                                  "stream_options": {"include_usage": True}})
    choices = [e["choices"][0] for e in events if e["choices"]]
    assert [c["delta"] for c in choices[:2]] == [{"role": "assistant", "content": ""}] * 2
    assert [c["index"] for c in choices[:2]] == [0, 1]
    for j in range(2):
        mine = [c for c in choices if c["index"] == j]
        text = "".join(c["delta"].get("content", "") for c in mine)
        assert text == answer_text(ids("<user>hi<assistant>"), SamplingParams(1.0, 0, 1.0, 3 + j), 10)
        assert [c["finish_reason"] for c in mine if c["finish_reason"]] == ["length"]
    assert len({e["id"] for e in events}) == 1
    assert events[-1]["choices"] == [] and events[-1]["usage"]["completion_tokens"] == 20


def test_too_many_choices_are_refused(api):
    assert_error(complete(api, 400, prompt=["a"] * 9, n=8, max_tokens=1), "prompt", in_message="64")
    assert_error(complete(api, 400, prompt="a", n=9), "n")
    assert api.session.requests == []


# ------------------------------------------------------------------------------------ log-probabilities
def test_chat_logprobs_whole(api):
    r = chat(api, messages=[{"role": "user", "content": "hi"}], max_tokens=10, logprobs=True, top_logprobs=2)
    choice = r["choices"][0]
    content = choice["logprobs"]["content"]
    assert len(content) == 10 and choice["logprobs"]["refusal"] is None
    assert bytes(b for e in content for b in e["bytes"]).decode() == choice["message"]["content"]
    prompt = ids("<user>hi<assistant>")
    for k, e in enumerate(content):
        t = answer_token(prompt, GREEDY, k)
        want = logprob_of(t, k, 2)
        assert e == {"token": FakeTokenizer().piece(t).decode(errors="replace"), "logprob": want.logprob,
                     "bytes": list(FakeTokenizer().piece(t)),
                     "top_logprobs": [{"token": FakeTokenizer().piece(a).decode(errors="replace"), "logprob": p,
                                       "bytes": list(FakeTokenizer().piece(a))} for a, p in want.top]}
    assert api.session.requests[-1].decoding.top_logprobs == 2
    plain = chat(api, messages=[{"role": "user", "content": "hi"}], max_tokens=3, logprobs=True)
    assert all(e["top_logprobs"] == [] for e in plain["choices"][0]["logprobs"]["content"])
    assert api.session.requests[-1].decoding.top_logprobs == 0


def test_streamed_logprobs_go_with_the_text_that_completes_their_tokens(api):
    """Each chunk carries the entries of the tokens whose last byte it releases: the first byte of a split "é"
    waits for the chunk that holds the whole character."""
    events = stream(api, "/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 25,
                                                  "logprobs": True, "top_logprobs": 1})
    text, entry_bytes = b"", b""
    for e in events:
        c = e["choices"][0]
        if c["finish_reason"] or "role" in c["delta"]:
            continue
        text += c["delta"]["content"].encode()
        entry_bytes += bytes(b for x in c["logprobs"]["content"] for b in x["bytes"])
        assert entry_bytes == text  # aligned at every chunk
    assert text.decode() == answer_text(ids("<user>hi<assistant>"), GREEDY, 25) and "é" in text.decode()


def test_a_stop_string_cuts_the_logprobs_too(api):
    full = chat(api, messages=[{"role": "user", "content": "hi"}], max_tokens=12)["choices"][0]["message"]["content"]
    stop = full[4:6]
    r = chat(api, messages=[{"role": "user", "content": "hi"}], max_tokens=12, logprobs=True, stop=stop)
    choice = r["choices"][0]
    assert choice["message"]["content"] == full[:full.index(stop)] and choice["finish_reason"] == "stop"
    got = bytes(b for e in choice["logprobs"]["content"] for b in e["bytes"]).decode()
    assert got == choice["message"]["content"]


def test_completion_logprobs_legacy_shape(api):
    r = complete(api, prompt="ba", max_tokens=8, logprobs=2)
    lp = r["choices"][0]["logprobs"]
    assert set(lp) == {"tokens", "token_logprobs", "top_logprobs", "text_offset"}
    assert len(lp["tokens"]) == len(lp["token_logprobs"]) == len(lp["top_logprobs"]) == len(lp["text_offset"]) == 8
    assert lp["text_offset"][0] == 0 and lp["text_offset"] == sorted(lp["text_offset"])
    for tok, top in zip(lp["tokens"], lp["top_logprobs"]):
        assert tok in top and len(top) <= 3
    streamed = stream(api, "/v1/completions", {"prompt": "ba", "max_tokens": 8, "logprobs": 0})
    pieces = [e["choices"][0] for e in streamed if not e["choices"][0]["finish_reason"]]
    assert sum(len(p["logprobs"]["tokens"]) for p in pieces) == 8
    offsets = [o for p in pieces for o in p["logprobs"]["text_offset"]]
    assert offsets == lp["text_offset"]


def test_no_logprobs_unless_asked(api):
    r = chat(api, messages=[{"role": "user", "content": "hi"}], max_tokens=3, logprobs=False)
    assert r["choices"][0]["logprobs"] is None and api.session.requests[-1].decoding.top_logprobs is None


def answer_events(tokens_per_call: list[list[int]], stops: list[str]) -> list[tuple]:
    """What serving.answer.Answer pushes for these on_tokens calls (each after on_logprobs for its tokens) and the
    finish."""
    from pipeinfer.serving.answer import Answer
    events: list = []
    job = SimpleNamespace(stops=stops, push=events.append, cancelled=threading.Event(), n_predict=99, meter=None,
                          prompt_tokens=[1], request_id="r", t_queued_s=0.0, t_first_token_s=0.0)
    ans = Answer(job, FakeTokenizer())
    k = 0
    for tokens in tokens_per_call:
        ans.on_logprobs([logprob_of(t, k + i, 0) for i, t in enumerate(tokens)])
        k += len(tokens)
        ans.on_tokens(tokens)
    ans.finish(Stats(n_generated=k), lambda _msg: None, None)
    return events


def reported(events) -> list[tuple[bytes, bytes]]:
    """(the text's bytes, the bytes of the tokens whose entries it carries) of each text event."""
    return [(ev.text.encode(), bytes(b for e in ev.logprobs for b in e["bytes"])) for ev in events
            if isinstance(ev, TextEvent)]


def test_a_token_the_stop_string_cuts_in_part_is_not_reported():
    """" hello" is one token: a stop string "ll" cuts it; the text before the stop goes out, its entry does not."""
    out = reported(answer_events([[ord("a")], [257], [ord("b")]], ["ll"]))
    assert b"".join(t for t, _ in out) == b"a he" and b"".join(e for _, e in out) == b"a"


def test_entries_wait_for_held_text_and_then_go_with_it():
    """"x" could begin the stop string "xyz": its text and its entry wait, and go out together once "q" shows the
    stop does not follow; a token with no text (BOS) goes with the next release."""
    out = reported(answer_events([[ord("x")], [BOS], [ord("q")], [0xC3], [0xA9]], ["xyz"]))
    assert out == [(b"xq", b"xq"), ("é".encode(), "é".encode())]


def test_invalid_utf8_never_holds_entries_back():
    out = reported(answer_events([[0xFF], [ord("a")], [0xC3]], []))
    assert len(b"".join(e for _, e in out)) == 3  # every token reported by the end


def test_a_choice_that_fails_fails_the_request_and_stops_the_others(api, monkeypatch):
    """The fake scheduler refuses a prompt over 400 tokens (as a real one whose context is short); the other
    choice, still generating, is stopped."""
    monkeypatch.setattr(api.session.sched, "step_s", 0.01)
    r = api.client.post("/v1/completions", json={"model": "fake", "prompt": ["ok", "x" * 401], "max_tokens": 100})
    assert r.status_code == 500 and r.json()["error"]["message"] == "does not fit"
    ok = next(q for q in api.session.requests if len(q.prompt) == 3)
    assert ok.should_stop()
    assert wait_for(lambda: not api.session.sched.running), "a choice still generates"


def wait_for(check, timeout: float = 10) -> bool:
    deadline = time.monotonic() + timeout
    while not check():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.01)
    return True


# ------------------------------------------------------------------------------------ constraints
@pytest.fixture
def no_lltokenizer(monkeypatch):
    """engine/grammar's compile_constraint as it is, without llguidance's tokenizer (the fake has no vocab)."""
    from pipeinfer.engine import grammar
    monkeypatch.setattr(grammar, "lltokenizer", lambda tok: None)


SCHEMA = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}


@pytest.mark.parametrize("fields, constraint", [
    ({"response_format": {"type": "text"}}, None),
    ({"response_format": {"type": "json_object"}}, Constraint("json_object")),
    ({"response_format": {"type": "json_object", "schema": SCHEMA}}, Constraint("json_schema", json.dumps(SCHEMA))),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": SCHEMA, "strict": True}}},
     Constraint("json_schema", json.dumps(SCHEMA), True)),
    ({"grammar": 'root ::= "yes" | "no"'}, Constraint("gbnf", 'root ::= "yes" | "no"')),
    ({"json_schema": SCHEMA}, Constraint("json_schema", json.dumps(SCHEMA))),
])
def test_constraints_reach_the_job(api, no_lltokenizer, fields, constraint):
    chat(api, messages=[{"role": "user", "content": "hi"}], max_tokens=2, **fields)
    assert api.session.requests[-1].decoding.constraint == constraint


@pytest.mark.parametrize("fields, param, words", [
    ({"response_format": {"type": "xml"}}, "response_format.type", "unknown type 'xml'"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}}, "response_format.json_schema.schema",
     "required"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "bogus"}}}},
     "response_format", "invalid schema"),
    ({"grammar": "root ::= missing"}, "grammar", "invalid GBNF grammar"),
    ({"json_schema": {"type": 5}}, "json_schema", "invalid schema"),
    ({"grammar": 'root ::= "a"', "response_format": {"type": "json_object"}}, "grammar", "one constraint"),
    ({"response_format": "json"}, "response_format", "valid dictionary"),
    ({"response_format": {}}, "response_format.type", "required"),
])
def test_bad_constraints_are_400_before_any_token(api, no_lltokenizer, fields, param, words):
    assert_error(chat(api, 400, messages=[{"role": "user", "content": "hi"}], **fields), param, in_message=words)
    assert api.session.requests == []


def test_constraint_error_from_the_compiler_is_a_400(api, monkeypatch):
    """Whatever compile_constraint refuses (ConstraintError) is the request's 400, naming the field it came in."""
    from pipeinfer.engine import grammar

    def refuse(constraint, lltok, field=None):
        raise grammar.ConstraintError(f"{field}: refused by the fake")
    monkeypatch.setattr(grammar, "lltokenizer", lambda tok: None)
    monkeypatch.setattr(grammar, "compile_constraint", refuse)
    assert_error(complete(api, 400, prompt="x", response_format={"type": "json_object"}), "response_format",
                 in_message="refused by the fake")
    assert api.session.requests == []


# ------------------------------------------------------------------------------------ every field's error
@pytest.mark.parametrize("path, fields, param, words", [
    ("/v1/completions", {"max_tokens": 0}, "max_tokens", "greater than or equal to 1"),
    ("/v1/completions", {"temperature": "hot"}, "temperature", "number"),
    ("/v1/completions", {"temperature": 2.5}, "temperature", "less than or equal to 2"),
    ("/v1/completions", {"top_p": 0}, "top_p", "greater than 0"),
    ("/v1/completions", {"top_k": -1}, "top_k", "greater than or equal to 0"),
    ("/v1/completions", {"seed": "x"}, "seed", "integer"),
    ("/v1/completions", {"stop": 5}, "stop", "a string or a list of strings"),
    ("/v1/completions", {"stop": ["a", 3]}, "stop", "a string or a list of strings"),
    ("/v1/completions", {"n": 0}, "n", "greater than or equal to 1"),
    ("/v1/completions", {"stream": "maybe"}, "stream", "boolean"),
    ("/v1/completions", {"stream_options": {"include_usage": "x"}}, "stream_options.include_usage", "boolean"),
    ("/v1/completions", {"logit_bias": {"12": 101}}, "logit_bias.12", "less than or equal to 100"),
    ("/v1/completions", {"logit_bias": {"x": 1}}, "logit_bias", "'x' is not a token id"),
    ("/v1/completions", {"logit_bias": {"-3": 1}}, "logit_bias", "not a token id"),
    ("/v1/completions", {"logit_bias": {str(N_VOCAB): 1}}, "logit_bias", "not in the vocabulary"),
    ("/v1/completions", {"logit_bias": [1, 2]}, "logit_bias", "valid dictionary"),
    ("/v1/completions", {"frequency_penalty": 2.5}, "frequency_penalty", "less than or equal to 2"),
    ("/v1/completions", {"presence_penalty": -3}, "presence_penalty", "greater than or equal to -2"),
    ("/v1/completions", {"logprobs": 6}, "logprobs", "less than or equal to 5"),
    ("/v1/completions", {"echo": True}, "echo", "not supported"),
    ("/v1/completions", {"suffix": "end"}, "suffix", "not supported"),
    ("/v1/completions", {"best_of": 3}, "best_of", "not supported"),
    ("/v1/completions", {"max_tokens": 10_000}, "max_tokens", "exceed the context"),
    ("/v1/chat/completions", {"top_logprobs": 21}, "top_logprobs", "less than or equal to 20"),
    ("/v1/chat/completions", {"top_logprobs": 2}, "top_logprobs", "needs logprobs: true"),
    ("/v1/chat/completions", {"logprobs": "yes please"}, "logprobs", "boolean"),
    ("/v1/chat/completions", {"max_completion_tokens": 10_000}, "max_completion_tokens", "exceed the context"),
    ("/v1/chat/completions", {"messages": []}, "messages", "at least 1"),
    ("/v1/chat/completions", {"messages": [{"role": "wizard", "content": "x"}]}, "messages.0.role", "unknown role"),
    ("/v1/chat/completions", {"messages": [{"content": "x"}]}, "messages.0.role", "required"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": 5}]}, "messages.0.content", "content parts"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": [
        {"type": "text", "text": "a"}, {"type": "image_url", "image_url": {"url": "x"}}]}]}, "messages.0.content.1",
     "only text parts"),
])
def test_each_malformed_field_is_a_400_naming_it(api, path, fields, param, words):
    body = {"prompt": "x"} if path == "/v1/completions" else {"messages": [{"role": "user", "content": "x"}]}
    assert_error(post(api, path, {"model": "fake", **body, **fields}, 400), param, in_message=words)
    assert api.session.requests == []


def test_bodies_that_are_not_json(api):
    for raw in (b"{not json", b"[1, 2]", b""):
        r = api.client.post("/v1/chat/completions", content=raw, headers={"Content-Type": "application/json"})
        assert r.status_code == 400, r.text
        assert r.json()["error"]["type"] == "invalid_request_error" and r.json()["error"]["message"]
    assert "not valid JSON" in api.client.post("/v1/completions", content=b"{x",
                                               headers={"Content-Type": "application/json"}).json()["error"]["message"]
    assert complete(api, prompt="x", max_tokens=2)["usage"]["completion_tokens"] == 2  # and it serves on


def test_unknown_routes_and_wrong_methods_answer_in_openai_shape(api):
    r = api.client.post("/v1/embeddings", json={})
    assert r.status_code == 404
    assert_error(r.json(), None, code="not_found", in_message="POST /v1/embeddings")
    r = api.client.get("/v1/chat/completions")
    assert r.status_code == 405 and r.headers["allow"] == "POST"
    assert_error(r.json(), None, code="method_not_allowed", in_message="GET")


def test_models_report_the_context(api):
    r = api.client.get("/v1/models").json()
    assert r["object"] == "list"
    (m,) = r["data"]
    assert m["id"] == "fake" and m["object"] == "model" and m["max_model_len"] == N_CTX
    assert m["meta"] == {"n_ctx": N_CTX, "n_ctx_train": None, "n_vocab": N_VOCAB}


def test_tokenize_and_detokenize(api):
    assert post(api, "/tokenize", {"content": "hé"}) == {"tokens": list("hé".encode())}
    assert post(api, "/tokenize", {"content": "a", "add_special": True}) == {"tokens": [BOS, ord("a")]}
    pieces = post(api, "/tokenize", {"content": "aé", "with_pieces": True})["tokens"]
    assert pieces == [{"id": 97, "piece": "a"}, {"id": 0xC3, "piece": [0xC3]}, {"id": 0xA9, "piece": [0xA9]}]
    assert post(api, "/detokenize", {"tokens": [104, 256, 258]}) == {"content": "hé日本"}
    assert_error(post(api, "/detokenize", {"tokens": [1, N_VOCAB]}, 400), "tokens", in_message="not in the vocabulary")
    assert_error(post(api, "/detokenize", {"tokens": "abc"}, 400), "tokens", in_message="token ids")
    assert_error(post(api, "/tokenize", {}, 400), "content", in_message="required")


# ------------------------------------------------------------------------------------ a request's jobs, all or none
class RefusingGenerator:
    """Takes `room` jobs, then says the queue is full."""
    parallel, fatal = 1, None

    def __init__(self, room: int):
        self.room, self.jobs = room, []

    def submit(self, job) -> None:
        if len(self.jobs) == self.room:
            raise RequestError(503, "the queue is full", code="queue_full")
        self.jobs.append(job)


def test_a_request_whose_choices_do_not_all_fit_in_the_queue_is_refused_whole():
    gen = RefusingGenerator(2)
    app = create_app(ServeConfig("fake", N_CTX, 4, DEFAULT_MAX), gen, FakeTokenizer(), chat_template)
    with TestClient(app) as client:
        r = client.post("/v1/completions", json={"model": "fake", "prompt": "x", "n": 3, "temperature": 1})
    assert r.status_code == 503 and r.headers["retry-after"] == "1" and r.json()["error"]["code"] == "queue_full"
    assert len(gen.jobs) == 2 and all(job.cancelled.is_set() for job in gen.jobs)


def test_each_api_module_registers_only_its_own_routes():
    """The app wires every API; an API module registers its own routes, and takes nothing of another API's module
    (what they share is in submit.py and sse.py)."""
    import ast
    from pathlib import Path

    from fastapi import FastAPI

    from pipeinfer.frontend import anthropic_api, openai_api, responses_api
    own = {openai_api.register_openai: {"/v1/completions", "/v1/chat/completions"},
           anthropic_api.register_anthropic: {"/v1/messages", "/v1/messages/count_tokens"},
           responses_api.register_responses: {"/v1/responses"}}
    for register, paths in own.items():
        app = FastAPI()
        before = {r.path for r in app.routes}
        register(app, ServeConfig("fake", N_CTX, 4, DEFAULT_MAX), RefusingGenerator(1), FakeTokenizer(), chat_template)
        assert {r.path for r in app.routes} - before == paths, register.__name__
    for module, other in ((anthropic_api, "responses_api"), (responses_api, "anthropic_api")):
        tree = ast.parse(Path(module.__file__).read_text())
        taken = {n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)}
        assert other not in taken, f"{module.__name__} imports {other}"


# ------------------------------------------------------------------------------------ the openai package
@pytest.fixture(scope="module")
def openai_client(served):
    import httpx2
    from openai import OpenAI
    with serving(served.app) as url:
        yield OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0, http_client=httpx2.Client(timeout=30))


def test_the_openai_package_reads_every_shape(openai_client):
    import openai
    c = openai_client
    r = c.completions.create(model="fake", prompt=["ba", "ki"], max_tokens=6, n=2, temperature=1.0, seed=0,
                             logprobs=1)
    assert [ch.index for ch in r.choices] == [0, 1, 2, 3] and r.usage.completion_tokens == 24
    assert r.choices[2].text == answer_text(ids("ki"), SamplingParams(1.0, 0, 1.0, 0), 6)
    assert len(r.choices[0].logprobs.tokens) == 6
    msgs = [{"role": "user", "content": "hi"}]
    whole = c.chat.completions.create(model="fake", messages=msgs, max_tokens=7, logprobs=True, top_logprobs=3)
    assert [len(e.top_logprobs) for e in whole.choices[0].logprobs.content] == [3] * 7
    chunks = list(c.chat.completions.create(model="fake", messages=msgs, max_tokens=7, n=2, stream=True,
                                            logprobs=True, stream_options={"include_usage": True}))
    for j in range(2):
        text = "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices and ch.choices[0].index == j)
        assert text == whole.choices[0].message.content
    assert chunks[-1].usage.completion_tokens == 14
    with pytest.raises(openai.BadRequestError) as e:
        c.chat.completions.create(model="fake", messages=msgs, response_format={"type": "yaml"})
    assert e.value.body["param"] == "response_format.type"
    assert c.chat.completions.create(model="other", messages=msgs, max_tokens=2).model == "fake"
    assert [m.id for m in c.models.list().data] == ["fake"]


# ------------------------------------------------------------------------------------ model names: --alias
ALIASES = ("gpt-4o-mini", "fake", "claude-3-5-haiku-latest")


@pytest.fixture(scope="module")
def aliased():
    """An app serving the model "fake" also as ALIASES (`serve --alias`), over this module's fake session."""
    session = FakeSession()
    gen = Generator(session, max_queue=64, log=lambda _msg: None)
    gen.start()
    app = create_app(ServeConfig("fake", N_CTX, 4, DEFAULT_MAX, aliases=ALIASES), gen, session.tok, chat_template)
    with TestClient(app) as client:
        yield client
    gen.stop()


def test_models_list_the_id_then_each_alias_once(aliased):
    data = aliased.get("/v1/models").json()["data"]
    assert [m["id"] for m in data] == ["fake", "gpt-4o-mini", "claude-3-5-haiku-latest"]
    assert all(m["max_model_len"] == N_CTX and m["meta"]["n_ctx"] == N_CTX for m in data)


@pytest.mark.parametrize("asked, named", [("gpt-4o-mini", "gpt-4o-mini"), ("claude-3-5-haiku-latest",
                                          "claude-3-5-haiku-latest"), ("fake", "fake"), ("no-such-model", "fake")])
def test_every_api_answers_any_model_and_names_a_listed_one(aliased, asked, named):
    """As llama-server: any name gets the answer; the reply names the model as asked when that name is listed (the
    id or an alias), else by its id. The same on the OpenAI, Anthropic and Responses routes, streamed or not."""
    user = [{"role": "user", "content": "hi"}]
    calls = {"/v1/completions": {"prompt": "ba", "max_tokens": 3},
             "/v1/chat/completions": {"messages": user, "max_tokens": 3},
             "/v1/messages": {"messages": user, "max_tokens": 3},
             "/v1/responses": {"input": "hi", "max_output_tokens": 3}}
    for path, body in calls.items():
        r = aliased.post(path, json={"model": asked, **body})
        assert r.status_code == 200, (path, r.text)
        assert r.json()["model"] == named, path
    with aliased.stream("POST", "/v1/chat/completions", json={"model": asked, "stream": True, **calls[
            "/v1/chat/completions"]}) as r:
        chunks = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: {")]
    assert chunks and {c["model"] for c in chunks} == {named}
    with aliased.stream("POST", "/v1/messages", json={"model": asked, "stream": True, **calls["/v1/messages"]}) as r:
        starts = [json.loads(line[6:]) for line in r.iter_lines()
                  if line.startswith("data: ") and "message_start" in line]
    assert [s["message"]["model"] for s in starts] == [named]
    r = aliased.post("/v1/messages/count_tokens", json={"model": asked, "messages": user})
    assert r.status_code == 200 and r.json()["input_tokens"] > 0


def test_without_aliases_any_model_is_answered_by_the_id(api):
    assert complete(api, prompt="x", max_tokens=2)["model"] == "fake"
    assert post(api, "/v1/completions", {"model": "gpt-4", "prompt": "x", "max_tokens": 2})["model"] == "fake"
    assert [m["id"] for m in api.client.get("/v1/models").json()["data"]] == ["fake"]
