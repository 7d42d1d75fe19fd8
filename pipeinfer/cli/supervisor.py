"""`pipeinfer serve --np N` / `--hostfile HOSTS` (not under mpiexec): a server that survives a lost machine.

This process is the supervisor: it keeps the HTTP front end (server.py), the request queue and every request's
state (prompt, sampling, the tokens already streamed) and runs the pipeline as a child MPI job (the launcher
and hostfile as `pipeinfer launch` builds them) whose rank 0 attaches to it over a local Unix socket
(attach.py: one JSON line per message, a few dozen bytes per token).

When the child job fails (a rank killed, a host cut off, a rank gone silent: liveness ends the job with one
line naming the rank and its host), the supervisor drops that rank's slot (its host's, on a cluster), starts
the job again on the slots that remain (the layer split re-planned by start-up, as for any rank count) and
resumes every request that was in flight from its prompt + the tokens it had streamed, replayed as they were
first decoded (Head.start): the client's stream pauses, and the answer is the one it would have been. A job
that cannot start (too few slots left, or no slot at all) ends the server with one line. The supervisor's
own host is the one that cannot be lost. /health says `degraded` and names the lost slots.
"""
from __future__ import annotations

import json
import os
import re
import shlex
import socket
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field, fields
from pathlib import Path

from ..core.errors import UserError
from ..core.metrics import Stats

_FAILED_RANK = re.compile(r"rank (\d+) \(host ([^,)]+)")


def child_args(argv: list[str], command: str, with_value: set[str], flags: set[str] = frozenset()) -> list[str]:
    """`command`'s arguments in argv less the named options (--opt VALUE, --opt=VALUE, flags): what the
    supervised job's rank 0 takes of this process's command line."""
    out, skip = [], False
    for a in argv[argv.index(command) + 1:]:
        if skip:
            skip = False
            continue
        name = a.split("=", 1)[0]
        if name in with_value:
            skip = "=" not in a
        elif name not in flags:
            out.append(a)
    return out
START_TIMEOUT_S = 600.0


@dataclass
class _Record:
    """One request as the supervisor keeps it across child jobs."""
    jid: int
    job: object                 # server.Job
    answer: object              # server._Answer: text, stop strings
    tokens: list[int] = field(default_factory=list)  # streamed so far
    cancel_sent: bool = False
    n_resumes: int = 0


def _stats_from(d: dict) -> Stats:
    names = {f.name for f in fields(Stats)}
    s = Stats(**{k: v for k, v in d.items() if k in names})
    s.accept_hist = {int(k): v for k, v in s.accept_hist.items()}
    s.draft_len_hist = {int(k): v for k, v in s.draft_len_hist.items()}
    return s


