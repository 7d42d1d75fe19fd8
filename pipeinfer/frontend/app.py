"""`pipeinfer serve`: an OpenAI-compatible HTTP server on the head rank (rank 0).

Endpoints: POST /v1/chat/completions and /v1/completions (streaming as server-sent events ending with
`data: [DONE]`, or one JSON answer; fields in openai_api.py, reply shapes in openai_reply.py), GET /v1/models (with
the context: llama-server's `meta` and vLLM's `max_model_len`), GET /health, and llama-server's POST /tokenize and
/detokenize. Every error, on every route (an unknown route and a wrong method too), is OpenAI's JSON:
`{"error": {"message", "type", "param", "code"}}`: 400 for a malformed field (named in `param`) or a request that
does not fit the context, 404 for an unknown model or route, 405 for a wrong method, 503 + Retry-After when the
queue is full, 500 when the pipeline failed.

Threads on rank 0: uvicorn's event loop takes requests and turns each into jobs (submit.py: one per choice); one
generation thread (feeders/generator.py) owns the pipeline and runs queued jobs first come first served: one at a time
(--parallel 1), or up to N at once through the scheduler (ranks/scheduler.py: --parallel N). Text goes back to the
request's handler through an asyncio queue (serving/answer.py). A client that disconnects (or a stop string that matches)
sets the job's stop flag: the head stops launching, cancels its runs in flight through the pipeline's
cancellation, and collects them, so no run or KV cell is left behind; each generation starts from an empty KV
cache on every stage (ranks/startup.HeadSession), or, with the prompt cache (--cache-prompt, and the request's
`cache_prompt`, llama-server's field), from the cells of an earlier prompt's head it shares: the same tokens,
never another request's answer. /health shows the cache (`prompt_cache`). The other ranks serve the pipeline as
they do for `generate`.

Modules, downward: serving/job.py (requests as jobs, their events) <- serving/answer.py (a job's text and
log-probabilities on the way out) <- feeders/generator.py (the generation thread) <- submit.py <- turn.py (a conversation with tools: its prompt, the tool
calls parsed from its answers) <- openai_api.py / openai_reply.py <- this one (the routes).
"""
from __future__ import annotations

from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from ..serving.answer import StopMatcher
from ..serving.job import Job, Prompt, RequestError, new_request_id
from .submit import ServeConfig, acheck_constraint, check_model, check_token_ids, make_jobs, submit, with_seed
from .openai_api import (Body, ChatRequest, Common, CompletionRequest, chat_conversation, chat_top_logprobs,
                         check_choices, completion_prompts, constraint_of, refuse_unsupported, settings_of)
from .openai_reply import CHAT, COMPLETION, Reply, ReplyKind, respond
from .turn import AnswerFormat, answer_format, render

__all__ = ["Job", "RequestError", "ServeConfig", "StopMatcher", "Reply", "submit", "create_app"]


class TokenizeRequest(Body):
    content: str
    add_special: bool = False
    parse_special: bool = True
    with_pieces: bool = False


class DetokenizeRequest(Body):
    tokens: Any  # token ids (check_token_ids)


# ------------------------------------------------------------------------------------ errors
def _validation_error(exc: RequestValidationError) -> RequestError:
    """The first of pydantic's complaints, in one line naming the field (a dotted path: messages.0.role)."""
    first = exc.errors()[0] if exc.errors() else {}
    if first.get("type") == "json_invalid":
        return RequestError(400, f"the body is not valid JSON: {first.get('ctx', {}).get('error', 'invalid')}")
    where = ".".join(str(x) for x in first.get("loc", ()) if x != "body")
    return RequestError(400, f"{where or 'body'}: {first.get('msg', 'invalid request body')}", param=where or None)


def _http_error(request: Request, exc: StarletteHTTPException) -> RequestError:
    if exc.status_code == 404:
        return RequestError(404, f"Invalid URL ({request.method} {request.url.path})", code="not_found")
    if exc.status_code == 405:
        allowed = (exc.headers or {}).get("Allow", "")
        return RequestError(405, f"method {request.method} is not allowed on {request.url.path}"
                                 f"{f' (allowed: {allowed})' if allowed else ''}", code="method_not_allowed")
    return RequestError(exc.status_code, str(exc.detail))


def _error_handlers(app: FastAPI) -> None:
    def reply(exc: RequestError, headers: dict | None = None) -> JSONResponse:
        if exc.status == 503:
            headers = {**(headers or {}), "Retry-After": "1"}
        return JSONResponse(exc.body(), status_code=exc.status, headers=headers)

    @app.exception_handler(RequestError)
    async def _request_error(_request, exc: RequestError):
        return reply(exc)

    @app.exception_handler(RequestValidationError)
    async def _invalid(_request, exc: RequestValidationError):
        return reply(_validation_error(exc))

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, exc: StarletteHTTPException):
        return reply(_http_error(request, exc), exc.headers)

    @app.exception_handler(Exception)
    async def _internal(_request, exc: Exception):  # a bug: the client gets one line, the log the traceback
        return reply(RequestError(500, f"internal error: {type(exc).__name__}: {exc}"))


