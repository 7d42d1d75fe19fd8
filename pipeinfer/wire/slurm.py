"""Slurm: the allocation a job runs in, and the srun line that starts pipeinfer's ranks in it as a job step.

Inside an allocation (`salloc`, `sbatch`: SLURM_JOB_ID is set) `pipeinfer launch` and the supervised server start
their MPI jobs with srun, not mpiexec, as Slurm's MPI guide asks (srun places, binds, accounts for and cleans up the
ranks). The hosts and their slots are the allocation's (SLURM_JOB_NODELIST expanded by `scontrol show hostnames`,
SLURM_TASKS_PER_NODE); a hostfile, when given, only adds per-host settings (threads, weight, mem, role=draft) to the
nodes it names (launcher.py describes its format). The ranks go where the launcher puts them with mpiexec: a host's
ranks together, the draft host's last, through srun's arbitrary distribution (SLURM_HOSTFILE: one node per task, in
rank order).

srun tells each rank its place through PMI, which the MPI library that mpi4py loads must speak: MPICH (the mpich
wheel) takes PMI-2 (`--mpi=pmi2`), Open MPI PMIx (`--mpi=pmix`). With another plugin every rank starts as a job of
one process; each rank says so in one line (launcher.world_size_mismatch), naming the option.
"""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Collection, Mapping, Sequence

from ..core.cpus import expand_tasks_per_node
from .container import in_image, step_command
from .launcher import Host, job_plan, rank_hosts

SRUN_MPI = {"mpich": "pmi2", "openmpi": "pmix"}   # the srun --mpi plugin each MPI's library speaks
# The mpich wheel under srun runs on its OFI netmod: a UCX address makes PMI-1 lines long enough that Slurm's pmi2
# plugin reads them in pieces ("mpi/pmi2: value not properly terminated in client request") and MPI_Init fails;
# OFI's addresses are short (measured on the emulated cluster: UCX 0 of 6 starts, OFI 6 of 6). A value the user
# set stays.
SRUN_ENV = {"mpich": {"MPIR_CVAR_CH4_NETMOD": "ofi"}, "openmpi": {}}
TASK_FILE_ENV = "SLURM_HOSTFILE"                   # srun --distribution=arbitrary: one node per task, rank order


@dataclass(frozen=True)
class Allocation:
    job_id: str
    nodes: tuple[str, ...]   # in Slurm's order
    tasks: tuple[int, ...]   # tasks Slurm gives each node (SLURM_TASKS_PER_NODE)


def in_allocation(environ: Mapping[str, str]) -> bool:
    return bool(environ.get("SLURM_JOB_ID"))


def srun_path() -> str:
    """srun, which a Slurm job (SLURM_JOB_ID) needs to start its steps; a one-line error where it is missing."""
    srun = shutil.which("srun")
    if srun is None:
        raise RuntimeError(f"SLURM_JOB_ID={os.environ.get('SLURM_JOB_ID')} is set but srun is not on PATH")
    return srun


def hostnames(nodelist: str, scontrol: str = "scontrol") -> list[str]:
    """A Slurm node list ("h[0-2],x") as names, through `scontrol show hostnames` (Slurm's own reading of it)."""
    try:
        out = subprocess.run([scontrol, "show", "hostnames", nodelist], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired) as e:
        raise RuntimeError(f"cannot run {scontrol} show hostnames {nodelist}: {e}") from None
    if out.returncode != 0:
        raise RuntimeError(f"{scontrol} show hostnames {nodelist}: {out.stderr.strip() or out.returncode}")
    return out.stdout.split()


def allocation(environ: Mapping[str, str], names=None) -> Allocation | None:
    """The allocation this process runs in (None outside one); `names` expands a node list (default: hostnames)."""
    if not in_allocation(environ):
        return None
    nodelist = environ.get("SLURM_JOB_NODELIST") or environ.get("SLURM_NODELIST")
    if not nodelist:
        raise RuntimeError(f"SLURM_JOB_ID={environ['SLURM_JOB_ID']} is set but SLURM_JOB_NODELIST is not")
    nodes = (names or hostnames)(nodelist)
    per_node = environ.get("SLURM_TASKS_PER_NODE")
    tasks = expand_tasks_per_node(per_node) if per_node else [1] * len(nodes)
    if len(tasks) != len(nodes):
        raise RuntimeError(f"SLURM_TASKS_PER_NODE={per_node} counts {len(tasks)} nodes, "
                           f"SLURM_JOB_NODELIST={nodelist} {len(nodes)}")
    return Allocation(environ["SLURM_JOB_ID"], tuple(nodes), tuple(tasks))


