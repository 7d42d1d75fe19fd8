"""The generation thread of `pipeinfer serve` on rank 0: it owns the head session (every MPI call and llama.cpp
decode happens there) and runs the pump (pump.py) over its scheduler (decide/scheduler.py), which runs up to
--parallel jobs at once, admitted first come first served. A queued job (serving/job.py) goes from this thread's
queue straight to the session as its Request (its SamplingParams as the HTTP server made them). Each job's answer
goes back to its request's handler through the job's asyncio queue (answer.py)."""
from __future__ import annotations

import queue
import sys
import threading

from ..serving.answer import Answer
from ..serving.job import ErrorEvent, Job, RequestError
from .pump import END, NOTHING, TOOK, pump


class Generator:
    """Jobs in (`submit`, from the event loop), answers out through each job's events."""

    def __init__(self, session, max_queue: int, log=None, on_done=None):
        self.session, self.tok = session, session.tok
        self.parallel = session.parallel
        self.jobs: queue.Queue[Job | None] = queue.Queue(maxsize=max_queue)
        self.log = log or (lambda msg: print(msg, file=sys.stderr, flush=True))
        self.on_done = on_done  # callable(job, stats, finish_reason), e.g. a --results row
        self.fatal: str | None = None
        self.thread = threading.Thread(target=self._loop, name="pipeinfer-generation", daemon=True)

    def start(self) -> None:
        self.thread.start()

    def submit(self, job: Job) -> None:
        if self.fatal:
            raise RequestError(503, f"the pipeline failed: {self.fatal}", code="pipeline_failed")
        try:
            self.jobs.put_nowait(job)
        except queue.Full:
            raise RequestError(503, f"the queue is full ({self.jobs.maxsize} requests waiting); retry later",
                               code="queue_full") from None

    def stop(self) -> None:
        while True:  # drop what waits, then tell the thread to end after the jobs it runs
            try:
                job = self.jobs.get_nowait()
            except queue.Empty:
                break
            if job is not None:
                job.push(ErrorEvent("the server is shutting down"))
        self.jobs.put(None)
        self.thread.join()

    def load(self) -> dict:
        """For /health, /metrics and /state: what waits and what the pipeline holds now, every stage's counters
        (HeadSession.stages) included (a snapshot read from another thread)."""
        load = self.session.load()
        return {"queued": self.jobs.qsize() + load.pop("waiting"), **load}

    def _fail(self, e: Exception, jobs) -> None:
        """The pipeline is gone (a rank failed): fail these and every later request."""
        self.fatal = f"{type(e).__name__}: {e}"
        for job in jobs:
            job.push(ErrorEvent(f"the pipeline failed: {self.fatal}"))
        self.log(f"[serve] fatal: {self.fatal}")

    def _loop(self) -> None:
        sched = self.session.scheduler()
        running: dict[int, Job] = {}

        def take(timeout: float | None) -> str:
            """The pump's next job: admitted (TOOK), nothing by the timeout (NOTHING), or the end (stop)."""
            try:
                job = self.jobs.get(block=timeout != 0, timeout=timeout or None)
            except queue.Empty:
                return NOTHING
            if job is None:
                return END
            self._admit(sched, job, running)
            return TOOK
        try:
            pump(sched, take, tick=self.session.poll_stages)
        except Exception as e:
            self._fail(e, list(running.values()))

    def _admit(self, sched, job: Job, running: dict) -> None:
        if job.cancelled.is_set():
            self.log(f"[serve] {job.request_id}: cancelled while queued")
            return
        ans = Answer(job, self.tok)

        def done(tokens: list[int], stats) -> None:
            running.pop(id(job), None)
            ans.finish(stats, self.log, self.on_done)
        req = self.session.request(job.prompt_tokens, n_predict=job.n_predict, sampling=job.sampling,
                                   prompt_text=job.prompt_text, chat=job.chat, on_tokens=ans.on_tokens,
                                   should_stop=ans.should_stop, on_done=done, decoding=job.decoding,
                                   on_logprobs=ans.on_logprobs, cache_prompt=job.cache_prompt)
        req.t_queued_s = job.t_queued_s
        try:
            sched.submit(req)
        except ValueError as e:  # does not fit the context as the stages planned it
            job.push(ErrorEvent(str(e)))
            return
        running[id(job)] = job
