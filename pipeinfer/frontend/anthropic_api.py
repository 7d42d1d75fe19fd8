"""Anthropic's Messages API on `pipeinfer serve`: POST /v1/messages (one JSON message, or Anthropic's server-sent
events, sse.py) and POST /v1/messages/count_tokens (`register_anthropic`).

A request becomes a conversation in OpenAI's shape (tools.from_anthropic_messages / from_anthropic_tools) and its
Settings (serving/job.py: the sampling by serving.job.sampling_of), run as one turn (turn.Turn): rendered through
the chat template (with tools or tool calls: the GGUF's Jinja template, engine/chat.py; else the app's
apply_chat_template), one job made and queued on the generator (submit.submit_request); the answer's text is cut
at the first stop sequence (answer.StopMatcher there, so the reply can say which one matched; the job is then
cancelled) and, when the request has tools, parsed into text and tool calls as it streams (tools.ToolCallParser).

Every error on these routes is Anthropic's: {"type": "error", "error": {"type", "message"}}; the body is validated
here (not by FastAPI) so that a malformed one is not answered in OpenAI's shape. `x-api-key` and
`anthropic-version` are accepted and ignored.

    field                   what the server does
    ----------------------  -----------------------------------------------------------------------------------
    model                   any name is answered (llama-server's rule); the reply names it when it is the
                            model's id or an --alias, else the model's id (submit.reply_model)
    max_tokens              required, >= 1; prompt + max_tokens must fit the context (400)
    messages                roles user / assistant; content a string or blocks text, tool_use, tool_result;
                            image, document, thinking ... blocks refused (400)
    system                  a string or text blocks
    stop_sequences          the text is cut before the first match: stop_reason "stop_sequence"
    temperature 0..1, top_p, top_k   sampling (temperature 0, the default here: greedy)
    stream                  Anthropic's events (message_start ... message_stop)
    tools, tool_choice      client tools {name, description, input_schema}; auto / any / tool / none
                            (any and tool constrain the answer to a call; disable_parallel_tool_use: one call
                            at most); server tools refused
    cache_prompt            llama-server's, as on the chat route (false: the prompt neither starts from the
                            prompt cache nor stays in it); usage.cache_read_input_tokens: the prompt tokens taken
                            from it, input_tokens the rest (Anthropic's split)
    metadata, thinking, service_tier, container, mcp_servers ...  ignored
"""
from __future__ import annotations

import traceback
import uuid
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict, Field

from ..serving.job import RequestError, Settings, sampling_of
from .sse import JobStream, event
from .submit import ServeConfig, read_body, reply_model, validation_error, with_seed
from .tools import (CallArgs, CallEnd, CallFailed, CallStart, Text, ToolError, from_anthropic_messages,
                    from_anthropic_tools, new_call_id)
from .turn import Block, Conversation, Outcome, Turn, arguments_object, fold, render


# ==================================================================================== Anthropic's bodies
class _Body(BaseModel):
    model_config = ConfigDict(extra="allow", allow_inf_nan=False)


class AnthropicMessage(_Body):
    role: str
    content: Any                              # a string or a list of blocks (checked by hand)


class CountTokensRequest(_Body):
    model: str
    messages: list[AnthropicMessage] = Field(min_length=1)
    system: Any = None
    tools: Any = None
    tool_choice: Any = None


class MessagesRequest(CountTokensRequest):
    max_tokens: int = Field(ge=1)
    stop_sequences: list[str] | None = None
    temperature: float | None = Field(default=None, ge=0, le=1)
    top_p: float | None = Field(default=None, gt=0, le=1)
    top_k: int | None = Field(default=None, ge=0)
    stream: bool = False
    cache_prompt: bool | None = Field(default=None, strict=True)  # llama-server's (None: true)


BLOCKS = ("text", "tool_use", "tool_result")
ERROR_TYPES = {400: "invalid_request_error", 404: "not_found_error", 413: "request_too_large",
               429: "rate_limit_error", 503: "overloaded_error"}


