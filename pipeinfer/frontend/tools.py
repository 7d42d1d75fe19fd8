"""Tool calls: OpenAI's `tools` / `tool_choice` / `parallel_tool_calls` checked, the model's tool-call syntax
(ToolFormat) found in its chat template, the generated text parsed into content and calls as it streams
(ToolCallParser), the grammar that forces a call for `tool_choice` "required" or a named function
(tool_constraint), and Anthropic's tools and messages mapped onto OpenAI's shapes.

Shapes, OpenAI's: a tool {"type": "function", "function": {"name", "description"?, "parameters"?: JSON schema,
"strict"?}}; tool_choice "none" | "auto" | "required" | {"type": "function", "function": {"name"}}; a call
{"id": "call_<24 hex>", "type": "function", "function": {"name", "arguments": JSON text of an object}}.

The Hermes format (Qwen2.5, Qwen3, Hermes, many fine-tunes) wraps each call as the template writes it:
`<tool_call>\n{"name": "f", "arguments": {...}}\n</tool_call>`, calls one after another separated by "\n". In the
Qwen2.5 vocabulary <tool_call> (151657) and </tool_call> (151658) are single user-defined tokens whose text the
detokenizer writes out, so the parser sees them in the streamed text and the grammar names them by id.
A template without a known format cannot take tools: ToolError (rather than tools described in a made-up system
message the model was never trained on).
"""
from __future__ import annotations

import json
import re
import secrets
from dataclasses import dataclass, replace
from typing import Callable, Union

import jsonschema
import llguidance

from ..core.decoding import Constraint

NAME_PATTERN = re.compile(r"^[a-zA-Z0-9_-]{1,64}$")   # OpenAI's rule for function names
MAX_TOOLS = 128
CHOICES = ("none", "auto", "required")


class ToolError(ValueError):
    """A request's tools refused; `param` names the field ("tools.0.function.name"), for the error's `param`."""

    def __init__(self, param: str, message: str):
        super().__init__(f"{param}: {message}")
        self.param, self.message = param, message


# ---------------------------------------------------------------- checking a request's tools
def check_tools(tools, tool_choice, parallel_tool_calls) -> None:
    """Raise ToolError naming the field when the tools, the tool_choice or parallel_tool_calls are malformed."""
    if tools is not None:
        if not isinstance(tools, list):
            raise ToolError("tools", "must be a list of tools")
        if len(tools) > MAX_TOOLS:
            raise ToolError("tools", f"{len(tools)} tools, at most {MAX_TOOLS}")
        seen: set[str] = set()
        for i, tool in enumerate(tools):
            name = _check_tool(tool, f"tools.{i}")
            if name in seen:
                raise ToolError(f"tools.{i}.function.name", f"'{name}' is defined twice")
            seen.add(name)
    _check_choice(tool_choice, [t["function"]["name"] for t in tools or []])
    if parallel_tool_calls is not None and not isinstance(parallel_tool_calls, bool):
        raise ToolError("parallel_tool_calls", "must be true or false")


def _check_tool(tool, where: str) -> str:
    if not isinstance(tool, dict):
        raise ToolError(where, "a tool is an object {\"type\": \"function\", \"function\": {...}}")
    if tool.get("type") != "function":
        raise ToolError(f"{where}.type", f"unsupported tool type {tool.get('type')!r} (only 'function')")
    fn = tool.get("function")
    if not isinstance(fn, dict):
        raise ToolError(f"{where}.function", "missing, or not an object")
    name = fn.get("name")
    if not isinstance(name, str) or not NAME_PATTERN.match(name):
        raise ToolError(f"{where}.function.name", f"{name!r} is not a name of 1 to 64 letters, digits, _ or -")
    if not isinstance(fn.get("description", ""), str):
        raise ToolError(f"{where}.function.description", "must be a string")
    if "strict" in fn and not isinstance(fn["strict"], (bool, type(None))):
        raise ToolError(f"{where}.function.strict", "must be true or false")
    if fn.get("parameters") is not None:
        _check_parameters(fn["parameters"], f"{where}.function.parameters")
    return name


