"""Slurm without a cluster: the allocation read from its variables, the srun line of a job step, the one line of a
job whose tasks came up alone. The same against a real Slurm: tests/test_slurm_real.py."""
import signal

import pytest
from click.testing import CliRunner

from pipeinfer.cli.main import main
from pipeinfer.wire import slurm
from pipeinfer.wire.launcher import Host, parse_hostfile_text, signal_to_pass_on
from pipeinfer.wire.slurm import (Allocation, allocation, allocation_hosts, expand_tasks_per_node, srun_command,
                                  srun_world_mismatch)


@pytest.mark.parametrize("text, counts", [("1", [1]), ("2(x3),1", [2, 2, 2, 1]), ("4,2(x2)", [4, 2, 2])])
def test_tasks_per_node(text, counts):
    assert expand_tasks_per_node(text) == counts


def test_tasks_per_node_refuses_what_it_cannot_read():
    with pytest.raises(ValueError, match="cannot read '2x'"):
        expand_tasks_per_node("2x")


def fake_names(nodelist):
    assert nodelist == "h[0-2]"
    return ["h0", "h1", "h2"]


def test_allocation_from_the_environment():
    env = {"SLURM_JOB_ID": "7", "SLURM_JOB_NODELIST": "h[0-2]", "SLURM_TASKS_PER_NODE": "2,1(x2)"}
    assert allocation(env, fake_names) == Allocation("7", ("h0", "h1", "h2"), (2, 1, 1))
    assert allocation({}, fake_names) is None
    with pytest.raises(RuntimeError, match="counts 2 nodes, SLURM_JOB_NODELIST=h\\[0-2\\] 3"):
        allocation({**env, "SLURM_TASKS_PER_NODE": "1(x2)"}, fake_names)


def test_a_hostfile_gives_settings_to_the_allocations_nodes():
    alloc = Allocation("7", ("h0", "h1", "h2"), (2, 2, 2))
    overlay = parse_hostfile_text("h1:5 # pipeinfer: threads=3 weight=2\nh2 # pipeinfer: role=draft threads=1\n")
    assert allocation_hosts(alloc, overlay) == [Host("h0", 2), Host("h1", 2, threads=3, weight=2.0),
                                                Host("h2", 1, threads=1, role="draft")]
    with pytest.raises(ValueError, match="names x, not in allocation 7"):
        allocation_hosts(alloc, [Host("x")])


def test_the_srun_line_places_the_ranks_as_mpiexec_would(tmp_path):
    """A host's ranks together, the draft host's last, the hostfile's settings as options; PMI-2 for MPICH."""
    hosts = [Host("h2", 1, threads=1, role="draft"), Host("h0", 2, threads=2), Host("h1", 1, threads=4)]
    tasks = tmp_path / "tasks"
    cmd, env = srun_command(hosts, 4, "mpich", ["generate", "-n", "8"], task_file=str(tasks), srun="srun",
                            python="py", environ={})
    assert cmd == ["srun", "--mpi=pmi2", "--distribution=arbitrary", "--ntasks=4", "--nodes=3", "--kill-on-bad-exit=1",
                   "--cpu-bind=none", "--overlap", "py", "-m", "mpi4py", "-m", "pipeinfer", "generate", "-n", "8",
                   "--draft-at", "rank", "--draft-threads", "1", "--threads", "2,2,4"]
    assert env == {"SLURM_HOSTFILE": str(tasks), "MPIR_CVAR_CH4_NETMOD": "ofi"}  # MPICH on OFI: short PMI lines
    assert tasks.read_text() == "h0\nh0\nh1\nh2\n"
    mine = {"MPIR_CVAR_CH4_NETMOD": "ucx"}   # the user's choice stays
    assert srun_command(hosts, 4, "mpich", [], task_file=str(tasks), environ=mine)[1] == {"SLURM_HOSTFILE": str(tasks)}
    assert srun_command(hosts[1:], 2, "openmpi", ["profile"], task_file=str(tasks), accepts={"threads"},
                        python="py")[0][:2] == ["srun", "--mpi=pmix"]


