"""One turn of a conversation with tools, whatever API it came in by: the conversation in (OpenAI's chat shapes,
tools.py and engine/chat.py), text and tool calls out, as they stream.

`render` makes the prompt (through the GGUF's Jinja template when tools or tool calls are in the conversation,
else through the app's apply_chat_template); `answer_format` says what shapes the answer (the request's own
constraint, or the llguidance grammar that forces a call for tool_choice "required" or a named function: not
both) and gives each choice its `CallParser` (none when no tools are offered: tool_choice "none", or no tools).
A CallParser is tools.ToolCallParser given the request's tool names (so the model's loose wrappings count, such as
Qwen2.5's fenced JSON), that stops after the first call when parallel_tool_calls is false (the caller then stops
the generation: `done`).

Two ways to run it:
  - `Turn` (Anthropic's Messages API, OpenAI's Responses API): one job of the Settings its API module made, its
    stop sequences matched here (so the reply can name the one that matched), its events the parser's Text /
    CallStart / CallArgs / CallEnd / CallFailed and then an Outcome; `fold` gathers them into blocks for a whole
    answer.
  - `parsed_events` (OpenAI's chat completions): a request's n jobs (submit.submit_request's events), each
    choice parsed by its own CallParser; the events stay serving/job.py's, with a CallEvent for each of the calls'
    pieces (a CallFailed's text is content from then on), and a finish reason "tool_calls" for a choice that made
    calls; `collect_parsed` gathers them into one ParsedChoice each. Every
    token's log-probability entry goes with its choice's next event that carries something (content, a call's
    start or a fragment of its arguments; the rest of them before the choice's "done").
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field, replace
from typing import Callable

from ..core.decoding import Constraint, Decoding
from ..serving.answer import StopMatcher
from ..serving.job import ErrorEvent, Job, Prompt, RequestError, Settings, TextEvent, new_request_id
from .submit import ServeConfig, acheck_constraint, submit_request
from .tools import (CallArgs, CallEnd, CallFailed, CallStart, Text, ToolCallParser, ToolError, ToolFormat,
                    new_call_id, prompt_tools, tool_constraint, tool_format)


@dataclass
class Conversation:
    """What a request asks, in OpenAI's chat shapes (tools.py, engine/chat.py)."""
    messages: list[dict]
    tools: list[dict] | None = None          # OpenAI's [{"type": "function", "function": {...}}], checked
    tool_choice: object = None
    parallel_tool_calls: bool | None = None
    constraint: Constraint | None = None     # the answer's format (response_format, the Responses API's text.format)
    constraint_param: str = ""


def _chat_template(tokenizer) -> str | None:
    get = getattr(tokenizer, "chat_template", None)
    return get() if callable(get) else None


def render(conv: Conversation, tokenizer, apply_chat_template: Callable[[list[dict]], str]) -> Prompt:
    """The conversation's prompt: through the GGUF's Jinja template when tools or tool calls are in it (400 when
    the model has no template), else through the app's apply_chat_template."""
    tools = prompt_tools(conv.tools, conv.tool_choice)
    needs_jinja = tools or any(m.get("tool_calls") or m["role"] == "tool" for m in conv.messages)
    if needs_jinja:
        template = _chat_template(tokenizer)
        if template is None:
            raise RequestError(400, "this model has no chat template: it cannot take tools or tool calls",
                               param="tools")
        from ..engine.chat import render_chat
        try:
            text = render_chat(template, conv.messages, tools)
        except ValueError as e:
            raise RequestError(400, str(e), param="messages") from None
    else:
        text = apply_chat_template([{"role": m["role"], "content": m.get("content") or ""} for m in conv.messages])
    users = [m["content"] for m in conv.messages if m["role"] == "user"]
    single = len(conv.messages) == 1 and len(users) == 1 and isinstance(users[0], str)
    return Prompt(tokenizer.encode(text), users[0] if single else text, single)


# ==================================================================================== the answer's format
class CallParser:
    """One choice's answer parsed as it streams (tools.ToolCallParser: feed, close, n_calls); with `single`
    (parallel_tool_calls false) nothing after the first call: `done` then, and the caller stops the generation."""

    def __init__(self, fmt: ToolFormat, names: list[str], call_id: Callable[[], str], single: bool):
        self.parser, self.single, self.done = ToolCallParser(fmt, names, call_id), single, False

    @property
    def n_calls(self) -> int:
        return self.parser.n_calls

    def _cut(self, events: list) -> list:
        if self.single:
            end = next((k for k, e in enumerate(events) if isinstance(e, CallEnd)), None)
            if end is not None:
                self.done, events = True, events[:end + 1]
        return events

    def feed(self, text: str) -> list:
        return [] if self.done else self._cut(self.parser.feed(text))

    def close(self) -> list:
        return [] if self.done else self._cut(self.parser.close())


