"""A route's common work, whatever its API: a body read and checked (`read_body`, for the routes that answer its
errors in their own shape; a constraint before any token: `check_constraint`); the model a reply names
(`reply_model`); a request's Prompts and Settings (serving/job.py, made by the API module) sent down to the
generator in one move (`submit_request`: one Job per choice, each checked against the context, then every one
queued), its events coming back as `(choice index, event)`; `collect` gathers them into one Choice each for a whole
answer. Every sampled reply names its seed (`with_seed`).
"""
from __future__ import annotations

import asyncio
from dataclasses import dataclass, field, replace
from typing import Callable

from fastapi import Request
from fastapi.responses import JSONResponse, Response
from pydantic import BaseModel, ValidationError

from ..core.decoding import Constraint
from ..serving.job import DoneEvent, ErrorEvent, Job, Prompt, RequestError, Settings, TextEvent, bad


@dataclass
class ServeConfig:
    model_id: str
    n_ctx: int
    cells_reserve: int      # KV cells runs in flight may take beyond the prompt and the answer
    default_max_tokens: int
    webui: bool = True      # the web page at / (frontend/page.py; --no-webui turns it off)
    aliases: tuple[str, ...] = ()  # more names of the model (--alias), listed in /v1/models after model_id

    @property
    def model_names(self) -> tuple[str, ...]:
        """The names /v1/models lists: the model's id, then its aliases (each once)."""
        return tuple(dict.fromkeys((self.model_id, *self.aliases)))


# the response header that names the seed a request sampled with (choice j: + j), the one it asked for or the one
# drawn for it: sent back as `seed`, it reproduces the answer
SEED_HEADER = "X-Seed"


def with_seed(reply, seed: int) -> Response:
    """A route's reply (a JSON body or a Response) naming its seed in SEED_HEADER."""
    response = reply if isinstance(reply, Response) else JSONResponse(reply)
    response.headers[SEED_HEADER] = str(seed)
    return response


# ------------------------------------------------------------------------------------ checks and jobs
async def read_body(request: Request, model: type[BaseModel], describe: Callable[[ValidationError], RequestError]):
    """The JSON body validated by `model` (RequestError 400 naming the field; never FastAPI's 422 path)."""
    try:
        raw = await request.json()
    except (ValueError, UnicodeDecodeError) as e:
        raise RequestError(400, f"the body is not valid JSON: {e}") from None
    if not isinstance(raw, dict):
        raise RequestError(400, "the body must be a JSON object")
    try:
        return model.model_validate(raw)
    except ValidationError as e:
        raise describe(e) from None


def validation_error(e: ValidationError) -> RequestError:
    """pydantic's first complaint as a 400 naming the field (a dotted path: messages.0.role)."""
    first = e.errors()[0] if e.errors() else {}
    where = ".".join(str(x) for x in first.get("loc", ()))
    msg = first.get("msg", "invalid request body")
    if first.get("type") == "missing":
        msg = "Field required"
    return RequestError(400, f"{where or 'body'}: {msg}", param=where or None)


def reply_model(cfg: ServeConfig, asked: str) -> str:
    """The model a reply names: the name the request asked for when it is one of the served names (the model's id
    or an --alias), else the model's id. Any name is answered, as llama-server does: one model is served, and an
    application that hard-codes another model's name still gets its answers (--alias lists that name too)."""
    return asked if asked in cfg.model_names else cfg.model_id


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


def _make_jobs(cfg: ServeConfig, prompts: list[Prompt], s: Settings, request_id: str) -> list[Job]:
    """One job per prompt per choice, prompt i's choice j at index i * n + j (OpenAI's order) sampling as the
    request asks with seed + j, each checked against the context (RequestError); a request of several jobs logs
    them as request_id-k. Call from the event loop (the jobs answer on it)."""
    loop = asyncio.get_running_loop()
    jobs = []
    for i, p in enumerate(prompts):
        if not p.tokens:
            raise bad("prompt" if len(prompts) == 1 else f"prompt.{i}", "the prompt is empty")
        n_predict = _n_predict(cfg, len(p.tokens), s)
        for j in range(s.n):
            k = i * s.n + j
            sampling = replace(s.sampling, seed=s.sampling.seed + j)
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
def submit_request(generator, cfg: ServeConfig, prompts: list[Prompt], s: Settings, request, request_id: str):
    """A request sent down to `generator`: its jobs, every one made and checked against the context before the
    first is queued, then queued, all or none (one refused cancels those already queued: RequestError). Returns
    the jobs and their events: (choice index, event) as they come, until every job is done or one failed. A client
    that leaves (checked twice a second while nothing comes, and when a streaming response is cancelled) stops
    every generation."""
    jobs = _make_jobs(cfg, prompts, s, request_id)
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
    return jobs, events()


@dataclass
class Choice:
    """One choice's whole answer."""
    text: str = ""
    logprobs: list[dict] = field(default_factory=list)  # answer.py's entries (none when not asked for)
    finish_reason: str | None = None
    completion_tokens: int = 0
    cached_tokens: int = 0          # of the prompt's tokens, taken from the prompt cache


async def collect(events, n_choices: int) -> list[Choice] | None:
    """Every choice's whole answer from submit_request's events; None when the client went away. A failed
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
