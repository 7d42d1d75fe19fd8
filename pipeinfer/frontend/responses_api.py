"""OpenAI's Responses API on `pipeinfer serve`: POST /v1/responses (`register_responses`), one Response object or
its typed server-sent events (sse.py). Stateless: nothing is stored, so previous_response_id and conversation are
refused. The turn (prompt, job, stop and tool-call parsing) is turn.Turn's, of the Settings made here (the sampling
by serving.job.sampling_of); errors are OpenAI's shape (serving.job.RequestError).

    field                   what the server does
    ----------------------  -----------------------------------------------------------------------------------
    model                   any name is answered (llama-server's rule); the reply names it when it is the
                            model's id or an --alias, else the model's id (submit.reply_model)
    input                   a string (one user message), or a list of items: messages {role user / assistant /
                            system / developer, content: a string or input_text / output_text parts},
                            function_call {call_id, name, arguments} and function_call_output {call_id, output};
                            any other item or part (images, files, reasoning ...) refused (400)
    instructions            a system message before the input
    max_output_tokens       the answer's length (status "incomplete", reason max_output_tokens, when reached)
    temperature 0..2, top_p sampling (temperature 0, the default here: greedy)
    stream                  the typed events, response.created ... response.completed (or .incomplete)
    tools, tool_choice, parallel_tool_calls   function tools {type, name, description, parameters, strict};
                            tool_choice auto / none / required / {type: function, name}; other tool types refused
    text.format             text | json_object | json_schema {name, schema, strict}: the chat route's constraint
    previous_response_id, conversation, background   refused (400): nothing is stored
    cache_prompt            llama-server's, as on the chat route (false: the prompt neither starts from the
                            prompt cache nor stays in it); usage.input_tokens_details.cached_tokens: the prompt
                            tokens taken from it
    store, metadata, include, reasoning, user, truncation, service_tier ...  ignored
"""
from __future__ import annotations

import time
import traceback
import uuid
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from ..serving.job import RequestError, Settings, bad, sampling_of
from .sse import JobStream, event
from .submit import ServeConfig, read_body, reply_model, validation_error, with_seed
from .openai_api import Common, ResponseFormat, constraint_of
from .tools import CallArgs, CallEnd, CallFailed, CallStart, Text, ToolError, check_tools
from .turn import Block, Conversation, Outcome, Turn, fold


class ResponsesRequest(BaseModel):
    model_config = ConfigDict(extra="allow", allow_inf_nan=False)
    model: str
    input: Any = None
    instructions: str | None = None
    max_output_tokens: int | None = Field(default=None, ge=1)
    temperature: float | None = Field(default=None, ge=0, le=2)
    top_p: float | None = Field(default=None, gt=0, le=1)
    stream: bool = False
    tools: Any = None
    tool_choice: Any = None
    parallel_tool_calls: bool | None = None
    text: Any = None
    previous_response_id: str | None = None
    conversation: Any = None
    background: bool | None = None
    cache_prompt: bool | None = Field(default=None, strict=True)  # llama-server's (None: true)


ROLES = {"user": "user", "assistant": "assistant", "system": "system", "developer": "system"}
TEXT_PARTS = ("input_text", "output_text", "text")


def _content(where: str, content) -> str:
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise bad(where, "must be a string or a list of content parts")
    for k, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind not in TEXT_PARTS or not isinstance(part.get("text"), str):
            raise bad(f"{where}.{k}", f"only input_text / output_text parts are supported (this one is {kind!r})")
    return "".join(p["text"] for p in content)


