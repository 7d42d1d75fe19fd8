"""The error rule on every rank: a user's mistake is one line and a non-zero exit on every rank (MPI_Abort
under mpiexec, so no rank hangs); a bug shows its traceback and takes every rank down the same way. And a stop
asked for by a signal (StopSignals): no error at all, a clean end."""
from __future__ import annotations

import os
import signal
import sys
import time

import click

from ..core.errors import UserError
from ..core.protocol import ProtocolError
from ..wire.launcher import mpi_rank, mpi_size
from ..engine.models import ModelError, resolve_model
from ..engine.stagefile import StageFileError


def _alone_in_its_world() -> bool:
    """MPI runs, with a world of one process, although the launcher started several: the launcher is of another MPI
    than the library mpi4py loaded. No peer can be reached, so none may be waited for or aborted."""
    if mpi_size() <= 1 or "mpi4py.MPI" not in sys.modules:
        return False
    from mpi4py import MPI
    return MPI.Is_initialized() and not MPI.Is_finalized() and MPI.COMM_WORLD.Get_size() == 1


def run_guarded(fn, kw) -> None:
    """User errors: one line, exit 1 on every rank (MPI_Abort under mpiexec, so no rank hangs)."""
    try:
        fn(kw)
        return
    except (UserError, StageFileError, ModelError, ProtocolError, click.ClickException) as e:
        msg = e.format_message() if isinstance(e, click.ClickException) else str(e)
        code = 1
    except KeyboardInterrupt:
        msg, code = "interrupted", 130
    except Exception:  # a bug, not a user error: show where, and take every rank down with us
        import traceback
        traceback.print_exc()
        msg, code = "internal error (traceback above)", 2
    die(msg, code)


def die(msg: str, code: int) -> None:
    size = mpi_size()
    rank = mpi_rank()
    if _alone_in_its_world():
        # every process of the job runs alone and meets the same error: the launcher's rank 0 says it, once
        if rank == 0:
            print(f"pipeinfer: error: {msg}", file=sys.stderr, flush=True)
        sys.stdout.flush()
        os._exit(code)  # not sys.exit: under `python -m mpi4py` that becomes MPI_Abort, and Open MPI's notice block
    where = f" (rank {rank})" if rank else ""
    if size > 1:
        from ..wire.liveness import announce_abort
        announce_abort()  # the peers' liveness threads stay quiet: this line says why the job ends
        if rank:
            # most bad input fails on every rank alike: rank 0's line (and its MPI_Abort) comes first, so the
            # user reads one line; an error of this rank alone still comes out, 2 s later
            time.sleep(2)
    print(f"pipeinfer: error{where}: {msg}", file=sys.stderr, flush=True)
    if size > 1:
        time.sleep(0.3)  # let mpiexec forward the line: MPI_Abort's clean-up can drop what is still in the pipe
        from mpi4py import MPI
        MPI.COMM_WORLD.Abort(code)
    sys.exit(code)


def installed(name: str) -> str | None:
    """The path of a registry model when it is installed, else None."""
    try:
        return str(resolve_model(name))
    except ModelError:
        return None


# ------------------------------------------------------------------------------------ a requested stop
# The signals that ask a job to stop: SIGINT (Ctrl-C; MPICH's mpiexec passes it on to every rank), SIGTERM (a service
# manager, or Open MPI's mpirun ending the job after a Ctrl-C: SIGTERM, then SIGKILL 1 s later) and SIGUSR1 (which
# Open MPI's mpirun passes on as it is: `pipeinfer launch` turns Ctrl-C into it there, for a stop without a deadline).
STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGUSR1)


class StopSignals:
    """A stop asked for by a signal, on every rank. Rank 0 ends what it does when `requested` (the generation's runs
    in flight are cancelled, the pipeline is shut down, exit 0); the other ranks serve on until the head shuts the
    pipeline down. Every rank tells the liveness hub at once, so ranks that the launcher ends meanwhile are not
    reported as lost."""

    def __init__(self) -> None:
        self.signal_name: str | None = None
        self.then = None  # callable() run on every stop signal, e.g. telling the HTTP server to stop

    def install(self) -> StopSignals:
        from ..wire.liveness import set_stop_hook
        for s in STOP_SIGNALS:
            signal.signal(s, self.on_signal)
        set_stop_hook(self.request)  # rank 0: a stop signal to another rank alone reaches it through the hub
        return self

    @property
    def requested(self) -> bool:
        return self.signal_name is not None

    def on_signal(self, signum: int, _frame=None) -> None:
        self.request(signal.Signals(signum).name)

    def request(self, why: str) -> None:
        """Stop: why is the signal's name (with the rank it went to when not this one)."""
        from ..wire.liveness import announce_stop
        self.signal_name = self.signal_name or why
        announce_stop(self.signal_name)
        if self.then is not None:
            self.then()
