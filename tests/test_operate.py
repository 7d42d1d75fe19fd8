"""Operating `pipeinfer serve` without ranks (the real app and generation thread over tests/api_fakes.py's
sessions): /metrics against a load of known size, API keys with the real openai and anthropic clients, HTTPS
with a self-signed certificate, the body and concurrency limits in each API's error shape, a client that stops
reading, and the options of `serve`."""
from __future__ import annotations

import gc
import json
import socket
import ssl
import subprocess
import time
from types import SimpleNamespace

import pytest
from fastapi.testclient import TestClient

from api_fakes import CountingSession, ScriptedSession, serving, simple_template
from pipeinfer.frontend.access import Access, error_body, exposure_warning, read_keys
from pipeinfer.feeders.generator import Generator
from pipeinfer.frontend.app import ServeConfig, create_app

N_CTX = 4096
KEYS = ("sk-first-key", "sk-second-key")


def make_app(session, access: Access | None = None, n_ctx: int = N_CTX, max_queue: int = 64):
    gen = Generator(session, max_queue=max_queue, log=lambda _msg: None)
    gen.start()
    return create_app(ServeConfig("fake", n_ctx, 4, 16), gen, session.tok, simple_template, access=access), gen


def chat(text: str, max_tokens: int = 8, stream: bool = False) -> dict:
    return {"model": "fake", "messages": [{"role": "user", "content": text}], "max_tokens": max_tokens,
            "stream": stream}


