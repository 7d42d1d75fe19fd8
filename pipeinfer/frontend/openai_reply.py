"""OpenAI's reply shapes for chat and completions: a request's events (submit.submit_request's) as one JSON answer
or as server-sent events (sse.py), every choice under its index.

Streamed: chat opens each choice with a chunk holding the assistant's role; then a chunk per piece of text (the
choices interleaved as their pieces come, each chunk one choice; with tools, the pieces of each call as OpenAI's
delta.tool_calls: [{index, id, type: function, function: {name, arguments: ""}}] at its start, then [{index,
function: {arguments: fragment}}], turn.py parsing the text; a call that breaks down once started goes on as
content), a chunk with each choice's finish reason, the usage when stream_options.include_usage asks (after every
choice finished), then `data: [DONE]`. A failed generation ends the stream with an error object instead. Usage
counts each prompt's tokens once and every choice's completion tokens (as OpenAI does with n and with a list of
prompts); prompt_tokens_details.cached_tokens: the prompt tokens taken from the prompt cache (a prompt's fewest
among its choices).

Log-probabilities (answer.py's entries, OpenAI's chat shape) go out with the piece of text that completes their
tokens: chat as `logprobs: {"content": [...], "refusal": null}`, completions in the legacy shape {tokens,
token_logprobs, top_logprobs: [{token: logprob}], text_offset}, where a token's offset is the sum of the lengths
of the tokens before it in its choice (its piece decoded; exact while each token holds whole characters). With
tools, every token's entry, its text content or a call's, goes with its choice's next chunk (turn.parsed_events).
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Callable

from fastapi.responses import JSONResponse

from ..serving.job import ErrorEvent, Job, Prompt, RequestError, TextEvent
from . import sse
from .submit import collect
from .tools import CallArgs, CallFailed, CallStart
from .turn import CallEvent, CallParser, ParsedChoice, collect_parsed, parsed_events


def chat_logprobs(entries: list[dict], _offset: int) -> dict:
    return {"content": entries, "refusal": None}


def legacy_logprobs(entries: list[dict], offset: int) -> dict:
    """The completions' shape; `offset`: the text's length before the first of these tokens."""
    offsets = []
    for e in entries:
        offsets.append(offset)
        offset += len(e["token"])
    tops = []
    for e in entries:
        top = {t["token"]: t["logprob"] for t in e["top_logprobs"]}
        top.setdefault(e["token"], e["logprob"])  # OpenAI: up to logprobs + 1, the chosen token's always there
        tops.append(top)
    return {"tokens": [e["token"] for e in entries], "token_logprobs": [e["logprob"] for e in entries],
            "top_logprobs": tops, "text_offset": offsets}


def _completion_choice(index: int, text: str | None, finish: str | None, logprobs: dict | None) -> dict:
    return {"index": index, "text": text or "", "finish_reason": finish, "logprobs": logprobs}


def _chat_delta(index: int, text: str | None, finish: str | None, logprobs: dict | None) -> dict:
    return {"index": index, "delta": {"content": text} if text or logprobs else {}, "finish_reason": finish,
            "logprobs": logprobs}


def _chat_message(index: int, text: str, finish: str | None, logprobs: dict | None) -> dict:
    return {"index": index, "message": {"role": "assistant", "content": text}, "finish_reason": finish,
            "logprobs": logprobs}


def _chat_call_message(index: int, c: ParsedChoice, logprobs: dict | None) -> dict:
    """A whole chat choice whose answer was parsed for tool calls: content null when empty beside calls."""
    message = {"role": "assistant", "content": c.text}
    if c.tool_calls:
        message.update(content=c.text or None, tool_calls=c.tool_calls)
    return {"index": index, "message": message, "finish_reason": c.finish_reason, "logprobs": logprobs}


def _chat_call_delta(index: int, e, logprobs: dict | None) -> dict | None:
    """A streamed piece of a tool call (OpenAI's delta.tool_calls: the id, type and name at the call's start, then
    its arguments in fragments), or a broken call's text as content; None when there is nothing to send."""
    if isinstance(e, CallStart):
        delta = {"tool_calls": [{"index": e.index, "id": e.id, "type": "function",
                                 "function": {"name": e.name, "arguments": ""}}]}
    elif isinstance(e, CallArgs) and e.fragment:
        delta = {"tool_calls": [{"index": e.index, "function": {"arguments": e.fragment}}]}
    elif isinstance(e, CallFailed) and e.text:
        delta = {"content": e.text}
    else:
        return None
    return {"index": index, "delta": delta, "finish_reason": None, "logprobs": logprobs}


def _chat_opening(index: int) -> dict:
    return {"index": index, "delta": {"role": "assistant", "content": ""}, "finish_reason": None, "logprobs": None}


Shape = Callable[[int, "str | None", "str | None", "dict | None"], dict]  # (index, text, finish, logprobs) -> choice


@dataclass(frozen=True)
class ReplyKind:
    """What differs between OpenAI's chat and completion replies; the rest of a reply is the same for both."""
    id_prefix: str
    object_name: str                 # the whole answer's "object"
    chunk_object: str                # a streamed chunk's "object"
    piece: Shape                     # a streamed choice
    whole: Shape                     # the whole answer's choice
    logprobs: Callable[[list[dict], int], dict]      # (entries, text offset) -> a choice's "logprobs"
    opening: Callable[[int], dict] | None = None     # the choice streamed before any text (chat: the role)


