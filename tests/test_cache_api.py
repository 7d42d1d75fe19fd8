"""The prompt cache as `pipeinfer serve`'s clients see it, without ranks (tests/api_fakes.py's scripted session
with a prompt cache's arithmetic; the real app, generation thread and SDKs): llama-server's per-request
`cache_prompt` on every generating route, down to the session's request (a bad one a 400 naming it); the prompt
tokens taken from the cache (Stats.n_cached) in each API's usage; the cache on /health and /metrics, directly and
through a supervisor (rank 0's Ready and Done carry it)."""
from __future__ import annotations

import shutil

import pytest

from api_fakes import scripted_server, say
from pipeinfer.core.sampling import SamplingParams
from pipeinfer.serving import link
from pipeinfer.serving.job import DoneEvent
from pipeinfer.frontend.openai_reply import CHAT, Reply

CACHE_KEYS = {"enabled", "entries", "tokens", "hits", "tokens_reused", "cells_used", "cells"}


@pytest.fixture(scope="module")
def cached():
    with scripted_server(2048, 64, prompt_cache=True) as srv:
        yield srv


@pytest.fixture
def api(cached):
    cached.session.requests.clear()
    return cached


def _post(api, path: str, body: dict, status: int = 200) -> dict:
    r = api.http.post(api.url + path, json={"model": "fake", **body})
    assert r.status_code == status, r.text
    return r.json()


ROUTES = [  # (path, the body but cache_prompt)
    ("/v1/chat/completions", {"messages": say("hello"), "max_tokens": 8}),
    ("/v1/completions", {"prompt": "say:hello", "max_tokens": 8}),
    ("/v1/messages", {"messages": say("hello"), "max_tokens": 8}),
    ("/v1/responses", {"input": "say:hello", "max_output_tokens": 8}),
]


# ------------------------------------------------------------------------------------ cache_prompt
@pytest.mark.parametrize("path, body", ROUTES, ids=[p for p, _ in ROUTES])
def test_cache_prompt_reaches_the_sessions_request(api, path, body):
    for given, expected in ((False, False), (True, True), (None, True), ("absent", True)):
        fields = {} if given == "absent" else {"cache_prompt": given}
        _post(api, path, {**body, **fields})
        assert api.session.requests[-1].cache_prompt is expected, (given, path)


@pytest.mark.parametrize("path, body", ROUTES, ids=[p for p, _ in ROUTES])
@pytest.mark.parametrize("value", ["false", 0, 1, "yes", [], {}])
def test_a_cache_prompt_that_is_no_boolean_is_a_400_naming_it(api, path, body, value):
    err = _post(api, path, {**body, "cache_prompt": value}, 400)
    if path == "/v1/messages":  # Anthropic's shape
        assert err["type"] == "error" and err["error"]["type"] == "invalid_request_error", err
        assert err["error"]["message"].startswith("cache_prompt: "), err
    else:  # OpenAI's
        assert set(err["error"]) == {"message", "type", "param", "code"}, err
        assert err["error"]["param"] == "cache_prompt" and err["error"]["type"] == "invalid_request_error", err
        assert err["error"]["message"].startswith("cache_prompt: ") and "boolean" in err["error"]["message"], err
    assert not api.session.requests  # refused before anything reached the pipeline


# ------------------------------------------------------------------------------------ usage
def _twice(api, send) -> tuple:
    """`send()` twice; its results and each time's prompt (the second's head all in the cache: all but its last
    token comes from there)."""
    first = send()
    second = send()
    assert api.session.requests[-1].prompt == api.session.requests[-2].prompt
    return first, second, len(api.session.requests[-1].prompt)


def test_chat_usage_carries_the_cached_tokens(api):
    text = "chat usage whole"
    first, second, n = _twice(api, lambda: api.oai.chat.completions.create(model="fake", messages=say(text)))
    assert second.usage.prompt_tokens == n and second.usage.prompt_tokens_details.cached_tokens == n - 1
    assert first.usage.prompt_tokens_details.cached_tokens < n - 1
    off = api.oai.chat.completions.create(model="fake", messages=say(text), extra_body={"cache_prompt": False})
    assert off.usage.prompt_tokens_details.cached_tokens == 0 and off.choices[0].message.content == text


