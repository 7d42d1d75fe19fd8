"""OpenAI's chat and completions: POST /v1/chat/completions and /v1/completions (`register_openai`), their
request bodies, and what they ask, sent down as one request (submit.submit_request) and answered in OpenAI's
shapes (openai_reply.py).

Every field, and what the server does with it (C: chat, T: completions; llama-server's own fields marked L):

    field                              what the server does
    ---------------------------------  ---------------------------------------------------------------------------
    model                              any name is answered (llama-server's rule); the reply names it when it is
                                       the model's id or an --alias, else the model's id (submit.reply_model)
    messages (C)                       roles system, developer (as system), user, assistant, tool; text content
                                       parts joined; any other content part refused (400); an assistant's
                                       tool_calls [{id, type: function, function: {name, arguments: JSON text of
                                       an object}}] and a tool message's tool_call_id rendered through the GGUF's
                                       chat template (engine/chat.py)
    prompt (T)                         a string, a list of strings, a list of token ids, or a list of token-id
                                       lists: one prompt each, never joined; ids checked against the vocabulary
    max_tokens, max_completion_tokens  the answer's length (C: max_completion_tokens first); without either, the
                                       server's default within the room the context leaves
    temperature 0..2, top_p, top_k (L) sampling (temperature 0, the default: greedy)
    seed                               choice j of a prompt samples with seed + j (no seed: a new one per request;
                                       the reply's X-Seed header names it)
    stop                               a string or a list of strings; the text is cut before the first match
    n 1..8                             choices per prompt, each its own generation (T: index prompt_i * n + j)
    stream, stream_options             server-sent events; include_usage adds a last chunk with the usage
    logprobs, top_logprobs             C: logprobs true, top_logprobs 0..20 -> choices[i].logprobs.content;
                                       T: logprobs 0..5 -> the legacy {tokens, token_logprobs, top_logprobs,
                                       text_offset}; streamed with the chunk that releases each token's text
    logit_bias                         {"token id": -100..100}, ids checked against the vocabulary
    frequency_penalty, presence_penalty  -2..2, OpenAI's rule
    response_format                    text | json_object | json_schema {name, schema, strict}: the answer is
                                       constrained (llguidance, engine/grammar.py); L: json_object with a schema;
                                       with a forced tool call (below) refused (400)
    grammar (L), json_schema (L)       a GBNF grammar / a JSON schema, as llama-server takes them
    echo (T)                           refused when true (400)
    suffix (T)                         refused when not empty (400)
    best_of (T)                        refused above n (400): the server does not rank choices
    tools (C)                          function tools {type: function, function: {name, description,
                                       parameters: JSON schema, strict}}, checked (400 naming the field) and
                                       rendered through the GGUF's chat template (turn.py, tools.py); the answer
                                       is parsed into message.tool_calls (streamed: delta.tool_calls), each choice
                                       its own, finish_reason "tool_calls"; arguments are held to the parameters
                                       only when a call is forced (strict or not)
    tool_choice (C)                    none: tools not rendered, nothing parsed; auto (the default with tools):
                                       free text, parsed (the model's loose habits too: Qwen's fenced JSON);
                                       required / {type: function, function: {name}}: the answer constrained to
                                       calls (llguidance grammar, tools.tool_constraint)
    parallel_tool_calls (C)            false: one call at most (required: the grammar; auto: the generation
                                       stops after the first call)
    cache_prompt (L)                   true (the default; null too): the prompt starts from what the prompt
                                       cache holds of it and stays there for later requests; false: neither
                                       (usage.prompt_tokens_details.cached_tokens: the tokens taken from it)
    functions, function_call           (deprecated) ignored
    anything else                      ignored (user, metadata, store, service_tier, min_p, ...)

A malformed field is a 400 naming it, before anything reaches the ranks; at most one constraint per request.
No body field is a union (beyond None): pydantic would name the union's member in the error's location, so such
fields are `Any` here and checked by hand, with one-line errors.
"""
from __future__ import annotations

import json
import re
from typing import Annotated, Any

from fastapi import FastAPI, Request
from pydantic import BaseModel, ConfigDict, Field

from ..core.decoding import MAX_TOP_LOGPROBS, Constraint, Decoding
from ..serving.job import Prompt, RequestError, Settings, bad, new_request_id, sampling_of
from .openai_reply import CHAT, COMPLETION, ReplyKind, respond
from .submit import ServeConfig, acheck_constraint, check_token_ids, reply_model, submit_request, with_seed
from .tools import ToolError, check_tools
from .turn import AnswerFormat, Conversation, answer_format, render

