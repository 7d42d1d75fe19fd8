"""`pipeinfer serve --np N` / `--hostfile HOSTS` (not under mpiexec): a server that survives a lost machine.

This process is the supervisor: it keeps the HTTP front end (frontend/app.py), the request queue and every request's
state (prompt, sampling, the tokens already streamed) and runs the pipeline as a child MPI job (the launcher
and hostfile as `pipeinfer launch` builds them) whose rank 0 attaches to it over a local Unix socket
(attach.py; the messages are link.py's: one JSON line each, a few dozen bytes per token).

When the child job fails (a rank killed, a host cut off, a rank gone silent: liveness ends the job with one
line naming the rank and its host), the supervisor drops that rank's slot (its host's, on a cluster), starts
the job again on the slots that remain (the layer split re-planned by start-up, as for any rank count) and
resumes every request that was in flight from its prompt + the tokens it had streamed, replayed as they were
first decoded (Head.start): the client's stream pauses, and the answer is the one it would have been. A job
that cannot start (no slot left, or too little memory on the hosts left for their share of the model:
Footprint) ends the server with one line, and so does anything else that fails while the job is re-formed or
re-planned (the launcher not found, an OSError): the requests in flight get that error, /health says it, and the
server exits 1, never left waiting for a job that will not come. The supervisor's own host is the one that cannot
be lost. /health says `degraded` and names the lost slots, and its `phase` what the supervisor is doing.

The Supervisor coordinates; each of its tasks is a module of its own: where the job runs (placement.py, slots.py),
the job's launches and restarts (lifecycle.py over child.py, launch.py and failures.py), the requests in flight and
their resumption (inflight.py), and what it reports (health.py).
"""
from __future__ import annotations

import os
import signal
import sys
import tempfile
import threading
import time

from ..core.config import Config
from ..core.errors import UserError
from ..serving import link
from ..serving.job import ErrorEvent, Generation, RequestError
from .child import ChildJob
from .health import Health
from .inflight import InFlight
from .lifecycle import JobLifecycle
from .placement import DraftHost, Footprint
from .slots import LostSlot, Slots

REJOIN_CHECK_S = 10.0   # --rejoin: how often an idle, degraded supervisor asks whether a lost host answers again


def _stop_this_process(_why: str) -> None:
    """on_fatal where the caller gives none: a SIGTERM ends this process's HTTP server as a user's would, and
    `serve` then reports Supervisor.fatal as its one line and exits 1 (cli/main.py)."""
    os.kill(os.getpid(), signal.SIGTERM)