def _check_parameters(schema, where: str) -> None:
    """A JSON schema (by its metaschema: Draft 2020-12 unless its $schema says otherwise) of an object."""
    if not isinstance(schema, dict):
        raise ToolError(where, "must be a JSON schema object")
    if schema.get("type", "object") != "object":
        raise ToolError(where, f"the arguments are an object: type must be 'object', not {schema['type']!r}")
    validator = jsonschema.validators.validator_for(schema, default=jsonschema.Draft202012Validator)
    try:
        validator.check_schema(schema)
    except jsonschema.SchemaError as e:
        at = "".join(f".{p}" for p in e.absolute_path)
        raise ToolError(where + at, f"not a valid JSON schema: {e.message}") from None


def _check_choice(tool_choice, names: list[str]) -> None:
    if tool_choice is None:
        return
    if isinstance(tool_choice, str):
        if tool_choice not in CHOICES:
            raise ToolError("tool_choice", f"{tool_choice!r} is not one of {', '.join(CHOICES)} or a function")
        if tool_choice == "required" and not names:
            raise ToolError("tool_choice", "'required' needs tools")
        return
    fn = tool_choice.get("function") if isinstance(tool_choice, dict) else None
    if not isinstance(tool_choice, dict) or tool_choice.get("type") != "function" or not isinstance(fn, dict):
        raise ToolError("tool_choice", "a named choice is {\"type\": \"function\", \"function\": {\"name\": ...}}")
    if fn.get("name") not in names:
        raise ToolError("tool_choice.function.name", f"{fn.get('name')!r} is not one of the tools")


def choice_of(tools, tool_choice) -> tuple[str, str | None]:
    """(mode, name) of a checked tool_choice: mode "none" | "auto" | "required" | "function" (name given).
    OpenAI's default: "auto" with tools, "none" without."""
    if tool_choice is None:
        return ("auto" if tools else "none"), None
    if isinstance(tool_choice, str):
        return (tool_choice if tools else "none"), None
    return "function", tool_choice["function"]["name"]


def prompt_tools(tools, tool_choice) -> list[dict] | None:
    """The tools the chat template is given: none for tool_choice "none" (the model must not call any)."""
    return None if choice_of(tools, tool_choice)[0] == "none" else (tools or None)


# ---------------------------------------------------------------- the model's tool-call syntax
@dataclass(frozen=True)
class ToolFormat:
    name: str                       # "hermes"
    open: str                       # text that opens a call: "<tool_call>"
    close: str                      # text that closes it: "</tool_call>"
    pad: str = "\n"                 # what the template writes inside the tags around the JSON and between calls
    open_id: int | None = None      # the open tag's token id when the vocabulary has it as one token
    close_id: int | None = None
    # (open, close) of other wrappings the model writes calls in, untrained by its template: a call only when its
    # JSON is {"name": <one of the request's tools>, "arguments": {...}}, else text
    loose: tuple[tuple[str, str], ...] = ()

    def grammar_tag(self, which: str) -> str:
        """A tag in Lark: by token id (the one token the model emits) when known, else as text."""
        tid, text = (self.open_id, self.open) if which == "open" else (self.close_id, self.close)
        return f"<[{tid}]>" if tid is not None else json.dumps(text, ensure_ascii=False)


# Qwen2.5-Coder-1.5B, given tools and left free, writes its calls as a fenced JSON block (```json\n{"name": ...,
# "arguments": {...}}\n```), never with <tool_call> (checked at temperature 0 on several prompts)
HERMES = ToolFormat("hermes", "<tool_call>", "</tool_call>", loose=(("```json\n", "```"),))
FORMATS = (HERMES,)   # known formats, found in a template by both of their tags