def metrics_of(text: str) -> dict:
    """{(sample name, frozenset(labels)): value} of a /metrics page, parsed by prometheus-client's own parser."""
    from prometheus_client.parser import text_string_to_metric_families
    return {(s.name, frozenset(s.labels.items())): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


# ------------------------------------------------------------------------------------ /metrics
def test_metrics_count_a_known_load():
    """10 requests of 8 tokens each, every answer max_tokens long: the counters are the load's, the acceptance
    ratio the Stats' one, every latency observed once per request; a refusal and an unknown route counted."""
    session = CountingSession()
    app, gen = make_app(session)
    try:
        with TestClient(app) as client:
            for i in range(10):
                r = client.post("/v1/chat/completions", json=chat(f"request {i}", 8, stream=i % 2 == 1))
                assert r.status_code == 200, r.text
            assert client.get("/nowhere").status_code == 404
            assert client.post("/v1/chat/completions", json=chat("x", 10**6)).status_code == 400
            page = client.get("/metrics")
    finally:
        gen.stop()
    assert page.status_code == 200 and page.headers["content-type"].startswith("text/plain")
    m = metrics_of(page.text)
    prompts = sum(len(r.prompt) for r in session.requests)
    assert m[("pipeinfer:generation_tokens_total", frozenset())] == 80
    assert m[("pipeinfer:prompt_tokens_total", frozenset())] == prompts
    assert m[("pipeinfer:requests_total", frozenset({("route", "/v1/chat/completions"), ("status", "200")}))] == 10
    assert m[("pipeinfer:requests_total", frozenset({("route", "/v1/chat/completions"), ("status", "400")}))] == 1
    assert m[("pipeinfer:requests_total", frozenset({("route", "other"), ("status", "404")}))] == 1
    assert m[("pipeinfer:request_success_total", frozenset({("finished_reason", "length")}))] == 10
    assert m[("pipeinfer:draft_tokens_total", frozenset())] == 160
    assert m[("pipeinfer:accepted_draft_tokens_total", frozenset())] == 80
    assert m[("pipeinfer:acceptance_ratio", frozenset())] == pytest.approx(0.5)  # Stats.acceptance_rate: 8 / 16
    assert m[("pipeinfer:cancelled_runs_total", frozenset())] == 20
    assert m[("pipeinfer:speculative_runs_total", frozenset())] == 80
    assert m[("pipeinfer:draft_level_proposed_tokens_total", frozenset({("level", "ngram")}))] == 80
    assert m[("pipeinfer:draft_level_kept_tokens_total", frozenset({("level", "ngram")}))] == 40
    assert m[("pipeinfer:draft_level_busy_seconds_total", frozenset({("level", "a.gguf")}))] == pytest.approx(5.0)
    for h in ("time_to_first_token_seconds", "inter_token_latency_seconds", "e2e_request_latency_seconds"):
        assert m[(f"pipeinfer:{h}_count", frozenset())] == 10, h
    assert m[("pipeinfer:requests_generating", frozenset())] == 0
    assert m[("pipeinfer:requests_queued", frozenset())] == 0
    assert m[("pipeinfer:pipeline_up", frozenset())] == 1
    assert m.get(("pipeinfer:request_errors_total", frozenset())) == 0
    assert not [k for k in m if k[0] == "pipeinfer:requests_rejected_total"]  # none refused yet


def test_metrics_are_the_apps_own():
    """Two apps count apart; prometheus-client's global registry has none of them."""
    from prometheus_client import REGISTRY, generate_latest
    first, gen1 = make_app(CountingSession())
    second, gen2 = make_app(CountingSession())
    try:
        with TestClient(first) as a, TestClient(second) as b:
            assert a.post("/v1/chat/completions", json=chat("one", 5)).status_code == 200
            assert metrics_of(a.get("/metrics").text)[("pipeinfer:generation_tokens_total", frozenset())] == 5
            assert metrics_of(b.get("/metrics").text)[("pipeinfer:generation_tokens_total", frozenset())] == 0
    finally:
        gen1.stop()
        gen2.stop()
    assert b"pipeinfer:" not in generate_latest(REGISTRY)


def test_metrics_of_a_supervisor_and_the_stages():
    """The supervisor's re-forms and lost hosts, and a stage per slot (rank, host), from its load()."""
    from pipeinfer.frontend.metrics import ServerMetrics

    class Sup:
        parallel, fatal, on_done, slots = 2, None, None, ["node-a", "node-b"]

        def load(self):
            return {"queued": 0, "generating": 1, "ranks": 2, "degraded": True, "lost": ["rank 2 (host node-c)"],
                    "reforms": 3, "phase": "serving", "down_s": 12.5}
    from prometheus_client.parser import text_string_to_metric_families
    text = ServerMetrics(Sup()).exposition().decode()
    m = {(s.name, frozenset(s.labels.items())): s.value for f in text_string_to_metric_families(text)
         for s in f.samples}
    assert m[("pipeinfer:reforms_total", frozenset())] == 3
    assert m[("pipeinfer:lost_hosts", frozenset())] == 1
    assert m[("pipeinfer:down_seconds_total", frozenset())] == 12.5
    assert m[("pipeinfer:requests_generating", frozenset())] == 1
    assert m[("pipeinfer:stage_layers", frozenset({("rank", "1"), ("host", "node-b")}))] == -1


def test_metrics_of_the_stages_counters():
    """Each stage's counters (load()["stages"], HeadSession.stages' shape) as counters by rank and host."""
    from pipeinfer.frontend.metrics import ServerMetrics
    stages = [{"rank": 0, "host": "node-a", "n_reports": 0, "n_decoded": 40, "n_tokens": 90, "n_cancelled_before": 0,
               "n_cancelled_mid": 0, "n_kv_txns": 0, "t_busy_s": 1.25, "t_idle_s": 3.5, "bytes_sent": 123_456},
              {"rank": 1, "host": "node-b", "n_reports": 7, "n_decoded": 38, "n_tokens": 85, "n_cancelled_before": 2,
               "n_cancelled_mid": 1, "n_kv_txns": 4, "t_busy_s": 2.5, "t_idle_s": 2.0, "bytes_sent": 800}]

    class Gen:
        parallel, fatal, on_done = 2, None, None

        def load(self):
            return {"queued": 0, "generating": 1, "stages": stages}
    m = metrics_of(ServerMetrics(Gen()).exposition().decode())

    def at(name, rank, host, **more):
        return m[(f"pipeinfer:{name}", frozenset({("rank", str(rank)), ("host", host), *more.items()}))]
    assert at("stage_busy_seconds_total", 1, "node-b") == 2.5 and at("stage_busy_seconds_total", 0, "node-a") == 1.25
    assert at("stage_idle_seconds_total", 1, "node-b") == 2.0
    assert at("stage_decodes_total", 1, "node-b") == 38 and at("stage_batch_tokens_total", 0, "node-a") == 90
    assert at("stage_cancelled_total", 1, "node-b", when="before") == 2
    assert at("stage_cancelled_total", 1, "node-b", when="mid") == 1
    assert at("link_sent_bytes_total", 0, "node-a") == 123_456
    from prometheus_client.parser import text_string_to_metric_families
    types = {f.name: f.type for f in text_string_to_metric_families(ServerMetrics(Gen()).exposition().decode())}
    assert all(types[f"pipeinfer:{n}"] == "counter" for n in ("stage_busy_seconds", "stage_idle_seconds",
                                                              "stage_decodes", "stage_batch_tokens",
                                                              "stage_cancelled", "link_sent_bytes"))


# ------------------------------------------------------------------------------------ keys
@pytest.fixture(scope="module")
def keyed():
    import anthropic
    import openai
    session = ScriptedSession()
    app, gen = make_app(session, Access(api_keys=KEYS))
    with serving(app) as url:
        yield SimpleNamespace(url=url, openai=openai, anthropic=anthropic,
                              oai=lambda key: openai.OpenAI(base_url=f"{url}/v1", api_key=key, max_retries=0),
                              claude=lambda key: anthropic.Anthropic(base_url=url, api_key=key, max_retries=0))
    gen.stop()


def test_the_openai_client_with_a_key_is_served_and_without_one_refused(keyed):
    for key in KEYS:
        out = keyed.oai(key).chat.completions.create(model="fake", messages=[{"role": "user", "content": "say:hi"}])
        assert out.choices[0].message.content == "hi"
    for key in ("wrong", "sk-first-ke", KEYS[0] + "x"):
        with pytest.raises(keyed.openai.AuthenticationError) as e:
            keyed.oai(key).chat.completions.create(model="fake", messages=[{"role": "user", "content": "x"}])
        assert e.value.status_code == 401
        assert e.value.body["type"] == "invalid_request_error" and e.value.body["code"] == "invalid_api_key"
        assert key not in json.dumps(e.value.body)
    with pytest.raises(keyed.openai.AuthenticationError):
        keyed.oai("wrong").models.list()


def test_the_anthropic_client_with_a_key_is_served_and_without_one_refused(keyed):
    out = keyed.claude(KEYS[1]).messages.create(model="fake", max_tokens=16,
                                                messages=[{"role": "user", "content": "say:hello"}])
    assert out.content[0].text == "hello"
    with pytest.raises(keyed.anthropic.AuthenticationError) as e:
        keyed.claude("wrong").messages.create(model="fake", max_tokens=16, messages=[{"role": "user", "content": "x"}])
    assert e.value.status_code == 401
    assert e.value.body["type"] == "error" and e.value.body["error"]["type"] == "authentication_error"
    assert set(e.value.body["error"]) == {"type", "message"}
    assert "wrong" not in e.value.body["error"]["message"]


def test_keys_by_hand_health_open_the_rest_closed(keyed):
    import httpx2 as httpx
    with httpx.Client(base_url=keyed.url, timeout=30) as c:
        assert c.get("/health").status_code == 200
        for path in ("/metrics", "/v1/models", "/openapi.json", "/nowhere", "/state"):
            r = c.get(path)
            assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key", path
        for path in ("/", "/static/page.js"):  # the page holds no data: it sends the key the user gives it
            assert c.get(path).status_code != 401, path
        r = c.post("/v1/messages/count_tokens", json={"model": "fake", "messages": []})
        assert r.status_code == 401 and r.json()["error"]["type"] == "authentication_error"
        assert c.get("/v1/models", headers={"x-api-key": KEYS[0]}).status_code == 200  # either header, any route
        assert c.get("/metrics", headers={"Authorization": f"bearer {KEYS[1]}"}).status_code == 200
        assert c.get("/v1/models", headers={"Authorization": KEYS[0]}).status_code == 401  # no "Bearer "
        assert c.get("/v1/models", headers={"Authorization": "Bearer nope", "x-api-key": KEYS[0]}).status_code == 401
        m = metrics_of(c.get("/metrics", headers={"x-api-key": KEYS[0]}).text)
        assert m[("pipeinfer:requests_rejected_total", frozenset({("reason", "unauthorized")}))] >= 5


def test_key_files_and_the_exposure_warning(tmp_path):
    f = tmp_path / "keys"
    f.write_text("# the team's keys\nsk-a\n\n  sk-b  \nsk-a\n")
    assert read_keys(("sk-c",), str(f)) == ("sk-c", "sk-a", "sk-b")
    (tmp_path / "empty").write_text("# none\n")
    from pipeinfer.core.errors import UserError
    with pytest.raises(UserError, match="no key"):
        read_keys((), str(tmp_path / "empty"))
    with pytest.raises(UserError) as e:
        read_keys(("has a space",), None)
    assert "has a space" not in str(e.value)
    assert exposure_warning("0.0.0.0", ()) and exposure_warning("10.1.2.3", ())
    assert exposure_warning("0.0.0.0", ("k",)) is None
    assert all(exposure_warning(h, ()) is None for h in ("127.0.0.1", "::1", "localhost"))


# ------------------------------------------------------------------------------------ TLS
def test_https_with_a_self_signed_certificate(tmp_path):
    import httpx2 as httpx
    import openai
    cert, key = tmp_path / "cert.pem", tmp_path / "key.pem"
    subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", str(key), "-out",
                    str(cert), "-days", "1", "-subj", "/CN=localhost", "-addext",
                    "subjectAltName=IP:127.0.0.1,DNS:localhost"], check=True, capture_output=True)
    session = ScriptedSession()
    app, gen = make_app(session, Access(api_keys=KEYS[:1]))
    try:
        with serving(app, ssl_certfile=str(cert), ssl_keyfile=str(key)) as url:
            assert url.startswith("https://")
            http = httpx.Client(verify=ssl.create_default_context(cafile=str(cert)), timeout=30)
            client = openai.OpenAI(base_url=f"{url}/v1", api_key=KEYS[0], max_retries=0, http_client=http)
            out = client.chat.completions.create(model="fake", messages=[{"role": "user", "content": "say:secure"}])
            assert out.choices[0].message.content == "secure"
            chunks = client.chat.completions.create(model="fake", stream=True,
                                                    messages=[{"role": "user", "content": "say:streamed"}])
            assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == "streamed"
            with pytest.raises(openai.APIConnectionError):  # a client that does not trust it
                openai.OpenAI(base_url=f"{url}/v1", api_key=KEYS[0], max_retries=0).models.list()
            http.close()
    finally:
        gen.stop()


