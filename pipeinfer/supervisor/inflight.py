"""The requests a supervised pipeline has not answered yet, each kept across jobs with the tokens it streamed: a new
job's rank 0 gets every one of them again, resumed from its prompt + those tokens (replayed as they were first
decoded), so that its answer is the one an uninterrupted job gives.
"""
from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field, replace
from typing import Callable

from ..core.metrics import Stats
from ..serving import link
from ..serving.answer import Answer
from ..serving.job import ErrorEvent, Generation


def resumed_status(n_resumes: int) -> str:
    """A supervised answer's --results status."""
    return f"ok: resumed {n_resumes}" if n_resumes else "ok"


@dataclass
class Record:
    """One request as the supervisor keeps it across child jobs."""
    jid: int
    job: Generation             # an HTTP request's Job, or resume.StdoutJob (generate --np)
    answer: Answer              # text, stop strings
    tokens: list[int] = field(default_factory=list)  # streamed so far
    cancel_sent: bool = False   # to the job now attached (a new job needs its own)
    n_resumes: int = 0
    # when (time.perf_counter here) it first went to a job, and its first, second and latest tokens came back: a
    # resumed request's times (resumed_stats), which no one job saw whole
    t_sent: float = 0.0
    t_token1: float = 0.0
    t_token2: float = 0.0
    t_token_last: float = 0.0

    def generate_message(self) -> link.Generate:
        """The request as rank 0 takes it: the tokens streamed so far to replay, the rest to generate. Its first
        sending starts its clock (t_sent)."""
        self.t_sent = self.t_sent or time.perf_counter()
        job = self.job
        return link.Generate(self.jid, job.prompt_tokens, self.tokens, max(1, job.n_predict - len(self.tokens)),
                             job.sampling, job.prompt_text, job.chat, job.decoding.to_dict(), job.cache_prompt)


def resumed_stats(stats: Stats, rec: Record) -> Stats:
    """The Stats of a request that jobs answered in turn: the last job's counters (its own drafts), with every token
    counted and the times the supervisor saw (its clock: from when the request first went to a job), since no job's
    clock spans the whole answer."""
    return replace(stats, n_generated=len(rec.tokens), t_start_s=rec.t_sent, t_prompt_done_s=rec.t_token1 or rec.t_sent,
                   t_first_s=rec.t_token2, t_last_s=rec.t_token_last or rec.t_token1 or rec.t_sent)


class InFlight:
    """The records of the requests not answered yet, by id, under the supervisor's lock (`lock`, shared: a record
    and the rank 0 it goes to change together). `send(msg)` -> whether it went to the attached rank 0: where none
    is, the next one gets it with every record (resend_all)."""

    def __init__(self, tok, lock: threading.RLock, send: Callable[[object], bool]):
        self.tok, self._lock, self._send = tok, lock, send
        self._records: dict[int, Record] = {}
        self._next_id = 0

    def __len__(self) -> int:
        with self._lock:
            return len(self._records)

    def add(self, job: Generation) -> Record:
        """A new request, recorded and sent to rank 0."""
        with self._lock:
            rec = Record(self._next_id, job, Answer(job, self.tok))
            self._next_id += 1
            self._records[rec.jid] = rec
            self._send(rec.generate_message())
        return rec

    def get(self, jid: int) -> Record | None:
        with self._lock:
            return self._records.get(jid)

    def records(self) -> list[Record]:
        """Every record, as they are now (the server stops: each gets its error)."""
        with self._lock:
            return list(self._records.values())

    def take_all(self) -> list[Record]:
        """Every record, none kept (the pipeline failed: each gets its error, and nothing answers them)."""
        with self._lock:
            recs = list(self._records.values())
            self._records.clear()
        return recs

    def resend_all(self) -> None:
        """Every record to a new rank 0, from the tokens it streamed; no cancel sent to it yet."""
        with self._lock:
            for rec in self._records.values():
                rec.cancel_sent = False
                self._send(rec.generate_message())

    def mark_resumed(self) -> int:
        """Every record is resumed once more (a re-form resent it); how many there are."""
        with self._lock:
            for rec in self._records.values():
                rec.n_resumes += 1
            return len(self._records)

    def send_cancels(self) -> None:
        """A client that left, or a stop string that matched: that request's runs are cancelled on rank 0."""
        with self._lock:
            for rec in self._records.values():
                if not rec.cancel_sent and rec.answer.should_stop():
                    rec.cancel_sent = self._send(link.Cancel(rec.jid))

    # ---------------------------------------------------------------- rank 0's answers
    @staticmethod
    def add_tokens(rec: Record, msg: link.Tokens) -> None:
        now, had = time.perf_counter(), len(rec.tokens)
        rec.tokens += msg.tokens
        rec.t_token1 = rec.t_token1 or now
        if had <= 1 < len(rec.tokens):
            rec.t_token2 = now
        rec.t_token_last = now
        rec.job.on_token_ids(msg.tokens)
        if (logprobs := msg.token_logprobs()) is not None:
            rec.answer.on_logprobs(logprobs)
        rec.answer.on_tokens(msg.tokens)

    def finish(self, rec: Record, msg: link.Done, log, on_done) -> None:
        """The answer is whole: its Stats (across every job that answered it) to the client and to on_done(job,
        stats, finish, n_resumes)."""
        stats = Stats.from_dict(msg.stats)
        stats.n_generated = len(rec.tokens)  # this job's and the earlier jobs' tokens
        if rec.n_resumes:
            stats = resumed_stats(stats, rec)
        with self._lock:
            self._records.pop(rec.jid, None)
        if rec.n_resumes:
            log(f"[serve] {rec.job.request_id}: resumed {rec.n_resumes} time(s)")
        finished = on_done and (lambda job, st, fin: on_done(job, st, fin, rec.n_resumes))
        rec.answer.finish(stats, log, finished)

    def refused(self, rec: Record, msg: link.JobError) -> None:
        with self._lock:
            self._records.pop(rec.jid, None)
        rec.job.push(ErrorEvent(msg.message))