def allocation_hosts(alloc: Allocation, overlay: Sequence[Host] = ()) -> list[Host]:
    """The allocation's nodes as hosts with its tasks as their slots, in its order, with the settings a hostfile
    gives the nodes it names (its slots are the allocation's; a host outside the allocation is an error). A
    role=draft host runs the draft alone: one slot."""
    settings = {h.name: h for h in overlay}
    outside = sorted(set(settings) - set(alloc.nodes))
    if outside:
        raise ValueError(f"the hostfile names {', '.join(outside)}, not in allocation {alloc.job_id} "
                         f"({', '.join(alloc.nodes)})")
    hosts = []
    for node, n_tasks in zip(alloc.nodes, alloc.tasks):
        given = settings.get(node)
        host = Host(node, n_tasks) if given is None else replace(given, slots=n_tasks)
        hosts.append(replace(host, slots=1) if host.role == "draft" else host)
    return hosts


def srun_command(hosts: Sequence[Host], np: int, mpi: str, pipeinfer_args: Sequence[str], *, task_file: str,
                 srun: str = "srun", python: str = sys.executable, extra: Sequence[str] = (),
                 accepts: Collection[str] | None = None,
                 environ: Mapping[str, str] | None = None) -> tuple[list[str], dict[str, str]]:
    """(argv, environment to add) of a job step that runs ``python -m mpi4py -m pipeinfer ARGS`` on np ranks of
    `hosts`, placed as launcher.build_command places them: one node per task written to `task_file`, in rank order.
    Each rank gets the allocation's CPUs per task (salloc/sbatch --cpus-per-task, which srun reads from the
    environment) unbound, so its threads spread over them; the step may overlap a step still ending (a job the
    supervisor re-forms, a probe of a lost node). The environment to add: the task file, and SRUN_ENV's values
    that `environ` (default: this process's) does not set."""
    if mpi not in SRUN_MPI:
        raise ValueError(f"unknown MPI {mpi!r} (expected one of {tuple(SRUN_MPI)})")
    hosts, args = job_plan(hosts, np, pipeinfer_args, accepts)
    order = rank_hosts(hosts, np)
    Path(task_file).write_text("".join(h.name + "\n" for h in order))
    cmd = [srun, f"--mpi={SRUN_MPI[mpi]}", "--distribution=arbitrary", f"--ntasks={np}",
           f"--nodes={len({h.name for h in order})}", "--kill-on-bad-exit=1", "--cpu-bind=none", "--overlap"]
    environ = os.environ if environ is None else environ
    env = {TASK_FILE_ENV: str(task_file), **{k: v for k, v in SRUN_ENV[mpi].items() if k not in environ}}
    return cmd + list(extra) + _rank_python(python, environ) + ["-m", "mpi4py", "-m", "pipeinfer"] + args, env


def _rank_python(python: str, environ: Mapping[str, str]) -> list[str]:
    """What a task runs as the rank's Python: `python`, or the image's in a container (launch --image)."""
    return step_command(environ) if in_image(environ) else [python]


def srun_probe(host: str, python: str = sys.executable, srun: str = "srun") -> list[str]:
    """A one-task step on `host` that runs `pipeinfer --version` (no MPI): whether a lost node answers again."""
    return [srun, "--mpi=none", f"--nodelist={host}", "--nodes=1", "--ntasks=1", "--overlap",
            *_rank_python(python, os.environ), "-m", "pipeinfer", "--version"]


def srun_each_node(alloc: Allocation, pipeinfer_args: Sequence[str], python: str = sys.executable,
                   srun: str = "srun") -> list[str]:
    """A step of one task on every node of the allocation that runs ``python -m pipeinfer ARGS`` without MPI
    (`doctor`'s probe): each task has the CPUs a rank there would have (the job's on its node, unbound), and a
    node that fails leaves the others' answers."""
    n = len(alloc.nodes)
    return [srun, "--mpi=none", f"--nodes={n}", f"--ntasks={n}", "--ntasks-per-node=1", "--cpu-bind=none",
            "--overlap", "--kill-on-bad-exit=0", python, "-m", "pipeinfer", *pipeinfer_args]


def srun_world_mismatch(world_size: int, library: str, environ: Mapping[str, str]) -> str | None:
    """One line when srun started more tasks than MPI sees: the ranks came up as jobs of one process each, since
    srun's PMI plugin is not one the MPI library speaks."""
    launched = environ.get("SLURM_STEP_NUM_TASKS") if environ.get("SLURM_STEP_ID") not in (None, "batch") else None
    if not launched or not launched.isdigit() or int(launched) == world_size:
        return None
    wanted = SRUN_MPI["openmpi" if "open mpi" in library.lower() else "mpich"]
    return (f"srun started {launched} tasks but MPI ({library}) sees {world_size}: every task runs alone; "
            f"start them with srun --mpi={wanted} (or `pipeinfer launch`, which does; `srun --mpi=list` shows "
            f"this Slurm's plugins)")