# ------------------------------------------------------------------------------------ limits
def test_a_body_beyond_the_limit_is_413_in_each_shape():
    app, gen = make_app(ScriptedSession(), Access(max_body_bytes=2048))
    try:
        with TestClient(app) as client:
            big = chat("y" * 4000)
            r = client.post("/v1/chat/completions", json=big)
            assert r.status_code == 413 and r.json()["error"]["code"] == "request_too_large", r.text
            r = client.post("/v1/messages", json={**big, "max_tokens": 4})
            assert r.status_code == 413 and r.json() == {"type": "error", "error": {
                "type": "request_too_large", "message": r.json()["error"]["message"]}}

            def chunked():  # no Content-Length: counted as it arrives
                for _ in range(8):
                    yield b" " * 512
            r = client.post("/v1/chat/completions", content=chunked(), headers={"content-type": "application/json"})
            assert r.status_code == 413
            assert client.post("/v1/chat/completions", json=chat("say:small")).status_code == 200
    finally:
        gen.stop()


def test_the_context_limits_are_400():
    app, gen = make_app(ScriptedSession(), n_ctx=256)
    try:
        with TestClient(app) as client:
            r = client.post("/v1/chat/completions", json=chat("p" * 300))
            assert r.status_code == 400 and r.json()["error"]["code"] == "context_length_exceeded"
            r = client.post("/v1/chat/completions", json=chat("short", max_tokens=1000))
            assert r.status_code == 400 and r.json()["error"]["param"] == "max_tokens"
            r = client.post("/v1/messages", json={"model": "fake", "max_tokens": 1000,
                                                  "messages": [{"role": "user", "content": "x"}]})
            assert r.status_code == 400 and r.json()["type"] == "error"
    finally:
        gen.stop()


