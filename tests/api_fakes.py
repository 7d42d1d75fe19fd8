"""Fakes shared by the HTTP API tests: a byte tokenizer with a Hermes-style Jinja chat template, and a head
session whose scheduler answers what the prompt's last "say:" asks for (then ends, as at an end-of-generation
token), a few tokens per step (with `prompt_cache`, a prompt cache's arithmetic: a request with cache_prompt takes
the longest head it shares with an earlier such request's prompt, all of it but its last token); plus the app
served by uvicorn on a free port in a thread (for the real SDKs)."""
from __future__ import annotations

import socket
import threading
import time
from contextlib import contextmanager

import pytest

from pipeinfer.core.decoding import Decoding
from pipeinfer.core.metrics import Stats
from pipeinfer.decide.scheduler import Request

N_VOCAB, BOS = 257, 256

# what engine/chat.render_chat renders: roles in <|role|> tags, tools listed, calls in Hermes tags
TEMPLATE = (
    "{%- if tools %}<|tools|>{% for t in tools %}{{ t.function.name }};{% endfor %}{% endif %}"
    "{%- for m in messages %}<|{{ m.role }}|>{% if m.content %}{{ m.content }}{% endif %}"
    "{%- for c in m.tool_calls or [] %}<tool_call>{{ c.function | tojson }}</tool_call>{% endfor %}"
    "{%- endfor %}<|assistant|>")


class ByteTokenizer:
    """Ids 0..255 are bytes, 256 BOS."""
    n_vocab = N_VOCAB

    def piece(self, token: int) -> bytes:
        return b"" if token == BOS else bytes([token])

    def encode(self, text: str, add_special: bool = True, parse_special: bool = True) -> list[int]:
        return ([BOS] if add_special else []) + list(text.encode())

    def decode(self, tokens: list[int]) -> str:
        return b"".join(self.piece(t) for t in tokens).decode("utf-8", errors="replace")

    def chat_template(self) -> str:
        return TEMPLATE


def simple_template(messages: list[dict]) -> str:
    """The app's apply_chat_template for messages without tools."""
    return "".join(f"<|{m['role']}|>{m['content']}" for m in messages) + "<|assistant|>"


def scripted_answer(prompt_text: str) -> str:
    """What follows the prompt's last "say:", up to the next <|tag|>."""
    at = prompt_text.rfind("say:")
    if at < 0:
        return "ok"
    rest = prompt_text[at + 4:]
    end = rest.find("<|")
    return rest if end < 0 else rest[:end]


def _shared(a: list[int], b: list[int]) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


class ScriptedScheduler:
    N_CELLS = 2048

    def __init__(self, prompt_cache: bool = False):
        self.running: list[tuple[Request, list[int]]] = []
        self.waiting: list = []
        self.made: dict[int, int] = {}   # id(request) -> tokens made so far
        self.cache: list[list[int]] | None = [] if prompt_cache else None  # the prompts finished requests left
        self.cached: dict[int, int] = {}  # id(request) -> its prompt tokens taken from the cache
        self.hits = self.reused = 0

    def cache_load(self) -> dict:
        """Scheduler.cache_load's keys."""
        entries = self.cache or []
        held = sum(map(len, entries)) + sum(len(req.prompt) + self.made.get(id(req), 0) for req, _ in self.running)
        return {"enabled": self.cache is not None, "entries": len(entries), "tokens": sum(map(len, entries)),
                "hits": self.hits, "tokens_reused": self.reused, "cells_used": min(held, self.N_CELLS),
                "cells": self.N_CELLS}

    @property
    def busy(self) -> bool:
        return bool(self.running)

    def has_idle_work(self) -> bool:
        return False

    def idle_work(self) -> bool:
        return False

    def submit(self, req: Request) -> None:
        script = list(scripted_answer(ByteTokenizer().decode(req.prompt)).encode())
        if self.cache is not None and req.cache_prompt:
            n = min(max((_shared(p, req.prompt) for p in self.cache), default=0), len(req.prompt) - 1)
            if n > 0:
                self.cached[id(req)] = n
                self.hits, self.reused = self.hits + 1, self.reused + n
        self.running.append((req, script))

    def step(self) -> None:
        for req, script in list(self.running):
            done = self.made.get(id(req), 0)
            if req.should_stop() or done >= min(req.n_predict, len(script)):
                self.running.remove((req, script))
                self.made.pop(id(req), None)
                if self.cache is not None and req.cache_prompt:
                    self.cache.append(list(req.prompt))
                req.on_done(script[:done], Stats(n_prompt=len(req.prompt), n_generated=done,
                                                 n_cached=self.cached.pop(id(req), 0)))
                continue
            tokens = script[done:min(req.n_predict, len(script), done + 1 + done % 3)]
            self.made[id(req)] = done + len(tokens)
            req.on_tokens(tokens)
        time.sleep(0.001)


class ScriptedSession:
    parallel = 4

    def __init__(self, prompt_cache: bool = False):
        self.tok, self.sched, self.requests = ByteTokenizer(), ScriptedScheduler(prompt_cache), []

    def scheduler(self) -> ScriptedScheduler:
        return self.sched

    def load(self) -> dict:
        cache_load = getattr(self.sched, "cache_load", None)
        return {"generating": len(self.sched.running), "waiting": 0,
                **({"prompt_cache": cache_load()} if cache_load else {})}

    def poll_stages(self, waited_s: float = 0.0) -> None:
        """No pipeline: no stage reports."""

    def stages(self) -> list[dict]:
        return []

    def request(self, prompt, *, n_predict, sampling, prompt_text, chat, on_tokens, should_stop, on_done,
                decoding=None, on_logprobs=None, cache_prompt=True) -> Request:
        self.requests.append(Request(list(prompt), n_predict, sampling, prompt_text, chat, on_tokens, should_stop,
                                     on_done, decoding=decoding or Decoding(), on_logprobs=on_logprobs,
                                     cache_prompt=cache_prompt))
        return self.requests[-1]