def test_tasks_that_came_up_alone_say_which_plugin():
    step = {"SLURM_STEP_ID": "0", "SLURM_STEP_NUM_TASKS": "3"}
    msg = srun_world_mismatch(1, "MPICH 4.3.0", step)
    assert msg.startswith("srun started 3 tasks but MPI (MPICH 4.3.0) sees 1") and "srun --mpi=pmi2" in msg
    assert "srun --mpi=pmix" in srun_world_mismatch(1, "Open MPI 4.1.4", step)
    assert srun_world_mismatch(3, "MPICH 4.3.0", step) is None
    assert srun_world_mismatch(1, "MPICH 4.3.0", {"SLURM_STEP_ID": "batch", "SLURM_STEP_NUM_TASKS": "3"}) is None
    assert srun_world_mismatch(1, "MPICH 4.3.0", {}) is None


def test_srun_gets_sigterm_which_it_forwards():
    assert signal_to_pass_on("slurm", signal.SIGINT, first=True) == signal.SIGTERM
    assert signal_to_pass_on("slurm", signal.SIGTERM, first=False) == signal.SIGTERM


@pytest.fixture
def in_allocation(monkeypatch):
    monkeypatch.setenv("SLURM_JOB_ID", "7")
    monkeypatch.setenv("SLURM_JOB_NODELIST", "h[0-2]")
    monkeypatch.setenv("SLURM_TASKS_PER_NODE", "1(x3)")
    monkeypatch.setattr(slurm, "hostnames", fake_names)
    monkeypatch.setattr("pipeinfer.cli.launch.shutil.which", lambda name: f"/usr/bin/{name}")


def test_launch_in_an_allocation_runs_srun(in_allocation, tmp_path):
    """No --hostfile: the allocation's nodes; a hostfile adds its settings to them; --dry-run prints the task file."""
    overlay = tmp_path / "hosts"
    overlay.write_text("h0 # pipeinfer: threads=2\nh1 # pipeinfer: threads=2\nh2 # pipeinfer: threads=2\n")
    for extra in ([], ["--hostfile", str(overlay)]):
        res = CliRunner().invoke(main, ["launch", *extra, "--dry-run", "--", "profile"])
        assert res.exit_code == 0, res.output
        first, *rest = res.output.splitlines()
        assert first.startswith("SLURM_HOSTFILE=") and " /usr/bin/srun --mpi=pmi2 " in first
        assert first.endswith("-m pipeinfer profile" + (" --threads 2,2,2" if extra else ""))
        assert rest[1:] == ["h0", "h1", "h2"]


def test_launch_serve_in_an_allocation_hands_its_nodes_to_the_supervisor(in_allocation, tmp_path):
    hosts = tmp_path / "hosts"
    res = CliRunner().invoke(main, ["launch", "--write-hostfile", str(hosts), "--dry-run", "--", "serve", "--port", "9"])
    assert res.exit_code == 0, res.output
    lines = res.output.splitlines()
    assert lines[0].endswith(f"-m pipeinfer serve --hostfile {hosts} --port 9")
    assert hosts.read_text() == "h0:1\nh1:1\nh2:1\n"
    assert " srun --mpi=pmi2 --distribution=arbitrary --ntasks=3 " in lines[2]  # its first job: a job step
    assert lines[3:] == ["# its hostfile:", "# h0", "# h1", "# h2"]


def test_launch_outside_an_allocation_needs_a_hostfile(monkeypatch):
    monkeypatch.delenv("SLURM_JOB_ID", raising=False)
    res = CliRunner().invoke(main, ["launch", "--dry-run", "--", "profile"])
    assert res.exit_code == 1 and "--hostfile HOSTS is needed outside a Slurm allocation" in res.output
