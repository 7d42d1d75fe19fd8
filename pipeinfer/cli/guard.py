"""The error rule on every rank: a user's mistake is one line and a non-zero exit on every rank (MPI_Abort
under mpiexec, so no rank hangs); a bug shows its traceback and takes every rank down the same way."""
from __future__ import annotations

import os
import sys
import time

import click

from ..core.errors import UserError
from ..core.protocol import ProtocolError
from ..engine.models import ModelError, resolve_model
from ..engine.stagefile import StageFileError


def mpi_size() -> int:
    # launched by mpiexec? (MPICH/Hydra: PMI_SIZE, Open MPI: OMPI_COMM_WORLD_SIZE)
    for var in ("PMI_SIZE", "OMPI_COMM_WORLD_SIZE", "PMIX_SIZE"):
        if os.environ.get(var):
            return int(os.environ[var])
    return 1


def mpi_rank() -> int:
    # this process's rank under mpiexec, without initialising MPI (MPICH/Hydra: PMI_RANK; Open MPI)
    return int(os.environ.get("PMI_RANK", os.environ.get("OMPI_COMM_WORLD_RANK", "0")))


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
