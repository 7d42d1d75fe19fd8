"""A conversation rendered through the GGUF's own Jinja chat template, as Hugging Face renders it: tools, assistant
messages carrying tool calls and tool results included (llama.cpp's llama_chat_apply_template knows neither).

Messages come in OpenAI's shape: {"role": "system"|"user"|"assistant"|"tool", "content": str | [parts] | None},
an assistant's {"tool_calls": [{"id", "type": "function", "function": {"name", "arguments": JSON text}}]}, a tool
message's {"tool_call_id"}. Templates expect arguments as objects and a tool message's function name, so both are
filled in here. The environment is the one of llama-cpp-python's Jinja2ChatFormatter (itself Transformers'):
sandboxed, trim_blocks/lstrip_blocks, loop controls, `{% generation %}` ignored, `tojson` as json.dumps with
non-ASCII kept, `raise_exception`, `strftime_now`.
"""
from __future__ import annotations

import functools
import json
from datetime import datetime

import jinja2
import jinja2.ext
from jinja2.sandbox import ImmutableSandboxedEnvironment
from llama_cpp.llama_chat_format import Jinja2ChatFormatter


def render_chat(template: str, messages: list[dict], tools: list[dict] | None = None, *, bos_token: str = "",
                eos_token: str = "") -> str:
    """The prompt text of `messages` (OpenAI shape, above) with the assistant's turn opened; `tools` in OpenAI's
    shape [{"type": "function", "function": {"name", "description", "parameters"}}], None or [] for none.
    bos_token "" by default: the tokenizer adds BOS itself when the vocabulary asks for it (as with format_chat).
    A template that fails (syntax, raise_exception, a missing field) -> ValueError of one line."""
    compiled, shaped = _compile(template), template_messages(messages)
    try:
        return compiled.render(messages=shaped, tools=tools or None, bos_token=bos_token,
                               eos_token=eos_token, add_generation_prompt=True, raise_exception=_raise,
                               strftime_now=_strftime_now)
    except (jinja2.TemplateError, TypeError, ValueError, KeyError, AttributeError, IndexError) as e:
        raise ValueError(f"the chat template failed: {_one_line(e)}") from None


def template_messages(messages: list[dict]) -> list[dict]:
    """Messages as templates expect them: text parts joined into one string, a missing content "" (but None
    beside tool calls, as OpenAI sends it), tool-call arguments parsed into objects, a tool message's `name`
    taken from the call it answers (by tool_call_id). ValueError naming the field
    (messages.I.tool_calls.J.function.arguments) when arguments are not a JSON object's text."""
    names: dict[str, str] = {}  # tool_call_id -> function name, from the assistant messages so far
    out = []
    for i, m in enumerate(messages):
        content = _text(m.get("content"))
        m = dict(m, content="" if content is None and not m.get("tool_calls") else content)
        if m.get("tool_calls"):
            m["tool_calls"] = [_template_call(c, f"messages.{i}.tool_calls.{j}") for j, c in enumerate(m["tool_calls"])]
            names.update((c["id"], c["function"]["name"]) for c in m["tool_calls"] if c.get("id"))
        if m.get("role") == "tool" and "name" not in m and m.get("tool_call_id") in names:
            m["name"] = names[m["tool_call_id"]]
        out.append(m)
    return out


def _text(content):
    """A content given as parts [{"type": "text", "text"}, ...]: the text parts joined; a string or None as is."""
    if isinstance(content, list):
        return "".join(p.get("text", "") for p in content if isinstance(p, dict) and p.get("type") == "text")
    return content


def _template_call(call: dict, where: str) -> dict:
    fn = dict(call.get("function") or {})
    args = fn.get("arguments")
    if isinstance(args, str):
        try:
            args = json.loads(args) if args.strip() else {}
        except json.JSONDecodeError as e:
            raise ValueError(f"{where}.function.arguments is not JSON: {e}") from None
    if not isinstance(args, dict):
        raise ValueError(f"{where}.function.arguments is not a JSON object")
    fn["arguments"] = args
    return dict(call, type=call.get("type", "function"), function=fn)


@functools.lru_cache(maxsize=8)
def _compile(template: str) -> jinja2.Template:
    """A template's text compiled once (a server renders the same one for every request)."""
    env = ImmutableSandboxedEnvironment(loader=jinja2.BaseLoader(), trim_blocks=True, lstrip_blocks=True,
                                        extensions=[Jinja2ChatFormatter.IgnoreGenerationTags, jinja2.ext.loopcontrols])
    env.filters["tojson"] = Jinja2ChatFormatter.tojson
    try:
        return env.from_string(template)
    except jinja2.TemplateError as e:
        raise ValueError(f"the chat template does not compile: {_one_line(e)}") from None


def _raise(message: str):
    raise ValueError(message)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


def _one_line(e: Exception) -> str:
    return " ".join(str(e).split()) or type(e).__name__
