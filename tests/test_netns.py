"""The emulated Ethernet cluster (launch/cluster/netns-cluster.sh): real ranks in network namespaces joined by
rate-limited veth links, with MPI traffic forced onto the links and measured; and a host cut off from the
network in the middle of a generation (a row of docs/failures.md, launch/bench/failures.py)."""
import json
import os
import re
import subprocess
import sys

import pytest

import faults as F
from helpers import (JOBS, NETNS, NETNS_MPI_ARGS, PROMPT, PROMPT_TEXT, ROOT, Server, job_references, mpirun,
                     netns_unavailable, stream_through_a_cut, universal_newlines, wait_until)

pytestmark = pytest.mark.mpi


def _netns_run(args: list[str], timeout: float = 300, **env_extra) -> subprocess.CompletedProcess:
    why = netns_unavailable()
    if why:
        pytest.skip(why)
    env = dict(os.environ, MPIEXEC=str(os.path.join(os.path.dirname(sys.executable), "mpiexec")),
               PATH=os.path.dirname(sys.executable) + os.pathsep + os.environ["PATH"], **env_extra)
    return subprocess.run(["bash", str(ROOT / "launch" / "cluster" / "netns-cluster.sh"), "run"] + args,
                          capture_output=True, text=True, timeout=timeout, env=env)


def _probe_mbit(stderr: str) -> float:
    line = next(l for l in stderr.splitlines() if "netprobe:" in l)
    return float(re.search(r"bandwidth ([0-9.]+) Mbit/s", line).group(1))


def _cleaned_up() -> None:
    # the namespaces, links and host entries are gone afterwards
    assert "h0" not in subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout.split()
    assert "pipeinfer-netns" not in open("/etc/hosts").read()


def test_three_hosts_over_shaped_links(models, tmp_path):
    """MPI traffic crosses the 100 Mbit/s links (the ping-pong says so), and the output stays exact."""
    cfg = {"model": str(models["q8"]), "prompt": PROMPT, "n": 32, "mode": "pipeinfer",
           "draft": str(models["draft60"])}
    (tmp_path / "cfg.json").write_text(json.dumps(cfg))
    p = _netns_run(["3", "--", sys.executable, "-m", "mpi4py", str(ROOT / "tests" / "mpi_gen.py"),
                    f"@{tmp_path}/cfg.json"], NETNS_RATE="100mbit")
    assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-3000:]
    mbit = _probe_mbit(p.stderr)
    assert 75 <= mbit <= 125, f"MPI ping-pong ran at {mbit} Mbit/s over links shaped to 100 Mbit/s"
    out = json.loads(next(l for l in p.stdout.splitlines() if l.startswith("RESULT "))[7:])
    single = mpirun(1, dict(cfg, mode="iterative"))
    assert out["tokens"] == single["tokens"]
    assert len(out["ranges"]) == 3
    _cleaned_up()


def test_each_host_its_own_disk_only_h0_has_the_model(tmp_path):
    """NETNS_DISKS: each emulated host its own stages/ and weights/ folders, the model's folder hidden on every host
    but h0; h1 and h2 receive their stage files from h0 (ranks/weights.py) and the text is the one of the model
    everywhere; the next start moves nothing."""
    from synth import make_llama_gguf
    (tmp_path / "models").mkdir()
    model = make_llama_gguf(tmp_path / "models" / "m.gguf", n_layer=6, qtype="q8_0")
    args = ["3", "--", sys.executable, "-m", "mpi4py", "-m", "pipeinfer", "generate", "-p", "hi", "-n", "8",
            "--mode", "iterative", "-t", "1", "-m", str(model)]
    disks = {"NETNS_DISKS": str(tmp_path / "disks"), "NETNS_HIDE": str(tmp_path / "models")}
    everywhere = _netns_run(args, NETNS_DISKS=str(tmp_path / "disks-all"), NETNS_HIDE="")
    assert everywhere.returncode == 0, everywhere.stderr[-3000:]
    assert "weights: sent" not in everywhere.stderr
    first = _netns_run(args, **disks)
    assert first.returncode == 0, first.stderr[-3000:]
    assert first.stdout == everywhere.stdout
    assert "weights: sent rank 1 (h1)" in first.stderr and "weights: sent rank 2 (h2)" in first.stderr
    for h in ("h1", "h2"):
        assert len(list((tmp_path / "disks" / h / "weights").glob("*.gguf"))) == 1
    assert not list((tmp_path / "disks" / "h0" / "weights").glob("*.gguf"))
    again = _netns_run(args, **disks)
    assert again.returncode == 0 and again.stdout == everywhere.stdout and "weights: sent" not in again.stderr
    _cleaned_up()


