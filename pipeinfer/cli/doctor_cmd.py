"""`pipeinfer doctor --hostfile HOSTS [-m MODEL]`: every host checked before a job, in parallel, one line per problem
(wire/doctor.py has the checks); exit 1 when a job would fail."""
from __future__ import annotations

import json
import os
import shlex
import subprocess
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import click

from ..wire.doctor import MEM_MARGIN, HostFacts, Need, facts, links_main, probe_main, problems
from ..wire.launcher import (Host, build_command, choose_launcher, group_hosts, host_settings, merged_slots,
                             mpi4py_library, parse_hostfile)

PROBE_TIMEOUT_S = 30.0
PORT_RANGE_VARS = ("MPIEXEC_PORT_RANGE", "MPICH_PORT_RANGE")  # MPICH's Hydra binds its control port in that range
LINKS_TIMEOUT_S = 120.0


@click.command("doctor")
@click.option("--hostfile", "hostfile_path", default=None, type=click.Path(exists=True, dir_okay=False),
              help="The hosts to check (as `pipeinfer launch` takes them).")
@click.option("-m", "--model", default=None, help="The target GGUF: check each host's memory and disk for its share.")
@click.option("--mpi-arg", "mpi_args", multiple=True, metavar="ARG", help="Extra option for mpiexec, repeatable.")
@click.option("--probe", is_flag=True, hidden=True, help="(on each host) print this host's facts")
@click.option("--links", is_flag=True, hidden=True, help="(under MPI) measure rank 0's link to each rank")
def doctor_cmd(hostfile_path, model, mpi_args, probe, links) -> None:
    """Check every host of HOSTFILE before a job: reachable, the same pipeinfer and llama.cpp build, memory and
    disk for its share of MODEL, its clock, and MPI across all of them with each link's speed. One line per
    problem; exit 1 when a job would fail."""
    from ..ranks.handshake import build_id
    if probe:
        return probe_main(build_id())
    if links:
        return links_main()
    if hostfile_path is None:
        raise click.UsageError("--hostfile HOSTS: which hosts to check")
    try:
        hosts = group_hosts(parse_hostfile(hostfile_path))
        library = mpi4py_library()
        mpiexec = choose_launcher(library)
    except (ValueError, RuntimeError, OSError) as e:
        raise click.ClickException(str(e)) from None
    extra = (["--allow-run-as-root"] if library.kind == "openmpi" and os.geteuid() == 0 else []) + [
        *shlex.split(os.environ.get("PIPEINFER_MPI_ARGS", "")), *mpi_args]
    names = [name for name, _ in merged_slots(hosts)]
    here = facts(build_id())
    # mpiexecs started at once in a pinned port range (docs/cluster.md, ports) race for its ports: Hydra's "unable
    # to create PMI port" would name a healthy host unreachable; so there the probes go one at a time
    pinned = any(os.environ.get(v) for v in PORT_RANGE_VARS)
    with ThreadPoolExecutor(max_workers=1 if pinned else min(16, len(names))) as pool:
        probed = dict(zip(names, pool.map(lambda n: _probe(n, library.kind, mpiexec, extra), names)))
    needs = _needs(hosts, model) if model else {}
    found: list[str] = []
    for name in names:
        got, why, rtt = probed[name]
        found += problems(name, got, why, here, needs.get(name), _declared_mem(hosts, name), rtt)
        if got is not None:
            click.echo(f"{name}: pipeinfer {got.pipeinfer}, llama-cpp-python {got.llama_cpp}, {got.cpus} CPUs, "
                       f"{got.mem_available / 2**30:.1f} GiB available, {got.disk_free / 2**30:.1f} GiB free disk")
    reachable = [n for n in names if probed[n][0] is not None]
    if len(reachable) > 1:
        link_lines, why = _links(reachable, library.kind, mpiexec, extra)
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


def _job(names: list[str], args: list[str], mpi: str, mpiexec: str, extra: list[str],
         timeout: float) -> tuple[list[dict], str | None, float]:
    """`pipeinfer ARGS` on one rank per host through the launcher: (its JSON lines, why it failed or None, seconds)."""
    fd, hostfile = tempfile.mkstemp(prefix="pipeinfer-doctor-", suffix=".txt")
    os.close(fd)
    try:
        cmd = build_command([Host(n) for n in names], len(names), mpi, args, mpiexec=mpiexec, extra=extra,
                            hostfile=hostfile)
        t0 = time.time()
        p = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, stdin=subprocess.DEVNULL)
    except subprocess.TimeoutExpired:
        return [], f"no answer in {timeout:.0f} s (ssh, or a host is down)", 0.0
    finally:
        Path(hostfile).unlink(missing_ok=True)
    lines = [json.loads(ln) for ln in p.stdout.splitlines() if ln.startswith("{")]
    if p.returncode != 0:
        tail = [ln.strip() for ln in (p.stderr + p.stdout).splitlines() if ln.strip() and not ln.startswith("{")]
        return lines, tail[-1] if tail else f"the launcher exited with {p.returncode}", 0.0
    return lines, None, time.time() - t0


def _probe(name: str, mpi: str, mpiexec: str, extra: list[str]) -> tuple[HostFacts | None, str | None, float]:
    """(the host's facts, None, round trip) or (None, why not, 0)."""
    lines, why, rtt = _job([name], ["doctor", "--probe"], mpi, mpiexec, extra, PROBE_TIMEOUT_S)
    if why is None and not lines:
        why = "the probe printed nothing"
    return (None, why, 0.0) if why else (HostFacts(**lines[0]), None, rtt)


def _links(names: list[str], mpi: str, mpiexec: str, extra: list[str]) -> tuple[list[dict], str | None]:
    links, why, _ = _job(names, ["doctor", "--links"], mpi, mpiexec, extra, LINKS_TIMEOUT_S)
    if why is None and len(links) != len(names) - 1:
        why = f"{len(links)} of {len(names) - 1} links measured"
    return links, why


def _needs(hosts: list[Host], model: str) -> dict[str, Need]:
    """Each host's share of the model as `launch` would split it (weight=, else evenly over the ranks)."""
    from ..engine.models import resolve_model
    size = Path(resolve_model(model)).stat().st_size
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
