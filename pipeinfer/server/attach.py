"""Rank 0's end of a supervised server (`serve --attach SOCKET`, started by supervisor.py): the pipeline's
scheduler fed by the supervisor over a local Unix socket instead of by HTTP.

One JSON object per line each way (a few dozen bytes per token; the HTTP front end, the text, the stop
strings and every request's state stay in the supervisor, which outlives this MPI job):

    supervisor -> rank 0:  {"op": "job", "id", "prompt": [ids], "replay": [ids], "n_predict", "sampling":
                            [temp, top_k, top_p, seed], "prompt_text", "chat"} | {"op": "cancel", "id"} | {"op": "stop"}
    rank 0 -> supervisor:  {"op": "ready", "ranks", "parallel"} | {"op": "tokens", "id", "tokens": [ids]} |
                           {"op": "done", "id", "stats": {...}} | {"op": "error", "id", "message"}
"""
from __future__ import annotations

import json
import os
import queue
import socket
import threading

from ..core.verify import SamplingParams
from ..wire.hosts import host_name
from ..wire.liveness import available_memory


class _Link:
    """The socket, one JSON line per message; sends from any thread."""

    def __init__(self, path: str):
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.sock.connect(path)
        self._out = self.sock.makefile("w", encoding="utf-8")
        self._in = self.sock.makefile("r", encoding="utf-8")
        self._lock = threading.Lock()

    def send(self, **msg) -> None:
        with self._lock:
            self._out.write(json.dumps(msg, separators=(",", ":")) + "\n")
            self._out.flush()

    def messages(self):
        for line in self._in:
            yield json.loads(line)


def run_attached(session, path: str, parallel: int, stop) -> None:
    """Serve the supervisor's jobs on this pipeline until it says stop (or goes away, or a signal stops us)."""
    link = _Link(path)
    inbox: queue.Queue = queue.Queue()
    cancelled: set = set()

    def read() -> None:
        try:
            for msg in link.messages():
                if msg["op"] == "cancel":
                    cancelled.add(msg["id"])
                else:
                    inbox.put(msg)
        except (OSError, ValueError):
            pass
        inbox.put(None)  # the supervisor is gone: finish what runs, then end
    threading.Thread(target=read, name="pipeinfer-attach", daemon=True).start()
    # every rank's (host, pid): the supervisor names a rank that the launcher reports by its pid; and what memory
    # each rank's host had before the job loaded (the supervisor checks a re-form on fewer hosts against it)
    if session.live is not None:
        ranks_at, mem = session.live.hosts, session.live.mem_available
    else:
        ranks_at, mem = [(host_name(), os.getpid())], [available_memory()]
    link.send(op="ready", ranks=len(session.ranges), parallel=parallel, ranks_at=ranks_at, mem_available=mem)
    sched = session.scheduler()
    stopping = False
    while True:
        while not stopping and not sched.waiting:
            try:
                msg = inbox.get() if not sched.busy else inbox.get_nowait()
            except queue.Empty:
                break
            if msg is None or msg["op"] == "stop":
                stopping = True
            else:
                _submit(session, sched, link, msg, cancelled, stop)
        if stop.requested:
            stopping = True
        if not sched.busy:
            if stopping:
                return
            continue
        sched.step()


def _submit(session, sched, link: _Link, msg: dict, cancelled: set, stop) -> None:
    jid = msg["id"]

    def done(tokens: list[int], stats) -> None:
        link.send(op="done", id=jid, stats=stats.to_dict())
    req = session.request(msg["prompt"], n_predict=msg["n_predict"], sampling=SamplingParams(*msg["sampling"]),
                          prompt_text=msg.get("prompt_text"), chat=bool(msg.get("chat")),
                          on_tokens=lambda tokens: link.send(op="tokens", id=jid, tokens=tokens),
                          should_stop=lambda: jid in cancelled or stop.requested, on_done=done,
                          replay=msg.get("replay") or ())
    try:
        sched.submit(req)
    except ValueError as e:
        link.send(op="error", id=jid, message=str(e))