def test_requests_beyond_max_connections_get_503_with_retry_after():
    """One slow stream holds the only place: the next request is 503 in the API's shape with Retry-After,
    /health and /metrics still answer, and after the stream the place is free again."""
    import httpx2 as httpx
    session = CountingSession(step_s=0.01)
    app, gen = make_app(session, Access(max_connections=1))
    try:
        with serving(app) as url, httpx.Client(base_url=url, timeout=30) as c:
            with c.stream("POST", "/v1/chat/completions", json=chat("slow", 200, stream=True)) as slow:
                lines = slow.iter_lines()
                assert next(lines).startswith("data:")
                r = c.post("/v1/chat/completions", json=chat("say:x"))
                assert r.status_code == 503 and r.headers["retry-after"] == "1", r.text
                assert r.json()["error"]["code"] == "too_many_connections"
                r = c.post("/v1/messages", json={"model": "fake", "max_tokens": 4,
                                                 "messages": [{"role": "user", "content": "x"}]})
                assert r.status_code == 503 and r.json()["error"]["type"] == "overloaded_error"
                assert c.get("/health").status_code == 200
                m = metrics_of(c.get("/metrics").text)
                assert m[("pipeinfer:requests_rejected_total", frozenset({("reason", "overloaded")}))] == 2
                assert m[("pipeinfer:requests_generating", frozenset())] == 1
                assert sum(1 for _ in lines) > 0
            assert c.post("/v1/chat/completions", json=chat("again", 4)).status_code == 200
    finally:
        gen.stop()


