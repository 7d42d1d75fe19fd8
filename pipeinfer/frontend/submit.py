"""A route's common work: a request's Prompts and Settings (serving/job.py) checked (`check_model`, a constraint
before any token: `check_constraint`) and made into one Job per choice, each checked against the context
(`make_jobs`); `submit_all` queues them and yields `(choice index, event)` as they come; `collect` gathers them into
one Choice each for a whole answer. A streamed answer goes out as a `JobStream`, which cancels its jobs however the
response ends; every sampled reply names its seed (`with_seed`).
"""
from __future__ import annotations

import asyncio
from dataclasses import dataclass, field

from fastapi.responses import JSONResponse, Response, StreamingResponse

from ..core.decoding import Constraint
from ..core.verify import SamplingParams
from ..serving.job import DoneEvent, ErrorEvent, Job, Prompt, RequestError, Settings, TextEvent, bad


@dataclass
class ServeConfig:
    model_id: str
    n_ctx: int
    cells_reserve: int      # KV cells runs in flight may take beyond the prompt and the answer
    default_max_tokens: int
    webui: bool = True      # the web page at / (frontend/page.py; --no-webui turns it off)


# the response header that names the seed a request sampled with (choice j: + j), the one it asked for or the one
# drawn for it: sent back as `seed`, it reproduces the answer
SEED_HEADER = "X-Seed"


def with_seed(reply, seed: int) -> Response:
    """A route's reply (a JSON body or a Response) naming its seed in SEED_HEADER."""
    response = reply if isinstance(reply, Response) else JSONResponse(reply)
    response.headers[SEED_HEADER] = str(seed)
    return response


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
                if isinstance(ev, ErrorEvent):
                    return
                if isinstance(ev, DoneEvent):
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
        if isinstance(ev, TextEvent):
            c.text += ev.text
            c.logprobs += ev.logprobs or []
        elif isinstance(ev, ErrorEvent):
            raise RequestError(500, ev.message, code="pipeline_failed")
        else:
            c.finish_reason, c.completion_tokens, c.cached_tokens = ev.finish_reason, ev.completion_tokens, ev.cached_tokens
            n_done += 1
    return choices if n_done == n_choices else None
