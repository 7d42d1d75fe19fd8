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
"""
from __future__ import annotations

import os
import re
import shlex
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field, replace
from pathlib import Path

from ..core.config import CONFIG_ENV, Config
from ..core.errors import UserError
from ..core.metrics import Stats
from ..core.protocol import STAGE_COUNTERS
from ..engine.drafts import draft_hint
from ..serving import link
from ..serving.answer import Answer
from ..serving.job import ErrorEvent, Generation, RequestError

DRAFT_PLACE = -1  # the draft host's key among the lost slots (Supervisor._away)
_FAILED_RANK = re.compile(r"rank (\d+) \(host ([^,)]+)")  # liveness's line, from rank 0 (or another rank)
# where the launcher tore the job down before any rank could say who failed: MPICH's Hydra names the pid (and
# the host as the hostfile names it), Open MPI's mpirun the rank
_HYDRA_PID = re.compile(r"PID (\d+) RUNNING AT (\S+)")
_OMPI_RANK = re.compile(r"process rank (\d+) with PID \d+ on node (\S+)")


START_TIMEOUT_S = 600.0
REJOIN_CHECK_S = 10.0   # --rejoin: how often an idle, degraded supervisor asks whether a lost host answers again
PROBE_TIMEOUT_S = 20.0  # a launch of `pipeinfer --version` on a host that takes longer: the host is still away
_LOCAL_NAMES = ("localhost", "127.0.0.1")


def resumed_status(n_resumes: int) -> str:
    """A supervised answer's --results status."""
    return f"ok: resumed {n_resumes}" if n_resumes else "ok"


class _StartFailed(UserError):
    """The job ended before its rank 0 attached (its log and process kept: a lost rank is named from them)."""

    def __init__(self, message: str, log: str, child: subprocess.Popen):
        super().__init__(message)
        self.log, self.child = log, child


def _last_error(log: str) -> str:
    """A job's one-line error: its last 'pipeinfer: error:' line, else what MPICH's launcher says ended, else its
    last line with an error, else its last."""
    lines = log.splitlines()
    ours = [ln for ln in lines if "pipeinfer: error:" in ln]
    if not ours and (m := _HYDRA_PID.search(log)):  # MPICH's block about the process it saw end
        how = re.search(r"EXIT STRING: (.+)", log)
        return f"process {m.group(1)} at {m.group(2)} ended" + (f": {how.group(1).strip()}" if how else "")
    errs = [ln for ln in lines if "error" in ln.lower()]
    return (ours or errs or lines or ["no output"])[-1].strip()


def _on_this_machine(host: str) -> bool:
    return host in (*_LOCAL_NAMES, socket.gethostname())


@dataclass(frozen=True)
class Footprint:
    """What the model asks of the hosts, checked before every start of the job (a re-form on fewer hosts above
    all): the target's weights split over the ranks as --layer-split says (evenly by default), the draft's beside
    rank 0; what a host has is its hostfile `mem=` (GiB) and, on this machine, MemAvailable."""
    weights_bytes: int
    head_bytes: int = 0
    declared_gib: dict = field(default_factory=dict)   # host -> GiB (hostfile mem=)

    def shortfall(self, slots: list[str], fractions: list[float] | None = None,
                  measured: dict | None = None) -> str | None:
        """`fractions`: the job's --layer-split (None: even); `measured`: host -> bytes its ranks found available
        when the last job started (before it loaded the model), the lesser of that and mem= counts."""
        from ..core.topology import memory_shortfall
        from ..wire.liveness import available_memory
        available = {h: int(g * 2**30) for h, g in self.declared_gib.items()}
        here = available_memory()
        for host, n in [*(measured or {}).items(), *((h, here) for h in set(slots) if _on_this_machine(h))]:
            available[host] = min(available.get(host, n), n)
        return memory_shortfall(slots, self.weights_bytes, self.head_bytes, available, fractions)


def split_fractions(config, n_ranks: int) -> list[float] | None:
    """A job's --layer-split fractions, or None (absent or balanced: about even in weight bytes, the output
    projection counted; even; auto: not known before the job measures; or not valid: the job itself says why)."""
    from ..core.topology import SPLIT_NAMES, SplitError, parse_split
    value = config.layer_split
    if value is None or value.strip() in SPLIT_NAMES:
        return None
    try:
        return parse_split(value, n_ranks)
    except SplitError:
        return None


