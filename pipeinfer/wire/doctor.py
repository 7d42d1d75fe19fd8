"""`pipeinfer doctor`: the hosts of a hostfile, or the nodes of the Slurm allocation it runs in, checked before a job,
each problem in one line.

Every host runs a probe as a job would reach it (`doctor --probe`: what it has, `HostFacts`, as a JSON line): a
one-rank job through the MPI's launcher per host of a hostfile, or inside an allocation one srun step of a task per
node. Then one job over all hosts measures rank 0's link to each of them (`doctor --links`), which also proves
that MPI's ports are open between them. `problems` compares what came back with this host and with what the model
asks of each host; the command exits 1 when a job would fail.
"""
from __future__ import annotations

import json
import os
import platform
import shutil
import sys
import time
from dataclasses import asdict, dataclass, fields
from importlib import metadata
from pathlib import Path

from ..core.files import node_cache_dir, stage_cache_dir
from ..core.stagecache import weights_dir

GiB = 2 ** 30
CLOCK_SKEW_S = 2.0        # more than this between two hosts' clocks: their logs cannot be read side by side
MEM_MARGIN = 1.15         # a stage's weights plus its KV cache and buffers, roughly


@dataclass(frozen=True)
class HostFacts:
    host: str
    pipeinfer: str          # version
    build: str              # ranks/handshake.build_id: version, protocol, a hash of the sources, llama-cpp-python's
    where: str              # the package's folder
    llama_cpp: str          # llama-cpp-python's version (each host builds llama.cpp for its own CPU)
    python: str
    mem_available: int      # bytes (MemAvailable)
    disk_free: int          # bytes free where stage files go (the stage and weights caches)
    clock: float            # time.time() when the probe ran
    cpus: int               # the machine's (os.cpu_count)
    task_cpus: int = 0      # CPUs this process may run on (its affinity: what Slurm, a cgroup or taskset left it)
    slurm_cpus: int = 0     # CPUs Slurm gave the task (SLURM_CPUS_PER_TASK, else SLURM_CPUS_ON_NODE; 0: no Slurm)
    slurm_mem: int = 0      # bytes the Slurm job may use on this node (SLURM_MEM_PER_NODE; 0: not limited)
    slurm_node: str = ""    # SLURMD_NODENAME: the node's name in the allocation
    cache: str = ""         # where stage files and received weights go (node-local scratch under Slurm)
    model: str = ""         # the model asked of it: "" (none asked), "readable", or why it cannot be read


def facts(build: str, model: str | None = None) -> HostFacts:
    """This host's facts (the probe); `build` as ranks/handshake.build_id gives it; `model`: a GGUF whose
    readability to check."""
    from .. import __version__
    from .hosts import host_name
    mem = 0
    try:
        for line in open("/proc/meminfo"):
            if line.startswith("MemAvailable:"):
                mem = int(line.split()[1]) * 1024
    except OSError:
        pass
    def free(folder: Path) -> int:  # where the folder is, or would be made
        while not folder.exists() and folder != folder.parent:
            folder = folder.parent
        return shutil.disk_usage(folder).free
    try:
        llama = metadata.version("llama_cpp_python")
    except metadata.PackageNotFoundError:
        llama = "missing"
    env = os.environ
    slurm_cpus = env.get("SLURM_CPUS_PER_TASK") or env.get("SLURM_CPUS_ON_NODE") or "0"
    return HostFacts(host_name(), __version__, build, os.path.dirname(os.path.dirname(os.path.abspath(__file__))), llama,
                     platform.python_version(), mem, min(free(stage_cache_dir()), free(weights_dir())), time.time(),
                     os.cpu_count() or 1, len(os.sched_getaffinity(0)), int(slurm_cpus) if slurm_cpus.isdigit() else 0,
                     int(env.get("SLURM_MEM_PER_NODE", "0") or 0) * 2 ** 20, env.get("SLURMD_NODENAME", ""),
                     str(node_cache_dir()), model_access(model) if model else "")


def model_access(path: str) -> str:
    """"readable" when this process can read the model's first bytes, else why not (one line)."""
    try:
        with open(path, "rb") as f:
            f.read(4)
        return "readable"
    except OSError as e:
        return e.strerror or str(e)