def tool_format(template: str | None, tok=None) -> ToolFormat:
    """The tool-call format the chat template writes; `tok` (anything with encode(text, add_special,
    parse_special) -> ids, e.g. the engine's Tokenizer) fills in the tags' token ids. ToolError("tools") when the
    template has no known format (or the model has no template)."""
    for fmt in FORMATS:
        if template and fmt.open in template and fmt.close in template:
            return replace(fmt, open_id=_one_token(tok, fmt.open), close_id=_one_token(tok, fmt.close))
    raise ToolError("tools", "this model's chat template has no tool-call format pipeinfer knows "
                             f"({', '.join(f.open for f in FORMATS)}): it cannot take tools")


def _one_token(tok, text: str) -> int | None:
    if tok is None:
        return None
    ids = tok.encode(text, add_special=False, parse_special=True)
    return ids[0] if len(ids) == 1 else None


# ---------------------------------------------------------------- the grammar for "required" or a named function
# The call's JSON as the template writes it (json.dumps' separators, no other whitespace): a small model kept to
# its trained layout stays on its habits, and cannot spin out whitespace until max_tokens.
CALL_JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": ", "lenient": True}
ANY_ARGUMENTS = {"type": "object", "properties": {}}


def tool_constraint(tools, tool_choice, parallel_tool_calls, fmt: ToolFormat) -> Constraint | None:
    """A Lark grammar forcing the answer to be tool calls, for tool_choice "required" (one call, or one or more
    when parallel_tool_calls is not false) or a named function (one call of it); None for "auto" and "none"
    (free text, parsed afterwards). Each call is `open pad {"name": <allowed>, "arguments": <its schema>} pad
    close`, calls separated by pad, and a pad may end the answer: Qwen2.5 writes "</tool_call>\n" and then
    <|endoftext|> (an end-of-generation token besides its EOS <|im_end|>; a mask that lets only <|im_end|> end
    the answer leaves it writing call after call). ToolError naming the parameters llguidance cannot turn into a
    grammar."""
    mode, name = choice_of(tools, tool_choice)
    if mode in ("none", "auto"):
        return None
    allowed = [(i, t["function"]) for i, t in enumerate(tools) if mode == "required" or t["function"]["name"] == name]
    rules = [f"f{k}: %json {json.dumps(_checked_call_schema(i, fn), ensure_ascii=False)}"
             for k, (i, fn) in enumerate(allowed)]
    pad = json.dumps(fmt.pad)
    many = mode == "required" and parallel_tool_calls is not False
    lines = [f"start: call ({pad} call)* {pad}?" if many else f"start: call {pad}?",
             f"call: {fmt.grammar_tag('open')} {pad} body {pad} {fmt.grammar_tag('close')}",
             "body: " + " | ".join(f"f{k}" for k in range(len(allowed)))] + rules
    return Constraint("lark", "\n".join(lines) + "\n")


def _checked_call_schema(i: int, fn: dict) -> dict:
    """The schema of one call's JSON: {"name": const, "arguments": the parameters}, name first (llguidance keeps
    the properties' order). The parameters' $defs/definitions move to the root, where their "#/$defs/..." refs
    point once the parameters sit under "arguments"."""
    params = dict(fn.get("parameters") or ANY_ARGUMENTS)
    defs = {k: params.pop(k) for k in ("$defs", "definitions") if k in params}
    params.pop("$schema", None)
    schema = {"type": "object", "properties": {"name": {"const": fn["name"]}, "arguments": params},
              "required": ["name", "arguments"], "additionalProperties": False, **defs,
              "x-guidance": CALL_JSON_OPTIONS}
    grammar = llguidance.LLMatcher.grammar_from_json_schema(schema)
    is_error, messages = llguidance.LLMatcher.validate_grammar_with_warnings(grammar)
    if is_error:
        raise ToolError(f"tools.{i}.function.parameters", "cannot constrain the arguments to this schema: "
                                                         + " ".join(messages[0].split()))
    return schema


# ---------------------------------------------------------------- parsing the generated text as it streams
@dataclass(frozen=True)
class Text:
    text: str         # content outside tool calls


@dataclass(frozen=True)
class CallStart:
    index: int        # the call's place in this answer's stream: 0, 1, ...
    id: str           # "call_<24 hex>"
    name: str


