"""The supervisor <-> rank 0 link of a supervised server (supervisor.py <-> attach.py): its messages, declared
once, and the socket that carries them.

One JSON object per line each way over a local Unix socket, `{"op": ..., field: value, ...}`. It stays JSON
(unlike the MPI messages, core/protocol): it carries start-up and control at a low rate, a few dozen bytes per
token, and a line of it reads as it is in a log. Every value goes by name: a field declared as a dataclass
(Generate's SamplingParams) is an object of its fields, `"sampling": {"temp": 0.7, "top_k": 40, ...}`.

    supervisor -> rank 0:  Generate (op "generate"), Cancel ("cancel"), Stop ("stop")
    rank 0 -> supervisor:  Ready ("ready", once, when it attaches), Tokens ("tokens"), Done ("done"),
                           JobError ("error": a request rank 0 refused), Stages ("stages": the stages' counters)

A line that is not one of these (not JSON, an unknown op, a field missing, unknown or of the wrong type) raises
LinkError with one line saying which.
"""
from __future__ import annotations

import json
import socket
import threading
import types
import typing
from dataclasses import MISSING, Field, dataclass, fields, is_dataclass
from typing import ClassVar, Iterator, Union

from ..core.decoding import TokenLogprob
from ..core.sampling import SamplingParams


class LinkError(ValueError):
    """A line that is not a message of this link."""


class LinkClosed(OSError):
    """A send on a link that was closed."""


# ------------------------------------------------------------------------------------ supervisor -> rank 0
@dataclass(frozen=True)
class Generate:
    """Generate for a request: its prompt, the tokens it already streamed (`replay`: decoded again as they first
    were, after a re-form), how many more to generate and how to sample them."""
    op: ClassVar[str] = "generate"
    id: int
    prompt: list[int]
    replay: list[int]
    n_predict: int
    sampling: SamplingParams                 # by its fields' names: {"temp", "top_k", "top_p", "seed"}
    prompt_text: str | None = None           # for the drafters that read text
    chat: bool = False
    decoding: dict | None = None             # core.decoding.Decoding.to_dict(): constraint, biases, log-probabilities
    cache_prompt: bool = True                # false: the prompt neither starts from the prompt cache nor stays in it


@dataclass(frozen=True)
class Cancel:
    """Stop that request's runs (its client left, or a stop string matched); rank 0 still answers Done."""
    op: ClassVar[str] = "cancel"
    id: int


@dataclass(frozen=True)
class Stop:
    """Finish the jobs in flight, then end the pipeline."""
    op: ClassVar[str] = "stop"


# ------------------------------------------------------------------------------------ rank 0 -> supervisor
@dataclass(frozen=True)
class Ready:
    """Rank 0 attached: the job's target ranks, how many generations it runs at once, every rank's (host, pid)
    (the supervisor names a rank that the launcher reports by its pid) and the bytes each rank's host had
    available before the job loaded its model (what a re-form on fewer hosts is checked against)."""
    op: ClassVar[str] = "ready"
    ranks: int
    parallel: int
    ranks_at: list[tuple[str, int]]
    mem_available: list[int]
    layers: list[tuple[int, int]] | None = None  # each target rank's layer range [start, end) (the web page)
    threads: list[int] | None = None             # each target rank's --threads (the web page)
    prompt_cache: dict | None = None             # the scheduler's prompt cache and cells (Scheduler.cache_load)


@dataclass(frozen=True)
class Tokens:
    """A request's next tokens (and their log-probabilities when it asked: [token, logprob, [[id, logprob], ...]])."""
    op: ClassVar[str] = "tokens"
    id: int
    tokens: list[int]
    logprobs: list | None = None

    @classmethod
    def of(cls, id: int, tokens: list[int], logprobs: list[TokenLogprob]) -> Tokens:
        return cls(id, list(tokens), [[lp.token, lp.logprob, [list(t) for t in lp.top]] for lp in logprobs]
                   if logprobs else None)

    def token_logprobs(self) -> list[TokenLogprob] | None:
        if self.logprobs is None:
            return None
        return [TokenLogprob(t, lp, tuple(tuple(x) for x in top)) for t, lp, top in self.logprobs]


@dataclass(frozen=True)
class Done:
    """A request finished: its statistics (core.metrics.Stats.to_dict), and the prompt cache as it left it (/health
    of the supervisor: Scheduler.cache_load)."""
    op: ClassVar[str] = "done"
    id: int
    stats: dict
    prompt_cache: dict | None = None


@dataclass(frozen=True)
class JobError:
    """Rank 0 refused a request (it does not fit): the reason, for its client."""
    op: ClassVar[str] = "error"
    id: int
    message: str


@dataclass(frozen=True)
class Stages:
    """Every stage's counters as rank 0 has them (HeadSession.stages: rank, host and protocol.StageReport's fields,
    counted since this job started), for the supervisor's /metrics and /state; sent when they changed, at most
    every STAGES_EVERY_S."""
    op: ClassVar[str] = "stages"
    stages: list[dict]


STAGES_EVERY_S = 1.0

TO_RANK0 = (Generate, Cancel, Stop)
TO_SUPERVISOR = (Ready, Tokens, Done, JobError, Stages)
Message = Union[Generate, Cancel, Stop, Ready, Tokens, Done, JobError, Stages]
BY_OP: dict[str, type] = {cls.op: cls for cls in (*TO_RANK0, *TO_SUPERVISOR)}
VALUES = (SamplingParams,)  # the dataclasses a message's field may be (sent as an object of their fields)
_HINTS = {cls: typing.get_type_hints(cls) for cls in (*BY_OP.values(), *VALUES)}  # each field's type, read once