def test_a_streamed_answers_usage_carries_the_cached_tokens(api):
    def send():
        return list(api.oai.chat.completions.create(model="fake", messages=say("chat usage streamed"), stream=True,
                                                    stream_options={"include_usage": True}))
    _first, second, n = _twice(api, send)
    assert second[-1].choices == [] and second[-1].usage.prompt_tokens_details.cached_tokens == n - 1


def test_completions_usage_carries_the_cached_tokens(api):
    _first, second, n = _twice(api, lambda: _post(api, "/v1/completions", {"prompt": "say:completion usage"}))
    assert second["usage"]["prompt_tokens_details"] == {"cached_tokens": n - 1}


def test_anthropic_usage_reads_the_cached_tokens_from_the_cache(api):
    _first, second, n = _twice(api, lambda: api.claude.messages.create(model="fake", max_tokens=50,
                                                                       messages=say("anthropic usage")))
    # Anthropic's split: input_tokens are the prompt's tokens not read from the cache
    assert (second.usage.cache_read_input_tokens, second.usage.input_tokens) == (n - 1, 1)
    assert second.usage.cache_creation_input_tokens == 0

    with api.claude.messages.stream(model="fake", max_tokens=50, messages=say("anthropic usage")) as s:
        final = s.get_final_message()
    assert final.usage.cache_read_input_tokens == n - 1 and final.usage.input_tokens == 1


def test_responses_usage_carries_the_cached_tokens(api):
    _first, second, n = _twice(api, lambda: api.oai.responses.create(model="fake", input="say:responses usage"))
    assert second.usage.input_tokens == n and second.usage.input_tokens_details.cached_tokens == n - 1
    events = list(api.oai.responses.create(model="fake", input="say:responses usage", stream=True))
    assert events[-1].response.usage.input_tokens_details.cached_tokens == n - 1


def test_cache_prompt_false_neither_reads_nor_leaves_the_cache(api):
    before = api.session.sched.cache_load()
    r = _post(api, "/v1/chat/completions", {"messages": say("never cached"), "cache_prompt": False})
    r = _post(api, "/v1/chat/completions", {"messages": say("never cached"), "cache_prompt": False})
    assert r["usage"]["prompt_tokens_details"] == {"cached_tokens": 0}
    after = api.session.sched.cache_load()
    assert (after["entries"], after["hits"]) == (before["entries"], before["hits"])


def test_several_choices_count_each_prompts_cached_tokens_once():
    reply = Reply(CHAT, "id", "fake", n_choices=4, prompt_tokens=20, per_prompt=2)
    assert reply.cached([5, 3, 0, 7]) == 3 + 0   # each prompt's fewest among its choices
    assert Reply(CHAT, "id", "fake", n_choices=2).cached([4, 6]) == 4 + 6


# ------------------------------------------------------------------------------------ /health and /metrics
def _metrics(text: str) -> dict:
    from prometheus_client.parser import text_string_to_metric_families
    return {s.name: s.value for family in text_string_to_metric_families(text) for s in family.samples
            if not s.labels}


def test_health_and_metrics_show_the_prompt_cache(api):
    _post(api, "/v1/chat/completions", {"messages": say("health and metrics")})
    load = api.session.sched.cache_load()
    health = api.http.get(api.url + "/health").json()
    assert set(health["prompt_cache"]) == CACHE_KEYS and health["prompt_cache"] == load
    assert load["enabled"] and load["entries"] > 0 and load["cells"] == 2048
    m = _metrics(api.http.get(api.url + "/metrics").text)
    assert m["pipeinfer:prompt_cache_entries"] == load["entries"]
    assert m["pipeinfer:prompt_cache_tokens"] == load["tokens"]
    assert m["pipeinfer:kv_cells_used"] == load["cells_used"] and m["pipeinfer:kv_cells"] == 2048
    assert m["pipeinfer:prompt_cache_hits_total"] == load["hits"] > 0
    assert m["pipeinfer:prompt_cache_tokens_reused_total"] == load["tokens_reused"] > 0
    assert m["pipeinfer:prompt_tokens_cached_total"] > 0   # the finished generations' Stats.n_cached
    state = api.http.get(api.url + "/state").json()        # the web page's numbers
    assert state["load"]["prompt_cache"] == load