COMPLETION = ReplyKind("cmpl-", "text_completion", "text_completion", _completion_choice, _completion_choice,
                       legacy_logprobs)
CHAT = ReplyKind("chatcmpl-", "chat.completion", "chat.completion.chunk", _chat_delta, _chat_message,
                 chat_logprobs, opening=_chat_opening)


def _usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int = 0) -> dict:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens,
            "prompt_tokens_details": {"cached_tokens": cached_tokens}}


@dataclass(frozen=True)
class Reply:
    """One request's reply: the same id, time and model on every object, in the shape of its kind."""
    kind: ReplyKind
    request_id: str
    model_id: str
    n_choices: int = 1
    prompt_tokens: int = 0           # every prompt's tokens, each counted once
    logprobs: bool = False           # asked for: every choice carries "logprobs"
    tools: bool = False              # chat: the events are turn.parsed_events' (tool calls parsed)
    per_prompt: int = 1              # choices per prompt (choice i answers prompt i // per_prompt)
    created: int = field(default_factory=lambda: int(time.time()))

    def cached(self, per_choice: list[int]) -> int:
        """The prompt tokens taken from the prompt cache: each prompt's fewest among its choices."""
        n = max(1, self.per_prompt)
        return sum(min(per_choice[i:i + n]) for i in range(0, len(per_choice), n))

    def body(self, object_name: str, choices: list, **more) -> dict:
        return {"id": self.kind.id_prefix + self.request_id, "object": object_name, "created": self.created,
                "model": self.model_id, "choices": choices, **more}

    def chunk(self, choice: dict) -> str:
        return sse.data(self.body(self.kind.chunk_object, [choice]))

    async def stream(self, events, want_usage: bool):
        """Server-sent events from submit_request's (index, event)s (the shape in the module docstring)."""
        if self.kind.opening is not None:
            for i in range(self.n_choices):
                yield self.chunk(self.kind.opening(i))
        offsets, completion, cached = [0] * self.n_choices, 0, [0] * self.n_choices
        async for i, ev in events:
            if isinstance(ev, TextEvent):
                shaped = None
                if self.logprobs:
                    shaped = self.kind.logprobs(ev.logprobs or [], offsets[i])
                    offsets[i] += sum(len(e["token"]) for e in ev.logprobs or [])
                yield self.chunk(self.kind.piece(i, ev.text, None, shaped))
            elif isinstance(ev, CallEvent):
                choice = _chat_call_delta(i, ev.part, self.kind.logprobs(ev.logprobs or [], 0) if self.logprobs else None)
                if choice is not None:
                    yield self.chunk(choice)
            elif isinstance(ev, ErrorEvent):
                yield sse.data(RequestError(500, ev.message).body())
                return
            else:
                completion += ev.completion_tokens
                cached[i] = ev.cached_tokens
                yield self.chunk(self.kind.piece(i, None, ev.finish_reason, None))
        if want_usage:
            yield sse.data(self.body(self.kind.chunk_object, [],
                                     usage=_usage(self.prompt_tokens, completion, self.cached(cached))))
        yield sse.DONE

    async def whole(self, events):
        """One JSON answer once every choice is done."""
        choices = await (collect_parsed if self.tools else collect)(events, self.n_choices)
        if choices is None:  # the client went away
            return JSONResponse({}, status_code=499)
        if self.tools:
            shaped = [_chat_call_message(i, c, self.kind.logprobs(c.logprobs, 0) if self.logprobs else None)
                      for i, c in enumerate(choices)]
        else:
            shaped = [self.kind.whole(i, c.text, c.finish_reason, self.kind.logprobs(c.logprobs, 0)
                                      if self.logprobs else None) for i, c in enumerate(choices)]
        return self.body(self.kind.object_name, shaped,
                         usage=_usage(self.prompt_tokens, sum(c.completion_tokens for c in choices),
                                      self.cached([c.cached_tokens for c in choices])))


async def respond(kind: ReplyKind, model_id: str, stream: bool, want_usage: bool, prompts: list[Prompt],
                  jobs: list[Job], events, request_id: str, parser: Callable[[], CallParser | None] | None = None):
    """The reply to the queued `jobs` from their `events` (submit.submit_request's), streamed (server-sent events)
    or whole, as the request asks. `parser` (chat with tools: turn.AnswerFormat.parser) gives each choice its
    tool-call parser."""
    parsers = [parser() for _ in jobs] if parser is not None else []
    tools = bool(parsers) and parsers[0] is not None
    reply = Reply(kind, request_id, model_id, len(jobs), sum(len(p.tokens) for p in prompts),
                  jobs[0].decoding.top_logprobs is not None, tools, len(jobs) // max(1, len(prompts)))
    if tools:
        events = parsed_events(events, parsers, jobs)
    if stream:
        return sse.JobStream(reply.stream(events, want_usage), jobs)
    return await reply.whole(events)