@contextmanager
def serving(app, sndbuf: int | None = None, servers: list | None = None, **config):
    """The app on a free port of 127.0.0.1 (uvicorn in a thread); yields its base URL (https with ssl_certfile).
    `config`: more of uvicorn.Config's; `sndbuf`: the send buffer of every connection (a small one: a client that
    stops reading blocks the server's writes soon); `servers`: the uvicorn.Server is appended to it."""
    import uvicorn
    sock = socket.socket()
    if sndbuf:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, sndbuf)  # accepted sockets inherit it
    sock.bind(("127.0.0.1", 0))
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning", **config))
    if servers is not None:
        servers.append(server)
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        assert time.monotonic() < deadline, "uvicorn did not start"
        time.sleep(0.02)
    try:
        scheme = "https" if config.get("ssl_certfile") else "http"
        yield f"{scheme}://127.0.0.1:{sock.getsockname()[1]}"
    finally:
        server.should_exit = True
        thread.join(30)
        sock.close()


# ------------------------------------------------------------------------------------ a load of known size
class CountingScheduler:
    """--ignore-eos style: every request gets exactly n_predict tokens ("abc..."), 1 + (made % 3) per step, and
    Stats with known draft counts (2 drafted and 1 accepted per token, one cancelled run per 4 tokens) and
    timings; `step_s` a sleep per step."""

    def __init__(self, step_s: float = 0.0):
        self.running: list[list] = []   # [request, tokens made, stats]
        self.waiting: list = []
        self.step_s = step_s

    @property
    def busy(self) -> bool:
        return bool(self.running)

    def has_idle_work(self) -> bool:
        return False

    def idle_work(self) -> bool:
        return False

    def submit(self, req: Request) -> None:
        self.running.append([req, 0, Stats(n_prompt=len(req.prompt), t_start_s=time.perf_counter())])

    def step(self) -> None:
        for entry in list(self.running):
            req, made, st = entry
            now = time.perf_counter()
            if req.should_stop() or made >= req.n_predict:
                self.running.remove(entry)
                st.n_generated, st.n_drafted, st.n_draft_accepted = made, 2 * made, made
                st.draft_levels = [{"level": "a.gguf", "proposed": 2 * made, "kept": 0, "calls": made, "busy_s": 0.5},
                                   {"level": "ngram", "proposed": made, "kept": made // 2, "calls": made,
                                    "busy_s": 0.0}]
                st.n_runs, st.n_spec_runs, st.n_cancelled = 1 + made, made, made // 4
                req.on_done([ord("a") + k % 26 for k in range(made)], st)
                continue
            tokens = [ord("a") + k % 26 for k in range(made, min(req.n_predict, made + 1 + made % 3))]
            if made == 0:
                st.t_prompt_done_s = now
            elif not st.t_first_s:
                st.t_first_s = now
            st.t_last_s = now
            entry[1] = made + len(tokens)
            req.on_tokens(tokens)
        time.sleep(self.step_s)


class CountingSession(ScriptedSession):
    """ScriptedSession with CountingScheduler's answers."""

    def __init__(self, step_s: float = 0.0):
        super().__init__()
        self.sched = CountingScheduler(step_s)

    def load(self) -> dict:
        return {"generating": len(self.sched.running), "waiting": 0}


@contextmanager
def scripted_server(n_ctx: int, default_max: int, prompt_cache: bool = False):
    """The real app and generation thread over a ScriptedSession on a port, with the real `openai` and `anthropic`
    clients pointed at it: (session, url, http, oai, claude)."""
    from types import SimpleNamespace

    import anthropic
    import httpx2
    import openai

    from pipeinfer.feeders.generator import Generator

    from pipeinfer.frontend.app import ServeConfig, create_app
    session = ScriptedSession(prompt_cache)
    gen = Generator(session, max_queue=16, log=lambda _msg: None)
    gen.start()
    app = create_app(ServeConfig("fake", n_ctx, 4, default_max), gen, session.tok, simple_template)
    try:
        with serving(app) as url:
            http = httpx2.Client(timeout=30)
            yield SimpleNamespace(session=session, url=url, http=http,
                                  claude=anthropic.Anthropic(base_url=url, api_key="x", max_retries=0, http_client=http),
                                  oai=openai.OpenAI(base_url=f"{url}/v1", api_key="x", max_retries=0, http_client=http))
            http.close()
    finally:
        gen.stop()


def say(text: str) -> list[dict]:
    """A conversation the scripted model answers with `text`."""
    return [{"role": "user", "content": f"say:{text}"}]


def last_prompt(api) -> str:
    return ByteTokenizer().decode(api.session.requests[-1].prompt)


# the fixtures of the API modules that talk to one scripted server (imported by them: pytest finds them there)
SCRIPTED_N_CTX, SCRIPTED_DEFAULT_MAX = 2048, 64


@pytest.fixture(scope="module")
def served():
    with scripted_server(SCRIPTED_N_CTX, SCRIPTED_DEFAULT_MAX) as srv:
        yield srv


@pytest.fixture
def api(served):
    """The module's scripted server, its record of requests emptied."""
    served.session.requests.clear()
    return served
