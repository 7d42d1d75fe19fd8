"""The pipeline's MPI job through its launches: started on the slots left, started again without the slot of a rank
lost (while it runs, or while it starts), and, with --rejoin, with the lost slots whose hosts answer again. Each
launch gives back its rank 0 once attached (its link, and its Ready); what goes over the link is the supervisor's.
"""
from __future__ import annotations

import os
import socket
from pathlib import Path
from typing import Callable

from ..core.config import CONFIG_ENV, Config
from ..core.errors import UserError
from ..serving import link
from . import launch
from .child import START_TIMEOUT_S, ChildJob, models_bytes, start_timeout_s
from .failures import StartFailed, last_error
from .slots import DRAFT_PLACE, Slots


class JobLifecycle:
    """The slots (slots.Slots), the job now running on them (None before the first launch), how many times it was
    re-formed, and what rank 0 of the job reported when it attached: its ranks' pids (a launcher's report of a
    failure names a pid) and what each host had available (the next start checks the model fits in it). The files
    of every launch live in `work_dir`."""

    def __init__(self, slots: Slots, config: Config, work_dir: str, log: Callable[[str], None], rejoin: bool):
        self.slots, self.config, self.work_dir = slots, config, work_dir
        self.log, self.rejoin = log, rejoin
        self.child: ChildJob | None = None
        self.n_reforms = 0
        self.pids: list[int] = []  # the current job's ranks' pids, rank 0 first (rank 0 reports them when it attaches)
        self.host_mem: dict[str, int] = {}  # host -> available bytes its ranks reported when a job last started

    def job_config(self) -> Config:
        """The configuration of a job on the slots left (per-rank values of theirs; where the draft runs)."""
        return self.slots.job_config(self.config)

    def start_surviving(self) -> tuple[link.Link, link.Ready]:
        """Start the job; where a rank is lost while it starts (named as for a running job: liveness's line or the
        launcher's report), start it again without that slot, until its rank 0 attaches (its link and what it said)
        or no slot is left (UserError)."""
        while True:
            try:
                return self._launch()
            except StartFailed as e:
                lost = e.ended.lost_at_start()
                if lost is None:
                    raise
                rank, host, label = lost
                self.slots.drop(rank, host, label)
                self.n_reforms += 1
                self.log(f"[serve] {label} was lost while the pipeline started: re-forming it on "
                         f"{len(self.slots.hosts)} slot(s): {e.ended.cause}")

    def _launch(self) -> tuple[link.Link, link.Ready]:
        """Start the job on the slots left and wait for its rank 0 to attach (or for the job to fail)."""
        self.slots.check_room(self.config, self.host_mem)
        self.pids = []  # the last job's (a launcher's report of this one's failure must not match them)
        sock_path = launch.rank0_socket(self.work_dir)
        Path(sock_path).unlink(missing_ok=True)
        listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            listener.bind(sock_path)
            listener.listen(1)
            listener.settimeout(0.5)
            env = {**os.environ, CONFIG_ENV: self.job_config().to_json()}  # every rank reads its configuration there
            hosts = self.slots.job_hosts()
            command, more = launch.job_command(hosts, self.work_dir, env)
            self.child = ChildJob(command, {**env, **more}, hosts, len(self.slots.hosts),
                                  os.path.join(self.work_dir, f"job{self.n_reforms}.log"), self.start_limit())
            conn = self.child.await_rank0(listener)
        finally:
            listener.close()
        return self.greet(conn)

    def start_limit(self) -> float:
        """Seconds the job may take until its rank 0 attaches: --start-timeout, else from the models' size."""
        config = self.config
        return start_timeout_s(models_bytes((config.model, config.draft.model)), config.wire.start_timeout)

    def greet(self, conn: socket.socket) -> tuple[link.Link, link.Ready]:
        """Rank 0's link on `conn` once it said Ready (its ranks' pids and what their hosts have available noted);
        UserError where it says anything else, or nothing in time."""
        # a rank 0 that connects and says nothing must not hold the start
        conn.settimeout(self.child.start_timeout if self.child else START_TIMEOUT_S)
        rank0 = link.Link(conn, link.TO_SUPERVISOR)
        try:
            ready, why = rank0.receive(), None
        except (OSError, link.LinkError) as e:
            ready, why = None, f"{type(e).__name__}: {e}"
        if not isinstance(ready, link.Ready):
            rank0.close()
            self.kill_child()
            raise UserError(f"the pipeline's rank 0 did not attach: {why or last_error(self.child.log())}")
        conn.settimeout(None)
        self.pids = [pid for _host, pid in ready.ranks_at]
        self.host_mem.update(zip(self.slots.job_hosts(), ready.mem_available))
        return rank0, ready

    def reform(self, child: ChildJob) -> tuple[link.Link, link.Ready]:
        """The job ended under us: drop the failed rank's slot (with --rejoin, take back the slots lost earlier whose
        hosts answer again), start again; the new rank 0 (start_surviving). UserError where no rank is named."""
        child.wait_or_kill(30)
        ended = child.ended(self.pids)
        rank, host = ended.failed_rank()
        if rank is None:
            raise UserError(f"the pipeline ended: {ended.cause}")
        lost_place = self.slots.drop(rank, host)
        if self.rejoin:  # hosts lost earlier that answer again come back now (not the one just lost)
            self.slots.restore(self.answering(p for p in self.slots.lost_slots if p != lost_place))
        self.n_reforms += 1
        self.log(f"[serve] re-forming the pipeline without {self.slots.lost[-1]} on {len(self.slots.hosts)} slot(s)"
                 f"{' (the draft beside rank 0)' if lost_place == DRAFT_PLACE else ''}: {ended.cause}")
        return self.start_surviving()

    def replan(self, back: list[int], stopped: ChildJob) -> tuple[link.Link, link.Ready]:
        """--rejoin: the lost slots at places `back` answer again: once the job `stopped` for it has ended, start it
        on them too; the new rank 0 (start_surviving)."""
        n_before = len(self.slots.hosts)
        hosts = self.slots.restore(back)
        self.log(f"[serve] {', '.join(hosts)} answer(s) again: re-planning the pipeline on {len(self.slots.hosts)} "
                 f"slot(s) (was {n_before})")
        stopped.wait_or_kill(60)
        return self.start_surviving()

    def answering(self, places) -> list[int]:
        """The lost places whose hosts answer again. A probe that cannot be launched counts as no answer (logged):
        the job that runs goes on as it is."""
        back = []
        for p in places:
            host = self.slots.lost_slots[p].host
            try:
                if launch.host_answers(host, self.work_dir):
                    back.append(p)
            except (OSError, RuntimeError, ValueError) as e:  # the launcher's failures (wire/launcher.py)
                self.log(f"[serve] --rejoin: cannot ask {host} whether it answers: {type(e).__name__}: {e}")
        return back

    def kill_child(self) -> None:
        if self.child is not None:
            self.child.kill()