@dataclass(frozen=True)
class AnswerFormat:
    """What shapes a conversation's answer: its constraint (and the field it came from), and the tool-call
    format its answers are parsed with (None: no tools offered)."""
    constraint: Constraint | None = None
    constraint_param: str = ""
    tool_format: ToolFormat | None = None
    names: tuple[str, ...] = ()
    single: bool = False                     # parallel_tool_calls false: one call at most

    def parser(self, call_id: Callable[[], str] = new_call_id) -> CallParser | None:
        """A new choice's parser (None without tools)."""
        if self.tool_format is None:
            return None
        return CallParser(self.tool_format, list(self.names), call_id, self.single)


def answer_format(conv: Conversation, tokenizer) -> AnswerFormat:
    """The conversation's AnswerFormat: a 400 when its tools cannot be taken (no tool-call format in the template,
    parameters llguidance cannot constrain to) or when a forced call and the conversation's own constraint would
    both constrain the answer (naming that constraint's field)."""
    constraint, param = conv.constraint, conv.constraint_param
    if not prompt_tools(conv.tools, conv.tool_choice):
        return AnswerFormat(constraint, param)
    try:
        fmt = tool_format(_chat_template(tokenizer), tokenizer)
        forced = tool_constraint(conv.tools, conv.tool_choice, conv.parallel_tool_calls, fmt)
    except ToolError as e:
        raise RequestError(400, str(e), param=e.param) from None
    if forced is not None:
        if constraint is not None:
            raise RequestError(400, f"{param}: a forced tool call and a text format cannot both constrain the "
                                    "answer", param=param)
        constraint, param = forced, "tool_choice"
    names = tuple(t["function"]["name"] for t in conv.tools)
    return AnswerFormat(constraint, param, fmt, names, conv.parallel_tool_calls is False)


@dataclass(frozen=True)
class CallEvent:
    """A piece of a tool call in a choice's events (parsed_events), with the log-probability entries it carries."""
    part: CallStart | CallArgs | CallEnd | CallFailed
    logprobs: list[dict] | None = None


# ==================================================================================== one job: Turn
@dataclass
class Outcome:
    """The end of a turn."""
    finish: str                     # "stop" | "length" | "stop_sequence" | "tool_calls" | "cancelled"
    prompt_tokens: int
    completion_tokens: int
    stop_sequence: str | None = None
    cached_tokens: int = 0          # of the prompt's tokens, taken from the prompt cache


class Turn:
    """One generation of a conversation, as `settings` ask (its API module's: one choice; its stops matched here,
    its decoding the conversation's constraint): checked and queued by `start`, then `events()`: the parser's Text /
    CallStart / CallArgs / CallEnd / CallFailed as the answer streams, then an Outcome (none when the client went
    away). A failed generation raises RequestError (500)."""

    def __init__(self, cfg: ServeConfig, tokenizer, apply_chat_template, conv: Conversation, settings: Settings,
                 call_id: Callable[[], str] = new_call_id):
        self.cfg, self.tokenizer, self.conv = cfg, tokenizer, conv
        self.prompt = render(conv, tokenizer, apply_chat_template)
        self.stops = [s for s in settings.stops if s]
        fmt = answer_format(conv, tokenizer)
        self.constraint, self.constraint_param = fmt.constraint, fmt.constraint_param
        self.parser = fmt.parser(call_id)
        # stop sequences are matched here (not by the job), so the reply can name the one that matched
        self.settings = replace(settings, stops=(), decoding=Decoding(self.constraint), n=1)
        self.request_id = new_request_id()
        self.job: Job | None = None
        self._events = None

    async def start(self, generator, request) -> "Turn":
        await acheck_constraint(self.constraint, self.tokenizer, self.constraint_param)
        jobs, self._events = submit_request(generator, self.cfg, [self.prompt], self.settings, request,
                                            self.request_id)
        self.job = jobs[0]
        return self

    def _parse(self, text: str, end: bool = False) -> list:
        if self.parser is None:
            return [Text(text)] if text else []
        out = self.parser.feed(text) + (self.parser.close() if end else [])
        if self.parser.done:
            self.job.cancelled.set()  # the one call allowed is made; its "done" still comes
        return out

    async def events(self):
        matcher, raw, hit = StopMatcher(self.stops), "", None
        async for _, ev in self._events:
            if isinstance(ev, TextEvent):
                raw += ev.text
                out = matcher.feed(ev.text)
                if matcher.hit and hit is None:
                    hit = min(self.stops, key=lambda s: (raw.find(s) if s in raw else len(raw) + 1))
                    self.job.cancelled.set()  # the generation stops; its "done" still comes
                for e in self._parse(out):
                    yield e
            elif isinstance(ev, ErrorEvent):
                raise RequestError(500, ev.message, code="pipeline_failed")
            else:
                for e in self._parse(matcher.flush(), end=True):
                    yield e
                finish = ev.finish_reason
                if hit is not None:
                    finish = "stop_sequence"
                elif self.parser is not None and self.parser.n_calls:
                    finish = "tool_calls"
                yield Outcome(finish, ev.prompt_tokens, ev.completion_tokens, hit, ev.cached_tokens)
                return


