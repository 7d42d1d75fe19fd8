"""A rank's default threads (core/cpus.py): the physical cores of its CPU set, shared with the ranks of its host whose
sets overlap it; under Slurm the CPUs given to the task, as cores."""
from pathlib import Path

from pipeinfer.core import cpus


def _sysfs(tmp_path: Path, siblings: dict[int, str]) -> Path:
    """A fake /sys/devices/system/cpu: logical CPU -> its core's sibling list."""
    for cpu, core in siblings.items():
        d = tmp_path / f"cpu{cpu}" / "topology"
        d.mkdir(parents=True)
        (d / "core_cpus_list").write_text(core + "\n")
    return tmp_path


def test_hyperthreads_of_one_core_count_once(tmp_path):
    sysfs = _sysfs(tmp_path, {0: "0,4", 1: "1,5", 2: "2,6", 3: "3,7", 4: "0,4", 5: "1,5", 6: "2,6", 7: "3,7"})
    assert cpus.physical_cores(range(8), sysfs) == 4
    assert cpus.physical_cores([0, 4], sysfs) == 1
    assert cpus.physical_cores([0, 1], sysfs) == 2


def test_a_cpu_sysfs_does_not_describe_counts_as_a_core(tmp_path):
    assert cpus.physical_cores([0, 1, 2], tmp_path) == 3


def test_one_rank_on_a_host_takes_every_core_it_may_run_on(tmp_path):
    sysfs = _sysfs(tmp_path, {i: str(i) for i in range(32)})
    every = frozenset(range(32))
    assert cpus.default_threads(every, [every], 0, {}, sysfs) == 32


def test_ranks_free_on_the_same_host_share_its_cores(tmp_path):
    sysfs = _sysfs(tmp_path, {i: str(i) for i in range(5)})
    every = frozenset(range(5))
    assert [cpus.default_threads(every, [every] * 2, i, {}, sysfs) for i in range(2)] == [3, 2]
    assert [cpus.default_threads(every, [every] * 8, i, {}, sysfs) for i in range(8)] == [1] * 8


def test_ranks_bound_to_cores_of_their_own_share_nothing(tmp_path):
    sysfs = _sysfs(tmp_path, {i: str(i) for i in range(8)})
    halves = [frozenset(range(4)), frozenset(range(4, 8))]
    assert [cpus.default_threads(halves[i], halves, i, {}, sysfs) for i in range(2)] == [4, 4]


def test_slurm_cpus_per_task_are_the_tasks_cores(tmp_path):
    sysfs = _sysfs(tmp_path, {0: "0,2", 1: "1,3", 2: "0,2", 3: "1,3"} | {i: str(i) for i in range(4, 8)})
    assert cpus.default_threads(frozenset(range(4, 8)), [frozenset(range(8))] * 2, 0,
                                {"SLURM_CPUS_PER_TASK": "4"}, sysfs) == 4
    # 2 hyperthreads per core: 4 CPUs are 2 cores
    assert cpus.default_threads(frozenset(range(4)), [frozenset(range(4))], 0, {"SLURM_CPUS_PER_TASK": "4"},
                                sysfs) == 2
    assert cpus.slurm_task_cpus({"SLURM_CPUS_PER_TASK": ""}) is None
    assert cpus.slurm_task_cpus({}) is None


def test_share_deals_every_core_and_at_least_one_each():
    for cores in range(1, 40):
        for n in range(1, 10):
            got = [cpus.share(cores, n, i) for i in range(n)]
            assert sum(got) == max(cores, n) and max(got) - min(got) <= 1 and min(got) >= 1


def test_a_slurm_steps_tasks_on_one_node_share_it_when_mpi_does_not_say(tmp_path):
    """srun --cpu-bind=none, 2 tasks on each of 2 nodes of 2 cores, MPI seeing each rank alone: Slurm's counts."""
    sysfs = _sysfs(tmp_path, {0: "0", 1: "1"})
    node = frozenset({0, 1})
    step = {"SLURM_STEP_TASKS_PER_NODE": "2(x2)", "SLURM_NODEID": "1", "SLURM_CPUS_ON_NODE": "2"}
    assert [cpus.default_threads(node, [node], 0, dict(step, SLURM_LOCALID=str(i)), sysfs) for i in range(2)] == [1, 1]
    one_each = dict(step, SLURM_STEP_TASKS_PER_NODE="1(x2)", SLURM_LOCALID="0")
    assert cpus.default_threads(node, [node], 0, one_each, sysfs) == 2
    # tasks Slurm bound to CPUs of their own share nothing
    bound = dict(step, SLURM_LOCALID="0")
    assert cpus.default_threads(frozenset({0}), [frozenset({0})], 0, bound, sysfs) == 1
    assert cpus.slurm_node_sharing(node, {}) is None
    assert cpus.expand_tasks_per_node("2(x3),1") == [2, 2, 2, 1]
