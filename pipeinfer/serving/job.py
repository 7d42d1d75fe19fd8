"""One generation asked of rank 0, whatever front end it came from (the HTTP server, a supervisor, a batch file),
and what every front end shares about it: the request refused (RequestError, OpenAI's error shape), the prompt,
the settings, and the one conversion of a request's sampling fields into the SamplingParams its generations sample
with (`sampling_of`: the defaults, the seed).

Declared here, as Protocols, what each side asks of the other: a Generation (every kind of job the generation
thread and the supervisor serve: an HTTP request's Job, a supervised `generate`'s StdoutJob), a TokenMeter (the
live page's counters a job may carry) and a Generator (what the HTTP server drives: rank 0's generation thread,
feeders/generator.py, or a supervisor, supervisor/supervisor.py).

A Job carries plain data only (token ids, SamplingParams, stop strings, Decoding) besides its event queue and
cancel flag: a supervised server sends it to rank 0 over a socket (link.py). Its events, the same for every API,
are TextEvent (pieces of the answer), then one DoneEvent or one ErrorEvent.
"""
from __future__ import annotations

import asyncio
import secrets
import threading
import time
import uuid
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Callable, Protocol, Union

from ..core.decoding import Decoding
from ..core.sampling import SamplingParams

if TYPE_CHECKING:
    from ..core.metrics import Stats

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


@dataclass(frozen=True)
class Prompt:
    tokens: list[int]       # what the target reads
    text: str | None        # what a drafter that reads text reads
    chat: bool = False      # a lone user message: the draft formats it its own way


def sampling_of(temperature: float | None = None, top_p: float | None = None, top_k: int | None = None,
                seed: int | None = None) -> SamplingParams:
    """A request's sampling fields (None: not given) as what its generations sample with, for every API: greedy,
    no top-k and no top-p unless asked; the seed asked for, else a fresh one when it samples, so that a sampled
    request without a seed is a new draw each time (as OpenAI's API and llama-server do); greedy, 0 (unused)."""
    temp = temperature or 0.0
    if seed is None:
        seed = secrets.randbits(32) if temp > 0 else 0
    return SamplingParams(temp=temp, top_k=top_k or 0, top_p=1.0 if top_p is None else top_p, seed=seed)


@dataclass(frozen=True)
class Settings:
    """What a request asks of each of its generations."""
    max_tokens: int | None = None   # None: the server's default, within the room the context leaves
    max_tokens_param: str = "max_tokens"  # the field it came from, for an error
    sampling: SamplingParams = SamplingParams()  # sampling_of's; choice j of a prompt samples with its seed + j
    stops: tuple[str, ...] = ()
    decoding: Decoding = Decoding()
    n: int = 1                      # choices per prompt
    cache_prompt: bool = True       # llama-server's: start from the prompt cache, and leave the prompt in it


def new_request_id() -> str:
    return uuid.uuid4().hex[:24]


# ------------------------------------------------------------------------------------ a job's events
@dataclass(frozen=True)
class TextEvent:
    """A piece of the answer, with the log-probabilities of the tokens whose text it completes (answer.py: OpenAI's
    chat entries {token, logprob, bytes, top_logprobs}); None: not asked for."""
    text: str
    logprobs: list[dict] | None = None


@dataclass(frozen=True)
class DoneEvent:
    """The answer is whole: why it ended ("stop", "length", "cancelled"; a front end may refine it), its counts
    (cached_tokens: the prompt's tokens taken from the prompt cache) and the generation's statistics."""
    finish_reason: str
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int = 0
    stats: Stats | None = None


@dataclass(frozen=True)
class ErrorEvent:
    """The generation failed (every other choice of the request is cancelled)."""
    message: str


Event = Union[TextEvent, DoneEvent, ErrorEvent]


# ------------------------------------------------------------------------------------ the interfaces
class TokenMeter(Protocol):
    """Counts a job's tokens and its end as they happen (frontend/state.Meter: the live page's numbers)."""

    def on_tokens(self, n: int) -> None: ...

    def on_done(self, job: Generation, stats: Stats, finish: str) -> None: ...


class Generation(Protocol):
    """One generation asked of rank 0, whoever asked it: what the generation thread, the supervisor and an
    answer (answer.Answer) read of it, and how its events and token ids come back."""
    prompt_tokens: list[int]
    n_predict: int
    sampling: SamplingParams
    stops: list[str]
    prompt_text: str | None
    chat: bool
    decoding: Decoding
    cache_prompt: bool               # false: neither starts from the prompt cache nor leaves its prompt in it
    cancelled: threading.Event
    request_id: str
    t_queued_s: float                # when it arrived (time.perf_counter, on the process it arrived at)
    t_first_token_s: float           # when its first token reached its answer (answer.Answer; 0: none yet)
    meter: TokenMeter | None

    def push(self, event: Event) -> None: ...

    def on_token_ids(self, tokens: list[int]) -> None: ...


def time_to_first_token_s(job: Generation) -> float:
    """Time to first token as the server reports it (its request log, /metrics, the page): from the request's
    arrival to its first token reaching its answer, so the wait for admission, the prompt's processing and (on a
    supervised server) the way back from rank 0 all count, as in vLLM's metric; 0 when no token came. `generate`
    and the --results rows keep the paper's TTFT instead (core/metrics.Stats.ttft_s: from the end of the prompt)."""
    return max(0.0, job.t_first_token_s - job.t_queued_s) if job.t_first_token_s else 0.0


class Generator(Protocol):
    """What the HTTP server drives: submit (RequestError 503 when it cannot take the job), fatal (why the pipeline
    failed, or None), parallel (generations at once), load() (the queue, the cells, the stages: /health's), log,
    and on_done(job, stats, finish) after each answer."""
    fatal: str | None
    parallel: int
    log: Callable[[str], None]
    on_done: Callable[[Generation, Stats, str], None] | None

    def submit(self, job: Generation) -> None: ...

    def load(self) -> dict: ...


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
    t_first_token_s: float = 0.0     # set by answer.Answer (time_to_first_token_s)
    meter: TokenMeter | None = None  # the live page's counters (frontend/state.py sets it)

    def push(self, event: Event) -> None:
        try:
            self.loop.call_soon_threadsafe(self.events.put_nowait, (self.index, event))
        except RuntimeError:  # the server's event loop has closed (it stopped): no one is left to read the event
            pass

    def on_token_ids(self, tokens: list[int]) -> None:
        """The ids as they come (a supervised generate keeps them for its results row); a client needs only text."""
