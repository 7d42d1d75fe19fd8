"""Who may use the server and how much of it: API keys, the largest body, requests at once, a client that stops
reading; every answer counted for /metrics (metrics.py).

One ASGI middleware (`Gate`) in front of every route, so a refusal costs no parsing and has the route's API error
shape: OpenAI's `{"error": {"message", "type", "param", "code"}}`, Anthropic's `{"type": "error", "error":
{"type", "message"}}` on /v1/messages*.

    keys         with --api-key/--api-key-file, every route but /health, the page (/) and its /static/* files needs
                 `Authorization: Bearer KEY` or `x-api-key: KEY` (Anthropic's header); compared in constant time;
                 401 otherwise. A key is never logged nor echoed.
    body         larger than --max-body-bytes (by its Content-Length, or as it arrives): 413, before the route
                 reads it.
    at once      more than --max-connections requests in progress: 503 with Retry-After (/health and /metrics
                 are not counted: they stay up under load); uvicorn's limit_concurrency, a little higher, is the
                 backstop for idle connections (its 503 is plain text).
    stalled      a response the client has not taken for --stalled-client-timeout seconds (its socket's buffers
                 full) is abandoned: the connection is closed and the request's generations cancelled, so it holds
                 no slot. The generation thread never waits for a client: it pushes each job's events into the
                 job's own unbounded asyncio queue, bounded in all by (queued + generating jobs) x max_tokens.
"""
from __future__ import annotations

import asyncio
import hmac
import json
import sys
from dataclasses import dataclass
from pathlib import Path

from ..core.errors import UserError

MiB = 2 ** 20
LOOPBACK = ("127.0.0.1", "::1", "localhost")
UNCOUNTED = ("/health", "/metrics", "/state")   # never refused for load (the page polls /state every second)
OPEN = ("/health", "/")               # no key needed: the page itself holds no data (it sends the key it is given)
OPEN_PREFIXES = ("/static/",)         # the page's script and style


@dataclass(frozen=True)
class Access:
    api_keys: tuple[str, ...] = ()
    max_body_bytes: int = 4 * MiB
    max_connections: int | None = None  # requests in progress at once (None: no limit)
    stalled_client_timeout_s: float | None = 60.0


def read_keys(keys: tuple[str, ...] | list[str], key_file: str | None) -> tuple[str, ...]:
    """--api-key (repeatable) and --api-key-file (one key a line; blank lines and # comments skipped). A key is
    printable ASCII without spaces (it travels in a header); an error never shows it."""
    out = [k.strip() for k in keys]
    if key_file:
        try:
            lines = Path(key_file).read_text().splitlines()
        except (OSError, UnicodeDecodeError) as e:
            raise UserError(f"--api-key-file {key_file}: {getattr(e, 'strerror', None) or e}") from None
        out += [line.strip() for line in lines if line.strip() and not line.strip().startswith("#")]
        if not out:
            raise UserError(f"--api-key-file {key_file}: no key in it")
        if Path(key_file).stat().st_mode & 0o004:  # a shared cluster's other users could read the keys
            print(f"[pipeinfer] warning: --api-key-file {key_file} is readable by every user (chmod 600 {key_file})",
                  file=sys.stderr, flush=True)
    for i, k in enumerate(out):
        if not k or not k.isascii() or not k.isprintable() or " " in k:
            raise UserError(f"API key #{i + 1} is empty or not printable ASCII without spaces (not shown)")
    return tuple(dict.fromkeys(out))


def exposure_warning(host: str, keys) -> str | None:
    """The line to print when listening beyond loopback without a key."""
    if keys or host in LOOPBACK:
        return None
    return (f"[pipeinfer] warning: listening on {host} without an API key: anyone who reaches this port can use "
            "the model (--api-key / --api-key-file)")


# ------------------------------------------------------------------------------------ error bodies
def _anthropic_route(path: str) -> bool:
    return path == "/v1/messages" or path.startswith("/v1/messages/")


def error_body(path: str, status: int, message: str, code: str) -> bytes:
    """The route's API error shape."""
    if _anthropic_route(path):
        kind = {401: "authentication_error", 413: "request_too_large", 503: "overloaded_error"}.get(status,
                                                                                                    "api_error")
        body = {"type": "error", "error": {"type": kind, "message": message}}
    else:
        kind = {401: "invalid_request_error", 413: "invalid_request_error", 503: "server_overloaded"}.get(
            status, "server_error")
        body = {"error": {"message": message, "type": kind, "param": None, "code": code}}
    return json.dumps(body).encode()


async def _reply(send, path: str, status: int, message: str, code: str, headers=()) -> None:
    body = error_body(path, status, message, code)
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
                            *headers]})
    await send({"type": "http.response.body", "body": body})


_timeout = getattr(asyncio, "timeout", None)  # 3.11: no task per chunk