MAX_N = 8
MAX_CHOICES = 64           # prompts x n in one request: each is a generation in the queue
MAX_LEGACY_LOGPROBS = 5    # /v1/completions' logprobs
ROLES = ("system", "user", "assistant", "developer", "tool")


# ------------------------------------------------------------------------------------ bodies
class Body(BaseModel):
    model_config = ConfigDict(extra="allow", allow_inf_nan=False)  # unknown fields are accepted and ignored


class StreamOptions(Body):
    include_usage: bool = False


class JsonSchemaFormat(Body):
    name: str | None = None
    schema_: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: bool | None = None


class ResponseFormat(Body):
    type: str
    json_schema: JsonSchemaFormat | None = None
    schema_: dict[str, Any] | None = Field(default=None, alias="schema")  # llama-server's json_object + schema


class Common(Body):
    model: str
    max_tokens: int | None = Field(default=None, ge=1)
    temperature: float | None = Field(default=None, ge=0, le=2)
    top_p: float | None = Field(default=None, gt=0, le=1)
    top_k: int | None = Field(default=None, ge=0)
    stop: Any = None                          # a string or a list of strings (`stops`)
    seed: int | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    n: int = Field(default=1, ge=1, le=MAX_N)
    logit_bias: dict[str, Annotated[float, Field(ge=-100, le=100)]] | None = None
    frequency_penalty: float | None = Field(default=None, ge=-2, le=2)
    presence_penalty: float | None = Field(default=None, ge=-2, le=2)
    response_format: ResponseFormat | None = None
    grammar: str | None = None
    json_schema: dict[str, Any] | None = None
    cache_prompt: bool | None = Field(default=None, strict=True)  # None: true (a string or a number is a 400)


class CompletionRequest(Common):
    prompt: Any                               # the four shapes (`completion_prompts`)
    logprobs: int | None = Field(default=None, ge=0, le=MAX_LEGACY_LOGPROBS)
    echo: bool = False
    suffix: str | None = None
    best_of: int | None = Field(default=None, ge=1)


class Message(Body):
    role: str
    content: Any = None                       # a string, or a list of content parts
    tool_calls: Any = None                    # an assistant's calls (`chat_conversation`)
    tool_call_id: Any = None                  # a tool message's answer to a call


class ChatRequest(Common):
    messages: list[Message] = Field(min_length=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)
    logprobs: bool | None = None
    top_logprobs: int | None = Field(default=None, ge=0, le=MAX_TOP_LOGPROBS)
    tools: Any = None                         # checked by hand (tools.check_tools)
    tool_choice: Any = None
    parallel_tool_calls: Any = None


# ------------------------------------------------------------------------------------ fields
def stops(value) -> tuple[str, ...]:
    if value is None:
        return ()
    if isinstance(value, str):
        return (value,)
    if isinstance(value, list) and all(isinstance(s, str) for s in value):
        return tuple(value)
    raise bad("stop", "must be a string or a list of strings")


def _response_format(rf: ResponseFormat) -> Constraint | None:
    if rf.type == "text":
        return None
    if rf.type == "json_object" and rf.schema_ is None:
        return Constraint("json_object")
    if rf.type == "json_object":
        return Constraint("json_schema", json.dumps(rf.schema_))
    if rf.type == "json_schema":
        if rf.json_schema is None or rf.json_schema.schema_ is None:
            raise bad("response_format.json_schema.schema", "a schema is required for type json_schema")
        return Constraint("json_schema", json.dumps(rf.json_schema.schema_), bool(rf.json_schema.strict))
    raise bad("response_format.type", f"unknown type '{rf.type}' (text, json_object or json_schema)")


def constraint_of(req: Common) -> tuple[Constraint | None, str]:
    """The constraint a request asks for and the field it came from: response_format, or llama-server's grammar
    or json_schema, one at most."""
    asked = []
    if req.response_format is not None and (c := _response_format(req.response_format)) is not None:
        asked.append((c, "response_format"))
    if req.grammar:
        asked.append((Constraint("gbnf", req.grammar), "grammar"))
    if req.json_schema is not None:
        asked.append((Constraint("json_schema", json.dumps(req.json_schema)), "json_schema"))
    if len(asked) > 1:
        raise bad(asked[1][1], f"one constraint per request: {' and '.join(p for _, p in asked)} were both given")
    return asked[0] if asked else (None, "")


