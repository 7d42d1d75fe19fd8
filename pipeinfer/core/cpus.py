"""How many threads a rank decodes on when `-t` does not say: the physical cores it may run on, shared with the
ranks of its host that may run on the same cores; inside a Slurm job step that asked for CPUs, the cores Slurm gave
the task.

A host's core count is not `os.cpu_count()`: that counts the whole machine's logical CPUs, hyperthreads included,
while a process under Slurm (task/affinity, task/cgroup), in a container or under `taskset` may run on fewer
(`os.sched_getaffinity`), and llama.cpp's own default is the physical cores (common.cpp
`cpu_get_num_physical_cores`): two hyperthreads of one core share its SIMD units and gain little on a decode.
"""
from __future__ import annotations

import os
import re
from collections.abc import Iterable, Mapping
from pathlib import Path

SYSFS_CPU = Path("/sys/devices/system/cpu")


def affinity() -> frozenset[int]:
    """The logical CPUs this process may run on."""
    try:
        return frozenset(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return frozenset(range(os.cpu_count() or 1))


def physical_cores(cpus: Iterable[int], sysfs: Path = SYSFS_CPU) -> int:
    """The physical cores among logical CPUs `cpus` (hyperthreads of one core count once), from each CPU's
    topology/core_cpus_list (its core's siblings); each CPU counts as a core where sysfs does not say."""
    cores: set[str] = set()
    for cpu in cpus:
        topo = sysfs / f"cpu{cpu}" / "topology"
        try:
            siblings = (topo / "core_cpus_list").read_text().strip()
        except OSError:
            try:
                siblings = (topo / "thread_siblings_list").read_text().strip()
            except OSError:
                siblings = f"cpu{cpu}"
        cores.add(siblings)
    return max(1, len(cores))


def slurm_task_cpus(env: Mapping[str, str]) -> int | None:
    """The CPUs Slurm gave each task of this job step (SLURM_CPUS_PER_TASK, set only when the job asked for them)."""
    text = env.get("SLURM_CPUS_PER_TASK", "").strip()
    return int(text) if text.isdigit() and int(text) > 0 else None


def expand_tasks_per_node(text: str) -> list[int]:
    """Slurm's compact per-node counts (SLURM_TASKS_PER_NODE, SLURM_STEP_TASKS_PER_NODE), one per node:
    "2(x3),1" -> [2, 2, 2, 1]."""
    counts: list[int] = []
    for part in filter(None, (p.strip() for p in text.split(","))):
        m = re.fullmatch(r"(\d+)(?:\(x(\d+)\))?", part)
        if m is None:
            raise ValueError(f"SLURM_TASKS_PER_NODE={text!r}: cannot read {part!r}")
        counts += [int(m.group(1))] * int(m.group(2) or 1)
    return counts


def slurm_node_sharing(mine: frozenset[int], env: Mapping[str, str]) -> tuple[int, int] | None:
    """(the tasks of this job step on this node, this task's place among them) when they may all run on the
    node's CPUs (this task's set is every CPU Slurm gave the node: srun --cpu-bind=none, as `launch` starts them);
    None outside a step or when Slurm bound each task to CPUs of its own."""
    try:
        counts = expand_tasks_per_node(env.get("SLURM_STEP_TASKS_PER_NODE", ""))
        node, local, on_node = int(env["SLURM_NODEID"]), int(env["SLURM_LOCALID"]), int(env["SLURM_CPUS_ON_NODE"])
    except (KeyError, ValueError):
        return None
    if node >= len(counts) or len(mine) < on_node:
        return None
    return counts[node], local


def sharing(mine: frozenset[int], host_sets: list[frozenset[int]], my_index: int) -> tuple[int, int]:
    """(how many ranks of this host may run on some of my CPUs, my place among them): ranks bound to cores of
    their own (mpirun --bind-to core, srun's task affinity) share nothing; ranks free on the whole host share it.
    host_sets: each rank's CPU set on this host, in rank order; my_index: mine among them."""
    overlapping = [i for i, cpus in enumerate(host_sets) if cpus & mine]
    return len(overlapping), overlapping.index(my_index)


def share(cores: int, n_sharing: int, index: int) -> int:
    """`cores` dealt among n_sharing ranks, the first cores % n_sharing one more; at least 1 each."""
    return max(1, cores // n_sharing + (1 if index < cores % n_sharing else 0))


def default_threads(mine: frozenset[int], host_sets: list[frozenset[int]], my_index: int,
                    env: Mapping[str, str], sysfs: Path = SYSFS_CPU) -> int:
    """A rank's threads when -t does not say. With SLURM_CPUS_PER_TASK: those CPUs as physical cores (a node with
    2 hyperthreads per core gives 16 cores for 32 CPUs). Otherwise the physical cores of its CPU set, shared with
    the ranks of its host whose sets overlap it (MPI's view, else the Slurm step's)."""
    cores = physical_cores(mine, sysfs)
    per_core = max(1, len(mine) // cores)
    task_cpus = slurm_task_cpus(env)
    if task_cpus is not None:
        return max(1, task_cpus // per_core)
    n, index = sharing(mine, host_sets, my_index)
    # MPI does not always see the ranks of a node as sharing memory (a network module without shared memory);
    # within a Slurm step, Slurm says how many tasks run on this node
    step = slurm_node_sharing(mine, env) if n == 1 else None
    if step is not None:
        n, index = step
    return share(cores, n, index)