def _messages(req: ResponsesRequest) -> list[dict]:
    """The input items as OpenAI's chat messages (engine/chat.py's shape)."""
    out = [{"role": "system", "content": req.instructions}] if req.instructions else []
    items = req.input
    if isinstance(items, str):
        return out + [{"role": "user", "content": items}]
    if not isinstance(items, list) or not items:
        raise bad("input", "must be a string or a non-empty list of items")
    for i, item in enumerate(items):
        where = f"input.{i}"
        if not isinstance(item, dict):
            raise bad(where, "an item is an object")
        kind = item.get("type", "message")
        if kind == "message":
            role = ROLES.get(item.get("role"))
            if role is None:
                raise bad(f"{where}.role", f"unknown role {item.get('role')!r} (user, assistant, system, developer)")
            out.append({"role": role, "content": _content(f"{where}.content", item.get("content"))})
        elif kind == "function_call":
            if not all(isinstance(item.get(k), str) for k in ("call_id", "name", "arguments")):
                raise bad(where, "a function_call item has call_id, name and arguments (strings)")
            call = {"id": item["call_id"], "type": "function",
                    "function": {"name": item["name"], "arguments": item["arguments"]}}
            last = out[-1] if out else None
            if last is not None and last["role"] == "assistant":  # the assistant's text and calls: one turn
                last.setdefault("tool_calls", []).append(call)
            else:
                out.append({"role": "assistant", "content": None, "tool_calls": [call]})
        elif kind == "function_call_output":
            if not isinstance(item.get("call_id"), str):
                raise bad(f"{where}.call_id", "must be a string")
            out.append({"role": "tool", "tool_call_id": item["call_id"],
                        "content": _content(f"{where}.output", item.get("output", ""))})
        else:
            raise bad(f"{where}.type", f"unsupported input item type {kind!r} "
                                       "(message, function_call, function_call_output)")
    return out


def _tools(req: ResponsesRequest) -> tuple[list[dict] | None, Any]:
    """The flat function tools and tool_choice as the chat API's, checked (errors name the Responses fields)."""
    tools = req.tools
    if tools is not None:
        if not isinstance(tools, list):
            raise bad("tools", "must be a list of tools")
        for i, t in enumerate(tools):
            if not isinstance(t, dict) or t.get("type") != "function":
                kind = t.get("type") if isinstance(t, dict) else None
                raise bad(f"tools.{i}.type", f"unsupported tool type {kind!r} (only 'function')")
        tools = [{"type": "function", "function": {k: v for k, v in t.items() if k != "type"}} for t in tools]
    choice = req.tool_choice
    if isinstance(choice, dict) and choice.get("type") == "function" and "function" not in choice:
        choice = {"type": "function", "function": {"name": choice.get("name")}}
    try:
        check_tools(tools, choice, req.parallel_tool_calls)
    except ToolError as e:
        param = e.param.replace(".function.", ".").replace("tool_choice.function.", "tool_choice.")
        raise RequestError(400, f"{param}: {e.message}", param=param) from None
    return tools or None, choice


def _text_format(req: ResponsesRequest):
    """text.format as the chat route's response_format constraint (errors name text.format)."""
    if req.text is None:
        return None, ""
    fmt = req.text.get("format") if isinstance(req.text, dict) else None
    if fmt is None:
        return None, ""
    if not isinstance(fmt, dict) or not isinstance(fmt.get("type"), str):
        raise bad("text.format", "must be {\"type\": \"text\" | \"json_object\" | \"json_schema\", ...}")
    rf = {"type": fmt["type"]}
    if fmt["type"] == "json_schema":
        rf["json_schema"] = {k: fmt[k] for k in ("name", "schema", "strict") if k in fmt}
    try:
        constraint, _ = constraint_of(Common(model=req.model, response_format=ResponseFormat.model_validate(rf)))
    except ValidationError as e:
        raise bad("text.format", " ".join(e.errors()[0]["msg"].split()) if e.errors() else "invalid") from None
    except RequestError as e:
        param = (e.param or "text.format").replace("response_format.json_schema", "text.format").replace(
            "response_format", "text.format")
        raise RequestError(400, e.message.replace(e.param or "\0", param), param=param) from None
    return constraint, "text.format"