@dataclass(frozen=True)
class CallArgs:
    index: int
    fragment: str     # the fragments of a call, joined, are its arguments' JSON text


@dataclass(frozen=True)
class CallEnd:
    index: int


@dataclass(frozen=True)
class CallFailed:
    index: int        # a call announced by CallStart whose text then broke the format (or the answer ended in it)
    text: str         # its raw text, open tag included: from now on content (finish() drops the call)


Event = Union[Text, CallStart, CallArgs, CallEnd, CallFailed]


@dataclass
class ParsedOutput:
    content: str              # the text outside calls (and of malformed calls); "" when there is none
    tool_calls: list[dict]    # OpenAI's calls, in order


def new_call_id(prefix: str = "call_") -> str:
    return prefix + secrets.token_hex(12)


WS = " \t\r\n"
# a JSON string, and what can still grow into one
JSON_STRING = re.compile(r'"(?:[^"\\\x00-\x1f]|\\["\\/bfnrtu])*"')
JSON_STRING_START = re.compile(r'"(?:[^"\\\x00-\x1f]|\\["\\/bfnrtu])*\\?')
HEADER = ("ws", "{", "ws", '"name"', "ws", ":", "ws", "str", "ws", ",", "ws", '"arguments"', "ws", ":", "ws")
TAIL = ("ws", "}", "ws")   # after the arguments, before the close tag
UNDECIDED, FAILED = "undecided", "failed"


def _match(buf: str, steps) -> tuple[str, int, str | None] | str:
    """Match `steps` ("ws": any JSON whitespace, "str": a JSON string, else literal text) at the start of buf:
    (matched, end, the string's value) | UNDECIDED (buf is a prefix of a match) | FAILED."""
    pos, value = 0, None
    for step in steps:
        if step == "ws":
            while pos < len(buf) and buf[pos] in WS:
                pos += 1
            if pos == len(buf):
                return UNDECIDED
        elif step == "str":
            m = JSON_STRING.match(buf, pos)
            if not m:
                return UNDECIDED if JSON_STRING_START.fullmatch(buf, pos) else FAILED
            value, pos = json.loads(m.group()), m.end()
        elif buf.startswith(step, pos):
            pos += len(step)
        else:
            return UNDECIDED if step.startswith(buf[pos:]) else FAILED
    return "matched", pos, value


class _ObjectEnd:
    """Where a JSON object's text ends, fed piece by piece: bracket depth outside strings (validity is checked
    once it is whole)."""

    def __init__(self):
        self.depth, self.in_string, self.escaped = 0, False, False

    def feed(self, text: str) -> int | None:
        """The index in text just past the object's closing bracket, or None (not closed yet)."""
        for i, ch in enumerate(text):
            if self.in_string:
                if self.escaped:
                    self.escaped = False
                elif ch == "\\":
                    self.escaped = True
                elif ch == '"':
                    self.in_string = False
            elif ch == '"':
                self.in_string = True
            elif ch in "{[":
                self.depth += 1
            elif ch in "}]":
                self.depth -= 1
                if self.depth == 0:
                    return i + 1
        return None


@dataclass(frozen=True)
class _Wrap:
    open: str
    close: str
    loose: bool    # a call only when it names one of the request's tools, its JSON in the usual key order