def test_run_refuses_when_mpi_bypasses_the_links():
    """Without forcing TCP, MPICH's UCX uses shared memory between namespaces: `run` must say so and stop."""
    p = _netns_run(["2", "--", "true"], timeout=120, NETNS_RATE="100mbit", NETNS_MPI_TCP="0")
    assert p.returncode != 0
    errors = [l for l in p.stderr.splitlines() if l.startswith("netns-cluster: MPI traffic")]
    assert len(errors) == 1 and "not crossing the emulated network" in errors[0], p.stderr[-2000:]
    assert _probe_mbit(p.stderr) > 200
    _cleaned_up()


def test_network_cut_to_a_worker_host(tmp_path):
    """h2's link goes down while the text streams (tests/faults.py's netcut-worker): the job ends by itself
    on every rank within --stall-timeout + 10 s, exit 3, one line naming rank 2 on h2, no traceback, the text
    so far on stdout, the --results row marked failed; the emulated hosts are removed whatever happens."""
    why = netns_unavailable()
    if why:
        pytest.skip(why)
    case = next(c for c in F.CASES if c.name == "netcut-worker")
    r = F.run_case(case, F.make_models(tmp_path / "models"), tmp_path)  # removes the hosts, kills ranks left
    ctx = f"{r['error']}\n{r['stderr_tail']}"
    assert r["from"] == "fault", "the link was not cut: " + ctx
    assert r["exit_code"] == 3, ctx
    assert not r["traceback"], ctx
    assert r["n_error_lines"] == 1 and "rank 2 (host h2, pid" in r["error"] and "went silent" in r["error"], ctx
    assert r["seconds"] < F.NET_STALL + 10, ctx
    assert r["ranks_gone_s"] is not None and r["ranks_gone_s"] < F.NET_STALL + 10, "a rank outlived the job: " + ctx
    assert r["stdout_bytes_at_fault"] > 0 and r["stdout_bytes"] >= r["stdout_bytes_at_fault"], ctx
    assert (r["results_status"] or "").startswith(case.results_status), ctx
    _cleaned_up()


def test_supervised_server_survives_a_cut_link(models, tmp_path):
    """`serve --hostfile --rejoin` over the emulated cluster (h0, h1, h2): h2's link goes down while three answers
    stream; the supervisor re-forms the job on h0 and h1 and every answer equals its no-failure answer; when the
    link comes back, h2 is taken back and the next answer is the no-failure one too."""
    why = netns_unavailable()
    if why:
        pytest.skip(why)
    from pipeinfer.supervisor.launch import PROBE_TIMEOUT_S
    from pipeinfer.supervisor.supervisor import REJOIN_CHECK_S
    script = str(ROOT / "launch" / "cluster" / "netns-cluster.sh")
    env = dict(os.environ, PATH=os.path.dirname(sys.executable) + os.pathsep + os.environ["PATH"])
    up = subprocess.run(["bash", script, "up", "3"], capture_output=True, text=True, env=env, timeout=120)
    try:
        assert up.returncode == 0, up.stderr[-2000:]
        hosts = tmp_path / "hosts.txt"
        hosts.write_text("h0\nh1\nh2\n")
        refs = job_references(models["q8"])
        srv = Server(["--hostfile", str(hosts), "-m", str(models["q8"]), "--mode", "iterative", "-c", "2048",
                      "--stall-timeout", "3", "--rejoin"], None, tmp_path / "sup.log", timeout=180,
                     env=dict(os.environ, PIPEINFER_MPI_ARGS=NETNS_MPI_ARGS))
        try:
            stream_through_a_cut(srv, refs)
            # --rejoin: h2's link comes back; once idle, the supervisor's launch of `pipeinfer --version` there
            # succeeds and the job is re-planned on h0, h1, h2
            subprocess.run(["ip", "link", "set", "pi-h2", "up"], check=True)
            health = wait_until(lambda: (h := srv.health())["ranks"] == 3 and h["phase"] == "serving" and h,
                                REJOIN_CHECK_S + PROBE_TIMEOUT_S + 90, lambda: srv.text()[-3000:], every=1)
            assert health["status"] == "ok", health
            assert "h2 answer(s) again: re-planning the pipeline on 3 slot(s) (was 2)" in srv.text()
            after = srv.stream({"model": "t-q8", "prompt": JOBS[0][0], "max_tokens": JOBS[0][1]})
            assert universal_newlines(after) == refs[0], srv.text()[-2000:]
        finally:
            code = srv.stop()  # (and kills what is left of its jobs)
        assert code == 0, srv.text()[-3000:]
        assert "re-forming the pipeline without rank 2 (host h2)" in srv.text()
        print(srv.wait_for_log(r".*re-formed in.*").group(0))  # the re-form time docs/failures.md quotes
    finally:
        subprocess.run(["bash", script, "down", "3"], capture_output=True, env=env, timeout=120)
    _cleaned_up()


