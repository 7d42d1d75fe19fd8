"""`pipeinfer doctor`: the checks as pure functions, and on the emulated cluster a healthy one passes while a host
cut off, a host whose disk is too small and a host with another pipeinfer are each found in one line."""
import os
import shutil
import subprocess
import sys
from dataclasses import replace

import pytest

from pipeinfer.wire.doctor import GiB, HostFacts, Need, facts, problems
from helpers import NETNS_MPI_ARGS, ROOT, netns_unavailable

BUILD = "pipeinfer 0.1.0 (protocol 7, sources 06f0fe87f1ef), llama-cpp-python 0.3.36"
HERE = HostFacts("h0", "0.1.0", BUILD, "/opt/pipeinfer", "0.3.36", "3.11.7", 20 * GiB, 50 * GiB, 1000.0, 16)


def test_a_healthy_host_has_no_problem():
    assert problems("h1", replace(HERE, host="h1"), None, HERE, Need(10 * GiB, 10 * GiB),
                    window=(HERE.clock - 0.1, HERE.clock + 0.1)) == []


@pytest.mark.parametrize("change, need, mem, line", [
    (dict(build=BUILD.replace("06f0", "1582")), None, None,
     "h1: another build: pipeinfer 0.1.0 (protocol 7, sources 1582fe87f1ef), llama-cpp-python 0.3.36 (here pipeinfer"),
    (dict(where="/home/x/pipeinfer"), None, None, "h1: pipeinfer is at /home/x/pipeinfer (here /opt/pipeinfer;"),
    (dict(mem_available=4 * GiB), Need(6 * GiB, 1), None, "h1: not enough memory: its share needs 6.0 GiB, it has 4.0"),
    ({}, Need(6 * GiB, 1), 5.0, "h1: not enough memory: its share needs 6.0 GiB, it has 5.0 GiB"),   # hostfile mem=
    (dict(disk_free=GiB), Need(1, 2 * GiB), None, "h1: not enough disk for its stage files: 2.0 GiB needed, 1.0"),
    (dict(clock=1010.0), None, None, "h1: its clock is 10.0 s off this host's"),
])
def test_each_problem_is_one_line(change, need, mem, line):
    found = problems("h1", replace(HERE, host="h1", **change), None, HERE, need, mem, window=(HERE.clock, HERE.clock))
    assert len(found) == 1 and found[0].startswith(line), found


@pytest.mark.parametrize("change, first, line", [
    (dict(model="Permission denied"), True, "h1: cannot read the model: Permission denied (rank 0 runs here"),
    (dict(task_cpus=16, slurm_cpus=1), False, "h1: Slurm gave its task 1 CPU of 16: ask for the node's cores"),
    (dict(task_cpus=1), False, "h1: this process may run on 1 CPU of 16 (taskset or a cgroup)"),
    (dict(slurm_mem=4 * GiB), False, "h1: not enough memory in the Slurm job: its share needs 6.0 GiB, the job may "
                                     "use 4.0 GiB on a node (sbatch --mem=0: all of it)"),
])
def test_what_a_node_of_an_allocation_can_lack(change, first, line):
    found = problems("h1", replace(HERE, host="h1", **change), None, HERE, Need(6 * GiB, 1), first=first)
    assert len(found) == 1 and found[0].startswith(line), found


def test_a_node_without_the_model_is_no_problem_but_rank_0s():
    """Only rank 0's host reads the model; the others receive their layers."""
    elsewhere = replace(HERE, host="h1", model="No such file or directory")
    assert problems("h1", elsewhere, None, HERE, None) == []
    assert problems("h1", replace(HERE, host="h1", slurm_cpus=16, task_cpus=16), None, HERE, None, first=True) == []


def test_the_clock_inside_the_probes_window_is_no_skew():
    """An srun step probes every node at once: a clock within the step's window (this host's, sent to back) is
    right, one outside it by more than 2 s is off by that much."""
    assert problems("h1", replace(HERE, host="h1", clock=1005.0), None, HERE, None, window=(1000.0, 1008.0)) == []
    found = problems("h1", replace(HERE, host="h1", clock=1012.0), None, HERE, None, window=(1000.0, 1008.0))
    assert found == ["h1: its clock is 4.0 s off this host's (run NTP: logs and timings compare badly)"]


def test_a_probe_line_of_another_version_is_read():
    from dataclasses import asdict

    from pipeinfer.wire.doctor import facts_of
    assert facts_of({**asdict(HERE), "a_later_field": 1}) == HERE


def test_a_slurm_tasks_facts(tmp_path, monkeypatch):
    from pipeinfer.ranks.handshake import build_id
    for name, value in (("SLURM_JOB_ID", "7"), ("SLURM_CPUS_PER_TASK", "3"), ("SLURM_MEM_PER_NODE", "2048"),
                        ("SLURMD_NODENAME", "h1"), ("SLURM_TMPDIR", str(tmp_path))):
        monkeypatch.setenv(name, value)
    monkeypatch.delenv("PIPEINFER_CACHE", raising=False)
    model = tmp_path / "m.gguf"
    model.write_bytes(b"GGUF")
    f = facts(build_id(), str(model))
    assert (f.slurm_cpus, f.slurm_mem, f.slurm_node, f.cache, f.model) == (3, 2 * GiB, "h1",
                                                                           str(tmp_path / "pipeinfer"), "readable")
    assert f.task_cpus == len(os.sched_getaffinity(0))
    assert facts(build_id(), str(tmp_path / "none")).model == "No such file or directory"


def test_an_unreachable_host_says_why():
    assert problems("h2", None, "ssh: connect to host h2 port 22: No route to host", HERE, None) == [
        "h2: unreachable: ssh: connect to host h2 port 22: No route to host"]


