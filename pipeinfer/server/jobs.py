"""Requests as jobs for the generation thread, whatever API they came in by, and the events that come back.

A route turns its body into Prompts (token ids, and the text a drafter reads) and Settings (what each generation
asks: length, sampling, stop strings, core/decoding.Decoding), checks the model (`check_model`) and a constraint
(`check_constraint`, before any token), and `make_jobs` makes one Job per choice, each checked against the
context. `submit_all` queues a request's jobs and yields `(choice index, event)` as they come; `collect` gathers
them into one Choice each for a whole answer. The events, the same for every API:

    ("text", str, list[dict] | None)  a piece of the answer, with the log-probabilities of the tokens whose text
                                      it completes (answer.py: OpenAI's chat entries {token, logprob, bytes,
                                      top_logprobs}); None: not asked for
    ("done", {"finish_reason", "prompt_tokens", "completion_tokens", "cached_tokens", "stats"})
                                      cached_tokens: the prompt's tokens taken from the prompt cache
    ("error", message)                the generation failed (every other choice of the request is cancelled)

A Job carries plain data only (token ids, SamplingParams, stop strings, Decoding) besides its event queue and
cancel flag: a supervised server sends it to rank 0 over a socket (link.py). A streamed answer goes out as a
`JobStream`, which cancels its jobs however the response ends.
"""
from __future__ import annotations

import asyncio
import threading
import time
import uuid
from dataclasses import dataclass, field

from fastapi.responses import StreamingResponse

from ..core.decoding import Constraint, Decoding
from ..core.verify import SamplingParams

ERROR_TYPES = {400: "invalid_request_error", 404: "invalid_request_error", 405: "invalid_request_error",
               503: "server_overloaded"}


class RequestError(Exception):
    """A request refused, in OpenAI's error shape: {"error": {"message", "type", "param", "code"}}."""

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": ERROR_TYPES.get(self.status, "server_error"),
                          "param": self.param, "code": self.code}}


def bad(param: str, message: str) -> RequestError:
    """A 400 naming the field: "param: message"."""
    return RequestError(400, f"{param}: {message}", param=param)


@dataclass
class ServeConfig:
    model_id: str
    n_ctx: int
    cells_reserve: int      # KV cells runs in flight may take beyond the prompt and the answer
    default_max_tokens: int
    webui: bool = True      # the web page at / (server/page.py; --no-webui turns it off)


@dataclass(frozen=True)
class Prompt:
    tokens: list[int]       # what the target reads
    text: str | None        # what a drafter that reads text reads
    chat: bool = False      # a lone user message: the draft formats it its own way


@dataclass(frozen=True)
class Settings:
    """What a request asks of each of its generations."""
    max_tokens: int | None = None   # None: the server's default, within the room the context leaves
    max_tokens_param: str = "max_tokens"  # the field it came from, for an error
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int = 0                   # choice j of a prompt samples with seed + j
    stops: tuple[str, ...] = ()
    decoding: Decoding = Decoding()
    n: int = 1                      # choices per prompt
    cache_prompt: bool = True       # llama-server's: start from the prompt cache, and leave the prompt in it


def new_request_id() -> str:
    return uuid.uuid4().hex[:24]


@dataclass
class Job:
    """One generation (one choice of a request) for the generation thread."""
    prompt_tokens: list[int]
    n_predict: int
    sampling: SamplingParams
    stops: list[str]
    prompt_text: str | None
    chat: bool
    loop: asyncio.AbstractEventLoop
    decoding: Decoding = Decoding()
    index: int = 0                  # the choice it answers
    cache_prompt: bool = True       # false: neither starts from the prompt cache nor leaves its prompt in it
    events: asyncio.Queue = field(default_factory=asyncio.Queue)  # (index, event), shared by a request's jobs
    cancelled: threading.Event = field(default_factory=threading.Event)
    request_id: str = field(default_factory=new_request_id)
    t_queued_s: float = field(default_factory=time.perf_counter)

    def push(self, event: tuple) -> None:
        self.loop.call_soon_threadsafe(self.events.put_nowait, (self.index, event))

    def on_token_ids(self, tokens: list[int]) -> None:
        """The ids as they come (a supervised generate keeps them for its results row); a client needs only text."""


# ------------------------------------------------------------------------------------ checks and jobs
def check_model(cfg: ServeConfig, model: str) -> None:
    if model != cfg.model_id:
        raise RequestError(404, f"the model '{model}' does not exist; this server has '{cfg.model_id}'",
                           param="model", code="model_not_found")


def check_token_ids(ids, n_vocab: int, param: str) -> list[int]:
    """A list of token ids, each in the vocabulary (400 naming `param`)."""
    if not isinstance(ids, list) or not all(isinstance(t, int) and not isinstance(t, bool) for t in ids):
        raise bad(param, "must be a list of token ids (integers)")
    wrong = next((t for t in ids if not 0 <= t < n_vocab), None)
    if wrong is not None:
        raise bad(param, f"token id {wrong} is not in the vocabulary (0..{n_vocab - 1})")
    return ids