def test_supervised_generate_survives_a_cut_link(tmp_path):
    """tests/faults.py's row: `generate --hostfile` (h0, h1, h2) with h2's link cut while the text streams:
    the job re-forms on h0 and h1 and the whole answer comes, the --results row saying it was resumed."""
    why = netns_unavailable()
    if why:
        pytest.skip(why)
    case = next(c for c in F.CASES if c.name == "netcut-worker-resumed")
    r = F.run_case(case, F.make_models(tmp_path / "models"), tmp_path, timeout=240)
    assert r["exit_code"] == 0 and not r["traceback"], r["stderr_tail"]
    F.check_resumed(case, r)


def test_a_supervised_job_over_ssh_gets_its_configuration(models, tmp_path):
    """A supervised `generate --hostfile` on h0 and h1 whose hosts start the proxies as ssh does, with the login's
    variables and not the launcher's (NETNS_CLEAN_ENV): every rank receives the job's configuration through
    MPI's launcher (Hydra 5.0.2 drops the last variable of its environment from -genvlist: launcher_env) and the
    text is one process's."""
    why = netns_unavailable()
    if why:
        pytest.skip(why)
    env = dict(os.environ, PATH=os.path.dirname(sys.executable) + os.pathsep + os.environ["PATH"])
    up = subprocess.run(["bash", str(NETNS), "up", "2"], capture_output=True, text=True, env=env, timeout=120)
    try:
        assert up.returncode == 0, up.stderr[-2000:]
        hosts = tmp_path / "hosts.txt"
        hosts.write_text("h0\nh1\n")
        args = ["generate", "-m", str(models["q8"]), "-p", PROMPT_TEXT, "--no-chat", "-n", "16", "--json"]
        p = subprocess.run([sys.executable, "-m", "pipeinfer", *args, "--hostfile", str(hosts)], capture_output=True,
                           text=True, timeout=300, env=dict(env, PIPEINFER_MPI_ARGS=NETNS_MPI_ARGS, NETNS_CLEAN_ENV="1"))
        assert p.returncode == 0, p.stderr[-3000:]
        alone = subprocess.run([sys.executable, "-m", "pipeinfer", *args, "--mode", "iterative"], capture_output=True,
                               text=True, timeout=300)
        assert json.loads(p.stdout)["tokens"] == json.loads(alone.stdout)["tokens"]
    finally:
        subprocess.run(["bash", str(NETNS), "down", "2"], capture_output=True, env=env, timeout=120)
    _cleaned_up()


def test_one_rank_per_host_takes_every_core_of_its_host(models, tmp_path):
    """Two emulated hosts, one rank each, no -t: each rank runs on its host's cores (MPI says no other rank shares
    its memory), where two ranks on one host take half each (tests/test_threads.py)."""
    from pipeinfer.core import cpus
    cfg = {"model": str(models["q8"]), "prompt": PROMPT, "n": 4, "threads": None}
    (tmp_path / "cfg.json").write_text(json.dumps(cfg))
    p = _netns_run(["2", "--", sys.executable, "-m", "mpi4py", str(ROOT / "tests" / "mpi_gen.py"),
                    f"@{tmp_path}/cfg.json"])
    assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-3000:]
    out = json.loads(next(l for l in p.stdout.splitlines() if l.startswith("RESULT "))[7:])
    assert out["threads"] == [cpus.physical_cores(cpus.affinity())] * 2
    _cleaned_up()


def test_unequal_hosts_each_rank_counts_its_own_cores(models, tmp_path):
    """Two emulated hosts, h1 given one CPU of this machine's (NETNS_CPUS: its processes' affinity), no -t: the rank
    on h0 runs every core, the one on h1 its one, and the text is one process's."""
    from pipeinfer.core import cpus
    here = cpus.physical_cores(cpus.affinity())
    if here < 2:
        pytest.skip("needs 2 cores to make the hosts unequal")
    cfg = {"model": str(models["q8"]), "prompt": PROMPT, "n": 16, "threads": None}
    (tmp_path / "cfg.json").write_text(json.dumps(cfg))
    p = _netns_run(["2", "--", sys.executable, "-m", "mpi4py", str(ROOT / "tests" / "mpi_gen.py"),
                    f"@{tmp_path}/cfg.json"], NETNS_CPUS="h1:1")
    assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-3000:]
    out = json.loads(next(l for l in p.stdout.splitlines() if l.startswith("RESULT "))[7:])
    assert out["threads"] == [here, 1]
    assert out["tokens"] == mpirun(1, dict(cfg, mode="iterative", threads="1"))["tokens"]
    _cleaned_up()