def _launch_command(slots: list[str], pipeinfer_args: list[str], hostfile: str,
                    environ=None) -> tuple[list[str], dict[str, str]]:
    """(the launcher's command line that runs `pipeinfer ARGS` with one rank per slot, the variables it needs): the
    MPI mpi4py loads, the hostfile as `launch` writes it, PIPEINFER_MPI_ARGS (the launcher's own options,
    docs/cluster.md) from `environ` (default: this process's), whose PIPEINFER_* variables go to every rank. Inside
    a Slurm allocation the job is a job step: srun on the slots' nodes, a lost one left out of the task file."""
    from ..wire.launcher import Host, build_command, choose_launcher, mpi4py_library
    from ..wire.slurm import in_allocation, srun_command
    library = mpi4py_library()
    mpi = library.kind
    hosts = [Host(name) for name in slots]  # one slot each; the hostfile merges a host's lines
    extra = shlex.split((os.environ if environ is None else environ).get("PIPEINFER_MPI_ARGS", ""))
    if in_allocation(os.environ):
        return srun_command(hosts, len(slots), mpi, pipeinfer_args, task_file=hostfile, extra=extra, environ=environ)
    extra = (["--allow-run-as-root"] if mpi == "openmpi" and os.geteuid() == 0 else []) + extra
    return build_command(hosts, len(slots), mpi, pipeinfer_args, mpiexec=choose_launcher(library, None),
                         extra=extra, hostfile=hostfile, environ=environ), {}


def first_job_command(where: "Placement", work_dir: str, environ) -> tuple[list[str], dict[str, str]]:
    """The launcher's command line of the server's first job on `where` (its hostfile written in work_dir) in the
    server's environment: what `launch --dry-run -- serve` shows."""
    hosts = where.slots + ([where.draft.name] if where.draft else [])
    return _launch_command(hosts, ["attach", os.path.join(work_dir, "rank0.sock")], os.path.join(work_dir, "hosts.txt"),
                           environ)


def _answers(host: str, work_dir: str) -> bool:
    """Whether `host` runs pipeinfer again: a one-rank launch of `pipeinfer --version` there succeeds in time
    (this machine always does)."""
    if _on_this_machine(host):
        return True
    from ..wire.slurm import in_allocation, srun_probe
    cmd, env = (srun_probe(host), {}) if in_allocation(os.environ) else \
        _launch_command([host], ["--version"], os.path.join(work_dir, "probe-hosts.txt"))
    probe = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                             start_new_session=True, env={**os.environ, **env})
    try:
        return probe.wait(timeout=PROBE_TIMEOUT_S) == 0
    except subprocess.TimeoutExpired:
        os.killpg(probe.pid, 9)  # the launcher and what it started (its proxies)
        probe.wait()
        return False


@dataclass(frozen=True)
class DraftHost:
    """The hostfile's draft host (role=draft): the job's last rank runs the draft there (`settings`: draft_at rank,
    draft_threads, as Config fields); when it is lost, the draft (`n_bytes` of it) moves beside rank 0."""
    name: str
    settings: dict
    n_bytes: int


@dataclass(frozen=True)
class Placement:
    """Where a supervised job runs: one host per target rank (rank 0 first), the draft's host if the hostfile has
    one, what the model asks of them, and the configuration with what the hostfile's per-host settings give
    (threads=, threads_batch=, weight=)."""
    slots: list[str]
    footprint: Footprint
    config: Config
    draft: DraftHost | None = None


