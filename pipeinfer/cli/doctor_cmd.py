"""`pipeinfer doctor --hostfile HOSTS [-m MODEL]`: every host checked before a job, in parallel, one line per problem
(wire/doctor.py has the checks); exit 1 when a job would fail. Inside a Slurm allocation without --hostfile, the
allocation's nodes, probed by one srun step (a task per node) instead of ssh."""
from __future__ import annotations

import json
import os
import shlex
import subprocess
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Callable

import click

from ..wire.doctor import MEM_MARGIN, HostFacts, Need, facts, facts_of, links_main, probe_main, problems
from ..wire.launcher import (Host, build_command, choose_launcher, group_hosts, host_settings, merged_slots,
                             launcher_env, mpi4py_library, parse_hostfile)
from ..wire.slurm import Allocation, allocation, allocation_hosts, srun_command, srun_each_node, srun_path

PROBE_TIMEOUT_S = 30.0
SRUN_PROBE_TIMEOUT_S = 120.0   # one step over every node: Python and pipeinfer imported on each (from NFS, often)
PORT_RANGE_VARS = ("MPIEXEC_PORT_RANGE", "MPICH_PORT_RANGE")  # MPICH's Hydra binds its control port in that range
LINKS_TIMEOUT_S = 120.0

# host -> (its facts, why not, this host's clock when its probe was sent and when it came back)
Probed = dict[str, tuple[HostFacts | None, str | None, tuple[float, float]]]
# a job of one rank per host that runs `pipeinfer ARGS`: (names, args, its hostfile) -> (argv, environment to add)
JobCommand = Callable[[list[str], list[str], str], tuple[list[str], dict[str, str]]]


@click.command("doctor")
@click.option("--hostfile", "hostfile_path", default=None, type=click.Path(exists=True, dir_okay=False),
              help="The hosts to check (as `pipeinfer launch` takes them) [default inside a Slurm allocation: its "
                   "nodes, through srun].")
@click.option("-m", "--model", default=None, help="The target GGUF: check each host's memory and disk for its share.")
@click.option("--mpi-arg", "mpi_args", multiple=True, metavar="ARG", help="Extra option for mpiexec, repeatable.")
@click.option("--probe", is_flag=True, hidden=True, help="(on each host) print this host's facts")
@click.option("--links", is_flag=True, hidden=True, help="(under MPI) measure rank 0's link to each rank")
def doctor_cmd(hostfile_path, model, mpi_args, probe, links) -> None:
    """Check every host of HOSTFILE (inside a Slurm allocation: its nodes) before a job: reachable, the same
    pipeinfer and llama.cpp build, the CPUs it may use, memory and disk for its share of MODEL (which rank 0's host
    must read), its clock, and MPI across all of them with each link's speed. One line per problem; exit 1 when a
    job would fail."""
    from ..ranks.handshake import build_id
    if probe:
        return probe_main(build_id(), model)
    if links:
        return links_main()
    try:
        slurm = allocation(os.environ) if hostfile_path is None else None
        if hostfile_path is None and slurm is None:
            raise click.UsageError("--hostfile HOSTS: which hosts to check (inside a Slurm allocation: its nodes)")
        hosts = allocation_hosts(slurm) if slurm else group_hosts(parse_hostfile(hostfile_path))
        library = mpi4py_library()
        job = _srun_job(library.kind, mpi_args) if slurm else _mpiexec_job(library, mpi_args)
    except (ValueError, RuntimeError, OSError) as e:
        raise click.ClickException(str(e)) from None
    names = [name for name, _ in merged_slots(hosts)]
    path = str(_model_path(model)) if model else None
    probe_args = ["doctor", "--probe"] + (["-m", path] if path else [])
    here = facts(build_id())
    if slurm:
        probed = _probe_allocation(slurm, probe_args)
    else:
        # mpiexecs started at once in a pinned port range (docs/cluster.md, ports) race for its ports: Hydra's
        # "unable to create PMI port" would name a healthy host unreachable; so there the probes go one at a time
        pinned = any(os.environ.get(v) for v in PORT_RANGE_VARS)
        with ThreadPoolExecutor(max_workers=1 if pinned else min(16, len(names))) as pool:
            probed = dict(zip(names, pool.map(lambda n: _probe(n, probe_args, job), names)))
    needs = _needs(hosts, path) if path else {}
    found: list[str] = []
    for name in names:
        got, why, probe_window = probed[name]
        found += problems(name, got, why, here, needs.get(name), _declared_mem(hosts, name),
                          first=name == names[0], window=probe_window)
        if got is not None:
            click.echo(_summary(name, got))
    reachable = [n for n in names if probed[n][0] is not None]
    if len(reachable) > 1:
        link_lines, why = _links(reachable, job)
        for link in link_lines:
            click.echo(f"link {link['from']} -> {link['to']}: {link['bandwidth_bit_s'] / 1e6:.0f} Mbit/s, "
                       f"{link['latency_s'] * 1e6:.0f} us one way")
        if why:
            found.append(f"MPI cannot run a job across {', '.join(reachable)} (ports blocked between them?): {why}")
    for line in found:
        click.echo(f"problem: {line}")
    if found:
        raise SystemExit(f"doctor: {len(found)} problem(s): a job on these hosts would fail")
    click.echo(f"doctor: {len(names)} host(s), no problem found")