class Supervisor:
    """The generator the HTTP app talks to (serving/job.Generator: submit, fatal, parallel, load, log, on_done),
    forwarding to rank 0 of a child MPI job and re-forming that job when it fails; `phase` (health.Health) says
    what it does.

    A request that comes while no rank 0 is attached waits in the records: each new rank 0 gets every record not
    answered yet. One lock (`_lock`) covers the records, the attached rank 0 and the phase, which change together
    on every failure: stop reading, drop a slot, start again, resend every unfinished record."""

    def __init__(self, slots: list[str], config, tok, log=None, on_done=None,
                 footprint: Footprint | None = None, rejoin: bool = False, draft: DraftHost | None = None,
                 on_fatal=None):
        self.config, self.tok = config, tok   # core/config.Config of the first job (the user's, the hosts' settings)
        self.log = log or (lambda msg: print(msg, file=sys.stderr, flush=True))
        self.on_done = on_done
        self.on_fatal = on_fatal or _stop_this_process  # callable(why) once the pipeline cannot go on
        self.rejoin = rejoin
        self.work_dir = tempfile.mkdtemp(prefix="pipeinfer-sup-")
        # the front end may wrap self.log (frontend/state.py): the life cycle logs through it as it is at each line
        self.lifecycle = JobLifecycle(Slots(slots, footprint, draft), config, self.work_dir,
                                      lambda msg: self.log(msg), rejoin)
        self.health = Health()
        self._lock = threading.RLock()
        self.requests = InFlight(tok, self._lock, self._send)
        self._rank0: link.Link | None = None  # the attached rank 0's link; None between jobs
        self._stopped_for_replan: ChildJob | None = None  # a job stopped for a re-plan (--rejoin): its end no failure
        self._stopping = False

    # ---------------------------------------------------------------- what the front end and the page read
    @property
    def fatal(self) -> str | None:
        return self.health.fatal

    @property
    def parallel(self) -> int:
        return self.health.parallel

    @property
    def phase(self) -> str:
        return self.health.phase

    @property
    def ready(self) -> link.Ready | None:
        return self.health.ready

    @property
    def n_reforms(self) -> int:
        return self.lifecycle.n_reforms

    @property
    def slots(self) -> list[str]:
        """One host per target rank of the job, rank 0 first."""
        return self.lifecycle.slots.hosts

    @property
    def lost(self) -> list[str]:
        """"rank R (host H)" of each slot lost (and not taken back)."""
        return self.lifecycle.slots.lost

    @property
    def lost_slots(self) -> dict[int, LostSlot]:
        """Each lost slot by its place in the first job."""
        return self.lifecycle.slots.lost_slots

    def job_config(self) -> Config:
        """The configuration of the job on the slots left."""
        return self.lifecycle.job_config()

    def job_hosts(self) -> list[str]:
        """One host per rank of the job: the target's slots, then the draft host's while it serves."""
        return self.lifecycle.slots.job_hosts()

    # ---------------------------------------------------------------- what the command line and the HTTP side call
    def start(self) -> None:
        """Start the job and wait for its rank 0 (UserError, one line, where it cannot start)."""
        try:
            self._attach(*self.lifecycle.start_surviving())
        except UserError:
            self.lifecycle.kill_child()
            raise
        except (OSError, RuntimeError, ValueError) as e:  # the launcher's (no launcher of mpi4py's MPI, ...)
            self.lifecycle.kill_child()
            raise UserError(f"cannot start the pipeline's job: {e}") from None
        threading.Thread(target=self._watch_cancels, daemon=True).start()
        if self.rejoin:
            threading.Thread(target=self._watch_returns, daemon=True).start()

    def submit(self, job: Generation) -> None:
        with self._lock:  # fatal read under the lock: a request recorded after _fail's would wait for ever
            if self.health.fatal:
                raise RequestError(503, f"the pipeline failed: {self.health.fatal}", code="pipeline_failed")
            self.requests.add(job)

    def load(self) -> dict:
        # every request goes to rank 0 at once: what it has not answered yet is generating or queued there
        life = self.lifecycle
        return self.health.report(len(self.requests), life.slots, life.n_reforms, life.host_mem)

    def stop(self) -> None:
        self._stopping = True
        with self._lock:
            recs = self.requests.records()
            if self.health.fatal is None:
                self.health.phase = "stopping"
        for rec in recs:
            rec.job.push(ErrorEvent("the server is shutting down"))
        self._send(link.Stop())
        if self.lifecycle.child is not None:
            self.lifecycle.child.wait_or_kill(60)

    # ---------------------------------------------------------------- rank 0 of each job
    def _attach(self, rank0: link.Link, ready: link.Ready) -> None:
        """A new job's rank 0 attached (`ready`: what it said): every request not answered yet goes (again) to it."""
        self.health.attached(ready, rank0)
        with self._lock:
            self._rank0 = rank0
            self.health.serving()
            self.requests.resend_all()
        threading.Thread(target=self._read, args=(rank0, self.lifecycle.child), daemon=True).start()

    def _send(self, msg) -> bool:
        """Whether `msg` went to the attached rank 0. Not while none is (between jobs: _attach sends every record
        not answered yet to the next), nor where its job has just ended (its reader re-forms the job, which
        resends them)."""
        rank0 = self._rank0
        if rank0 is None:
            return False
        try:
            rank0.send(msg)
        except OSError:
            return False
        return True

    def _read(self, rank0: link.Link, child: ChildJob) -> None:
        """Rank 0's messages until its job ends, then a re-form (not for a job stopped on purpose). A message this
        end cannot take ends the supervisor: nothing would read rank 0 after it."""
        try:
            for msg in rank0.messages():
                self._on_message(msg, rank0)
        except OSError:
            pass  # the job is gone: as at the end of its messages
        except Exception as e:  # a bad line (LinkError), or a failure handling one
            self._fail(f"reading rank 0's messages: {type(e).__name__}: {e}")
            return
        finally:
            rank0.close()
        with self._lock:
            if self._rank0 is not rank0 or self._stopping or child is self._stopped_for_replan:
                return
            self._rank0 = None  # requests from now on wait for the new job (_attach)
            self.health.went_down("re-forming")
        self._guarded("cannot re-form the pipeline", lambda: self._reform(child))

    def _on_message(self, msg, rank0: link.Link) -> None:
        if isinstance(msg, link.Ready):
            raise link.LinkError("ready: rank 0 attached a second time")
        if isinstance(msg, link.Stages):
            self.health.stage_totals.take(rank0, msg.stages)
            return
        rec = self.requests.get(msg.id)
        if rec is None:  # answered or failed already
            return
        if isinstance(msg, link.Tokens):
            self.requests.add_tokens(rec, msg)
        elif isinstance(msg, link.Done):
            if msg.prompt_cache is not None:
                self.health.prompt_cache = msg.prompt_cache
            self.requests.finish(rec, msg, self.log, self.on_done)
        elif isinstance(msg, link.JobError):
            self.requests.refused(rec, msg)

    # ---------------------------------------------------------------- re-forms, re-plans, failures
    def _reform(self, child: ChildJob) -> None:
        """The job ended under us: drop the failed rank's slot, start again, resume every request."""
        t0 = time.perf_counter()
        self._attach(*self.lifecycle.reform(child))
        n = self.requests.mark_resumed()
        self.log(f"[serve] pipeline re-formed in {time.perf_counter() - t0:.1f} s on {len(self.slots)} slot(s); "
                 f"{n} request(s) resumed")

    def _watch_returns(self) -> None:
        """--rejoin: while no request is in flight, a lost slot whose host answers again (a launch of `pipeinfer
        --version` there succeeds) is taken back, and the job is re-planned on it: never mid-request."""
        while not self._stopping and not self.health.fatal:
            time.sleep(REJOIN_CHECK_S)
            with self._lock:
                idle = not len(self.requests) and self.lost_slots and not self._stopping and not self.health.fatal
            if idle:
                self._guarded("cannot re-plan the pipeline", self._replan)

    def _replan(self) -> None:
        back = self.lifecycle.answering(list(self.lost_slots))
        if not back:
            return
        with self._lock:
            if len(self.requests) or self._stopping:  # a request came while the hosts were asked: next time
                return
            self._stopped_for_replan = self.lifecycle.child  # its end is no failure (_read)
            self._send(link.Stop())
            self._rank0 = None  # requests from now on wait for the new job (_attach)
            self.health.went_down("re-planning")
        t0 = time.perf_counter()
        self._attach(*self.lifecycle.replan(back, self._stopped_for_replan))
        self.log(f"[serve] pipeline re-planned in {time.perf_counter() - t0:.1f} s on {len(self.slots)} slot(s)")

    def _guarded(self, what: str, step) -> None:
        """Run a re-form or a re-plan on the thread that found it due. Whatever it raises ends the supervisor with
        its cause (the old job is stopped by then: nothing else would answer the requests, or report it)."""
        try:
            step()
        except UserError as e:  # no slot left, too little memory: its own one line
            self._fail(str(e))
        except Exception as e:  # a launcher's RuntimeError, an OSError, or a bug: an error, never a hang
            self._fail(f"{what}: {type(e).__name__}: {e}")

    def _fail(self, why: str) -> None:
        """The pipeline cannot go on: every request in flight, and every later one, fails naming `why`; /health
        says it; no job is left running; on_fatal ends the front end."""
        with self._lock:
            if self.health.fatal is not None:  # the first cause is the one reported
                return
            self.health.fatal, self.health.phase, self._rank0 = why, "failed", None
            recs = self.requests.take_all()
        self.log(f"[serve] fatal: {why}")
        self.lifecycle.kill_child()
        for rec in recs:
            rec.job.push(ErrorEvent(f"the pipeline failed: {why}"))
        self.on_fatal(why)

    def _watch_cancels(self) -> None:
        """A client that left, or a stop string that matched: that request's runs are cancelled on rank 0."""
        while not self._stopping:
            self.requests.send_cancels()
            time.sleep(0.05)