def placement(np: int | None, hostfile: str | None, config: Config) -> Placement:
    """--hostfile's slots (--np of them), or --np on this machine; the options the user set (config.set_by_user) win
    over the hostfile's settings."""
    from ..wire.launcher import host_settings, mpi_size, parse_hostfile, rank_hosts, with_draft_last
    if mpi_size() > 1:
        raise UserError("--np/--hostfile start the pipeline's MPI job themselves: run pipeinfer without mpiexec")
    hosts, settings, draft = [], {}, None
    draft_bytes = Path(config.draft).stat().st_size if config.draft else 0
    if hostfile:
        try:
            hosts = parse_hostfile(hostfile)
            n = np or sum(h.slots for h in hosts)
            ordered, draft_settings = with_draft_last(hosts, n, config.set_by_user)
            if ordered and ordered[-1].role == "draft":
                if not config.draft:
                    raise ValueError(f"{ordered[-1].name} has role=draft but this run has no draft model: give "
                                     f"{draft_hint(config.model)}, or drop role=draft")
                draft, ordered, n = DraftHost(ordered[-1].name, draft_settings, draft_bytes), ordered[:-1], n - 1
            slots = [h.name for h in rank_hosts(ordered, n)]
            settings = host_settings(ordered, n, config.set_by_user)
            config = replace(config, **settings)
        except (ValueError, OSError) as e:
            raise UserError(f"--hostfile {hostfile}: {e}") from None
    else:
        slots = ["localhost"] * np
    beside = draft is None and config.draft_at != "rank"
    return Placement(slots, Footprint(Path(config.model).stat().st_size, draft_bytes if beside else 0,
                                      {h.name: h.mem for h in hosts if h.mem}), config, draft)


@dataclass
class _Record:
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


def resumed_stats(stats: Stats, rec: _Record) -> Stats:
    """The Stats of a request that jobs answered in turn: the last job's counters (its own drafts), with every token
    counted and the times the supervisor saw (its clock: from when the request first went to a job), since no job's
    clock spans the whole answer."""
    return replace(stats, n_generated=len(rec.tokens), t_start_s=rec.t_sent, t_prompt_done_s=rec.t_token1 or rec.t_sent,
                   t_first_s=rec.t_token2, t_last_s=rec.t_token_last or rec.t_token1 or rec.t_sent)


class StageTotals:
    """Each stage's counters over every job of a supervised server, by (rank, host): a new job's stages count from
    zero, so the totals of the jobs before it are added; a (rank, host) that the new job lacks keeps its last total.
    So no counter goes backwards across a re-form (what a job's last Stages missed of its last second is lost).
    Thread-safe: rank 0's reader writes, the HTTP side reads."""

    def __init__(self):
        self._lock = threading.Lock()
        self._earlier: dict[tuple[int, str], dict] = {}  # (rank, host) -> counters of the jobs before this one
        self._current: list[dict] = []                    # this job's stages, as its rank 0 last sent them
        self._job: link.Link | None = None                # this job's link: a late Stages of the last job is ignored

    def new_job(self, job) -> None:
        with self._lock:
            self._earlier = self._merged()
            self._current, self._job = [], job

    def take(self, job, stages: list[dict]) -> None:
        with self._lock:
            if job is self._job:
                self._current = stages

    def totals(self) -> list[dict]:
        """[{rank, host, counter: value, ...}] in (rank, host) order (HeadSession.stages()'s shape, n_reports left
        out)."""
        with self._lock:
            merged = self._merged()
        return [{"rank": rank, "host": host, **counters} for (rank, host), counters in sorted(merged.items())]

    def _merged(self) -> dict[tuple[int, str], dict]:
        merged = {key: dict(counters) for key, counters in self._earlier.items()}
        for st in self._current:
            total = merged.setdefault((int(st["rank"]), str(st["host"])), dict.fromkeys(STAGE_COUNTERS, 0))
            for name in STAGE_COUNTERS:
                total[name] += st.get(name, 0)
        return merged


def _stop_this_process(_why: str) -> None:
    """on_fatal where the caller gives none: a SIGTERM ends this process's HTTP server as a user's would, and
    `serve` then reports Supervisor.fatal as its one line and exits 1 (cli/main.py)."""
    os.kill(os.getpid(), signal.SIGTERM)