def _stuck_client(url: str, max_tokens: int) -> socket.socket:
    """A raw socket (a small receive buffer) that asks for a long stream and reads nothing."""
    stuck = socket.socket()
    stuck.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    stuck.connect(("127.0.0.1", int(url.rsplit(":", 1)[1])))
    body = json.dumps(chat("never read", max_tokens, stream=True)).encode()
    stuck.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                  b"Content-Length: " + str(len(body)).encode() + b"\r\n\r\n" + body)
    return stuck


def _until(condition, what: str, timeout_s: float = 60.0) -> None:
    """Wait for `condition()` (a generous bound: only a hang fails, never a slow machine)."""
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, what
        time.sleep(0.02)


def _writes_wait(server) -> bool:
    """Whether uvicorn holds back a response's writes: a client took nothing until every buffer filled (the socket's
    and the transport's, past its high-water mark)."""
    return any(getattr(getattr(c, "flow", None), "write_paused", False) for c in server.server_state.connections)


def test_a_client_that_stops_reading_stalls_no_one_and_is_dropped():
    """A raw socket asks for a long stream and reads nothing (small buffers on both ends). Once the server's writes
    to it wait, another request is answered while the stalled one is still held and generating; the stalled one
    is cancelled when its client goes. With a stalled-client timeout, the server drops such a client once its
    writes have waited that long (not before), and cancels its generation. No step is timed against the machine's
    speed: each waits for its condition (the stalled stream makes at most ~1000 tokens a second, far from its
    100_000, whatever the bound). The garbage collector is off: a generation stops because the server stops it,
    not because the abandoned stream happened to be collected."""
    collecting = gc.isenabled()
    gc.disable()
    try:
        _no_one_waits_for_a_stalled_client()
        _a_stalled_client_is_dropped()
    finally:
        if collecting:
            gc.enable()


