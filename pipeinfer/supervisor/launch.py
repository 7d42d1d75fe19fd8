"""The launcher's command lines the supervisor runs: the pipeline's job (every rank `pipeinfer attach SOCKET`, rank 0
attaching to the supervisor there) and, for --rejoin, a one-rank probe (`pipeinfer --version`) of a lost host.
The files they need (the hostfile, rank 0's socket) live in the supervisor's work directory.
"""
from __future__ import annotations

import os
import shlex
import subprocess

from .placement import Placement, on_this_machine

PROBE_TIMEOUT_S = 20.0  # a launch of `pipeinfer --version` on a host that takes longer: the host is still away


def rank0_socket(work_dir: str) -> str:
    """Where the job's rank 0 attaches: a Unix socket in the work directory."""
    return os.path.join(work_dir, "rank0.sock")


def launch_command(slots: list[str], pipeinfer_args: list[str], hostfile: str,
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


def job_command(hosts: list[str], work_dir: str, environ) -> tuple[list[str], dict[str, str]]:
    """The launcher's command line of the pipeline's job, one rank per host of `hosts` (its hostfile written in
    work_dir), every rank attached through rank 0's socket there; the variables it needs besides `environ`."""
    from ..wire.container import with_volumes
    image = with_volumes(environ, [work_dir])  # rank 0 in the image reaches the socket there
    cmd, more = launch_command(hosts, ["attach", rank0_socket(work_dir)], os.path.join(work_dir, "hosts.txt"),
                               {**environ, **image})
    return cmd, {**image, **more}


def first_job_command(where: Placement, work_dir: str, environ) -> tuple[list[str], dict[str, str]]:
    """The launcher's command line of the server's first job on `where` (its hostfile written in work_dir) in the
    server's environment: what `launch --dry-run -- serve` shows."""
    return job_command(where.slots + ([where.draft.name] if where.draft else []), work_dir, environ)


def host_answers(host: str, work_dir: str) -> bool:
    """Whether `host` runs pipeinfer again: a one-rank launch of `pipeinfer --version` there succeeds in time
    (this machine always does)."""
    if on_this_machine(host):
        return True
    from ..wire.slurm import in_allocation, srun_probe
    cmd, env = (srun_probe(host), {}) if in_allocation(os.environ) else \
        launch_command([host], ["--version"], os.path.join(work_dir, "probe-hosts.txt"))
    probe = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                             start_new_session=True, env={**os.environ, **env})
    try:
        return probe.wait(timeout=PROBE_TIMEOUT_S) == 0
    except subprocess.TimeoutExpired:
        os.killpg(probe.pid, 9)  # the launcher and what it started (its proxies)
        probe.wait()
        return False