def _summary(name: str, got: HostFacts) -> str:
    """The host's line: versions, the CPUs its task may use (of the machine's), memory, disk, the model."""
    cpus = f"{got.cpus} CPUs" if got.task_cpus in (0, got.cpus) else f"{got.task_cpus} of {got.cpus} CPUs"
    slurm = f" (Slurm gave the task {got.slurm_cpus})" if got.slurm_cpus else ""
    where = f" in {got.cache}" if got.cache else ""
    model = {"": "", "readable": ", the model readable"}.get(got.model, ", the model not readable here (its stage "
                                                                          "travels)")
    return (f"{name}: pipeinfer {got.pipeinfer}, llama-cpp-python {got.llama_cpp}, {cpus}{slurm}, "
            f"{got.mem_available / 2**30:.1f} GiB available, {got.disk_free / 2**30:.1f} GiB free disk{where}{model}")


def _mpiexec_job(library, mpi_args) -> JobCommand:
    mpiexec = choose_launcher(library)
    extra = (["--allow-run-as-root"] if library.kind == "openmpi" and os.geteuid() == 0 else []) + [
        *shlex.split(os.environ.get("PIPEINFER_MPI_ARGS", "")), *mpi_args]

    def command(names: list[str], args: list[str], hostfile: str) -> tuple[list[str], dict[str, str]]:
        return build_command([Host(n) for n in names], len(names), library.kind, args, mpiexec=mpiexec, extra=extra,
                             hostfile=hostfile), {}
    return command


def _srun_job(mpi: str, mpi_args) -> JobCommand:
    srun = srun_path()

    def command(names: list[str], args: list[str], task_file: str) -> tuple[list[str], dict[str, str]]:
        return srun_command([Host(n) for n in names], len(names), mpi, args, task_file=task_file, srun=srun,
                            extra=list(mpi_args))
    return command


def _job(names: list[str], args: list[str], job: JobCommand, timeout: float) -> tuple[list[dict], str | None]:
    """`pipeinfer ARGS` on one rank per host through the launcher: (its JSON lines, why it failed or None)."""
    fd, hostfile = tempfile.mkstemp(prefix="pipeinfer-doctor-", suffix=".txt")
    os.close(fd)
    try:
        cmd, env = job(names, args, hostfile)
        p = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, stdin=subprocess.DEVNULL,
                           env=launcher_env({**os.environ, **env}))
    except subprocess.TimeoutExpired:
        return [], f"no answer in {timeout:.0f} s (ssh, or a host is down)"
    finally:
        Path(hostfile).unlink(missing_ok=True)
    lines = [json.loads(ln) for ln in p.stdout.splitlines() if ln.startswith("{")]
    if p.returncode != 0:
        return lines, _last_words(p) or f"the launcher exited with {p.returncode}"
    return lines, None


def _last_words(p: subprocess.CompletedProcess) -> str | None:
    tail = [ln.strip() for ln in (p.stderr + p.stdout).splitlines() if ln.strip() and not ln.startswith("{")]
    return tail[-1] if tail else None


def _probe(name: str, args: list[str], job: JobCommand) -> tuple[HostFacts | None, str | None, tuple[float, float]]:
    """(the host's facts, None, this host's clock when the probe was sent and when it came back) or (None, why not,
    that window): the host's clock must read within the window (a loaded machine only widens it)."""
    t0 = time.time()
    lines, why = _job([name], args, job, PROBE_TIMEOUT_S)
    window = (t0, time.time())
    if why is None and not lines:
        why = "the probe printed nothing"
    return (None, why, window) if why else (facts_of(lines[0]), None, window)


def _probe_allocation(alloc: Allocation, args: list[str]) -> Probed:
    """Every node of the allocation probed by one srun step (a task per node): node -> (facts, why not, the step's
    window)."""
    t0 = time.time()
    try:
        p = subprocess.run(srun_each_node(alloc, args, srun=srun_path()), capture_output=True, text=True,
                           timeout=SRUN_PROBE_TIMEOUT_S, stdin=subprocess.DEVNULL)
        out, why = p.stdout, (_last_words(p) if p.returncode != 0 else None)
    except subprocess.TimeoutExpired as e:
        out = e.stdout.decode(errors="replace") if isinstance(e.stdout, bytes) else (e.stdout or "")
        why = f"no answer in {SRUN_PROBE_TIMEOUT_S:.0f} s"
    got = {}
    for line in out.splitlines():
        if line.startswith("{"):
            f = facts_of(json.loads(line))
            got[f.slurm_node or f.host] = f
    why = why or "srun: its task printed nothing"
    why = why if why.startswith("srun") else f"srun: {why}"
    window = (t0, time.time())
    return {n: (got[n], None, window) if n in got else (None, why, window) for n in alloc.nodes}


def _links(names: list[str], job: JobCommand) -> tuple[list[dict], str | None]:
    links, why = _job(names, ["doctor", "--links"], job, LINKS_TIMEOUT_S)
    if why is None and len(links) != len(names) - 1:
        why = f"{len(links)} of {len(names) - 1} links measured"
    return links, why


def _model_path(model: str) -> Path:
    from ..engine.models import resolve_model   # ModelError: one line
    return Path(resolve_model(model)).absolute()


def _needs(hosts: list[Host], path: str) -> dict[str, Need]:
    """Each host's share of the model as `launch` would split it (weight=, else evenly over the ranks)."""
    size = Path(path).stat().st_size
    stages = [h for h in hosts if h.role != "draft"]
    n = sum(h.slots for h in stages)
    split = host_settings(stages, n).get("layer_split")
    fractions = [float(f) for f in split.split(",")] if split else [1 / n] * n
    per_host: dict[str, float] = {}
    ranks = [h.name for h in stages for _ in range(h.slots)]
    for name, frac in zip(ranks, fractions):
        per_host[name] = per_host.get(name, 0.0) + frac
    return {name: Need(int(frac * size * MEM_MARGIN), int(frac * size)) for name, frac in per_host.items()}


def _declared_mem(hosts: list[Host], name: str) -> float | None:
    return next((h.mem for h in hosts if h.name == name and h.mem), None)