def _n_predict(cfg: ServeConfig, n_prompt: int, s: Settings) -> int:
    """The tokens to generate: max_tokens, or the default within the room the context leaves."""
    n = s.max_tokens if s.max_tokens is not None else cfg.default_max_tokens
    room = cfg.n_ctx - n_prompt - cfg.cells_reserve
    if s.max_tokens is None:
        n = min(n, room)
    if n > room or room < 1:
        raise RequestError(400, f"the prompt ({n_prompt} tokens) + {s.max_tokens_param} ({n}) + {cfg.cells_reserve} "
                                f"for runs in flight exceed the context of {cfg.n_ctx} tokens",
                           param=s.max_tokens_param, code="context_length_exceeded")
    return n


def make_jobs(cfg: ServeConfig, prompts: list[Prompt], s: Settings, request_id: str) -> list[Job]:
    """One job per prompt per choice, prompt i's choice j at index i * n + j (OpenAI's order) with seed + j, each
    checked against the context (RequestError); a request of several jobs logs them as request_id-k. Call from the
    event loop (the jobs answer on it)."""
    loop = asyncio.get_running_loop()
    jobs = []
    for i, p in enumerate(prompts):
        if not p.tokens:
            raise bad("prompt" if len(prompts) == 1 else f"prompt.{i}", "the prompt is empty")
        n_predict = _n_predict(cfg, len(p.tokens), s)
        for j in range(s.n):
            k = i * s.n + j
            sampling = SamplingParams(temp=s.temperature, top_k=s.top_k, top_p=s.top_p, seed=s.seed + j)
            jobs.append(Job(list(p.tokens), n_predict, sampling, list(s.stops), p.text, p.chat, loop,
                            decoding=s.decoding, index=k, cache_prompt=s.cache_prompt,
                            request_id=request_id if len(prompts) * s.n == 1 else f"{request_id}-{k}"))
    for job in jobs[1:]:
        job.events = jobs[0].events
    return jobs


def check_constraint(constraint: Constraint | None, tokenizer, param: str) -> None:
    """Compile a request's constraint before any token is generated, so a grammar or schema llguidance refuses is
    a 400 naming its field (engine/grammar.py; the one place its names are used here)."""
    if constraint is None:
        return
    from ..engine import grammar
    try:
        grammar.compile_constraint(constraint, grammar.lltokenizer(tokenizer), field=param)
    except grammar.ConstraintError as e:
        raise RequestError(400, str(e), param=param) from None


async def acheck_constraint(constraint: Constraint | None, tokenizer, param: str) -> None:
    """check_constraint on a worker thread: a large schema, or the first build of llguidance's tokenizer (about a
    second), does not hold the event loop."""
    if constraint is not None:
        await asyncio.to_thread(check_constraint, constraint, tokenizer, param)


# ------------------------------------------------------------------------------------ submitting, and the events
def submit_all(generator, jobs: list[Job], request):
    """Queue a request's jobs, all or none (one refused cancels those already queued: RequestError); then
    (choice index, event) as they come, until every job is done or one failed. A client that leaves (checked
    twice a second while nothing comes, and when a streaming response is cancelled) stops every generation."""
    for k, job in enumerate(jobs):
        try:
            generator.submit(job)
        except RequestError:
            for queued in jobs[:k]:
                queued.cancelled.set()
            raise

    async def events():
        inbox, left = jobs[0].events, len(jobs)
        try:
            while left:
                try:
                    index, ev = await asyncio.wait_for(inbox.get(), timeout=0.5)
                except asyncio.TimeoutError:
                    if await request.is_disconnected():
                        return
                    continue
                yield index, ev
                if ev[0] == "error":
                    return
                if ev[0] == "done":
                    left -= 1
        finally:
            for job in jobs:
                job.cancelled.set()  # harmless once done; stops the generations when the client left
    return events()


class JobStream(StreamingResponse):
    """A request's server-sent events whose jobs are cancelled once the response ends, however it ends. A client
    that stops reading is given up inside `send` (access.Gate): the events' generators, idle at a yield then, are
    not closed by it, and would stop their generations only when the garbage collector finds them."""

    def __init__(self, content, jobs: list[Job], headers: dict | None = None):
        super().__init__(content, media_type="text/event-stream", headers=headers)
        self.jobs = list(jobs)

    async def __call__(self, scope, receive, send):
        try:
            await super().__call__(scope, receive, send)
        finally:
            for job in self.jobs:
                job.cancelled.set()  # harmless once done


def submit(generator, job: Job, request):
    """One job's events (submit_all's, without the index)."""
    merged = submit_all(generator, [job], request)

    async def events():
        async for _, ev in merged:
            yield ev
    return events()


@dataclass
class Choice:
    """One choice's whole answer."""
    text: str = ""
    logprobs: list[dict] = field(default_factory=list)  # answer.py's entries (none when not asked for)
    finish_reason: str | None = None
    completion_tokens: int = 0
    cached_tokens: int = 0          # of the prompt's tokens, taken from the prompt cache


async def collect(events, n_choices: int) -> list[Choice] | None:
    """Every choice's whole answer from submit_all's events; None when the client went away. A failed
    generation raises RequestError (500)."""
    choices = [Choice() for _ in range(n_choices)]
    n_done = 0
    async for index, ev in events:
        c = choices[index]
        if ev[0] == "text":
            c.text += ev[1]
            c.logprobs += ev[2] or []
        elif ev[0] == "error":
            raise RequestError(500, ev[1], code="pipeline_failed")
        else:
            c.finish_reason, c.completion_tokens = ev[1]["finish_reason"], ev[1]["completion_tokens"]
            c.cached_tokens = ev[1]["cached_tokens"]
            n_done += 1
    return choices if n_done == n_choices else None
