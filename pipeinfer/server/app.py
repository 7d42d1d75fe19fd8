"""`pipeinfer serve`: an OpenAI-compatible HTTP server on the head rank (rank 0).

Endpoints: POST /v1/chat/completions and /v1/completions (streaming as server-sent events ending with
`data: [DONE]`, or one JSON answer), GET /v1/models, GET /health. Errors are OpenAI-style JSON:
`{"error": {"message", "type", "param", "code"}}` with 400 for a malformed body or a request that does
not fit the context, 404 for an unknown model, 503 + Retry-After when the queue is full.

Threads on rank 0: uvicorn's event loop takes requests; one generation thread owns the pipeline (every
MPI call and llama.cpp decode happens there) and runs queued jobs first come first served: one at a time
(--parallel 1), or up to N at once through the scheduler (ranks/scheduler.py: --parallel N).
Tokens go back to the request's handler through an asyncio queue. A client that disconnects (or a stop
string that matches) sets the job's stop flag: the head stops launching, cancels its runs in flight
through the pipeline's cancellation, and collects them, so no run or KV cell is left behind; each
generation starts from an empty KV cache on every stage (ranks/startup.HeadSession), so no request sees
another's state. The other ranks serve the pipeline as they do for `generate`.
"""
from __future__ import annotations

import asyncio
import json
import queue
import sys
import threading
import time
import uuid
from dataclasses import dataclass, field
from typing import Any, Callable

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, StreamingResponse
from pydantic import BaseModel, ConfigDict, Field

from ..core.verify import SamplingParams
from .pump import pump

ERROR_TYPES = {400: "invalid_request_error", 404: "invalid_request_error", 503: "server_overloaded"}


class RequestError(Exception):
    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": ERROR_TYPES.get(self.status, "server_error"),
                          "param": self.param, "code": self.code}}


# ------------------------------------------------------------------------------------ stop strings
class StopMatcher:
    """Streams text through, holding back what could be the start of a stop string; `hit` once one matched
    (the text is cut before it)."""

    def __init__(self, stops: list[str]):
        self.stops = [s for s in stops if s]
        self.held = ""
        self.hit = False

    def feed(self, text: str) -> str:
        if self.hit or not self.stops:
            return "" if self.hit else text
        buf = self.held + text
        cut = min((i for i in (buf.find(s) for s in self.stops) if i >= 0), default=-1)
        if cut >= 0:
            self.hit, self.held = True, ""
            return buf[:cut]
        keep = 0  # the longest tail of buf that is a proper prefix of some stop string
        for s in self.stops:
            for k in range(min(len(s) - 1, len(buf)), keep, -1):
                if buf.endswith(s[:k]):
                    keep = k
                    break
        self.held = buf[len(buf) - keep:] if keep else ""
        return buf[:len(buf) - keep]

    def flush(self) -> str:
        out, self.held = ("" if self.hit else self.held), ""
        return out


# ------------------------------------------------------------------------------------ jobs
@dataclass
class Job:
    prompt_tokens: list[int]
    n_predict: int
    sampling: SamplingParams
    stops: list[str]
    prompt_text: str | None
    chat: bool
    loop: asyncio.AbstractEventLoop
    events: asyncio.Queue = field(default_factory=asyncio.Queue)  # ("text", str) ... ("done", info) | ("error", msg)
    cancelled: threading.Event = field(default_factory=threading.Event)
    request_id: str = field(default_factory=lambda: uuid.uuid4().hex[:24])
    t_queued_s: float = field(default_factory=time.perf_counter)

    def push(self, event: tuple) -> None:
        self.loop.call_soon_threadsafe(self.events.put_nowait, event)

    def on_token_ids(self, tokens: list[int]) -> None:
        """The ids as they come (a supervised generate keeps them for its results row); a client needs only text."""


class _Answer:
    """One job's text on its way out: token ids decoded as a stream, stop strings held back and matched."""

    def __init__(self, job: Job, tok):
        from ..engine.tokenizer import StreamDecoder
        self.job, self.dec, self.stop = job, StreamDecoder(tok), StopMatcher(job.stops)
        self.t_start_s = time.perf_counter()

    def on_tokens(self, tokens: list[int]) -> None:
        text = self.stop.feed(self.dec.feed(tokens))
        if text:
            self.job.push(("text", text))

    def should_stop(self) -> bool:
        return self.job.cancelled.is_set() or self.stop.hit

    def finish(self, stats, log, on_done) -> None:
        """The held-back text, the log line, the results row, then `done` (last: by the time a client has its
        whole answer, its log line and results row are written)."""
        job = self.job
        tail = self.stop.feed(self.dec.flush())
        tail += self.stop.flush()
        if tail:
            job.push(("text", tail))
        finish = "stop" if self.stop.hit or stats.n_generated < job.n_predict else "length"
        if job.cancelled.is_set():
            finish = "cancelled"
        queued = stats.t_queue_s or (self.t_start_s - job.t_queued_s)
        log(f"[serve] {job.request_id}: {len(job.prompt_tokens)} prompt + {stats.n_generated} tokens, "
            f"queued {queued:.2f} s, prompt {stats.t_prompt_done_s - stats.t_start_s:.2f} s, "
            f"ttft {stats.ttft_s:.3f} s, {stats.gen_tokens_per_s:.2f} tokens/s, "
            f"acceptance {stats.acceptance_rate * 100:.0f}%, {finish}")
        if on_done is not None:
            on_done(job, stats, finish)
        job.push(("done", {"finish_reason": finish, "prompt_tokens": len(job.prompt_tokens),
                           "completion_tokens": stats.n_generated, "stats": stats}))