def _conversation(req: ResponsesRequest) -> Conversation:
    for name in ("previous_response_id", "conversation"):
        if getattr(req, name) is not None:
            raise bad(name, "this server stores no responses: send the whole conversation in input")
    if req.background:
        raise bad("background", "background responses are not supported")
    tools, choice = _tools(req)
    constraint, where = _text_format(req)
    return Conversation(_messages(req), tools, choice, req.parallel_tool_calls, constraint, where)


# ------------------------------------------------------------------------------------ the reply
class ResponseReply:
    def __init__(self, model_id: str, req: ResponsesRequest, turn: Turn):
        self.id = "resp_" + uuid.uuid4().hex[:24]
        self.model_id, self.req, self.turn = model_id, req, turn
        self.created_at = int(time.time())
        self.seq = 0

    def _item_id(self, prefix: str) -> str:
        return f"{prefix}_{uuid.uuid4().hex[:24]}"

    def response(self, status: str, output: list, outcome: Outcome | None) -> dict:
        usage = None
        if outcome is not None:
            usage = {"input_tokens": outcome.prompt_tokens, "output_tokens": outcome.completion_tokens,
                     "total_tokens": outcome.prompt_tokens + outcome.completion_tokens,
                     "input_tokens_details": {"cached_tokens": outcome.cached_tokens},
                     "output_tokens_details": {"reasoning_tokens": 0}}
        incomplete = {"reason": "max_output_tokens"} if status == "incomplete" else None
        fmt = (self.req.text or {}).get("format") if isinstance(self.req.text, dict) else None
        return {"id": self.id, "object": "response", "created_at": self.created_at, "status": status,
                "model": self.model_id, "output": output, "usage": usage, "incomplete_details": incomplete,
                "error": None, "instructions": self.req.instructions, "max_output_tokens": self.req.max_output_tokens,
                "temperature": self.req.temperature, "top_p": self.req.top_p,
                "parallel_tool_calls": self.req.parallel_tool_calls is not False,
                "tool_choice": self.req.tool_choice or "auto", "tools": self.req.tools or [],
                "text": {"format": fmt or {"type": "text"}}, "metadata": {}, "store": False,
                "previous_response_id": None}

    @staticmethod
    def status(o: Outcome) -> str:
        return "incomplete" if o.finish == "length" else "completed"

    def message_item(self, item_id: str, text: str, status: str) -> dict:
        return {"type": "message", "id": item_id, "role": "assistant", "status": status,
                "content": [{"type": "output_text", "text": text, "annotations": []}] if text is not None else []}

    def call_item(self, b: Block, status: str) -> dict:
        return {"type": "function_call", "id": self._item_id("fc"),
                "call_id": b.call_id, "name": b.name, "arguments": b.arguments, "status": status}

    async def whole(self):
        folded = await fold(self.turn.events())
        o = folded.outcome
        if o is None:
            return JSONResponse({}, status_code=499)
        status = self.status(o)
        output = [self.message_item(self._item_id("msg"), b.text, status) if b.kind == "text"
                  else self.call_item(b, "completed") for b in folded.blocks]
        return self.response(status, output, o)

    # ---------------------------------------------------------------- streamed
    def event(self, kind: str, **data) -> str:
        out = event(kind, {"type": kind, **data, "sequence_number": self.seq})
        self.seq += 1
        return out

    async def stream(self):
        yield self.event("response.created", response=self.response("in_progress", [], None))
        yield self.event("response.in_progress", response=self.response("in_progress", [], None))
        output: list[dict] = []
        current: dict | None = None     # the item being written: {"item", "text" | "call": Block}
        calls: dict[int, int] = {}      # the parser's call index -> output index

        def close(status: str = "completed") -> list[str]:
            nonlocal current
            if current is None:
                return []
            out, i, item = [], len(output) - 1, current["item"]
            if item["type"] == "message":
                text = current["text"]
                part = {"type": "output_text", "text": text, "annotations": []}
                out.append(self.event("response.output_text.done", item_id=item["id"], output_index=i,
                                      content_index=0, text=text, logprobs=[]))
                out.append(self.event("response.content_part.done", item_id=item["id"], output_index=i,
                                      content_index=0, part=part))
                item.update(status=status, content=[part])
            else:
                out.append(self.event("response.function_call_arguments.done", item_id=item["id"], output_index=i,
                                      name=item["name"], arguments=item["arguments"]))
                item["status"] = "completed"
            out.append(self.event("response.output_item.done", output_index=i, item=item))
            current = None
            return out

        try:
            async for e in self.turn.events():
                out: list[str] = []
                if isinstance(e, (Text, CallFailed)) and e.text:
                    if current is None or current["item"]["type"] != "message":
                        out += close()
                        item = self.message_item(self._item_id("msg"), None, "in_progress")
                        output.append(item)
                        current = {"item": item, "text": ""}
                        i = len(output) - 1
                        out.append(self.event("response.output_item.added", output_index=i, item=dict(item)))
                        out.append(self.event("response.content_part.added", item_id=item["id"], output_index=i,
                                              content_index=0,
                                              part={"type": "output_text", "text": "", "annotations": []}))
                    current["text"] += e.text
                    out.append(self.event("response.output_text.delta", item_id=current["item"]["id"],
                                          output_index=len(output) - 1, content_index=0, delta=e.text,
                                          logprobs=[]))
                elif isinstance(e, CallStart):
                    out += close()
                    item = {"type": "function_call", "id": self._item_id("fc"), "call_id": e.id, "name": e.name,
                            "arguments": "", "status": "in_progress"}
                    output.append(item)
                    calls[e.index] = len(output) - 1
                    current = {"item": item}
                    out.append(self.event("response.output_item.added", output_index=len(output) - 1,
                                          item=dict(item)))
                elif isinstance(e, CallArgs) and e.fragment and current is not None:
                    current["item"]["arguments"] += e.fragment
                    out.append(self.event("response.function_call_arguments.delta", item_id=current["item"]["id"],
                                          output_index=len(output) - 1, delta=e.fragment))
                elif isinstance(e, CallEnd):
                    out += close()
                elif isinstance(e, Outcome):
                    status = self.status(e)
                    out += close(status)
                    kind = "response.completed" if status == "completed" else "response.incomplete"
                    out.append(self.event(kind, response=self.response(status, output, e)))
                for chunk in out:
                    yield chunk
        except RequestError as err:
            yield self.event("error", code=err.code or "server_error", message=err.message, param=None)


