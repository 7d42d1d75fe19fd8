"""`pipeinfer serve`'s HTTP server: the app (`create_app`) that wires every API's routes over a generator it is given.

Where it runs: in the process that `pipeinfer serve` starts. Under mpiexec that is rank 0, beside the generation
thread that owns the pipeline (feeders/generator.py); supervised (`serve --np N` / `--hostfile HOSTS`) it is the
supervisor's process, outside MPI, which runs the pipeline as a child job and feeds its rank 0 over a socket
(supervisor/supervisor.py, serving/link.py). Either way it imports no MPI and sees only the serving seam's
Generator (serving/job.py).

Routes: each API module registers its own, and renders the one kind of result every generation gives (serving/job
events) in its API's shape: OpenAI's POST /v1/chat/completions and /v1/completions (openai_api.py, replies in
openai_reply.py), Anthropic's POST /v1/messages and /v1/messages/count_tokens (anthropic_api.py), OpenAI's POST
/v1/responses (responses_api.py); streamed answers are server-sent events (sse.py). This module adds GET /v1/models
(the model's id and each --alias, with the context: llama-server's `meta` and vLLM's `max_model_len`), GET /health
and llama-server's POST /tokenize and /detokenize, then the page (page.py: / and /state), /metrics (metrics.py) and
the access gate (access.py).
Every error but those Anthropic's routes answer in their own shape (anthropic_api.py), an unknown route and a wrong
method too, is OpenAI's JSON: `{"error": {"message", "type", "param", "code"}}`: 400 for a malformed field (named
in `param`) or a request that does not fit the context, 404 for an unknown route, 405 for a wrong method,
503 + Retry-After when the queue is full, 500 when the pipeline failed.

A request goes down in one line: its API module parses the body into Prompts and Settings (serving/job.py; the
sampling made once, by serving.job.sampling_of), submit.submit_request makes one Job per choice and queues them on
the generator, whose thread hands each to the head session's scheduler (decide/scheduler.py: up to --parallel at
once, first come first served). Text comes back through the job's asyncio queue (serving/answer.py). A client
that disconnects (or a stop string that matches) sets the job's stop flag: the head stops launching, cancels its
runs in flight through the pipeline's cancellation, and collects them, so no run or KV cell is left behind; each
generation starts from an empty KV cache on every stage (ranks/startup.HeadSession), or, with the prompt cache
(--cache-prompt, and the request's `cache_prompt`, llama-server's field), from the cells of an earlier prompt's
head it shares: the same tokens, never another request's answer. /health shows the cache (`prompt_cache`).
"""
from __future__ import annotations

from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from ..serving.job import RequestError
from .anthropic_api import register_anthropic
from .openai_api import Body, register_openai
from .responses_api import register_responses
from .submit import ServeConfig, check_token_ids

__all__ = ["ServeConfig", "create_app"]


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
        return {"object": "list", "data": [{"id": name, "object": "model", "created": 0, "owned_by": "pipeinfer",
                                            "max_model_len": cfg.n_ctx, "meta": meta} for name in cfg.model_names]}


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


def create_app(cfg: ServeConfig, generator, tokenizer, apply_chat_template, access=None):
    """The ASGI app over `generator` (feeders/generator.Generator, or the supervisor). `apply_chat_template(messages) ->
    prompt text`; `access` (access.Access): keys and limits (none by default but a 4 MiB body), /metrics always."""
    app = FastAPI(title="pipeinfer", docs_url=None, redoc_url=None, openapi_url="/openapi.json")
    _error_handlers(app)
    _info_routes(app, cfg, generator, tokenizer)
    _token_routes(app, tokenizer)
    for register in (register_openai, register_anthropic, register_responses):  # each API its own routes
        register(app, cfg, generator, tokenizer, apply_chat_template)
    from .page import register_page; register_page(app, cfg, generator)  # noqa: E702  the page at /, GET /state
    from .access import Access, Gate; from .metrics import register_metrics  # noqa: E702
    app.add_middleware(Gate, access=access or Access(), metrics=register_metrics(app, generator))
    return app
