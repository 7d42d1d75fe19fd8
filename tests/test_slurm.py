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
    monkeypatch.setattr("pipeinfer.wire.slurm.shutil.which", lambda name: f"/usr/bin/{name}")


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
    assert lines[3:7] == ["# its hostfile:", "# h0", "# h1", "# h2"]  # then each rank's layers and RAM


def test_launch_outside_an_allocation_needs_a_hostfile(monkeypatch):
    monkeypatch.delenv("SLURM_JOB_ID", raising=False)
    res = CliRunner().invoke(main, ["launch", "--dry-run", "--", "profile"])
    assert res.exit_code == 1 and "--hostfile HOSTS is needed outside a Slurm allocation" in res.output


# ------------------------------------------------------------------------------------ a service that runs for days
def test_stage_files_go_to_node_local_scratch_under_slurm(tmp_path):
    """In a Slurm job: $SLURM_TMPDIR, else $TMPDIR (the first that is a folder); $PIPEINFER_CACHE overrides; outside
    a job the cache; the models stay in the cache."""
    from pipeinfer.core.files import cache_dir, node_cache_dir
    scratch, tmp = tmp_path / "scratch", tmp_path / "tmp"
    scratch.mkdir()
    tmp.mkdir()
    job = {"SLURM_JOB_ID": "7", "SLURM_TMPDIR": str(scratch), "TMPDIR": str(tmp)}
    assert node_cache_dir(job) == scratch / "pipeinfer"
    assert node_cache_dir({**job, "SLURM_TMPDIR": ""}) == tmp / "pipeinfer"
    assert node_cache_dir({**job, "SLURM_TMPDIR": str(tmp_path / "gone")}) == tmp / "pipeinfer"
    assert node_cache_dir({**job, "PIPEINFER_CACHE": "/big/cache"}) == cache_dir()
    assert node_cache_dir({"TMPDIR": str(tmp)}) == cache_dir()            # not in a Slurm job
    assert node_cache_dir({"SLURM_JOB_ID": "7"}) == cache_dir()          # a job without scratch


def test_the_weights_cache_follows_the_node_cache(tmp_path, monkeypatch):
    from pipeinfer.core.stagecache import weights_dir
    monkeypatch.delenv("PIPEINFER_CACHE", raising=False)
    monkeypatch.delenv("PIPEINFER_WEIGHTS_CACHE", raising=False)
    monkeypatch.setenv("SLURM_JOB_ID", "7")
    monkeypatch.setenv("SLURM_TMPDIR", str(tmp_path))
    assert weights_dir() == tmp_path / "pipeinfer" / "weights"


def test_the_start_limit_follows_the_models_size(tmp_path):
    from pipeinfer.supervisor.child import START_TIMEOUT_S, models_bytes, start_timeout_s
    assert start_timeout_s(2 * 2**30) == START_TIMEOUT_S == 600      # a small model: the floor
    assert start_timeout_s(135 * 2**30) == pytest.approx(2764.8)       # a 235B MoE at Q4: 46 minutes
    assert start_timeout_s(135 * 2**30, given=30) == 30                # --start-timeout
    model = tmp_path / "m.bin"
    model.write_bytes(b"x" * 1000)
    assert models_bytes((str(model), None, str(tmp_path / "missing"))) == 1000


def test_the_supervisors_start_limit(tmp_path):
    """The supervisor's limit for a job's start: from the target's and the draft's bytes, or --start-timeout."""
    from pipeinfer.core.config import Config
    from pipeinfer.supervisor.lifecycle import JobLifecycle
    from pipeinfer.supervisor.slots import Slots
    model = tmp_path / "m.gguf"
    with open(model, "wb") as f:
        f.truncate(100 * 2**30)   # sparse: 100 GiB at 50 MiB/s
    life = JobLifecycle(Slots(["localhost"], None, None), Config(str(model)), str(tmp_path), print, False)
    assert life.start_limit() == pytest.approx(2048.0)
    life.config = Config(str(model)).with_options(start_timeout=30.0)
    assert life.start_limit() == 30.0


def test_start_timeout_is_an_option_of_the_supervised_commands():
    from pipeinfer.cli.main import main
    from pipeinfer.core.config import OPTION_FIELDS
    assert OPTION_FIELDS["start_timeout"][:2] == ("wire", "start_timeout")
    for name in ("serve", "generate"):
        assert "--start-timeout" in CliRunner().invoke(main, [name, "--help"]).output


def test_doctor_probes_every_node_with_one_srun_step():
    from pipeinfer.wire.slurm import srun_each_node
    cmd = srun_each_node(Allocation("7", ("h0", "h1", "h2"), (1, 1, 1)), ["doctor", "--probe", "-m", "/m.gguf"],
                         python="py")
    assert cmd == ["srun", "--mpi=none", "--nodes=3", "--ntasks=3", "--ntasks-per-node=1", "--cpu-bind=none",
                   "--overlap", "--kill-on-bad-exit=0", "py", "-m", "pipeinfer", "doctor", "--probe", "-m", "/m.gguf"]