class Supervisor:
    """The generator the HTTP app talks to (server.Generator's interface: submit, stop, fatal, parallel, load),
    forwarding to rank 0 of a child MPI job and re-forming that job when it fails.

    Why one class: the records of the requests, the socket to the current child and the child's lifecycle change
    together on every failure (stop reading, drop a slot, start again, resend every unfinished record)."""

    def __init__(self, slots: list[str], child_args: list[str], tok, log=None, on_done=None):
        self.slots = list(slots)            # one host name per rank, rank 0 first
        self.child_args, self.tok = child_args, tok
        self.log = log or (lambda msg: print(msg, file=sys.stderr, flush=True))
        self.on_done = on_done
        self.fatal: str | None = None
        self.parallel = 0
        self.lost: list[str] = []           # "rank R (host H)" of every failure so far
        self.n_reforms = 0
        self._records: dict[int, _Record] = {}
        self._next_id = 0
        self._lock = threading.RLock()
        self._dir = tempfile.mkdtemp(prefix="pipeinfer-sup-")
        self._sock_path = os.path.join(self._dir, "rank0.sock")
        self._out = None
        self._child: subprocess.Popen | None = None
        self._stopping = False

    # ---------------------------------------------------------------- the child job
    def start(self) -> None:
        self._start_child()
        threading.Thread(target=self._watch_cancels, daemon=True).start()

    def _command(self) -> list[str]:
        from .launch import Host, build_command, choose_launcher, mpi4py_library
        library = mpi4py_library()
        mpi = library.kind
        hosts = [Host(name) for name in self.slots]  # one slot each; the hostfile merges a host's lines
        extra = ["--allow-run-as-root"] if mpi == "openmpi" and os.geteuid() == 0 else []
        extra += shlex.split(os.environ.get("PIPEINFER_MPI_ARGS", ""))  # the launcher's own options (README)
        return build_command(hosts, len(self.slots), mpi, ["serve", "--attach", self._sock_path] + self.child_args,
                             mpiexec=choose_launcher(library, None), extra=extra,
                             hostfile=os.path.join(self._dir, "hosts.txt"))

    def _start_child(self) -> None:
        """Start the job on the slots left and wait for its rank 0 to attach (or for the job to fail)."""
        if not self.slots:
            raise UserError(f"no slot left to run the pipeline on (lost: {'; '.join(self.lost)})")
        Path(self._sock_path).unlink(missing_ok=True)
        listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        listener.bind(self._sock_path)
        listener.listen(1)
        listener.settimeout(0.5)
        self._log_path = os.path.join(self._dir, f"job{self.n_reforms}.log")
        self._child = subprocess.Popen(self._command(), stdin=subprocess.DEVNULL, stdout=open(self._log_path, "w"),
                                       stderr=subprocess.STDOUT, start_new_session=True)
        deadline = time.monotonic() + START_TIMEOUT_S
        conn = None
        while conn is None:
            if self._child.poll() is not None:
                listener.close()
                raise UserError(f"the pipeline did not start on {len(self.slots)} slot(s): {self._job_error()}")
            if time.monotonic() > deadline:
                listener.close()
                self._kill_child()
                raise UserError(f"the pipeline did not start in {START_TIMEOUT_S:.0f} s")
            try:
                conn, _ = listener.accept()
            except socket.timeout:
                continue
        listener.close()
        conn.settimeout(None)
        self._out = conn.makefile("w", encoding="utf-8")
        reader = conn.makefile("r", encoding="utf-8")
        ready = json.loads(reader.readline() or "{}")
        if ready.get("op") != "ready":
            raise UserError(f"the pipeline's rank 0 did not attach: {self._job_error()}")
        self.parallel = ready["parallel"]
        t = threading.Thread(target=self._read, args=(reader, self._child), daemon=True)
        t.start()
        with self._lock:  # every request not answered yet goes (again) to the new rank 0
            for rec in self._records.values():
                self._send_job(rec)

    def _job_error(self) -> str:
        """The child job's one-line error (its last 'pipeinfer: error:' line), or its last line."""
        try:
            lines = Path(self._log_path).read_text(errors="replace").splitlines()
        except OSError:
            return "no output"
        ours = [ln for ln in lines if "pipeinfer: error:" in ln]
        errs = [ln for ln in lines if "error" in ln.lower()]
        return (ours or errs or lines or ["no output"])[-1].strip()

    def _kill_child(self) -> None:
        if self._child is not None and self._child.poll() is None:
            try:
                os.killpg(self._child.pid, 9)
            except ProcessLookupError:
                pass
            self._child.wait()

    # ---------------------------------------------------------------- messages from rank 0
    def _read(self, reader, child: subprocess.Popen) -> None:
        try:
            for line in reader:
                self._on_message(json.loads(line))
        except (OSError, ValueError):
            pass
        if self._stopping:
            return
        self._reform(child)

    def _on_message(self, msg: dict) -> None:
        with self._lock:
            rec = self._records.get(msg.get("id"))
        if rec is None:
            return
        if msg["op"] == "tokens":
            rec.tokens += msg["tokens"]
            if hasattr(rec.job, "on_token_ids"):  # generate --np (resume.py) keeps the ids
                rec.job.on_token_ids(msg["tokens"])
            rec.answer.on_tokens(msg["tokens"])
        elif msg["op"] == "done":
            stats = _stats_from(msg["stats"])
            stats.n_generated = len(rec.tokens)  # this job's and the earlier jobs' tokens
            with self._lock:
                self._records.pop(rec.jid, None)
            if rec.n_resumes:
                self.log(f"[serve] {rec.job.request_id}: resumed {rec.n_resumes} time(s)")
            on_done = self.on_done and (lambda job, st, fin: self.on_done(job, st, fin, rec.n_resumes))
            rec.answer.finish(stats, self.log, on_done)
        elif msg["op"] == "error":
            with self._lock:
                self._records.pop(rec.jid, None)
            rec.job.push(("error", msg["message"]))

    def _reform(self, child: subprocess.Popen) -> None:
        """The job ended under us: drop the failed rank's slot, start again, resume every request."""
        t0 = time.perf_counter()
        try:
            child.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self._kill_child()
        cause = self._job_error()
        m = _FAILED_RANK.search(cause)
        if m is not None and int(m.group(1)) < len(self.slots):
            rank, host = int(m.group(1)), m.group(2)
        elif len(self.slots) == 1 and child.returncode != 0:  # one rank: no liveness watcher names it
            rank, host = 0, self.slots[0]
        else:
            self._fail(f"the pipeline ended: {cause}")
            return
        self.lost.append(f"rank {rank} (host {host})")
        del self.slots[rank]
        self.n_reforms += 1
        self.log(f"[serve] re-forming the pipeline without rank {rank} (host {host}) on {len(self.slots)} "
                 f"slot(s): {cause}")
        try:
            self._start_child()
        except UserError as e:
            self._fail(str(e))
            return
        with self._lock:
            n = len(self._records)
            for rec in self._records.values():
                rec.n_resumes += 1
        self.log(f"[serve] pipeline re-formed in {time.perf_counter() - t0:.1f} s on {len(self.slots)} slot(s); "
                 f"{n} request(s) resumed")

    def _fail(self, why: str) -> None:
        self.fatal = why
        self.log(f"[serve] fatal: {why}")
        with self._lock:
            recs = list(self._records.values())
            self._records.clear()
        for rec in recs:
            rec.job.push(("error", f"the pipeline failed: {why}"))
        os.kill(os.getpid(), 15)  # the server stops (cli/main.py: the one line, exit 1)

    # ---------------------------------------------------------------- the HTTP side
    def submit(self, job) -> None:
        from .server import RequestError, _Answer
        if self.fatal:
            raise RequestError(503, f"the pipeline failed: {self.fatal}", code="pipeline_failed")
        with self._lock:
            rec = _Record(self._next_id, job, _Answer(job, self.tok))
            self._next_id += 1
            self._records[rec.jid] = rec
            self._send_job(rec)

    def _send_job(self, rec: _Record) -> None:
        job, left = rec.job, rec.job.n_predict - len(rec.tokens)
        sp = job.sampling
        self._send(op="job", id=rec.jid, prompt=job.prompt_tokens, replay=rec.tokens, n_predict=max(1, left),
                   sampling=[sp.temp, sp.top_k, sp.top_p, sp.seed], prompt_text=job.prompt_text, chat=job.chat)

    def _send(self, **msg) -> None:
        try:
            self._out.write(json.dumps(msg, separators=(",", ":")) + "\n")
            self._out.flush()
        except (OSError, ValueError, AttributeError):
            pass  # the child is gone: _reform resends what matters

    def _watch_cancels(self) -> None:
        """A client that left, or a stop string that matched: that request's runs are cancelled on rank 0."""
        while not self._stopping:
            with self._lock:
                for rec in self._records.values():
                    if not rec.cancel_sent and rec.answer.should_stop():
                        rec.cancel_sent = True
                        self._send(op="cancel", id=rec.jid)
            time.sleep(0.05)

    def load(self) -> dict:
        with self._lock:
            n = len(self._records)
        # every request goes to rank 0 at once: what it has not answered yet is generating or queued there
        return {"queued": 0, "generating": n, "ranks": len(self.slots), "degraded": bool(self.lost),
                "lost": list(self.lost), "reforms": self.n_reforms}

    def stop(self) -> None:
        self._stopping = True
        with self._lock:
            recs = list(self._records.values())
        for rec in recs:
            rec.job.push(("error", "the server is shutting down"))
        self._send(op="stop")
        if self._child is not None:
            try:
                self._child.wait(timeout=60)
            except subprocess.TimeoutExpired:
                self._kill_child()