class _Stalled(Exception):
    """The client took nothing for the stalled-client timeout."""


# ------------------------------------------------------------------------------------ the middleware
class Gate:
    """Keys, body size, requests at once and stalled clients for the app it wraps; every answer's route and
    status counted in `metrics` (metrics.ServerMetrics)."""

    def __init__(self, app, access: Access, metrics):
        self.app, self.access, self.metrics = app, access, metrics
        self.keys = [k.encode() for k in access.api_keys]
        self.in_progress = 0
        self.routes: set[str] | None = None  # the app's paths (a label for /metrics; others are "other")

    def _authorized(self, headers) -> bool:
        given = None
        for name, value in headers:
            if name == b"authorization" and value[:7].lower() == b"bearer ":
                given = value[7:].strip()
            elif name == b"x-api-key" and given is None:
                given = value.strip()
        if given is None:
            return False
        ok = False
        for key in self.keys:  # every key compared, in constant time each
            ok |= hmac.compare_digest(given, key)
        return ok

    def _route(self, scope) -> str:
        if self.routes is None:
            app = scope.get("app")
            self.routes = {getattr(r, "path", None) for r in getattr(app, "routes", ())} - {None}
        return scope["path"] if scope["path"] in self.routes else "other"

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        path, status = scope["path"], [0]

        async def counted(message):
            if message["type"] == "http.response.start":
                status[0] = message["status"]
            await send(message)
        try:
            await self._gated(scope, receive, counted, path)
        finally:
            self.metrics.answered(self._route(scope), status[0] or 499)  # 499: the client left first

    async def _gated(self, scope, receive, send, path: str):
        a = self.access
        if self.keys and path not in OPEN and not path.startswith(OPEN_PREFIXES) and \
                not self._authorized(scope["headers"]):
            return await _reply(send, path, 401, "Incorrect or missing API key: send `Authorization: Bearer KEY` "
                                                 "(or `x-api-key: KEY`)", "invalid_api_key",
                                [(b"www-authenticate", b"Bearer")])
        counts = path not in UNCOUNTED
        if counts and a.max_connections is not None and self.in_progress >= a.max_connections:
            return await _reply(send, path, 503, f"the server is answering {self.in_progress} requests, its "
                                                 f"limit (--max-connections); retry later", "too_many_connections",
                                [(b"retry-after", b"1")])
        body = await self._body(scope, receive, send, path)
        if body is None:
            return
        replayed = False

        async def replay():
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": body, "more_body": False}
            return await receive()
        self.in_progress += counts
        try:
            await self.app(scope, replay, self._patient(send) if a.stalled_client_timeout_s else send)
        except _Stalled:  # uvicorn closes the connection (the response is incomplete); the generations stop
            print(f"[serve] {path}: the client took nothing for {a.stalled_client_timeout_s:g} s: dropped",
                  file=sys.stderr, flush=True)
        finally:
            self.in_progress -= counts

    async def _body(self, scope, receive, send, path: str) -> bytes | None:
        """The whole body (None: refused with 413, or the client left)."""
        limit = self.access.max_body_bytes
        too_large = f"the request body is larger than {limit} bytes (--max-body-bytes)"
        for name, value in scope["headers"]:
            if name == b"content-length" and value.isdigit() and int(value) > limit:
                await _reply(send, path, 413, too_large, "request_too_large")
                return None
        chunks, size = [], 0
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                return None
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > limit:
                await _reply(send, path, 413, too_large, "request_too_large", [(b"connection", b"close")])
                return None
            chunks.append(chunk)
            if not message.get("more_body", False):
                return b"".join(chunks)

    def _patient(self, send):
        """`send`, given up (_Stalled) when the client has not taken a body chunk for the timeout."""
        timeout = self.access.stalled_client_timeout_s

        async def patient(message):
            if message["type"] != "http.response.body":
                return await send(message)
            try:
                if _timeout is None:  # Python 3.10
                    return await asyncio.wait_for(send(message), timeout)
                async with _timeout(timeout):
                    return await send(message)
            except asyncio.TimeoutError:
                raise _Stalled() from None
        return patient


def access_of(kw: dict) -> Access:
    """`serve`'s options as an Access (UserError for a wrong one); the TLS files checked too."""
    if bool(kw.get("ssl_certfile")) != bool(kw.get("ssl_keyfile")):
        raise UserError("--ssl-certfile and --ssl-keyfile go together")
    for f in (kw.get("ssl_certfile"), kw.get("ssl_keyfile")):
        if f and not Path(f).is_file():
            raise UserError(f"no such file: {f}")
    return Access(read_keys(kw.get("api_key") or (), kw.get("api_key_file")), kw["max_body_bytes"],
                  kw["max_connections"], kw["stalled_client_timeout"])
