"""`pipeinfer doctor`: the hosts of a hostfile checked before a job, each problem in one line.

Every host runs a one-rank probe through the MPI's launcher, as a job would reach it (`doctor --probe`: what it
has, `HostFacts`, as a JSON line), and then one job over all hosts measures rank 0's link to each of them
(`doctor --links`), which also proves that MPI's ports are open between them. `problems` compares what came back
with this host and with what the model asks of each host; the command exits 1 when a job would fail.
"""
from __future__ import annotations

import json
import os
import platform
import shutil
import sys
import time
from dataclasses import asdict, dataclass
from importlib import metadata
from pathlib import Path

from ..core.files import stage_cache_dir
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
    cpus: int


def facts(build: str) -> HostFacts:
    """This host's facts (the probe); `build` as ranks/handshake.build_id gives it."""
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
    return HostFacts(host_name(), __version__, build, os.path.dirname(os.path.dirname(os.path.abspath(__file__))), llama,
                     platform.python_version(), mem, min(free(stage_cache_dir()), free(weights_dir())), time.time(),
                     os.cpu_count() or 1)


def probe_main(build: str) -> None:
    print(json.dumps(asdict(facts(build))), flush=True)


@dataclass(frozen=True)
class Need:
    """What a job asks of one host: memory for its ranks' share of the weights, disk for their stage files."""
    mem: int
    disk: int


def problems(host: str, got: HostFacts | None, why_not: str | None, here: HostFacts, need: Need | None,
             mem_declared_gib: float | None = None, rtt_s: float = 0.0) -> list[str]:
    """One line per problem of `host` (`got`: its probe's facts; `why_not`: why the probe failed)."""
    if got is None:
        return [f"{host}: unreachable: {why_not}"]
    out = []
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
        if need.disk > got.disk_free:
            out.append(f"{host}: not enough disk for its stage files: {need.disk / GiB:.1f} GiB needed, "
                       f"{got.disk_free / GiB:.1f} GiB free under its pipeinfer cache")
    skew = abs(got.clock + rtt_s / 2 - here.clock)
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