def test_this_hosts_facts():
    from pipeinfer.ranks.handshake import build_id
    f = facts(build_id())
    assert f.pipeinfer and f.llama_cpp != "missing" and f.mem_available > 0 and f.disk_free > 0 and f.cpus >= 1


@pytest.mark.parametrize("pinned, most", [(None, 3), ("50000:50099", 1)])
def test_probes_in_a_pinned_port_range_go_one_at_a_time(tmp_path, monkeypatch, pinned, most):
    """mpiexecs started at once in MPIEXEC_PORT_RANGE (docs/cluster.md, ports) race for its ports, and Hydra's
    "unable to create PMI port" named a healthy host unreachable (3 runs of 4 here): there the probes go one by one."""
    import threading
    import time

    from click.testing import CliRunner

    from pipeinfer.cli import doctor_cmd
    from pipeinfer.cli.main import main
    from pipeinfer.wire.launcher import MpiLibrary
    running, seen, lock = [0], [0], threading.Lock()

    def probe(name, *_):
        with lock:
            running[0] += 1
            seen[0] = max(seen[0], running[0])
        time.sleep(0.1)
        with lock:
            running[0] -= 1
        t0 = time.time()
        return replace(HERE, host=name, clock=t0), None, (t0, t0 + 0.01)
    monkeypatch.setattr(doctor_cmd, "_probe", probe)
    monkeypatch.setattr(doctor_cmd, "_links", lambda names, *_: (
        [{"from": "h0", "to": n, "bandwidth_bit_s": 1e9, "latency_s": 1e-5} for n in names[1:]], None))
    monkeypatch.setattr(doctor_cmd, "facts", lambda build: replace(HERE, clock=time.time()))
    monkeypatch.setattr(doctor_cmd, "mpi4py_library", lambda: MpiLibrary("mpich", "MPICH 5.0.2", None))
    monkeypatch.setattr(doctor_cmd, "choose_launcher", lambda library: "mpiexec")
    for name in doctor_cmd.PORT_RANGE_VARS:
        monkeypatch.delenv(name, raising=False)
    if pinned:
        monkeypatch.setenv("MPIEXEC_PORT_RANGE", pinned)
    hosts = tmp_path / "hosts"
    hosts.write_text("h0\nh1\nh2\n")
    res = CliRunner().invoke(main, ["doctor", "--hostfile", str(hosts)])
    assert res.exit_code == 0 and "doctor: 3 host(s), no problem found" in res.output, res.output
    assert seen[0] == most


@pytest.mark.mpi
def test_doctor_on_the_emulated_cluster(tmp_path, models):
    """A healthy 3-host cluster passes (exit 0, each link measured); then h1 with another pipeinfer (its install
    folder holds another version), h2 with a 16 KiB disk for its stage files, and h3 cut off: one line each, exit 1."""
    why = netns_unavailable()
    if why:
        pytest.skip(why)
    script = str(ROOT / "launch" / "cluster" / "netns-cluster.sh")
    env = dict(os.environ, PATH=os.path.dirname(sys.executable) + os.pathsep + os.environ["PATH"],
               PIPEINFER_MPI_ARGS=NETNS_MPI_ARGS, NETNS_DISKS=str(tmp_path / "disks"), NETNS_HIDE="")
    up = subprocess.run(["bash", script, "up", "4"], capture_output=True, text=True, env=env, timeout=180)
    other = tmp_path / "other" / "pipeinfer"
    try:
        assert up.returncode == 0, up.stderr[-2000:]
        hosts = tmp_path / "hosts"
        hosts.write_text("h0\nh1\nh2\nh3\n")
        doctor = [sys.executable, "-m", "pipeinfer", "doctor", "--hostfile", str(hosts), "-m", str(models["q8"])]
        healthy = subprocess.run(doctor, capture_output=True, text=True, env=env, timeout=300)
        assert healthy.returncode == 0, healthy.stdout + healthy.stderr[-2000:]
        assert "doctor: 4 host(s), no problem found" in healthy.stdout
        assert sum(line.startswith("link h0 -> h") for line in healthy.stdout.splitlines()) == 3, healthy.stdout

        shutil.copytree(ROOT / "pipeinfer", other, ignore=shutil.ignore_patterns("__pycache__"))
        init = other / "__init__.py"
        init.write_text(init.read_text().replace('__version__ = "', '__version__ = "0.0.9+'))
        (tmp_path / "disks" / "h2").mkdir(parents=True, exist_ok=True)
        subprocess.run(["mount", "-t", "tmpfs", "-o", "size=16k", "pipeinfer-tiny", str(tmp_path / "disks" / "h2")],
                       check=True)
        subprocess.run(["ip", "link", "set", "pi-h3", "down"], check=True)
        faulty = subprocess.run(doctor, capture_output=True, text=True, timeout=300,
                                env=dict(env, NETNS_BIND=f"h1:{other}:{ROOT / 'pipeinfer'}"))
        assert faulty.returncode == 1, faulty.stdout + faulty.stderr[-2000:]
        lines = [line for line in faulty.stdout.splitlines() if line.startswith("problem: ")]
        assert len(lines) == 3, faulty.stdout
        assert lines[0].startswith("problem: h1: another build: pipeinfer 0.0.9+0.1.0 (protocol")
        assert lines[1].startswith("problem: h2: not enough disk for its stage files")
        assert lines[2].startswith("problem: h3: unreachable: ")
        assert "a job on these hosts would fail" in faulty.stderr
    finally:
        subprocess.run(["umount", str(tmp_path / "disks" / "h2")], capture_output=True)
        subprocess.run(["bash", script, "down", "4"], capture_output=True, env=env, timeout=120)