def _no_one_waits_for_a_stalled_client() -> None:
    """Its timeout far away: the stalled client is still held when the other is answered."""
    import httpx2 as httpx
    session = CountingSession(step_s=0.002)
    app, gen = make_app(session, Access(stalled_client_timeout_s=600.0), n_ctx=200_000)
    servers: list = []
    try:
        with serving(app, sndbuf=4096, servers=servers) as url, httpx.Client(base_url=url, timeout=60) as c:
            stuck = _stuck_client(url, 100_000)
            _until(lambda: session.requests, "the stalled request never reached the scheduler")
            stalled = session.requests[0]
            _until(lambda: _writes_wait(servers[0]), "the server's writes to the stalled client never waited")
            r = c.post("/v1/chat/completions", json=chat("meanwhile", 8))
            assert r.status_code == 200 and r.json()["choices"][0]["message"]["content"] == "abcdefgh", r.text
            assert not stalled.should_stop() and any(e[0] is stalled for e in session.sched.running)
            assert _writes_wait(servers[0])  # the stalled client is still held
            stuck.close()  # it goes: its generation stops
            _until(stalled.should_stop, "the generation of a client that went away was not cancelled")
            _until(lambda: not session.sched.running, "the cancelled generation did not end")
    finally:
        gen.stop()


def _a_stalled_client_is_dropped() -> None:
    """Stalled for the timeout: dropped, and its generation cancelled (and counted so)."""
    import httpx2 as httpx
    cancelled = ("pipeinfer:request_success_total", frozenset({("finished_reason", "cancelled")}))
    session = CountingSession(step_s=0.002)
    app, gen = make_app(session, Access(stalled_client_timeout_s=1.5), n_ctx=200_000)
    try:
        with serving(app, sndbuf=4096) as url, httpx.Client(base_url=url, timeout=60) as c:
            t0 = time.monotonic()
            stuck = _stuck_client(url, 100_000)
            _until(lambda: session.requests, "the stalled request never reached the scheduler")
            stalled = session.requests[0]
            _until(stalled.should_stop, "the stalled stream was never dropped")
            assert time.monotonic() - t0 >= 1.5  # not before its writes waited for the timeout
            _until(lambda: metrics_of(c.get("/metrics").text).get(cancelled) == 1, "the cancel was not counted")
            assert metrics_of(c.get("/metrics").text)[("pipeinfer:generation_tokens_total", frozenset())] < 100_000
            stuck.close()
            assert c.post("/v1/chat/completions", json=chat("after", 4)).status_code == 200
    finally:
        gen.stop()


def test_error_bodies():
    assert json.loads(error_body("/v1/messages/count_tokens", 401, "no", "invalid_api_key")) == {
        "type": "error", "error": {"type": "authentication_error", "message": "no"}}
    assert json.loads(error_body("/v1/responses", 401, "no", "invalid_api_key")) == {
        "error": {"message": "no", "type": "invalid_request_error", "param": None, "code": "invalid_api_key"}}


# ------------------------------------------------------------------------------------ the options
def test_serve_takes_the_options(tmp_path):
    from click.testing import CliRunner

    from pipeinfer.cli.main import main
    out = CliRunner().invoke(main, ["serve", "--help"])
    for option in ("--api-key", "--api-key-file", "--ssl-certfile", "--ssl-keyfile", "--max-body-bytes",
                   "--max-connections", "--stalled-client-timeout"):
        assert option in out.output, option
    from pipeinfer.frontend.access import access_of
    from pipeinfer.core.errors import UserError
    kw = {"api_key": ("k",), "api_key_file": None, "ssl_certfile": None, "ssl_keyfile": None,
          "max_body_bytes": 4096, "max_connections": 3, "stalled_client_timeout": 9.0}
    assert access_of(kw) == Access(("k",), 4096, 3, 9.0)
    with pytest.raises(UserError, match="go together"):
        access_of({**kw, "ssl_certfile": str(tmp_path / "c")})
    with pytest.raises(UserError, match="no such file"):
        access_of({**kw, "ssl_certfile": str(tmp_path / "c"), "ssl_keyfile": str(tmp_path / "k")})