def logit_bias(bias: dict[str, float] | None, tokenizer) -> tuple[tuple[int, float], ...]:
    """{"token id": bias} as (id, bias) pairs, each id in the vocabulary."""
    if not bias:
        return ()
    out = []
    for key, b in bias.items():
        if not re.fullmatch(r"\d+", key.strip()):
            raise bad("logit_bias", f"'{key}' is not a token id")
        t = int(key)
        if t >= tokenizer.n_vocab:
            raise bad("logit_bias", f"token id {t} is not in the vocabulary (0..{tokenizer.n_vocab - 1})")
        out.append((t, float(b)))
    return tuple(sorted(out))


def chat_top_logprobs(req: ChatRequest) -> int | None:
    if req.top_logprobs is not None and not req.logprobs:
        raise bad("top_logprobs", "needs logprobs: true")
    return (req.top_logprobs or 0) if req.logprobs else None


def refuse_unsupported(req: CompletionRequest) -> None:
    if req.echo:
        raise bad("echo", "echoing the prompt is not supported")
    if req.suffix:
        raise bad("suffix", "a suffix (insertion) is not supported")
    if req.best_of is not None and req.best_of > req.n:
        raise bad("best_of", "choices are not ranked here: best_of above n is not supported")


def settings_of(req: Common, constraint: Constraint | None, top_logprobs: int | None, tokenizer,
                max_tokens: int | None, max_tokens_param: str) -> Settings:
    """What the request asks of each of its generations, every field checked; its sampling made last, by the
    conversion every API shares (serving.job.sampling_of)."""
    decoding = Decoding(constraint, logit_bias(req.logit_bias, tokenizer), req.frequency_penalty or 0.0,
                        req.presence_penalty or 0.0, top_logprobs)
    stop_strings = stops(req.stop)
    return Settings(max_tokens, max_tokens_param, sampling_of(req.temperature, req.top_p, req.top_k, req.seed),
                    stop_strings, decoding, req.n, req.cache_prompt is not False)


# ------------------------------------------------------------------------------------ prompts
def completion_prompts(value, tokenizer) -> list[Prompt]:
    """OpenAI's four prompt shapes, one Prompt per prompt (never joined)."""
    shapes = "a string, a list of strings, a list of token ids or a list of token-id lists"
    if isinstance(value, str):
        return [Prompt(tokenizer.encode(value), value)]
    if not isinstance(value, list) or not value:
        raise bad("prompt", f"must be {shapes}")
    if all(isinstance(p, str) for p in value):
        return [Prompt(tokenizer.encode(p), p) for p in value]
    if all(isinstance(t, int) and not isinstance(t, bool) for t in value):
        return [_token_prompt(value, tokenizer, "prompt")]
    if all(isinstance(p, list) for p in value):
        return [_token_prompt(p, tokenizer, f"prompt.{i}") for i, p in enumerate(value)]
    raise bad("prompt", f"must be {shapes}, not a mix")


def _token_prompt(ids: list, tokenizer, param: str) -> Prompt:
    ids = check_token_ids(ids, tokenizer.n_vocab, param)
    return Prompt(ids, tokenizer.decode(ids))


def _message_text(i: int, content) -> str:
    """A message's content: a string, or its text parts joined."""
    if content is None or isinstance(content, str):
        return content or ""
    if not isinstance(content, list) or not all(isinstance(p, dict) for p in content):
        raise bad(f"messages.{i}.content", "must be a string or a list of content parts")
    for k, part in enumerate(content):
        if part.get("type") != "text" or not isinstance(part.get("text"), str):
            raise bad(f"messages.{i}.content.{k}", f"only text parts are supported (this one is '{part.get('type')}')")
    return "".join(p["text"] for p in content)


def _tool_calls(i: int, calls) -> list[dict]:
    """An assistant message's tool_calls, checked: [{id, type: function, function: {name, arguments}}]."""
    where = f"messages.{i}.tool_calls"
    if not isinstance(calls, list):
        raise bad(where, "must be a list of tool calls")
    out = []
    for j, call in enumerate(calls):
        at = f"{where}.{j}"
        fn = call.get("function") if isinstance(call, dict) else None
        if not isinstance(call, dict) or not isinstance(call.get("id"), str) or not isinstance(fn, dict):
            raise bad(at, "a tool call is {\"id\", \"type\": \"function\", \"function\": {\"name\", \"arguments\"}}")
        if call.get("type", "function") != "function":
            raise bad(f"{at}.type", f"unsupported tool call type {call.get('type')!r} (only 'function')")
        if not isinstance(fn.get("name"), str):
            raise bad(f"{at}.function.name", "must be a string")
        args = fn.get("arguments") or "{}"
        if not isinstance(args, str) or not _object_text(args):
            raise bad(f"{at}.function.arguments", "must be the JSON text of an object")
        out.append({"id": call["id"], "type": "function", "function": {"name": fn["name"], "arguments": args}})
    return out