def anthropic_error(e: RequestError) -> JSONResponse:
    headers = {"Retry-After": "1"} if e.status == 503 else None
    return JSONResponse({"type": "error", "error": {"type": ERROR_TYPES.get(e.status, "api_error"),
                                                    "message": e.message}}, status_code=e.status, headers=headers)


def _bad(param: str, message: str) -> RequestError:
    return RequestError(400, f"{param}: {message}", param=param)


def _check_messages(req: CountTokensRequest) -> None:
    if req.system is not None and not isinstance(req.system, str):
        if not isinstance(req.system, list) or not all(isinstance(b, dict) and b.get("type") == "text"
                                                       and isinstance(b.get("text"), str) for b in req.system):
            raise _bad("system", "must be a string or a list of text blocks")
    for i, m in enumerate(req.messages):
        if m.role not in ("user", "assistant"):
            raise _bad(f"messages.{i}.role", f"unexpected role '{m.role}' (user or assistant; the system prompt is "
                                             "the top-level system field)")
        if isinstance(m.content, str):
            continue
        if not isinstance(m.content, list):
            raise _bad(f"messages.{i}.content", "must be a string or a list of content blocks")
        for k, b in enumerate(m.content):
            where = f"messages.{i}.content.{k}"
            kind = b.get("type") if isinstance(b, dict) else None
            if kind not in BLOCKS:
                raise _bad(where, f"unsupported content block type {kind!r} (only {', '.join(BLOCKS)})")
            if kind == "text" and not isinstance(b.get("text"), str):
                raise _bad(f"{where}.text", "must be a string")
            if kind == "tool_use" and (m.role != "assistant" or not isinstance(b.get("input", {}), dict)
                                       or not isinstance(b.get("id"), str) or not isinstance(b.get("name"), str)):
                raise _bad(where, "a tool_use block is the assistant's {id, name, input: object}")
            if kind == "tool_result":
                if m.role != "user" or not isinstance(b.get("tool_use_id"), str):
                    raise _bad(where, "a tool_result block is the user's {tool_use_id, content}")
                c = b.get("content")
                if c is not None and not isinstance(c, str) and not (
                        isinstance(c, list) and all(isinstance(x, dict) and x.get("type") == "text" for x in c)):
                    raise _bad(f"{where}.content", "must be a string or a list of text blocks")


def conversation(req: CountTokensRequest) -> Conversation:
    _check_messages(req)
    try:
        tools, choice, parallel = from_anthropic_tools(req.tools, req.tool_choice)
    except ToolError as e:
        raise RequestError(400, str(e), param=e.param) from None
    messages = from_anthropic_messages(req.system, [m.model_dump() for m in req.messages])
    return Conversation(messages, tools, choice, parallel)


# ==================================================================================== Anthropic's replies
STOP_REASONS = {"length": "max_tokens", "stop_sequence": "stop_sequence", "tool_calls": "tool_use"}


def _stop_reason(o: Outcome) -> str:
    return STOP_REASONS.get(o.finish, "end_turn")


def usage(prompt_tokens: int, output_tokens: int, cached_tokens: int) -> dict:
    """Anthropic's usage: input_tokens are the prompt's tokens not read from the cache (cache_read_input_tokens)."""
    return {"input_tokens": prompt_tokens - cached_tokens, "output_tokens": output_tokens,
            "cache_creation_input_tokens": 0, "cache_read_input_tokens": cached_tokens}


def _block(b: Block) -> dict:
    if b.kind == "text":
        return {"type": "text", "text": b.text}
    return {"type": "tool_use", "id": b.call_id, "name": b.name, "input": arguments_object(b.arguments)}