@dataclass
class Block:
    """A piece of the answer in order: text, or a tool call (its arguments' JSON text)."""
    kind: str                        # "text" | "call"
    text: str = ""
    call_id: str = ""
    name: str = ""
    call_index: int = -1
    arguments: str = ""


@dataclass
class Folded:
    blocks: list[Block] = field(default_factory=list)
    outcome: Outcome | None = None


async def fold(events) -> Folded:
    """A turn's events as its blocks in order (a call that broke down becomes text); the whole answer."""
    out = Folded()
    async for e in events:
        if isinstance(e, Outcome):
            out.outcome = e
        elif isinstance(e, CallStart):
            out.blocks.append(Block("call", call_id=e.id, name=e.name, call_index=e.index))
        elif isinstance(e, CallArgs):
            next(b for b in out.blocks if b.call_index == e.index).arguments += e.fragment
        elif isinstance(e, (Text, CallFailed)):
            if isinstance(e, CallFailed):
                out.blocks = [b for b in out.blocks if b.call_index != e.index]
            if out.blocks and out.blocks[-1].kind == "text":
                out.blocks[-1].text += e.text
            elif e.text:
                out.blocks.append(Block("text", text=e.text))
    return out


def arguments_object(text: str) -> dict:
    try:
        value = json.loads(text) if text.strip() else {}
    except json.JSONDecodeError:
        return {}
    return value if isinstance(value, dict) else {}


# ==================================================================================== n jobs: chat completions
async def parsed_events(events, parsers: list[CallParser], jobs: list[Job]):
    """submit.submit_request's (index, event)s with each choice's text parsed by its parser (the module docstring):
    parsed text as TextEvents, a call's pieces as CallEvents, a choice that made calls finishing with "tool_calls";
    a choice whose parser is done is stopped."""
    held: list[list[dict] | None] = [None] * len(parsers)   # entries waiting for their choice's next event

    def shaped(i: int, parsed: list):
        for e in parsed:
            entries = None
            if isinstance(e, CallStart) or getattr(e, "text", "") or getattr(e, "fragment", ""):
                entries, held[i] = held[i], None   # an event with something to send takes the entries held
            if not isinstance(e, Text):
                yield i, CallEvent(e, entries)
            elif e.text:
                yield i, TextEvent(e.text, entries)

    async for i, ev in events:
        if isinstance(ev, TextEvent):
            if ev.logprobs is not None:
                held[i] = (held[i] or []) + ev.logprobs
            for out in shaped(i, parsers[i].feed(ev.text)):
                yield out
            if parsers[i].done:
                jobs[i].cancelled.set()  # the one call allowed is made; its "done" still comes
        elif isinstance(ev, ErrorEvent):
            yield i, ev
        else:
            for out in shaped(i, parsers[i].close()):
                yield out
            if held[i]:
                yield i, TextEvent("", held[i])
                held[i] = None
            yield i, replace(ev, finish_reason="tool_calls") if parsers[i].n_calls else ev


@dataclass
class ParsedChoice:
    """One choice's whole answer, its calls parsed (OpenAI's {"id", "type", "function": {"name", "arguments"}})."""
    text: str = ""
    tool_calls: list[dict] = field(default_factory=list)
    logprobs: list[dict] = field(default_factory=list)
    finish_reason: str | None = None
    completion_tokens: int = 0
    cached_tokens: int = 0           # of the prompt's tokens, taken from the prompt cache


async def collect_parsed(events, n_choices: int) -> list[ParsedChoice] | None:
    """Every choice's whole answer from parsed_events; None when the client went away. A failed generation raises
    RequestError (500). A call that broke down is dropped (its text is in the content)."""
    choices = [ParsedChoice() for _ in range(n_choices)]
    calls: list[dict[int, dict]] = [{} for _ in range(n_choices)]
    n_done = 0
    async for index, ev in events:
        c = choices[index]
        if isinstance(ev, (TextEvent, CallEvent)):
            c.logprobs += ev.logprobs or []
        if isinstance(ev, TextEvent):
            c.text += ev.text
        elif isinstance(ev, CallEvent):
            e = ev.part
            if isinstance(e, CallStart):
                calls[index][e.index] = {"id": e.id, "type": "function", "function": {"name": e.name, "arguments": ""}}
            elif isinstance(e, CallArgs):
                calls[index][e.index]["function"]["arguments"] += e.fragment
            elif isinstance(e, CallFailed):
                calls[index].pop(e.index, None)
                c.text += e.text
        elif isinstance(ev, ErrorEvent):
            raise RequestError(500, ev.message, code="pipeline_failed")
        else:
            c.finish_reason, c.completion_tokens, c.cached_tokens = ev.finish_reason, ev.completion_tokens, ev.cached_tokens
            n_done += 1
    if n_done < n_choices:
        return None
    for c, mine in zip(choices, calls):
        c.tool_calls = list(mine.values())
    return choices