def _named(value):
    """A field's value as JSON takes it: a dataclass as an object of its fields, by name."""
    return {f.name: getattr(value, f.name) for f in fields(value)} if is_dataclass(value) else value


def encode(msg: Message) -> str:
    """`msg` as its line (newline included)."""
    body = {"op": msg.op, **{f.name: _named(getattr(msg, f.name)) for f in fields(msg)}}
    return json.dumps(body, separators=(",", ":")) + "\n"


def decode(line: str, expected: tuple[type, ...] = (*TO_RANK0, *TO_SUPERVISOR)) -> Message:
    """The message on `line`, one of `expected` (the kinds this end receives); LinkError where it is not."""
    try:
        body = json.loads(line)
    except ValueError as e:
        raise LinkError(f"not a JSON line: {e}: {line.strip()[:120]!r}") from None
    if not isinstance(body, dict) or not isinstance(body.get("op"), str):
        raise LinkError(f"not a message (an object with an \"op\"): {line.strip()[:120]!r}")
    op = body.pop("op")
    cls = BY_OP.get(op)
    if cls not in expected:
        what = "unknown op" if cls is None else "op going the other way:"
        raise LinkError(f"{what} {op!r} (this end takes: {', '.join(c.op for c in expected)})")
    hints = _HINTS[cls]
    unknown = sorted(set(body) - {f.name for f in fields(cls)})
    if unknown:
        raise LinkError(f"{op}: unknown field(s) {', '.join(unknown)}")
    if missing := _missing(body, cls):
        raise LinkError(f"{op}: field {missing!r} missing")
    for name, value in body.items():
        if not _fits(value, hints[name]):
            raise LinkError(f"{op}: field {name!r} is not {_type_name(hints[name])}: {value!r:.80}")
    return cls(**{name: _as_declared(value, hints[name]) for name, value in body.items()})


def _required(f: Field) -> bool:
    return f.default is MISSING and f.default_factory is MISSING


def _missing(body: dict, cls) -> str | None:
    """The first field of dataclass `cls` without a default that `body` lacks (None: none)."""
    return next((f.name for f in fields(cls) if _required(f) and f.name not in body), None)


def _fits(value, hint) -> bool:
    """Whether a decoded JSON value has the declared type (a tuple arrives as a list; an int is a float; a
    dataclass as an object of its fields, those with a default optional)."""
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin in (Union, types.UnionType):
        return any(_fits(value, a) for a in args)
    if hint in VALUES:
        return (isinstance(value, dict) and set(value) <= {f.name for f in fields(hint)}
                and _missing(value, hint) is None and all(_fits(v, _HINTS[hint][k]) for k, v in value.items()))
    if hint is type(None):
        return value is None
    if isinstance(value, bool) and hint is not bool:  # JSON's true is no number
        return False
    if origin is list:
        return isinstance(value, list) and all(_fits(v, args[0]) for v in value)
    if origin is tuple:
        return (isinstance(value, (list, tuple)) and len(value) == len(args)
                and all(_fits(v, a) for v, a in zip(value, args)))
    if hint is float:
        return isinstance(value, (int, float))
    return isinstance(value, origin or hint)


def _as_declared(value, hint):
    """A value that _fits `hint` with its lists that are declared tuples made tuples (a message decodes equal to
    the one encoded)."""
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin in (Union, types.UnionType):  # X | None: as the member it fits
        return next((_as_declared(value, a) for a in args if a is not type(None) and _fits(value, a)), value)
    if hint in VALUES:
        return hint(**{k: _as_declared(v, _HINTS[hint][k]) for k, v in value.items()})
    if hint is float:
        return float(value)
    if origin is tuple:
        return tuple(_as_declared(v, a) for v, a in zip(value, args))
    if origin is list:
        return [_as_declared(v, args[0]) for v in value]
    return value


def _type_name(hint) -> str:
    return hint.__name__ if isinstance(hint, type) else str(hint).replace("typing.", "")


class Link:
    """One end of the socket, a message per line each way; sends from any thread, receives on one."""

    def __init__(self, sock: socket.socket, receives: tuple[type, ...]):
        self.sock = sock
        self.receives = receives  # the kinds of message this end takes
        self._out = sock.makefile("w", encoding="utf-8")
        self._in = sock.makefile("r", encoding="utf-8")
        self._lock = threading.Lock()
        self._closed = False

    @classmethod
    def connect(cls, path: str) -> Link:
        """Rank 0's end: connect to the supervisor's socket."""
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.connect(path)
        return cls(sock, TO_RANK0)

    def send(self, msg: Message) -> None:
        """OSError where the other end is gone (LinkClosed where this end was closed)."""
        line = encode(msg)
        with self._lock:
            if self._closed:
                raise LinkClosed(f"the link is closed ({msg.op} not sent)")
            self._out.write(line)
            self._out.flush()

    def receive(self) -> Message | None:
        """The next message; None once the other end closed the socket."""
        line = self._in.readline()
        return decode(line, self.receives) if line else None

    def messages(self) -> Iterator[Message]:
        while (msg := self.receive()) is not None:
            yield msg

    def close(self) -> None:
        """Close from any thread: a receive blocked on the other end returns None."""
        with self._lock:
            self._closed = True
        try:
            self.sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass  # not connected any more
        for f in (self._out, self._in, self.sock):
            try:
                f.close()
            except OSError:
                pass  # the other end is gone already: nothing to flush