class Generator:
    """The generation thread: owns the head session and pumps the jobs into its scheduler (ranks/scheduler.py),
    which runs up to --parallel of them at once, admitted first come first served."""

    def __init__(self, session, max_queue: int, log=None, on_done=None):
        self.session, self.tok = session, session.tok
        self.parallel = session.parallel
        self.jobs: queue.Queue[Job | None] = queue.Queue(maxsize=max_queue)
        self.log = log or (lambda msg: print(msg, file=sys.stderr, flush=True))
        self.on_done = on_done  # callable(job, stats, finish_reason), e.g. a --results row
        self.fatal: str | None = None
        self.thread = threading.Thread(target=self._loop, name="pipeinfer-generation", daemon=True)

    def start(self) -> None:
        self.thread.start()

    def submit(self, job: Job) -> None:
        if self.fatal:
            raise RequestError(503, f"the pipeline failed: {self.fatal}", code="pipeline_failed")
        try:
            self.jobs.put_nowait(job)
        except queue.Full:
            raise RequestError(503, f"the queue is full ({self.jobs.maxsize} requests waiting); retry later",
                               code="queue_full") from None

    def stop(self) -> None:
        while True:  # drop what waits, then tell the thread to end after the jobs it runs
            try:
                job = self.jobs.get_nowait()
            except queue.Empty:
                break
            if job is not None:
                job.push(("error", "the server is shutting down"))
        self.jobs.put(None)
        self.thread.join()

    def load(self) -> dict:
        """For /health: what waits and what the pipeline holds now (a snapshot read from another thread)."""
        load = self.session.load()
        return {"queued": self.jobs.qsize() + load.pop("waiting"), **load}

    def _fail(self, e: Exception, jobs) -> None:
        """The pipeline is gone (a rank failed): fail these and every later request."""
        self.fatal = f"{type(e).__name__}: {e}"
        for job in jobs:
            job.push(("error", f"the pipeline failed: {self.fatal}"))
        self.log(f"[serve] fatal: {self.fatal}")

    def _loop(self) -> None:
        sched = self.session.scheduler()
        running: dict[int, Job] = {}
        try:
            pump(sched, self.jobs, lambda job: self._admit(sched, job, running))
        except Exception as e:
            self._fail(e, list(running.values()))

    def _admit(self, sched, job: Job, running: dict) -> None:
        if job.cancelled.is_set():
            self.log(f"[serve] {job.request_id}: cancelled while queued")
            return
        ans = _Answer(job, self.tok)

        def done(tokens: list[int], stats) -> None:
            running.pop(id(job), None)
            ans.finish(stats, self.log, self.on_done)
        req = self.session.request(job.prompt_tokens, n_predict=job.n_predict, sampling=job.sampling,
                                   prompt_text=job.prompt_text, chat=job.chat, on_tokens=ans.on_tokens,
                                   should_stop=ans.should_stop, on_done=done)
        req.t_queued_s = job.t_queued_s
        try:
            sched.submit(req)
        except ValueError as e:  # does not fit the context as the stages planned it
            job.push(("error", str(e)))
            return
        running[id(job)] = job


# ------------------------------------------------------------------------------------ request bodies
class Message(BaseModel):
    model_config = ConfigDict(extra="allow")
    role: str
    content: str | list[dict[str, Any]] | None = None


class Common(BaseModel):
    model_config = ConfigDict(extra="allow")  # unknown OpenAI fields are accepted and ignored
    model: str
    max_tokens: int | None = Field(default=None, ge=1)
    temperature: float | None = Field(default=None, ge=0, le=2)
    top_p: float | None = Field(default=None, gt=0, le=1)
    stop: str | list[str] | None = None
    seed: int | None = None
    stream: bool = False
    n: int = Field(default=1, ge=1, le=1)
    stream_options: dict[str, Any] | None = None


class CompletionRequest(Common):
    prompt: str | list[str]


class ChatRequest(Common):
    messages: list[Message] = Field(min_length=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)