def register_responses(app: FastAPI, cfg: ServeConfig, generator, tokenizer, apply_chat_template) -> None:
    """POST /v1/responses (errors in OpenAI's shape, as on the chat route)."""

    @app.post("/v1/responses")
    async def responses(request: Request):
        try:
            req = await read_body(request, ResponsesRequest, validation_error)
            conv = _conversation(req)
            settings = Settings(req.max_output_tokens, "max_output_tokens", sampling_of(req.temperature, req.top_p),
                                cache_prompt=req.cache_prompt is not False)
            turn = Turn(cfg, tokenizer, apply_chat_template, conv, settings)
            await turn.start(generator, request)
        except RequestError as e:
            headers = {"Retry-After": "1"} if e.status == 503 else None
            return JSONResponse(e.body(), status_code=e.status, headers=headers)
        except Exception as e:  # a bug: one line to the client, the traceback to the log
            traceback.print_exc()
            err = RequestError(500, f"internal error: {type(e).__name__}: {e}")
            return JSONResponse(err.body(), status_code=500)
        reply = ResponseReply(reply_model(cfg, req.model), req, turn)
        if req.stream:
            return with_seed(JobStream(reply.stream(), [turn.job]), settings.sampling.seed)
        try:
            return with_seed(await reply.whole(), settings.sampling.seed)
        except RequestError as e:
            return JSONResponse(e.body(), status_code=e.status)