class Supervisor:
    """The generator the HTTP app talks to (serving/job.Generator: submit, fatal, parallel, load, log, on_done),
    forwarding to rank 0 of a child MPI job and re-forming that job when it fails.

    `phase` says what it does (/health): starting, serving, re-forming (the job failed), re-planning (--rejoin: a
    lost host is back), failed (`fatal` says why; every request fails, and on_fatal ends the front end) or stopping.
    A request that comes while no rank 0 is attached waits in the records: each new rank 0 gets every record not
    answered yet.

    Why one class: the records of the requests, the link to the current child and the child's lifecycle change
    together on every failure (stop reading, drop a slot, start again, resend every unfinished record)."""

    def __init__(self, slots: list[str], config, tok, log=None, on_done=None,
                 footprint: Footprint | None = None, rejoin: bool = False, draft: DraftHost | None = None,
                 on_fatal=None):
        self.slots = list(slots)            # one host name per target rank, rank 0 first
        self.footprint, self.rejoin = footprint, rejoin
        self.draft_host = draft             # the hostfile's role=draft host, lost or not (_draft_host_serving)
        self._places = list(range(len(slots)))  # each slot's rank in the first job (the order a rejoin restores)
        self._away: dict[int, tuple[str, str]] = {}  # place -> (host, its entry in self.lost) of each lost slot
        self._retired: subprocess.Popen | None = None  # a job stopped for a re-plan (--rejoin), not failed
        self._pids: list[int] = []  # the current job's ranks' pids (rank 0 reports them when it attaches)
        self._host_mem: dict[str, int] = {}  # host -> available bytes its ranks reported when a job last started
        self.ready: link.Ready | None = None  # the current (or last) job's rank 0 said so when it attached
        self.prompt_cache: dict | None = None  # rank 0's prompt cache, as its Ready or its last Done said it
        self.stage_totals = StageTotals()     # the stages' counters over every job (rank 0's Stages)
        self.config, self.tok = config, tok   # core/config.Config of the first job (the user's, the hosts' settings)
        self.log = log or (lambda msg: print(msg, file=sys.stderr, flush=True))
        self.on_done = on_done
        self.on_fatal = on_fatal or _stop_this_process  # callable(why) once the pipeline cannot go on
        self.fatal: str | None = None
        self.phase = "starting"
        self.parallel = 0
        self.lost: list[str] = []           # "rank R (host H)" of every failure so far
        self.n_reforms = 0
        self.t_down_s = 0.0                 # seconds without a serving job since the first one served
        self._down_since: float | None = None  # monotonic time the current job ended (re-forming, re-planning)
        self._records: dict[int, _Record] = {}
        self._next_id = 0
        self._lock = threading.RLock()
        self._dir = tempfile.mkdtemp(prefix="pipeinfer-sup-")
        self._sock_path = os.path.join(self._dir, "rank0.sock")
        self._rank0: link.Link | None = None  # the attached rank 0's link; None between jobs
        self._child: subprocess.Popen | None = None
        self._stopping = False

    # ---------------------------------------------------------------- the child job
    def start(self) -> None:
        """Start the job and wait for its rank 0 (UserError, one line, where it cannot start)."""
        try:
            self._start_surviving()
        except UserError:
            self._kill_child()
            raise
        except (OSError, RuntimeError, ValueError) as e:  # the launcher's (no launcher of mpi4py's MPI, ...)
            self._kill_child()
            raise UserError(f"cannot start the pipeline's job: {e}") from None
        threading.Thread(target=self._watch_cancels, daemon=True).start()
        if self.rejoin:
            threading.Thread(target=self._watch_returns, daemon=True).start()

    @property
    def _draft_host_serving(self) -> DraftHost | None:
        """The hostfile's draft host while it runs the draft on the job's last rank; None without one, or once it
        is lost (the draft then runs beside rank 0)."""
        return None if DRAFT_PLACE in self._away else self.draft_host

    def _job_hosts(self) -> list[str]:
        """One host per rank of the job: the target's slots, then the draft host's while it serves."""
        serving = self._draft_host_serving
        return self.slots + ([serving.name] if serving else [])

    def _job_config(self):
        """The configuration of a job on the slots left (per-rank values of theirs; where the draft runs)."""
        n_places = len(self._places) + len([p for p in self._away if p != DRAFT_PLACE])
        config = self.config.for_places(self._places, n_places)
        if self.draft_host is not None:  # the draft on its host (the last rank), or, that host lost, beside rank 0
            config = replace(config, **self.draft_host.settings) if self._draft_host_serving else \
                replace(config, draft_at="thread")
        return config

    def _command(self) -> tuple[list[str], dict]:
        """The launcher's command line of the job and its environment: every rank reads the configuration from it."""
        env = {**os.environ, CONFIG_ENV: self._job_config().to_json()}
        command, more = _launch_command(self._job_hosts(), ["attach", self._sock_path],
                                        os.path.join(self._dir, "hosts.txt"), env)
        return command, {**env, **more}

    def _check_room(self) -> None:
        """UserError where the slots left cannot run the pipeline: none left, or too little memory on them."""
        if not self.slots:
            raise UserError(f"no slot left to run the pipeline on (lost: {'; '.join(self.lost)})")
        short = (self.footprint.shortfall(self.slots, split_fractions(self._job_config(), len(self.slots)),
                                          self._host_mem) if self.footprint else None)
        if short:
            raise UserError(f"the {len(self.slots)} slot(s) left cannot hold the model: {short}" if self.lost else
                            f"the {len(self.slots)} slot(s) cannot hold the model: {short}")

    def _start_child(self) -> None:
        """Start the job on the slots left and wait for its rank 0 to attach (or for the job to fail)."""
        self._check_room()
        self._pids = []  # the last job's (a launcher's report of this one's failure must not match them)
        Path(self._sock_path).unlink(missing_ok=True)
        listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            listener.bind(self._sock_path)
            listener.listen(1)
            listener.settimeout(0.5)
            self._log_path = os.path.join(self._dir, f"job{self.n_reforms}.log")
            command, env = self._command()
            with open(self._log_path, "w") as job_log:
                self._child = subprocess.Popen(command, stdin=subprocess.DEVNULL, stdout=job_log, env=env,
                                               stderr=subprocess.STDOUT, start_new_session=True)
            conn = self._await_rank0(listener)
        finally:
            listener.close()
        self._attach(conn)

    def _await_rank0(self, listener: socket.socket) -> socket.socket:
        """The connection of the job's rank 0 once it attaches; _StartFailed where the job ends first."""
        deadline = time.monotonic() + START_TIMEOUT_S
        while True:
            if self._child.poll() is not None:
                raise _StartFailed(f"the pipeline did not start on {len(self.slots)} slot(s): "
                                   f"{_last_error(self._job_log())}", self._job_log(), self._child)
            if time.monotonic() > deadline:
                self._kill_child()
                raise UserError(f"the pipeline did not start in {START_TIMEOUT_S:.0f} s")
            try:
                return listener.accept()[0]
            except socket.timeout:
                continue

    def _attach(self, conn: socket.socket) -> None:
        """Rank 0's Ready on `conn`, then every request not answered yet goes (again) to it."""
        conn.settimeout(START_TIMEOUT_S)  # a rank 0 that connects and says nothing must not hold the start
        rank0 = link.Link(conn, link.TO_SUPERVISOR)
        try:
            ready, why = rank0.receive(), None
        except (OSError, link.LinkError) as e:
            ready, why = None, f"{type(e).__name__}: {e}"
        if not isinstance(ready, link.Ready):
            rank0.close()
            self._kill_child()
            raise UserError(f"the pipeline's rank 0 did not attach: {why or _last_error(self._job_log())}")
        conn.settimeout(None)
        self.parallel, self.ready = ready.parallel, ready
        self.prompt_cache = ready.prompt_cache  # a new job: its own (empty) cache
        self.stage_totals.new_job(rank0)        # ... and stages counting from zero, added to the jobs' before
        self._pids = [pid for _host, pid in ready.ranks_at]  # each rank's pid, rank 0 first
        self._host_mem.update(zip(self._job_hosts(), ready.mem_available))
        with self._lock:
            self._rank0, self.phase = rank0, "serving"
            if self._down_since is not None:
                self.t_down_s += time.monotonic() - self._down_since
                self._down_since = None
            for rec in self._records.values():
                rec.cancel_sent = False
                self._send_job(rec)
        threading.Thread(target=self._read, args=(rank0, self._child), daemon=True).start()

    def _start_surviving(self) -> None:
        """Start the job; where a rank is lost while it starts (named as for a running job: liveness's line or the
        launcher's report), start it again without that slot, until it attaches or no slot is left (UserError)."""
        while True:
            try:
                return self._start_child()
            except _StartFailed as e:
                cause = _last_error(e.log)
                # a rank that liveness names, or one that vanished (no rank said why): not a rank's own error
                lost = _FAILED_RANK.search(cause) is not None or "pipeinfer: error" not in e.log
                rank, host = self._failed_rank(cause, e.log, e.child, alone_is_named=False) if lost else (None, "")
                if rank is None and lost and (m := _HYDRA_PID.search(e.log)) and m.group(2) in self.slots:
                    # the launcher names a pid on a host of several slots, and rank 0 has not listed their pids
                    # yet: some rank there (which one matters not: each slot is just that host's name)
                    rank, host = len(self.slots) - 1 - self.slots[::-1].index(m.group(2)), m.group(2)
                    label = f"a rank (host {host})"
                elif rank is None:
                    raise
                else:
                    label = f"rank {rank} (host {host})"
                self._drop(rank, host, label)
                self.n_reforms += 1
                self.log(f"[serve] {label} was lost while the pipeline started: re-forming it on {len(self.slots)} "
                         f"slot(s): {cause}")

    def _drop(self, rank: int, host: str, label: str | None = None) -> int:
        """Take the failed rank's slot out (kept with its first job's place for --rejoin); its place. The draft's
        rank (after the target's): the draft goes beside rank 0 (its memory there from now on)."""
        if self._draft_host_serving is not None and rank == len(self.slots):
            self.lost.append(f"the draft's rank {rank} (host {host})")
            self._away[DRAFT_PLACE] = (self.draft_host.name, self.lost[-1])
            if self.footprint:
                self.footprint = replace(self.footprint, head_bytes=self.draft_host.n_bytes)
            return DRAFT_PLACE
        self.lost.append(label or f"rank {rank} (host {host})")
        slot = self.slots.pop(rank)  # the host as the hostfile names it (liveness names it by its hostname)
        place = self._places.pop(rank)
        self._away[place] = (slot, self.lost[-1])
        return place

    def _job_log(self) -> str:
        try:
            return Path(self._log_path).read_text(errors="replace")
        except OSError:
            return ""

    def _kill_child(self) -> None:
        if self._child is not None and self._child.poll() is None:
            try:
                os.killpg(self._child.pid, 9)
            except ProcessLookupError:
                pass
            self._child.wait()

    # ---------------------------------------------------------------- failures
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
            if self.fatal is not None:  # the first cause is the one reported
                return
            self.fatal, self.phase, self._rank0 = why, "failed", None
            recs = list(self._records.values())
            self._records.clear()
        self.log(f"[serve] fatal: {why}")
        self._kill_child()
        for rec in recs:
            rec.job.push(ErrorEvent(f"the pipeline failed: {why}"))
        self.on_fatal(why)

    # ---------------------------------------------------------------- --rejoin
    def _restore(self, places: list[int]) -> list[str]:
        """The lost slots at these places go back into the slots, in their first job's rank order; their hosts."""
        hosts = []
        for p in places:
            host, label = self._away.pop(p)
            self.lost.remove(label)
            hosts.append(host)
            if p == DRAFT_PLACE:  # the draft goes back to its host
                if self.footprint:
                    self.footprint = replace(self.footprint, head_bytes=0)
                continue
            self._places.append(p)
            self.slots.append(host)
        order = sorted(range(len(self.slots)), key=self._places.__getitem__)
        self._places, self.slots = [self._places[i] for i in order], [self.slots[i] for i in order]
        return hosts

    def _answering(self, places) -> list[int]:
        """The lost places whose hosts answer again. A probe that cannot be launched counts as no answer (logged):
        the job that runs goes on as it is."""
        back = []
        for p in places:
            host = self._away[p][0]
            try:
                if _answers(host, self._dir):
                    back.append(p)
            except (OSError, RuntimeError, ValueError) as e:  # the launcher's failures (wire/launcher.py)
                self.log(f"[serve] --rejoin: cannot ask {host} whether it answers: {type(e).__name__}: {e}")
        return back

    def _watch_returns(self) -> None:
        """--rejoin: while no request is in flight, a lost slot whose host answers again (a launch of `pipeinfer
        --version` there succeeds) is taken back, and the job is re-planned on it: never mid-request."""
        while not self._stopping and not self.fatal:
            time.sleep(REJOIN_CHECK_S)
            with self._lock:
                idle = not self._records and self._away and not self._stopping and not self.fatal
            if idle:
                self._guarded("cannot re-plan the pipeline", self._replan)

    def _replan(self) -> None:
        back = self._answering(list(self._away))
        if not back:
            return
        with self._lock:
            if self._records or self._stopping:  # a request came while the hosts were asked: next time
                return
            self._retired = self._child  # its end is no failure (_read)
            self._send(link.Stop())
            self._rank0, self.phase = None, "re-planning"  # requests from now on wait for the new job (_attach)
            self._down_since = time.monotonic()
        t0, n_before = time.perf_counter(), len(self.slots)
        hosts = self._restore(back)
        self.log(f"[serve] {', '.join(hosts)} answer(s) again: re-planning the pipeline on {len(self.slots)} slot(s) "
                 f"(was {n_before})")
        try:
            self._retired.wait(timeout=60)
        except subprocess.TimeoutExpired:
            self._kill_child()
        self._start_surviving()
        self.log(f"[serve] pipeline re-planned in {time.perf_counter() - t0:.1f} s on {len(self.slots)} slot(s)")

    # ---------------------------------------------------------------- messages from rank 0
    def _read(self, rank0: link.Link, child: subprocess.Popen) -> None:
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
            if self._rank0 is not rank0 or self._stopping or child is self._retired:
                return
            self._rank0, self.phase = None, "re-forming"  # requests from now on wait for the new job (_attach)
            self._down_since = time.monotonic()
        self._guarded("cannot re-form the pipeline", lambda: self._reform(child))

    def _on_message(self, msg, rank0: link.Link | None = None) -> None:
        if isinstance(msg, link.Ready):
            raise link.LinkError("ready: rank 0 attached a second time")
        if isinstance(msg, link.Stages):
            self.stage_totals.take(rank0, msg.stages)
            return
        with self._lock:
            rec = self._records.get(msg.id)
        if rec is None:  # answered or failed already
            return
        if isinstance(msg, link.Tokens):
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
        elif isinstance(msg, link.Done):
            if msg.prompt_cache is not None:
                self.prompt_cache = msg.prompt_cache
            stats = Stats.from_dict(msg.stats)
            stats.n_generated = len(rec.tokens)  # this job's and the earlier jobs' tokens
            if rec.n_resumes:
                stats = resumed_stats(stats, rec)
            with self._lock:
                self._records.pop(rec.jid, None)
            if rec.n_resumes:
                self.log(f"[serve] {rec.job.request_id}: resumed {rec.n_resumes} time(s)")
            on_done = self.on_done and (lambda job, st, fin: self.on_done(job, st, fin, rec.n_resumes))
            rec.answer.finish(stats, self.log, on_done)
        elif isinstance(msg, link.JobError):
            with self._lock:
                self._records.pop(rec.jid, None)
            rec.job.push(ErrorEvent(msg.message))

    def _reform(self, child: subprocess.Popen) -> None:
        """The job ended under us: drop the failed rank's slot, start again, resume every request."""
        t0 = time.perf_counter()
        try:
            child.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self._kill_child()
        log = self._job_log()
        cause = _last_error(log)
        rank, host = self._failed_rank(cause, log, child)
        if rank is None:
            self._fail(f"the pipeline ended: {cause}")
            return
        lost_place = self._drop(rank, host)
        if self.rejoin:  # hosts lost earlier that answer again come back now (not the one just lost)
            self._restore(self._answering(p for p in self._away if p != lost_place))
        self.n_reforms += 1
        self.log(f"[serve] re-forming the pipeline without {self.lost[-1]} on {len(self.slots)} slot(s)"
                 f"{' (the draft beside rank 0)' if lost_place == DRAFT_PLACE else ''}: {cause}")
        self._start_surviving()
        with self._lock:
            n = len(self._records)
            for rec in self._records.values():
                rec.n_resumes += 1
        self.log(f"[serve] pipeline re-formed in {time.perf_counter() - t0:.1f} s on {len(self.slots)} slot(s); "
                 f"{n} request(s) resumed")

    def _failed_rank(self, cause: str, log: str, child: subprocess.Popen,
                     alone_is_named: bool = True) -> tuple[int | None, str]:
        """The rank (and its host) whose failure ended the job: from liveness's line, else from the launcher's
        report (a pid rank 0 listed when it attached, or Open MPI's rank); a one-rank job's failure is rank 0's
        (alone_is_named: not for a job that failed to start, whose own error is the better line)."""
        hosts = self._job_hosts()
        m = _FAILED_RANK.search(cause)
        if m is not None and int(m.group(1)) < len(hosts):
            return int(m.group(1)), m.group(2)
        m = _OMPI_RANK.search(log)
        if m is not None and int(m.group(1)) < len(hosts):
            return int(m.group(1)), m.group(2)
        m = _HYDRA_PID.search(log)
        if m is not None and hosts.count(m.group(2)) == 1:  # the only rank on that host
            return hosts.index(m.group(2)), m.group(2)
        if m is not None and int(m.group(1)) in self._pids:
            return self._pids.index(int(m.group(1))), m.group(2)
        if alone_is_named and len(self.slots) == 1 and child.returncode != 0:  # one rank: no liveness watcher names it
            return 0, self.slots[0]
        return None, ""

    # ---------------------------------------------------------------- the HTTP side
    def submit(self, job: Generation) -> None:
        with self._lock:  # fatal read under the lock: a request recorded after _fail's would wait for ever
            if self.fatal:
                raise RequestError(503, f"the pipeline failed: {self.fatal}", code="pipeline_failed")
            rec = _Record(self._next_id, job, Answer(job, self.tok))
            self._next_id += 1
            self._records[rec.jid] = rec
            self._send_job(rec)

    def _send_job(self, rec: _Record) -> None:
        rec.t_sent = rec.t_sent or time.perf_counter()
        job, left = rec.job, rec.job.n_predict - len(rec.tokens)
        sp = job.sampling
        self._send(link.Job(rec.jid, job.prompt_tokens, rec.tokens, max(1, left),
                            (sp.temp, sp.top_k, sp.top_p, sp.seed), job.prompt_text, job.chat,
                            job.decoding.to_dict(), job.cache_prompt))

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

    def _watch_cancels(self) -> None:
        """A client that left, or a stop string that matched: that request's runs are cancelled on rank 0."""
        while not self._stopping:
            with self._lock:
                for rec in self._records.values():
                    if not rec.cancel_sent and rec.answer.should_stop():
                        rec.cancel_sent = self._send(link.Cancel(rec.jid))
            time.sleep(0.05)

    def load(self) -> dict:
        with self._lock:
            n = len(self._records)
        # every request goes to rank 0 at once: what it has not answered yet is generating or queued there
        out = {"queued": 0, "generating": n, "ranks": len(self.slots), "degraded": bool(self.lost),
               "lost": list(self.lost), "reforms": self.n_reforms, "phase": self.phase,
               "down_s": round(self.t_down_s + (time.monotonic() - self._down_since if self._down_since else 0.0), 3),
               "available_gib": {h: round(b / 2**30, 2) for h, b in self._host_mem.items()}}
        if self.draft_host is not None:  # serving the draft, or lost (the draft beside rank 0)
            serving = self._draft_host_serving
            out["draft_host"] = serving.name if serving else None
        if self.prompt_cache is not None:  # rank 0's, as of its last Done (or its Ready)
            out["prompt_cache"] = dict(self.prompt_cache)
        out["stages"] = self.stage_totals.totals()
        return out

    def stop(self) -> None:
        self._stopping = True
        with self._lock:
            recs = list(self._records.values())
            if self.fatal is None:
                self.phase = "stopping"
        for rec in recs:
            rec.job.push(ErrorEvent("the server is shutting down"))
        self._send(link.Stop())
        if self._child is not None:
            try:
                self._child.wait(timeout=60)
            except subprocess.TimeoutExpired:
                self._kill_child()