class MessageReply:
    def __init__(self, model_id: str, turn: Turn):
        self.id, self.model_id, self.turn = "msg_" + uuid.uuid4().hex[:24], model_id, turn

    def message(self, content: list, stop_reason, stop_sequence, input_tokens: int, output_tokens: int,
                cached_tokens: int = 0) -> dict:
        return {"id": self.id, "type": "message", "role": "assistant", "model": self.model_id, "content": content,
                "stop_reason": stop_reason, "stop_sequence": stop_sequence,
                "usage": usage(input_tokens, output_tokens, cached_tokens)}

    async def whole(self):
        folded = await fold(self.turn.events())
        o = folded.outcome
        if o is None:
            return JSONResponse({}, status_code=499)
        return self.message([_block(b) for b in folded.blocks], _stop_reason(o), o.stop_sequence,
                            o.prompt_tokens, o.completion_tokens, o.cached_tokens)

    async def stream(self):
        n_prompt = len(self.turn.prompt.tokens)
        yield event("message_start", {"type": "message_start",
                                      "message": self.message([], None, None, n_prompt, 0)})
        index, open_kind, calls = -1, None, {}   # calls: the parser's call index -> block index

        def close():
            nonlocal open_kind
            if open_kind is None:
                return []
            open_kind = None
            return [event("content_block_stop", {"type": "content_block_stop", "index": index})]

        def delta(d: dict) -> str:
            return event("content_block_delta", {"type": "content_block_delta", "index": index, "delta": d})

        try:
            async for e in self.turn.events():
                out: list[str] = []
                if isinstance(e, (Text, CallFailed)) and e.text:
                    if open_kind != "text":
                        out += close()
                        index, open_kind = index + 1, "text"
                        out.append(event("content_block_start", {"type": "content_block_start", "index": index,
                                                                 "content_block": {"type": "text", "text": ""}}))
                    out.append(delta({"type": "text_delta", "text": e.text}))
                elif isinstance(e, CallStart):
                    out += close()
                    index, open_kind = index + 1, "call"
                    calls[e.index] = index
                    out.append(event("content_block_start", {"type": "content_block_start", "index": index,
                                                             "content_block": {"type": "tool_use", "id": e.id,
                                                                               "name": e.name, "input": {}}}))
                elif isinstance(e, CallArgs) and e.fragment:
                    out.append(delta({"type": "input_json_delta", "partial_json": e.fragment}))
                elif isinstance(e, CallEnd):
                    out += close()
                elif isinstance(e, Outcome):
                    out += close()
                    out.append(event("message_delta", {"type": "message_delta",
                                                       "delta": {"stop_reason": _stop_reason(e),
                                                                 "stop_sequence": e.stop_sequence},
                                                       "usage": usage(e.prompt_tokens, e.completion_tokens,
                                                                      e.cached_tokens)}))
                    out.append(event("message_stop", {"type": "message_stop"}))
                for chunk in out:
                    yield chunk
        except RequestError as err:
            yield event("error", {"type": "error", "error": {"type": "api_error", "message": err.message}})


# ==================================================================================== the routes
def register_anthropic(app: FastAPI, cfg: ServeConfig, generator, tokenizer, apply_chat_template) -> None:
    """POST /v1/messages and /v1/messages/count_tokens, every error in Anthropic's shape."""

    async def guarded(work):
        try:
            return await work()
        except RequestError as e:
            return anthropic_error(e)
        except Exception as e:  # a bug: the client gets one line in Anthropic's shape, the log the traceback
            traceback.print_exc()
            return anthropic_error(RequestError(500, f"internal error: {type(e).__name__}: {e}"))

    @app.post("/v1/messages")
    async def messages(request: Request):
        async def work():
            req = await read_body(request, MessagesRequest, validation_error)
            conv = conversation(req)
            settings = Settings(req.max_tokens, "max_tokens", sampling_of(req.temperature, req.top_p, req.top_k),
                                tuple(req.stop_sequences or ()), cache_prompt=req.cache_prompt is not False)
            turn = Turn(cfg, tokenizer, apply_chat_template, conv, settings, call_id=lambda: new_call_id("toolu_"))
            await turn.start(generator, request)
            reply = MessageReply(reply_model(cfg, req.model), turn)
            if req.stream:
                return with_seed(JobStream(reply.stream(), [turn.job]), settings.sampling.seed)
            return with_seed(await reply.whole(), settings.sampling.seed)
        return await guarded(work)

    @app.post("/v1/messages/count_tokens")
    async def count_tokens(request: Request):
        async def work():
            req = await read_body(request, CountTokensRequest, validation_error)
            conv = conversation(req)
            return {"input_tokens": len(render(conv, tokenizer, apply_chat_template).tokens)}
        return await guarded(work)