# ------------------------------------------------------------------------------------ settings
@dataclass
class ServeConfig:
    model_id: str
    n_ctx: int
    cells_reserve: int      # KV cells runs in flight may take beyond the prompt and the answer
    default_max_tokens: int


# ------------------------------------------------------------------------------------ jobs from requests
def make_job(cfg: ServeConfig, tokenizer, req: Common, prompt_text: str, user_text: str | None, chat: bool,
             max_tokens: int | None) -> Job:
    """A request as a job for the generation thread, its model, prompt and context checked (RequestError).
    Without max_tokens a request gets the default, within the room the context leaves."""
    if req.model != cfg.model_id:
        raise RequestError(404, f"the model '{req.model}' does not exist; this server has '{cfg.model_id}'",
                           param="model", code="model_not_found")
    ids = tokenizer.encode(prompt_text)
    if not ids:
        raise RequestError(400, "the prompt is empty", param="prompt")
    n = max_tokens if max_tokens is not None else cfg.default_max_tokens
    room = cfg.n_ctx - len(ids) - cfg.cells_reserve
    if max_tokens is None:
        n = min(n, room)
    if n > room or room < 1:
        raise RequestError(400, f"the prompt ({len(ids)} tokens) + max_tokens ({n}) + {cfg.cells_reserve} for runs "
                                f"in flight exceed the context of {cfg.n_ctx} tokens",
                           param="max_tokens", code="context_length_exceeded")
    stops = [req.stop] if isinstance(req.stop, str) else list(req.stop or [])
    sampling = SamplingParams(temp=req.temperature or 0.0, top_p=req.top_p or 1.0, seed=req.seed or 0)
    return Job(ids, n, sampling, stops, user_text, chat, asyncio.get_running_loop())


def completion_job(cfg: ServeConfig, tokenizer, req: CompletionRequest) -> Job:
    prompt = req.prompt if isinstance(req.prompt, str) else "".join(req.prompt)
    return make_job(cfg, tokenizer, req, prompt, prompt, False, req.max_tokens)


def chat_job(cfg: ServeConfig, tokenizer, req: ChatRequest, apply_chat_template) -> Job:
    """The messages through the chat template (roles checked; a developer message is a system one)."""
    messages = []
    for i, m in enumerate(req.messages):
        content = m.content
        if isinstance(content, list):  # content parts: the text ones, joined
            content = "".join(p.get("text", "") for p in content if p.get("type") == "text")
        if m.role not in ("system", "user", "assistant", "developer", "tool"):
            raise RequestError(400, f"messages.{i}.role: unknown role '{m.role}'", param=f"messages.{i}.role")
        messages.append({"role": "system" if m.role == "developer" else m.role, "content": content or ""})
    text = apply_chat_template(messages)
    users = [m["content"] for m in messages if m["role"] == "user"]
    single = len(messages) == 1 and len(users) == 1  # the draft formats a lone user message its own way
    return make_job(cfg, tokenizer, req, text, users[0] if single else text, single,
                    req.max_completion_tokens or req.max_tokens)


# ------------------------------------------------------------------------------------ replies
def _completion_choice(text: str | None, finish: str | None) -> dict:
    return {"index": 0, "text": text or "", "finish_reason": finish, "logprobs": None}


def _chat_delta(text: str | None, finish: str | None) -> dict:
    return {"index": 0, "delta": {"content": text} if text else {}, "finish_reason": finish, "logprobs": None}


def _chat_message(text: str, finish: str) -> dict:
    return {"index": 0, "message": {"role": "assistant", "content": text}, "finish_reason": finish, "logprobs": None}


@dataclass(frozen=True)
class ReplyKind:
    """What differs between OpenAI's chat and completion replies; the rest of a reply is the same for both."""
    id_prefix: str
    object_name: str                 # the whole answer's "object"
    chunk_object: str                # a streamed chunk's "object"
    piece: Callable[[str | None, str | None], dict]   # a streamed choice from (text, finish reason)
    whole: Callable[[str, str], dict]                 # the whole answer's choice from (text, finish reason)
    opening: dict | None = None      # the choice streamed before any text (chat: the assistant's role)


COMPLETION = ReplyKind("cmpl-", "text_completion", "text_completion", _completion_choice, _completion_choice)
CHAT = ReplyKind("chatcmpl-", "chat.completion", "chat.completion.chunk", _chat_delta, _chat_message,
                 opening={"index": 0, "delta": {"role": "assistant", "content": ""}, "finish_reason": None,
                          "logprobs": None})


def _sse(obj) -> str:
    return f"data: {json.dumps(obj)}\n\n"


def _usage(info: dict) -> dict:
    return {"prompt_tokens": info["prompt_tokens"], "completion_tokens": info["completion_tokens"],
            "total_tokens": info["prompt_tokens"] + info["completion_tokens"]}


