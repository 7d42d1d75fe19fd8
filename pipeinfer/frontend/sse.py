"""Server-sent events, as every API of the server streams them: the response that carries them (`JobStream`, which
cancels its jobs however it ends) and their two framings: an unnamed event (`data`, OpenAI's chat and completions,
ending with DONE) and a named one (`event`: Anthropic's Messages, OpenAI's Responses).
"""
from __future__ import annotations

import json

from fastapi.responses import StreamingResponse

from ..serving.job import Job

HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
DONE = "data: [DONE]\n\n"  # OpenAI's last event


def data(obj) -> str:
    """An unnamed event (OpenAI's)."""
    return f"data: {json.dumps(obj)}\n\n"


def event(name: str, obj: dict) -> str:
    """A named event (Anthropic's and the Responses API's)."""
    return f"event: {name}\ndata: {json.dumps(obj, ensure_ascii=False)}\n\n"


class JobStream(StreamingResponse):
    """A request's server-sent events whose jobs are cancelled once the response ends, however it ends. A client
    that stops reading is given up inside `send` (access.Gate): the events' generators, idle at a yield then, are
    not closed by it, and would stop their generations only when the garbage collector finds them."""

    def __init__(self, content, jobs: list[Job]):
        super().__init__(content, media_type="text/event-stream", headers=HEADERS)
        self.jobs = list(jobs)

    async def __call__(self, scope, receive, send):
        try:
            await super().__call__(scope, receive, send)
        finally:
            for job in self.jobs:
                job.cancelled.set()  # harmless once done