def facts_of(line: dict) -> HostFacts:
    """A probe's JSON line as HostFacts (fields another version of pipeinfer added are left out)."""
    names = {f.name for f in fields(HostFacts)}
    return HostFacts(**{k: v for k, v in line.items() if k in names})


def probe_main(build: str, model: str | None = None) -> None:
    print(json.dumps(asdict(facts(build, model))), flush=True)


@dataclass(frozen=True)
class Need:
    """What a job asks of one host: memory for its ranks' share of the weights, disk for their stage files."""
    mem: int
    disk: int


def problems(host: str, got: HostFacts | None, why_not: str | None, here: HostFacts, need: Need | None,
             mem_declared_gib: float | None = None, *, first: bool = False,
             window: tuple[float, float] | None = None) -> list[str]:
    """One line per problem of `host` (`got`: its probe's facts; `why_not`: why the probe failed; `first`: rank 0's
    host, which must read the model; `window`: this host's clock when the probe was sent and when it came back: the
    host's clock must read within it, give or take CLOCK_SKEW_S, however long a loaded machine took)."""
    if got is None:
        return [f"{host}: unreachable: {why_not}"]
    out = []
    if first and got.model not in ("", "readable"):
        out.append(f"{host}: cannot read the model: {got.model} (rank 0 runs here and reads it)")
    if min(n for n in (got.task_cpus, got.slurm_cpus, got.cpus) if n) == 1 < got.cpus:
        out.append(f"{host}: Slurm gave its task 1 CPU of {got.cpus}: ask for the node's cores (sbatch or salloc "
                   "--exclusive, or --cpus-per-task=N)" if got.slurm_cpus else
                   f"{host}: this process may run on 1 CPU of {got.cpus} (taskset or a cgroup)")
    if got.build != here.build:
        out.append(f"{host}: another build: {got.build} (here {here.build}; install the same on every host)")
    if got.where != here.where:
        out.append(f"{host}: pipeinfer is at {got.where} (here {here.where}; every host needs it at the same path)")
    if got.python.rsplit(".", 1)[0] != here.python.rsplit(".", 1)[0]:
        out.append(f"{host}: Python {got.python} (here {here.python})")
    if need is not None:
        have = min(got.mem_available, int(mem_declared_gib * GiB)) if mem_declared_gib else got.mem_available
        if need.mem > have:
            out.append(f"{host}: not enough memory: its share needs {need.mem / GiB:.1f} GiB, it has "
                       f"{have / GiB:.1f} GiB available")
        elif got.slurm_mem and need.mem > got.slurm_mem:
            out.append(f"{host}: not enough memory in the Slurm job: its share needs {need.mem / GiB:.1f} GiB, the "
                       f"job may use {got.slurm_mem / GiB:.1f} GiB on a node (sbatch --mem=0: all of it)")
        if need.disk > got.disk_free:
            out.append(f"{host}: not enough disk for its stage files: {need.disk / GiB:.1f} GiB needed, "
                       f"{got.disk_free / GiB:.1f} GiB free under its pipeinfer cache" +
                       (f" ({got.cache})" if got.cache else ""))
    skew = max(0.0, window[0] - got.clock, got.clock - window[1]) if window else 0.0
    if skew > CLOCK_SKEW_S:
        out.append(f"{host}: its clock is {skew:.1f} s off this host's (run NTP: logs and timings compare badly)")
    return out


def links_main() -> None:
    """Under MPI, every host a rank: rank 0 measures its link to each other rank in turn (one JSON line each)."""
    import numpy as np
    from mpi4py import MPI

    from .hosts import host_name
    from .netprobe import _one_way_s
    comm = MPI.COMM_WORLD
    rank, hosts = comm.Get_rank(), comm.allgather(host_name())
    small, big = np.zeros(8, dtype=np.uint8), np.zeros(2 ** 20, dtype=np.uint8)
    for peer in range(1, comm.Get_size()):
        if rank in (0, peer):
            other = peer if rank == 0 else 0
            latency = _one_way_s(comm, other, small, 0.2, 10, 500)
            one_way = _one_way_s(comm, other, big, 0.5, 3, 100)
            if rank == 0:
                bits = big.nbytes * 8 / max(one_way - latency, one_way * 0.05)
                print(json.dumps({"from": hosts[0], "to": hosts[peer], "bandwidth_bit_s": bits,
                                  "latency_s": latency}), flush=True)
        comm.Barrier()
    sys.stdout.flush()