class ToolCallParser:
    """The generated text, fed as it streams, turned into events: Text outside calls (a possible partial open
    tag, and whitespace that may turn out to be the pad before a tag, held back), and for each call CallStart
    once its name is known, CallArgs as its arguments arrive, CallEnd at its close tag. A tagged call whose JSON
    is not {"name": ..., "arguments": {...}} in that order is held until its close tag and then read in any key
    order; when it is no call at all its text is content. With `names` (the request's tools) the format's loose
    wrappings count too. Nothing generated is lost: the content and the calls' arguments hold all the text but
    the wrappings, the pads and the JSON around the arguments (re-serialized when the call was held). A call
    announced and then broken ends with CallFailed, its text content. Feeding the same text in any pieces gives
    the same events, up to how Text and CallArgs are split (and the calls' random ids)."""

    def __init__(self, fmt: ToolFormat, names=None, new_id: Callable[[], str] = new_call_id):
        self.new_id = new_id
        self.names = set(names) if names is not None else None
        self.wraps = [_Wrap(fmt.open, fmt.close, False)] + [_Wrap(o, c, True) for o, c in (fmt.loose if names else ())]
        self._buf = ""           # text fed and not yet turned into events
        self._state = "text"     # text | header | args | tail | buffered
        self._wrap = self.wraps[0]   # the current call's wrapping
        self._raw = ""           # the current call's text consumed so far (the whitespace before it included)
        self._after_call = False  # whitespace right after a call is pad, not content
        self._index = 0
        self._args = ""          # the current call's arguments so far
        self._object_end = _ObjectEnd()
        self._events: list[Event] = []
        self._closed = False

    @property
    def n_calls(self) -> int:
        """Calls completed so far (a server that wants one call can stop generating after the first)."""
        return sum(isinstance(e, CallEnd) for e in self._events)

    def feed(self, text: str) -> list[Event]:
        self._buf += text
        start = len(self._events)
        while self._step():
            pass
        return self._events[start:]

    def close(self) -> list[Event]:
        """The end of the answer: the held-back text as content, a call left open as CallFailed (or as a call
        when only its close tag is missing)."""
        start = len(self._events)
        if not self._closed:
            self._closed = True
            while self._step():
                pass
            self._close_state()
        return self._events[start:]

    def finish(self) -> ParsedOutput:
        """The whole answer (close() first if it was not called)."""
        self.close()
        content: list[str] = []
        calls: dict[int, dict] = {}   # index -> call, in order; a failed one dropped
        for e in self._events:
            if isinstance(e, (Text, CallFailed)):
                content.append(e.text)
            if isinstance(e, CallFailed):
                calls.pop(e.index, None)
            elif isinstance(e, CallStart):
                calls[e.index] = {"id": e.id, "type": "function", "function": {"name": e.name, "arguments": ""}}
            elif isinstance(e, CallArgs):
                calls[e.index]["function"]["arguments"] += e.fragment
        return ParsedOutput("".join(content), list(calls.values()))

    # ------------------------------------------------------------ one step of the state machine
    def _step(self) -> bool:
        """Turn what it can of the buffer into events; False when it needs more text."""
        return getattr(self, f"_step_{self._state}")()

    def _step_text(self) -> bool:
        if self._after_call:
            rest = self._buf.lstrip(WS)
            if not rest:
                self._buf = ""
                return False
            self._buf, self._after_call = rest, False
        found = [(at, w) for w in self.wraps if (at := self._buf.find(w.open)) >= 0]
        if found:
            at, wrap = min(found, key=lambda f: f[0])
            before = self._buf[:at].rstrip(WS)
            self._emit_text(before)
            self._wrap, self._raw = wrap, self._buf[len(before):at + len(wrap.open)]
            self._buf, self._state = self._buf[at + len(wrap.open):], "header"
            return True
        keep = self._held_back(self._buf)
        self._emit_text(self._buf[:len(self._buf) - keep])
        self._buf = self._buf[len(self._buf) - keep:]
        return False

    def _held_back(self, buf: str) -> int:
        """How much of buf's end to hold back: a partial opening, and the whitespace before it."""
        if self._closed:
            return 0
        partial = max((k for w in self.wraps for k in range(1, min(len(buf), len(w.open) - 1) + 1)
                       if w.open.startswith(buf[-k:])), default=0)
        return len(buf) - len(buf[:len(buf) - partial].rstrip(WS))

    def _step_header(self) -> bool:
        m = _match(self._buf, HEADER)
        if m == UNDECIDED:
            return False
        if m == FAILED or self._buf[m[1]] != "{" or (self._wrap.loose and m[2] not in self.names):
            self._state = "text" if self._wrap.loose else "buffered"
            if self._wrap.loose:   # no call: its opening is text, and the rest is read as text
                self._emit_text(self._raw)
            return True
        _, end, name = m
        self._events.append(CallStart(self._index, self.new_id(), name))
        self._raw += self._buf[:end]
        self._buf, self._state, self._object_end, self._args = self._buf[end:], "args", _ObjectEnd(), ""
        return True

    def _step_args(self) -> bool:
        if not self._buf:
            return False
        end = self._object_end.feed(self._buf)
        piece = self._buf if end is None else self._buf[:end]
        self._args += piece
        self._raw += piece
        self._buf = self._buf[len(piece):]
        self._events.append(CallArgs(self._index, piece))
        if end is not None:
            self._state = "tail" if _is_object(self._args) else self._fail()
        return end is not None

    def _step_tail(self) -> bool:
        m = _match(self._buf, TAIL + (self._wrap.close,))
        if m == UNDECIDED:
            return False
        if m == FAILED:
            self._state = self._fail()
            return True
        self._buf = self._buf[m[1]:]
        self._end_call()
        return True

    def _step_buffered(self) -> bool:
        at = self._buf.find(self._wrap.close)
        if at < 0:
            return False
        body, self._buf = self._buf[:at], self._buf[at + len(self._wrap.close):]
        call = _loose_call(body)
        if call is None:
            self._emit_text(self._raw + body + self._wrap.close)
            self._state = "text"
            return True
        self._events += [CallStart(self._index, self.new_id(), call[0]), CallArgs(self._index, call[1])]
        self._end_call()
        return True

    def _close_state(self) -> None:
        close = self._wrap.close
        if self._state == "text":
            self._emit_text(self._buf.lstrip(WS) if self._after_call else self._buf)
        elif self._state in ("header", "buffered"):
            self._emit_text(self._raw + self._buf)
        elif self._state == "tail" and "}" in self._buf and _match(self._buf, TAIL + (close,)) == UNDECIDED:
            self._end_call()   # only (part of) the close tag missing: a stop string, or max_tokens right there
        else:
            self._fail()
            self._emit_text(self._buf)
        self._buf, self._state = "", "text"

    # ------------------------------------------------------------ events
    def _emit_text(self, text: str) -> None:
        if text:
            self._events.append(Text(text))

    def _end_call(self) -> None:
        self._events.append(CallEnd(self._index))
        self._index += 1
        self._raw, self._state, self._after_call = "", "text", True

    def _fail(self) -> str:
        """The current call, announced, is broken: its text so far becomes content; the rest is read as text."""
        self._events.append(CallFailed(self._index, self._raw))
        self._index += 1
        self._raw = ""
        return "text"