def _object_text(text: str) -> bool:
    try:
        return isinstance(json.loads(text), dict)
    except json.JSONDecodeError:
        return False


def _chat_message(i: int, m: Message) -> dict:
    """A message in engine/chat.py's shape (a developer message is a system one)."""
    if m.role not in ROLES:
        raise bad(f"messages.{i}.role", f"unknown role '{m.role}' ({', '.join(ROLES)})")
    out = {"role": "system" if m.role == "developer" else m.role, "content": _message_text(i, m.content)}
    if m.tool_calls is not None:
        if m.role != "assistant":
            raise bad(f"messages.{i}.tool_calls", "only an assistant message carries tool calls")
        if calls := _tool_calls(i, m.tool_calls):
            out["tool_calls"] = calls
            out["content"] = out["content"] or None
    if m.role == "tool":
        if not isinstance(m.tool_call_id, str) or not m.tool_call_id:
            raise bad(f"messages.{i}.tool_call_id", "a tool message answers a call: its tool_call_id (a string) is "
                                                   "required")
        out["tool_call_id"] = m.tool_call_id
    return out


def chat_conversation(req: ChatRequest) -> Conversation:
    """The messages (roles and tool calls checked), the tools (tools.check_tools: 400 naming the field) and the
    constraint the request asks for (`constraint_of`), as turn.py takes them."""
    messages = [_chat_message(i, m) for i, m in enumerate(req.messages)]
    try:
        check_tools(req.tools, req.tool_choice, req.parallel_tool_calls)
    except ToolError as e:
        raise RequestError(400, str(e), param=e.param) from None
    constraint, where = constraint_of(req)
    return Conversation(messages, req.tools or None, req.tool_choice, req.parallel_tool_calls, constraint, where)


def check_choices(n_prompts: int, n: int) -> None:
    if n_prompts * n > MAX_CHOICES:
        raise RequestError(400, f"prompt: {n_prompts} prompt(s) x n {n} is more than {MAX_CHOICES} generations "
                                f"in one request", param="prompt")


# ------------------------------------------------------------------------------------ the routes
def register_openai(app: FastAPI, cfg: ServeConfig, generator, tokenizer, apply_chat_template) -> None:
    """POST /v1/completions and /v1/chat/completions (errors: the app's handlers, OpenAI's shape)."""

    async def answer(request: Request, kind: ReplyKind, req: Common, prompts: list[Prompt], top_logprobs: int | None,
                     max_tokens: int | None, max_tokens_param: str, fmt: AnswerFormat | None = None):
        """Every field checked (the constraint compiled) before the request's jobs are made and queued; `fmt`
        (chat): the constraint and the tool-call parsing (turn.answer_format)."""
        check_choices(len(prompts), req.n)
        constraint, where = constraint_of(req) if fmt is None else (fmt.constraint, fmt.constraint_param)
        settings = settings_of(req, constraint, top_logprobs, tokenizer, max_tokens, max_tokens_param)
        await acheck_constraint(constraint, tokenizer, where)
        request_id = new_request_id()
        jobs, events = submit_request(generator, cfg, prompts, settings, request, request_id)
        want_usage = bool(req.stream_options and req.stream_options.include_usage)
        reply = await respond(kind, reply_model(cfg, req.model), req.stream, want_usage, prompts, jobs, events,
                              request_id, fmt.parser if fmt is not None else None)
        return with_seed(reply, settings.sampling.seed)

    @app.post("/v1/completions")
    async def completions(req: CompletionRequest, request: Request):
        refuse_unsupported(req)
        return await answer(request, COMPLETION, req, completion_prompts(req.prompt, tokenizer), req.logprobs,
                            req.max_tokens, "max_tokens")

    @app.post("/v1/chat/completions")
    async def chat(req: ChatRequest, request: Request):
        top = chat_top_logprobs(req)
        param = "max_completion_tokens" if req.max_completion_tokens is not None else "max_tokens"
        conv = chat_conversation(req)
        prompt = render(conv, tokenizer, apply_chat_template)
        return await answer(request, CHAT, req, [prompt], top, req.max_completion_tokens or req.max_tokens, param,
                            answer_format(conv, tokenizer))
