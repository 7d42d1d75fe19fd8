"""What a job's end says: its one-line error, and the rank (and host) whose failure ended it, read from liveness's
line (rank 0's, or another rank's) or, where the launcher tore the job down before any rank could say who failed,
from the launcher's report: MPICH's Hydra names the pid (and the host as the hostfile names it), Open MPI's mpirun
the rank.
"""
from __future__ import annotations

import re
from dataclasses import dataclass

from ..core.errors import UserError

_FAILED_RANK = re.compile(r"rank (\d+) \(host ([^,)]+)")  # liveness's line
_HYDRA_PID = re.compile(r"PID (\d+) RUNNING AT (\S+)")
_OMPI_RANK = re.compile(r"process rank (\d+) with PID \d+ on node (\S+)")


def last_error(log: str) -> str:
    """A job's one-line error: its last 'pipeinfer: error:' line, else what MPICH's launcher says ended, else its
    last line with an error, else its last."""
    lines = log.splitlines()
    ours = [ln for ln in lines if "pipeinfer: error:" in ln]
    if not ours and (m := _HYDRA_PID.search(log)):  # MPICH's block about the process it saw end
        how = re.search(r"EXIT STRING: (.+)", log)
        return f"process {m.group(1)} at {m.group(2)} ended" + (f": {how.group(1).strip()}" if how else "")
    errs = [ln for ln in lines if "error" in ln.lower()]
    return (ours or errs or lines or ["no output"])[-1].strip()


@dataclass(frozen=True)
class EndedJob:
    """A job that ended: its output, one host per rank (the target's slots, then the draft host's), how many of
    them are the target's, each rank's pid (rank 0 lists them when it attaches: none before) and its exit status."""
    log: str
    hosts: list[str]
    n_target: int
    pids: list[int]
    returncode: int | None

    @property
    def cause(self) -> str:
        return last_error(self.log)

    def failed_rank(self, alone_is_named: bool = True) -> tuple[int | None, str]:
        """The rank (and its host) whose failure ended the job: from liveness's line, else from the launcher's
        report (a pid rank 0 listed when it attached, or Open MPI's rank); a one-rank job's failure is rank 0's
        (alone_is_named: not for a job that failed to start, whose own error is the better line)."""
        m = _FAILED_RANK.search(self.cause)
        if m is not None and int(m.group(1)) < len(self.hosts):
            return int(m.group(1)), m.group(2)
        m = _OMPI_RANK.search(self.log)
        if m is not None and int(m.group(1)) < len(self.hosts):
            return int(m.group(1)), m.group(2)
        m = _HYDRA_PID.search(self.log)
        if m is not None and self.hosts.count(m.group(2)) == 1:  # the only rank on that host
            return self.hosts.index(m.group(2)), m.group(2)
        if m is not None and int(m.group(1)) in self.pids:
            return self.pids.index(int(m.group(1))), m.group(2)
        if alone_is_named and self.n_target == 1 and self.returncode != 0:  # one rank: no liveness watcher names it
            return 0, self.hosts[0]
        return None, ""

    def lost_at_start(self) -> tuple[int, str, str] | None:
        """(rank, host, label) of the slot lost while the job started, named as for a running job (liveness's line
        or the launcher's report); None where the job failed on its own (a rank's error: no slot to drop)."""
        # a rank that liveness names, or one that vanished (no rank said why): not a rank's own error
        if _FAILED_RANK.search(self.cause) is None and "pipeinfer: error" in self.log:
            return None
        rank, host = self.failed_rank(alone_is_named=False)
        if rank is not None:
            return rank, host, f"rank {rank} (host {host})"
        target = self.hosts[:self.n_target]
        if (m := _HYDRA_PID.search(self.log)) and m.group(2) in target:
            # the launcher names a pid on a host of several slots, and rank 0 has not listed their pids yet: some
            # rank there (which one matters not: each slot is just that host's name)
            host = m.group(2)
            return len(target) - 1 - target[::-1].index(host), host, f"a rank (host {host})"
        return None


class StartFailed(UserError):
    """The job ended before its rank 0 attached (what is known of it kept: a lost rank is named from it)."""

    def __init__(self, message: str, ended: EndedJob):
        super().__init__(message)
        self.ended = ended