def _is_object(text: str) -> bool:
    try:
        return isinstance(json.loads(text), dict)
    except json.JSONDecodeError:
        return False


def _loose_call(body: str) -> tuple[str, str] | None:
    """(name, arguments' JSON text) of a call's JSON with its keys in any order and arguments given as an object
    or as the JSON text of one; None when it is no call."""
    try:
        obj = json.loads(body)
    except json.JSONDecodeError:
        return None
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    args = obj.get("arguments", {})
    if isinstance(args, str) and _is_object(args):
        return obj["name"], args
    if isinstance(args, dict):
        return obj["name"], json.dumps(args, ensure_ascii=False)
    return None


# ---------------------------------------------------------------- Anthropic's Messages API onto OpenAI's shapes
ANTHROPIC_PARAMS = ((r"^(tools\.\d+)\.function\.parameters", r"\1.input_schema"),
                    (r"^(tools\.\d+)\.function\.(name|description)", r"\1.\2"),
                    (r"^(tools\.\d+)\.function", r"\1"), (r"^tool_choice\.function\.name", "tool_choice.name"),
                    (r"^parallel_tool_calls", "tool_choice.disable_parallel_tool_use"))


def from_anthropic_tools(tools, tool_choice) -> tuple[list[dict] | None, object, bool | None]:
    """Anthropic's tools [{"name", "description"?, "input_schema"}] and tool_choice {"type": "auto" | "any" |
    "tool" | "none", "name"?, "disable_parallel_tool_use"?} as OpenAI's (tools, tool_choice,
    parallel_tool_calls), checked; a ToolError names the Anthropic field ("tools.0.input_schema")."""
    if tools is not None and not isinstance(tools, list):
        raise ToolError("tools", "must be a list of tools")
    converted = None if tools is None else [_openai_tool(t, f"tools.{i}") for i, t in enumerate(tools)]
    choice, parallel = _openai_choice(tool_choice)
    try:
        check_tools(converted, choice, parallel)
    except ToolError as e:
        raise ToolError(_anthropic_param(e.param), e.message) from None
    return converted, choice, parallel