def test_doctor_inside_an_allocation_uses_srun(in_allocation, monkeypatch):
    """No hostfile in an allocation: its nodes, probed by one srun step; a node whose task said nothing is named
    with srun's last line, a task with one CPU of many is a problem."""
    import json
    import subprocess
    import time
    from dataclasses import asdict, replace

    from pipeinfer.cli import doctor_cmd
    from pipeinfer.wire.doctor import GiB, HostFacts
    here = HostFacts("h0", "0.1", "b", "/p", "0.3", "3.11.7", 20 * GiB, 50 * GiB, 0.0, 8, 8, 8, 0, "h0", "/s", "")
    ran, run = [], subprocess.run

    def fake_run(cmd, **kw):
        if not cmd[0].endswith("srun"):   # (the MPI library's own questions)
            return run(cmd, **kw)
        ran.append(cmd)
        if "--probe" in cmd:   # h1 gave the task one CPU; h2 never answered
            lines = [asdict(replace(here, clock=time.time())),
                     asdict(replace(here, host="x1", slurm_node="h1", task_cpus=1, slurm_cpus=1, clock=time.time()))]
            return subprocess.CompletedProcess(cmd, 1, "".join(json.dumps(x) + "\n" for x in lines),
                                               "srun: error: h2: task 2: Exited with exit code 1\n")
        link = {"from": "h0", "to": "h1", "bandwidth_bit_s": 1e9, "latency_s": 1e-5}
        return subprocess.CompletedProcess(cmd, 0, json.dumps(link) + "\n", "")
    monkeypatch.setattr(doctor_cmd.subprocess, "run", fake_run)
    monkeypatch.setattr(doctor_cmd, "facts", lambda build: replace(here, clock=time.time()))
    monkeypatch.setattr("pipeinfer.wire.slurm.shutil.which", lambda name: f"/usr/bin/{name}")
    res = CliRunner().invoke(main, ["doctor"])
    assert res.exit_code == 1, res.output
    assert ran[0][:3] == ["/usr/bin/srun", "--mpi=none", "--nodes=3"] and ran[0][-2:] == ["doctor", "--probe"]
    problems = [line for line in res.output.splitlines() if line.startswith("problem: ")]
    assert problems == ["problem: h1: Slurm gave its task 1 CPU of 8: ask for the node's cores (sbatch or salloc "
                        "--exclusive, or --cpus-per-task=N)",
                        "problem: h2: unreachable: srun: error: h2: task 2: Exited with exit code 1"], res.output
    assert ran[1][0] == "/usr/bin/srun" and ran[1][-2:] == ["doctor", "--links"]   # MPI over h0 and h1, a step


def test_doctor_outside_an_allocation_needs_a_hostfile(monkeypatch):
    monkeypatch.delenv("SLURM_JOB_ID", raising=False)
    res = CliRunner().invoke(main, ["doctor"])
    assert res.exit_code == 2 and "--hostfile HOSTS: which hosts to check" in res.output


def test_api_keys_from_a_file_or_the_environment(tmp_path, monkeypatch, capsys):
    """--api-key-file: a missing or empty file is one line; a file every user may read is said; PIPEINFER_API_KEY is
    --api-key's variable (keys apart by spaces)."""
    from pipeinfer.core.errors import UserError
    from pipeinfer.frontend.access import read_keys
    with pytest.raises(UserError, match=f"--api-key-file {tmp_path}/none: No such file or directory"):
        read_keys((), str(tmp_path / "none"))
    (tmp_path / "empty").write_text("\n# none yet\n")
    with pytest.raises(UserError, match="no key in it"):
        read_keys((), str(tmp_path / "empty"))
    keys = tmp_path / "keys"
    keys.write_text("sk-team\n")
    keys.chmod(0o600)
    assert read_keys((), str(keys)) == ("sk-team",) and capsys.readouterr().err == ""
    keys.chmod(0o644)
    assert read_keys((), str(keys)) == ("sk-team",)
    assert f"--api-key-file {keys} is readable by every user (chmod 600 {keys})" in capsys.readouterr().err
    monkeypatch.setenv("PIPEINFER_API_KEY", "sk-a sk-b")
    serve = main.commands["serve"]
    with serve.make_context("serve", ["-m", "x.gguf"]) as ctx:
        assert ctx.params["api_key"] == ("sk-a", "sk-b")


FAKE_SCONTROL = """#!/bin/bash
echo "$*" >>"$FAKE_LOG/scontrol"
case "$*" in
    "show hostnames h[0-1]") printf 'h0\\nh1\\n' ;;
    "-o show node h0") echo "NodeName=h0 Arch=x86_64 CoresPerSocket=1 NodeAddr=10.9.0.1 NodeHostName=h0 Version=22.05" ;;
esac
"""
# the server: its arguments and environment noted; a SIGTERM drains it (noted) and it exits 0
FAKE_PIPEINFER = """#!/bin/bash
printf '%s\\n' "$@" >"$FAKE_LOG/args"
trap 'echo drained >>"$FAKE_LOG/server"; exit 0' TERM
echo serving >>"$FAKE_LOG/server"
while true; do sleep 0.1; done
"""