# ------------------------------------------------------------------------------------ through a supervisor
def test_a_supervisor_relays_cache_prompt_and_rank0s_prompt_cache(tmp_path):
    """run_attached over a Unix socket (a fake session that reports a prompt cache): Ready carries the cache,
    each Done the cache as the request left it; a job's cache_prompt false reaches rank 0's request."""
    from link_fakes import WAIT_S, FakeSession, LetterTokenizer, attach_rank0, outcome

    from pipeinfer.core.sampling import SamplingParams
    from pipeinfer.frontend.metrics import _Now
    from pipeinfer.supervisor.resume import StdoutJob
    from pipeinfer.supervisor.supervisor import Supervisor

    class CachingSession(FakeSession):
        def __init__(self):
            super().__init__()
            self.cache_prompts: list[bool] = []

        def load(self) -> dict:
            n = len([r for r in self.requests if r not in self.sched.running])
            return {"generating": len(self.sched.running), "waiting": 0,
                    "prompt_cache": {"enabled": True, "entries": n, "tokens": 3 * n, "hits": n, "tokens_reused": 2 * n,
                                     "cells_used": 5 * n, "cells": 512}}

        def request(self, prompt, *, cache_prompt=True, **kw):
            self.cache_prompts.append(cache_prompt)
            return super().request(prompt, **kw)

    session = CachingSession()
    listener, conn, rank0 = attach_rank0(tmp_path, session)
    sup = Supervisor(["localhost"], [], LetterTokenizer(), log=lambda _msg: None, on_fatal=lambda _why: None)
    try:
        sup._attach(*sup.lifecycle.greet(conn))
        assert sup.load()["prompt_cache"]["entries"] == 0 and sup.load()["prompt_cache"]["cells"] == 512
        for cache_prompt in (True, False):
            job = StdoutJob([1, 2], 3, SamplingParams(), None, False, as_json=True, cache_prompt=cache_prompt)
            sup.submit(job)
            assert isinstance(outcome(job), DoneEvent)
        assert session.cache_prompts == [True, False]
        pc = sup.load()["prompt_cache"]
        assert set(pc) == CACHE_KEYS and (pc["entries"], pc["tokens_reused"], pc["cells_used"]) == (2, 4, 10)
        families = {f.name: f for f in _Now(sup).collect()}
        assert families["pipeinfer:prompt_cache_entries"].samples[0].value == 2
        assert families["pipeinfer:kv_cells"].samples[0].value == 512
    finally:
        sup.stop()
        listener.close()
        shutil.rmtree(sup.work_dir, ignore_errors=True)
    rank0.join(WAIT_S)
    assert not rank0.is_alive()


def test_the_link_carries_the_cache_and_cache_prompt():
    job = link.Generate(1, [2], [], 3, SamplingParams(), cache_prompt=False)
    assert link.decode(link.encode(job), link.TO_RANK0) == job
    done = link.Done(1, {}, {"enabled": True, "entries": 1})
    assert link.decode(link.encode(done), link.TO_SUPERVISOR) == done
    line = '{"op":"done","id":1,"stats":{}}'  # a Done without it: none
    assert link.decode(line, link.TO_SUPERVISOR).prompt_cache is None


def test_metrics_show_the_batching_counters_health_has():
    from pipeinfer.frontend.metrics import _Now

    class Loaded:
        def load(self):
            return {"batching": {"batch_rows": 3, "shared_decodes": 7, "shared_rows": 19, "draft_rides": 2,
                                 "riders_dropped": 1}}
    m = {s.name: s.value for f in _Now(Loaded()).collect() for s in f.samples}
    assert (m["pipeinfer:batch_rows"], m["pipeinfer:shared_decodes_total"], m["pipeinfer:shared_rows_total"],
            m["pipeinfer:draft_rides_total"], m["pipeinfer:riders_dropped_total"]) == (3, 7, 19, 2, 1)
    assert not any(f.name.startswith("pipeinfer:shared") for f in _Now(type("Bare", (), {"load": dict})()).collect())
