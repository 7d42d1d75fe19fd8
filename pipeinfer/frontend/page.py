"""The cluster's live page: GET / (static/index.html, its script and style, shipped in the package; no network:
plain JavaScript and SVG) and GET /state (state.py: the JSON the page polls every second). `serve --no-webui`
leaves the page out (ServeConfig.webui); /state stays, for scripts."""
from __future__ import annotations

from pathlib import Path

from fastapi import FastAPI
from fastapi.responses import FileResponse

from ..serving.job import RequestError
from .state import ClusterState

STATIC = Path(__file__).with_name("static")
FILES = {"index.html": "text/html; charset=utf-8", "page.js": "text/javascript; charset=utf-8",
         "page.css": "text/css; charset=utf-8"}
_NO_CACHE = {"Cache-Control": "no-cache"}


def register_page(app: FastAPI, cfg, generator) -> ClusterState:
    """GET /state, and with cfg.webui GET / and /static/{page.js, page.css}, on `app`."""
    state = ClusterState(cfg, generator)
    state.install()

    @app.get("/state")
    async def cluster_state():
        return state.snapshot()

    if getattr(cfg, "webui", True):
        @app.get("/", include_in_schema=False)
        async def page():
            return FileResponse(STATIC / "index.html", media_type=FILES["index.html"], headers=_NO_CACHE)

        @app.get("/static/{name}", include_in_schema=False)
        async def static(name: str):
            if name not in FILES or name == "index.html":
                raise RequestError(404, f"Invalid URL (GET /static/{name})", code="not_found")
            return FileResponse(STATIC / name, media_type=FILES[name], headers=_NO_CACHE)
    return state