def _wait_for(path, text: str, proc) -> None:
    import time
    deadline = time.monotonic() + 60
    while not (path.exists() and text in path.read_text()):
        assert proc.poll() is None and time.monotonic() < deadline, (proc.poll(), path)
        time.sleep(0.05)


@pytest.mark.parametrize("signum, requeued", [(signal.SIGUSR1, True), (signal.SIGTERM, False)])
def test_the_serve_script_writes_its_address_and_requeues_near_the_time_limit(tmp_path, signum, requeued):
    """slurm-serve.sbatch with stand-ins for scontrol and pipeinfer: it writes http://NODEADDR:PORT to the address
    file and hands serve the key file (no key on its command line). Slurm's USR1 before the time limit drains the
    server, then `scontrol requeue JOB`, the address file kept for the next start; a TERM (a stop for good) drains
    it and removes the file; both exit 0."""
    import os
    import subprocess
    from pathlib import Path
    bin_dir, log = tmp_path / "bin", tmp_path / "log"
    bin_dir.mkdir()
    log.mkdir()
    for name, text in (("scontrol", FAKE_SCONTROL), ("pipeinfer", FAKE_PIPEINFER)):
        (bin_dir / name).write_text(text)
        (bin_dir / name).chmod(0o755)
    keys = tmp_path / "pipeinfer-keys.txt"
    keys.write_text("sk-team\n")
    env = dict(os.environ, PATH=f"{bin_dir}:{os.environ['PATH']}", FAKE_LOG=str(log), SLURM_JOB_ID="41",
               SLURM_JOB_NODELIST="h[0-1]", SLURM_SUBMIT_DIR=str(tmp_path), SLURM_SUBMIT_HOST="login1",
               PIPEINFER_PORT="8123")
    env.pop("PIPEINFER_ADDRESS_FILE", None)
    env.pop("PIPEINFER_API_KEY_FILE", None)
    script = Path(__file__).resolve().parents[1] / "launch" / "cluster" / "slurm-serve.sbatch"
    proc = subprocess.Popen(["bash", str(script), "-m", "model.gguf"], env=env, cwd=tmp_path,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        _wait_for(log / "server", "serving", proc)
        address = tmp_path / "pipeinfer-serve.address"
        assert address.read_text() == "http://10.9.0.1:8123\n"
        assert (log / "args").read_text().split() == ["launch", "--", "serve", "--host", "0.0.0.0", "--port", "8123",
                                                       "--api-key-file", str(keys), "-m", "model.gguf"]
        proc.send_signal(signum)
        out, err = proc.communicate(timeout=60)
    finally:
        proc.kill()
    assert proc.returncode == 0, err
    assert (log / "server").read_text() == "serving\ndrained\n"
    assert ("requeue 41" in (log / "scontrol").read_text().splitlines()) == requeued
    assert address.exists() == requeued
    assert "pipeinfer: serving on h0:8123; from your machine: ssh -N -L 8123:h0:8123 " in out
    assert ("requeueing job 41" in out) == requeued


def test_the_serve_script_says_when_it_serves_without_a_key(tmp_path):
    """No key file: one line says so, and serve gets no key option."""
    import os
    import subprocess
    from pathlib import Path
    bin_dir, log = tmp_path / "bin", tmp_path / "log"
    bin_dir.mkdir()
    log.mkdir()
    (bin_dir / "scontrol").write_text(FAKE_SCONTROL)
    (bin_dir / "pipeinfer").write_text('#!/bin/bash\nprintf "%s\\n" "$@" >"$FAKE_LOG/args"\n')
    for f in bin_dir.iterdir():
        f.chmod(0o755)
    env = dict(os.environ, PATH=f"{bin_dir}:{os.environ['PATH']}", FAKE_LOG=str(log), SLURM_JOB_ID="41",
               SLURM_JOB_NODELIST="h[0-1]", SLURM_SUBMIT_DIR=str(tmp_path), PIPEINFER_ADDRESS_FILE=str(tmp_path / "a"))
    env.pop("PIPEINFER_API_KEY_FILE", None)
    script = Path(__file__).resolve().parents[1] / "launch" / "cluster" / "slurm-serve.sbatch"
    p = subprocess.run(["bash", str(script)], env=env, cwd=tmp_path, capture_output=True, text=True, timeout=60)
    assert p.returncode == 0, p.stderr
    assert f"pipeinfer: no key file {tmp_path}/pipeinfer-keys.txt (PIPEINFER_API_KEY_FILE): serving without a key" \
        in p.stderr
    assert "--api-key-file" not in (log / "args").read_text() and not (tmp_path / "a").exists()