def _openai_tool(tool, where: str) -> dict:
    if not isinstance(tool, dict):
        raise ToolError(where, "a tool is an object {\"name\", \"input_schema\"}")
    if tool.get("type") not in (None, "custom"):
        raise ToolError(f"{where}.type", f"unsupported tool type {tool['type']!r} (only client tools)")
    if not isinstance(tool.get("input_schema"), dict):
        raise ToolError(f"{where}.input_schema", "missing, or not a JSON schema object")
    fn = {"name": tool.get("name"), "parameters": tool["input_schema"]}
    if "description" in tool:
        fn["description"] = tool["description"]
    return {"type": "function", "function": fn}


def _openai_choice(tool_choice) -> tuple[object, bool | None]:
    if tool_choice is None:
        return None, None
    if not isinstance(tool_choice, dict) or tool_choice.get("type") not in ("auto", "any", "tool", "none"):
        raise ToolError("tool_choice", "must be {\"type\": \"auto\" | \"any\" | \"tool\" | \"none\"}")
    kind = tool_choice["type"]
    disable = tool_choice.get("disable_parallel_tool_use")
    choice = ({"type": "function", "function": {"name": tool_choice.get("name")}} if kind == "tool"
              else {"any": "required"}.get(kind, kind))
    return choice, (None if disable is None else not disable)


def _anthropic_param(param: str) -> str:
    """An OpenAI field's name as the Anthropic request spells it ("tools.0.function.parameters.properties" ->
    "tools.0.input_schema.properties")."""
    for pattern, repl in ANTHROPIC_PARAMS:
        if re.match(pattern, param):
            return re.sub(pattern, repl, param)
    return param


def from_anthropic_messages(system, messages: list[dict]) -> list[dict]:
    """Anthropic's system (text or text blocks) and messages (content: text or blocks of type text, tool_use
    {id, name, input}, tool_result {tool_use_id, content, is_error?}) as OpenAI's messages: tool_use blocks
    become the assistant's tool_calls, each tool_result a "tool" message (before the user's own text)."""
    out = [{"role": "system", "content": _blocks_text(system)}] if system else []
    for m in messages:
        blocks = [{"type": "text", "text": m["content"]}] if isinstance(m.get("content"), str) else m.get("content")
        text = _blocks_text([b for b in blocks or [] if b.get("type") == "text"])
        uses = [b for b in blocks or [] if b.get("type") == "tool_use"]
        results = [b for b in blocks or [] if b.get("type") == "tool_result"]
        out += [{"role": "tool", "tool_call_id": b.get("tool_use_id"), "content": _blocks_text(b.get("content"))}
                for b in results]
        if m.get("role") == "assistant" and uses:
            out.append({"role": "assistant", "content": text or None, "tool_calls": [
                {"id": b.get("id"), "type": "function",
                 "function": {"name": b.get("name"), "arguments": json.dumps(b.get("input", {}), ensure_ascii=False)}}
                for b in uses]})
        elif text or not results:
            out.append({"role": m.get("role"), "content": text})
    return out


def _blocks_text(content) -> str:
    if content is None or isinstance(content, str):
        return content or ""
    return "".join(b.get("text", "") for b in content if isinstance(b, dict) and b.get("type") == "text")