# ------------------------------------------------------------------------------------ routes
def _n_ctx_train(tokenizer) -> int | None:
    """The model's training context, from its GGUF header (None without one: a test's fake tokenizer)."""
    path = getattr(tokenizer, "path", None)
    if path is None:
        return None
    from ..engine.ggufheader import read_header
    fields = read_header(path).fields
    value = fields.get(f"{fields.get('general.architecture')}.context_length")
    return int(value) if value is not None else None


def _info_routes(app: FastAPI, cfg: ServeConfig, generator, tokenizer) -> None:
    @app.get("/health")
    async def health():
        if generator.fatal:
            return JSONResponse({"status": "error", "error": generator.fatal}, status_code=503)
        load = generator.load()
        return {"status": "degraded" if load.get("degraded") else "ok", "parallel": generator.parallel, **load}

    @app.get("/v1/models")
    async def models():
        meta = {"n_ctx": cfg.n_ctx, "n_ctx_train": _n_ctx_train(tokenizer), "n_vocab": tokenizer.n_vocab}
        return {"object": "list", "data": [{"id": cfg.model_id, "object": "model", "created": 0,
                                            "owned_by": "pipeinfer", "max_model_len": cfg.n_ctx, "meta": meta}]}


def _token_routes(app: FastAPI, tokenizer) -> None:
    """llama-server's /tokenize and /detokenize."""
    def piece(t: int) -> str | list[int]:
        raw = tokenizer.piece(t)
        try:
            return raw.decode("utf-8")
        except UnicodeDecodeError:  # part of a character: its bytes, as llama-server gives them
            return list(raw)

    @app.post("/tokenize")
    async def tokenize(req: TokenizeRequest):
        ids = tokenizer.encode(req.content, add_special=req.add_special, parse_special=req.parse_special)
        return {"tokens": [{"id": t, "piece": piece(t)} for t in ids] if req.with_pieces else ids}

    @app.post("/detokenize")
    async def detokenize(req: DetokenizeRequest):
        return {"content": tokenizer.decode(check_token_ids(req.tokens, tokenizer.n_vocab, "tokens"))}


def _openai_routes(app: FastAPI, cfg: ServeConfig, generator, tokenizer, apply_chat_template) -> None:
    async def answer(request: Request, kind: ReplyKind, req: Common, prompts: list[Prompt], top_logprobs: int | None,
                     max_tokens: int | None, max_tokens_param: str, fmt: AnswerFormat | None = None):
        """Every field checked (the constraint compiled) and every job made before the first is queued; `fmt`
        (chat): the constraint and the tool-call parsing (turn.answer_format)."""
        check_choices(len(prompts), req.n)
        constraint, where = constraint_of(req) if fmt is None else (fmt.constraint, fmt.constraint_param)
        settings = settings_of(req, constraint, top_logprobs, tokenizer, max_tokens, max_tokens_param)
        await acheck_constraint(constraint, tokenizer, where)
        request_id = new_request_id()
        jobs = make_jobs(cfg, prompts, settings, request_id)
        want_usage = bool(req.stream_options and req.stream_options.include_usage)
        return with_seed(await respond(generator, kind, cfg.model_id, req.stream, want_usage, prompts, jobs,
                                       request_id, request, fmt.parser if fmt is not None else None), settings.seed)

    @app.post("/v1/completions")
    async def completions(req: CompletionRequest, request: Request):
        check_model(cfg, req.model)
        refuse_unsupported(req)
        return await answer(request, COMPLETION, req, completion_prompts(req.prompt, tokenizer), req.logprobs,
                            req.max_tokens, "max_tokens")

    @app.post("/v1/chat/completions")
    async def chat(req: ChatRequest, request: Request):
        check_model(cfg, req.model)
        top = chat_top_logprobs(req)
        param = "max_completion_tokens" if req.max_completion_tokens is not None else "max_tokens"
        conv = chat_conversation(req)
        prompt = render(conv, tokenizer, apply_chat_template)
        return await answer(request, CHAT, req, [prompt], top, req.max_completion_tokens or req.max_tokens, param,
                            answer_format(conv, tokenizer))


def create_app(cfg: ServeConfig, generator, tokenizer, apply_chat_template, access=None):
    """The ASGI app over `generator` (feeders/generator.Generator, or the supervisor). `apply_chat_template(messages) ->
    prompt text`; `access` (access.Access): keys and limits (none by default but a 4 MiB body), /metrics always."""
    app = FastAPI(title="pipeinfer", docs_url=None, redoc_url=None, openapi_url="/openapi.json")
    _error_handlers(app)
    _info_routes(app, cfg, generator, tokenizer)
    _token_routes(app, tokenizer)
    _openai_routes(app, cfg, generator, tokenizer, apply_chat_template)
    from .responses_api import register_apis; register_apis(app, cfg, generator, tokenizer, apply_chat_template)  # noqa: E702,E501
    from .page import register_page; register_page(app, cfg, generator)  # noqa: E702  the page at /, GET /state
    from .access import Access, Gate; from .metrics import register_metrics  # noqa: E702
    app.add_middleware(Gate, access=access or Access(), metrics=register_metrics(app, generator))
    return app