@dataclass(frozen=True)
class Reply:
    """One request's reply: the same id, time and model on every object, in the shape of its kind."""
    kind: ReplyKind
    request_id: str
    model_id: str
    created: int = field(default_factory=lambda: int(time.time()))

    def body(self, object_name: str, choices: list, **more) -> dict:
        return {"id": self.kind.id_prefix + self.request_id, "object": object_name, "created": self.created,
                "model": self.model_id, "choices": choices, **more}

    def chunk(self, choice: dict) -> str:
        return _sse(self.body(self.kind.chunk_object, [choice]))

    async def stream(self, events, want_usage: bool):
        """Server-sent events: a chunk per piece of text, one with the finish reason, the usage when asked,
        then [DONE]; a failed pipeline ends the stream with an error object."""
        if self.kind.opening is not None:
            yield self.chunk(self.kind.opening)
        async for ev in events:
            if ev[0] == "text":
                yield self.chunk(self.kind.piece(ev[1], None))
            elif ev[0] == "error":
                yield _sse(RequestError(500, ev[1]).body())
                return
            else:
                info = ev[1]
                yield self.chunk(self.kind.piece(None, info["finish_reason"]))
                if want_usage:
                    yield _sse(self.body(self.kind.chunk_object, [], usage=_usage(info)))
        yield "data: [DONE]\n\n"

    async def whole(self, events):
        """One JSON answer once the generation is done."""
        parts, info = [], None
        async for ev in events:
            if ev[0] == "text":
                parts.append(ev[1])
            elif ev[0] == "error":
                raise RequestError(500, ev[1], code="pipeline_failed")
            else:
                info = ev[1]
        if info is None:  # the client went away
            return JSONResponse({}, status_code=499)
        return self.body(self.kind.object_name, [self.kind.whole("".join(parts), info["finish_reason"])],
                         usage=_usage(info))


def submit(generator: Generator, job: Job, request: Request):
    """Submit a job; its events as they come. A client that leaves (checked twice a second while
    nothing comes, and when a streaming response is cancelled) stops its generation."""
    generator.submit(job)

    async def events():
        try:
            while True:
                try:
                    ev = await asyncio.wait_for(job.events.get(), timeout=0.5)
                except asyncio.TimeoutError:
                    if await request.is_disconnected():
                        return
                    continue
                yield ev
                if ev[0] in ("done", "error"):
                    return
        finally:
            job.cancelled.set()  # harmless once done; stops the generation when the client left

    return events()


async def respond(cfg: ServeConfig, generator: Generator, kind: ReplyKind, req: Common, job: Job, request: Request):
    """Streamed (server-sent events) or whole, as the request asks."""
    reply = Reply(kind, job.request_id, cfg.model_id)
    events = submit(generator, job, request)
    if req.stream:
        want_usage = bool((req.stream_options or {}).get("include_usage"))
        return StreamingResponse(reply.stream(events, want_usage), media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
    return await reply.whole(events)


# ------------------------------------------------------------------------------------ the HTTP app
def create_app(cfg: ServeConfig, generator: Generator, tokenizer, apply_chat_template):
    """The ASGI app. `apply_chat_template(messages) -> prompt text`."""
    app = FastAPI(title="pipeinfer", docs_url=None, redoc_url=None)

    @app.exception_handler(RequestError)
    async def _request_error(_request, exc: RequestError):
        headers = {"Retry-After": "1"} if exc.status == 503 else None
        return JSONResponse(exc.body(), status_code=exc.status, headers=headers)

    @app.exception_handler(RequestValidationError)
    async def _invalid(_request, exc: RequestValidationError):
        first = exc.errors()[0] if exc.errors() else {}
        where = ".".join(str(x) for x in first.get("loc", ()) if x != "body")
        msg = f"{where}: {first.get('msg', 'invalid request')}" if where else first.get("msg", "invalid request body")
        return JSONResponse(RequestError(400, msg, param=where or None).body(), status_code=400)

    @app.get("/health")
    async def health():
        if generator.fatal:
            return JSONResponse({"status": "error", "error": generator.fatal}, status_code=503)
        load = generator.load()
        return {"status": "degraded" if load.get("degraded") else "ok", "parallel": generator.parallel, **load}

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": cfg.model_id, "object": "model", "created": 0,
                                            "owned_by": "pipeinfer"}]}

    @app.post("/v1/completions")
    async def completions(req: CompletionRequest, request: Request):
        return await respond(cfg, generator, COMPLETION, req, completion_job(cfg, tokenizer, req), request)

    @app.post("/v1/chat/completions")
    async def chat(req: ChatRequest, request: Request):
        job = chat_job(cfg, tokenizer, req, apply_chat_template)
        return await respond(cfg, generator, CHAT, req, job, request)

    return app
