"""Rank 0's end of a supervised server (`pipeinfer attach SOCKET`, started by supervisor.py): the pipeline's
scheduler fed by the supervisor over a local Unix socket instead of by HTTP.

The messages each way are link.py's (one JSON line each; the HTTP front end, the text, the stop strings and every
request's state stay in the supervisor, which outlives this MPI job): rank 0 says Ready when it attaches, takes
Generate, Cancel and Stop, and answers each Generate with Tokens as they come and Done (or JobError where it
refuses it). A Generate's fields go to session.request as they arrive (its SamplingParams decoded by the link).
Ready and every Done carry the prompt cache's numbers (session.load()["prompt_cache"]) for the supervisor's
/health and /metrics; Stages carries the stages' counters (session.stages()) when they changed, at most every
link.STAGES_EVERY_S, from the pump's tick (the generation thread takes the stages' reports there).
"""
from __future__ import annotations

import os
import queue
import threading
import time

from ..core.decoding import Decoding
from ..wire.hosts import host_name
from ..wire.liveness import available_memory
from ..serving.link import STAGES_EVERY_S, Cancel, Done, Generate, JobError, Link, Ready, Stages, Stop, Tokens
from .pump import END, NOTHING, TOOK, pump


def run_attached(session, path: str, stop) -> None:
    """Serve the supervisor's jobs on this pipeline until it says stop (or goes away, or a signal stops us)."""
    link = Link.connect(path)
    inbox: queue.Queue = queue.Queue()
    cancelled: set = set()

    def read() -> None:
        try:
            for msg in link.messages():
                if isinstance(msg, Cancel):
                    cancelled.add(msg.id)
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
    sched = session.scheduler()
    link.send(Ready(len(session.ranges), session.parallel, list(ranks_at), list(mem),
                    [(r.start, r.end) for r in session.ranges], getattr(session, "threads", None),
                    _prompt_cache(session)))

    def take(timeout: float | None) -> str:
        """The pump's next message: a Generate submitted (TOOK), nothing by the timeout (NOTHING), or the end."""
        try:
            msg = inbox.get(block=timeout != 0, timeout=timeout or None)
        except queue.Empty:
            return NOTHING
        if msg is None or isinstance(msg, Stop):
            return END
        _submit(session, sched, link, msg, cancelled, stop)
        return TOOK
    pump(sched, take, stop_requested=lambda: stop.requested, tick=_StageRelay(session, link))


class _StageRelay:
    """The pump's tick: the session takes its stages' reports; their counters go to the supervisor (Stages) when
    they changed, at most every STAGES_EVERY_S."""

    def __init__(self, session, link: Link):
        self.session, self.link = session, link
        self.t_sent, self.sent = -STAGES_EVERY_S, None

    def __call__(self, waited_s: float) -> None:
        self.session.poll_stages(waited_s)
        now = time.monotonic()
        if now - self.t_sent < STAGES_EVERY_S:
            return
        self.t_sent = now
        stages = self.session.stages()
        if stages and stages != self.sent:
            try:
                self.link.send(Stages(stages))
            except OSError:
                return  # the supervisor is gone: the reader ends the pump
            self.sent = stages


def _prompt_cache(session) -> dict | None:
    """The prompt cache's numbers now (None before the scheduler exists)."""
    return session.load()["prompt_cache"]


def _submit(session, sched, link: Link, msg: Generate, cancelled: set, stop) -> None:
    jid = msg.id

    def done(tokens: list[int], stats) -> None:
        link.send(Done(jid, stats.to_dict(), _prompt_cache(session)))
    pending: list = []  # the log-probabilities of the tokens about to be sent (on_logprobs comes just before)

    def on_tokens(tokens: list[int]) -> None:
        link.send(Tokens.of(jid, tokens, pending))
        pending.clear()
    req = session.request(msg.prompt, n_predict=msg.n_predict, sampling=msg.sampling,
                          prompt_text=msg.prompt_text, chat=msg.chat, on_tokens=on_tokens,
                          should_stop=lambda: jid in cancelled or stop.requested, on_done=done,
                          replay=msg.replay, decoding=Decoding.from_dict(msg.decoding), on_logprobs=pending.extend,
                          cache_prompt=msg.cache_prompt)
    try:
        sched.submit(req)
    except ValueError as e:
        link.send(JobError(jid, str(e)))
