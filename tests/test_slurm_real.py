"""A real Slurm (Debian's slurm-wlm 22.05 and munge) whose nodes are the emulated cluster's hosts: launch/cluster/slurm-netns.sh
runs slurmctld and one slurmd per network namespace (h0, h1, h2, each behind its own 1 Gbit/s link), so that srun
places ranks on "hosts" as on a cluster. Without root or the packages these tests skip; CI installs the packages
(.ci/run), and there none skips.

MPI traffic crosses the links: UCX_TLS=tcp and FI_PROVIDER=tcp (the mpich wheel would otherwise see one kernel and
use shared memory between the namespaces, as netns-cluster.sh explains). Under srun the mpich wheel runs on its OFI
netmod, as `pipeinfer launch` starts it (wire/slurm.SRUN_ENV; srun by hand: MPIR_CVAR_CH4_NETMOD=ofi)."""
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import urllib.error
import urllib.request
from pathlib import Path

import pytest

from pipeinfer.wire.slurm import SRUN_ENV
from helpers import (JOBS, PROMPT_TEXT, ROOT, Server, free_port, job_references, netns_unavailable, reference,
                     stream_through_a_cut, tagged_pids, universal_newlines, wait_until)

pytestmark = pytest.mark.mpi

SCRIPT = str(ROOT / "launch" / "cluster" / "slurm-netns.sh")
SERVE_SCRIPT = ROOT / "launch" / "cluster" / "slurm-serve.sbatch"
KEY = "sk-team-0123456789"
DAEMONS = ("slurmctld", "slurmd", "sinfo", "srun", "salloc", "sbatch", "scontrol", "munged", "nsenter")
PIPEINFER = [sys.executable, "-m", "pipeinfer"]


def _unavailable() -> str | None:
    missing = [c for c in DAEMONS if shutil.which(c) is None]
    if missing:
        return f"needs Slurm and munge ({', '.join(missing)} missing: apt-get install slurmctld slurmd slurm-client " \
               f"munge libpmix-dev)"
    return netns_unavailable()


@pytest.fixture(scope="module")
def slurm():
    """The emulated 3-node Slurm cluster, up for this module; the environment to reach it (SLURM_CONF). Its state
    lives in a folder of its own under /tmp that everyone may enter (munged refuses a socket below a private one,
    such as pytest's)."""
    why = _unavailable()
    if why:
        pytest.skip(why)
    state = Path(tempfile.mkdtemp(prefix="pipeinfer-slurm-")) / "s"
    os.chmod(state.parent, 0o755)
    env = dict(os.environ, SLURM_NETNS_DIR=str(state), UCX_TLS="tcp", FI_PROVIDER="tcp",
               PATH=os.path.dirname(sys.executable) + os.pathsep + os.environ["PATH"])
    up = subprocess.run(["bash", SCRIPT, "up", "3"], capture_output=True, text=True, env=env, timeout=300)
    try:
        assert up.returncode == 0, up.stderr[-3000:]
        yield dict(env, SLURM_CONF=str(state / "slurm.conf"))
    finally:
        subprocess.run(["bash", SCRIPT, "down"], capture_output=True, env=env, timeout=120)
        shutil.rmtree(state.parent, ignore_errors=True)
        assert "h0" not in subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout.split()


def _run(cmd: list[str], env: dict, timeout: float = 300) -> subprocess.CompletedProcess:
    return subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=timeout)


def _generate_args(models, n: int = 48) -> list[str]:
    return ["generate", "-m", str(models["q8"]), "-p", PROMPT_TEXT, "--no-chat", "-n", str(n), "-t", "1", "-q",
            "--mode", "pipeinfer", "--draft", str(models["draft60"]), "--drafter", "model"]


def test_slurm_srun_generate_equals_one_process(slurm, models):
    """`srun --mpi=pmi2 -N 3` starts one 3-rank job (PMI from srun, the mpich wheel's MPI) whose ranks run on h0, h1
    and h2 (the hidden states cross h1's and h2's links); PipeInfer's text is the one process's, token for token."""
    one = _run(PIPEINFER + _generate_args(models), slurm)
    assert one.returncode == 0, one.stderr[-2000:]
    before = {h: _link_bytes(h) for h in ("h1", "h2")}
    three = _run(["srun", "--mpi=pmi2", "-N", "3", "-n", "3", sys.executable, "-m", "mpi4py", "-m", "pipeinfer",
                  *_generate_args(models), "--json"], dict(slurm, **SRUN_ENV["mpich"]))
    assert three.returncode == 0, three.stderr[-3000:]
    out = json.loads(three.stdout)
    assert out["text"] == one.stdout[:-1] and len(out["ranges"]) == 3
    crossed = {h: _link_bytes(h) - before[h] for h in before}
    assert all(n > 48 * 256 for n in crossed.values()), crossed   # at least a hidden state per token each way


def _link_bytes(host: str) -> int:
    """Bytes through host's link, both ways (its root-side end, pi-HOST)."""
    stats = f"/sys/class/net/pi-{host}/statistics"
    return sum(int(open(f"{stats}/{d}_bytes").read()) for d in ("rx", "tx"))


def test_slurm_launch_in_an_allocation_runs_one_job(slurm, models):
    """`pipeinfer launch` inside `salloc -N 3`: no hostfile, the allocation's nodes; it runs srun (with the PMI-2
    plugin), one job whose text is on stdout."""
    one = _run(PIPEINFER + _generate_args(models), slurm)
    p = _run(["salloc", "-N", "3", *PIPEINFER, "launch", "--", *_generate_args(models)], slurm)
    assert p.returncode == 0, p.stderr[-3000:]
    assert p.stdout == one.stdout
    assert re.search(r"^SLURM_HOSTFILE=\S+ MPIR_CVAR_CH4_NETMOD=ofi \S*srun --mpi=pmi2 --distribution=arbitrary "
                     r"--ntasks=3 ", p.stderr, re.M), \
        p.stderr[-2000:]


@pytest.mark.slow
def test_slurm_launch_runs_the_image(slurm, image, podman_env, models, tmp_path):
    """`pipeinfer launch --image` inside `salloc -N 2`: each task of the srun step starts its rank in a container of
    the image on its node (the PMI descriptor Slurm gave the task passed in); the text is the one process's."""
    one = _run(PIPEINFER + _generate_args(models), slurm)
    env = dict(slurm, CONTAINERS_CONF=podman_env["CONTAINERS_CONF"], PIPEINFER_IMAGE_CACHE=str(tmp_path / "{host}"))
    p = _run(["salloc", "-N", "2", *PIPEINFER, "launch", "--image", image, "--", *_generate_args(models), "--json"],
             env)
    assert p.returncode == 0, p.stderr[-3000:]
    out = json.loads(p.stdout.strip().splitlines()[-1])
    assert out["text"] == one.stdout[:-1] and len(out["ranges"]) == 2
    assert " podman run --rm --init --network host " in p.stderr, p.stderr[:2000]
    assert sorted(d.name for d in tmp_path.iterdir()) == ["h0", "h1"]  # each node's cache its own


def test_slurm_ranks_take_the_cpus_slurm_gave_their_task(slurm, models):
    """No -t in an allocation: `-c 1` gives each task 1 CPU (SLURM_CPUS_PER_TASK), so each rank runs 1 thread; a rank
    alone on a whole node runs every core of it; whole nodes with a task per CPU (salloc's default) share each node's
    cores among its ranks (Slurm's step counts: MPI sees these emulated nodes' ranks apart)."""
    from pipeinfer.core import cpus
    args = [a for a in _generate_args(models, n=8) if a not in ("-t", "1")] + ["--json"]
    assert "-t" not in args
    node = cpus.physical_cores(cpus.affinity())  # the emulated nodes are this machine's namespaces
    for salloc, want in ((["-c", "1"], [1, 1]), (["--exclusive", "--ntasks-per-node=1"], [node, node]),
                         (["--exclusive"], [cpus.share(node, node, i) for i in range(node)] * 2)):
        p = _run(["salloc", "-N", "2", *salloc, *PIPEINFER, "launch", "--", *args], slurm)
        assert p.returncode == 0, p.stderr[-3000:]
        assert json.loads(p.stdout.strip().splitlines()[-1])["threads"] == want, salloc


def test_slurm_doctor_inside_an_allocation(slurm, models):
    """`pipeinfer doctor` in `salloc -N 3` without a hostfile: one srun step probes h0, h1 and h2 (each node's
    scratch the cache it names), one MPI step measures the links; whole nodes pass. Without --exclusive or
    --cpus-per-task, Slurm gave each task one CPU of the node's: a problem on every node, exit 1."""
    doctor = [*PIPEINFER, "doctor", "-m", str(models["q8"])]
    env = {k: v for k, v in slurm.items() if k != "PIPEINFER_STAGE_CACHE"}
    whole = _run(["salloc", "-N", "3", "--exclusive", *doctor], env)
    assert whole.returncode == 0 and "doctor: 3 host(s), no problem found" in whole.stdout, whole.stdout + whole.stderr
    state = Path(slurm["SLURM_CONF"]).parent
    for node in ("h0", "h1", "h2"):
        assert re.search(rf"^{node}: pipeinfer .* free disk in {state}/tmp-{node}/pipeinfer, the model readable$",
                         whole.stdout, re.M), whole.stdout
    assert len(re.findall(r"^link h0 -> h[12]: ", whole.stdout, re.M)) == 2, whole.stdout
    if os.cpu_count() > 1:
        one = _run(["salloc", "-N", "3", "-n", "3", *doctor], env)
        lines = [line for line in one.stdout.splitlines() if line.startswith("problem: ")]
        assert one.returncode == 1 and len(lines) == 3, one.stdout
        assert all(f"Slurm gave its task 1 CPU of {os.cpu_count()}" in line for line in lines), lines


def test_slurm_tasks_started_alone_say_which_plugin(slurm, models):
    """srun with a PMI plugin the mpich wheel does not speak (--mpi=none) starts three one-rank jobs: each says so
    in one line naming --mpi=pmi2, and exits non-zero, before any model loads."""
    p = _run(["srun", "--mpi=none", "-N", "3", "-n", "3", sys.executable, "-m", "mpi4py", "-m", "pipeinfer",
              *_generate_args(models, n=8)], dict(slurm, **SRUN_ENV["mpich"]), timeout=120)
    assert p.returncode != 0
    lines = [line for line in p.stderr.splitlines() if "srun started 3 tasks but MPI" in line]
    assert len(lines) == 3 and all("srun --mpi=pmi2" in line for line in lines), p.stderr[-2000:]
    assert "Traceback" not in p.stderr and not p.stdout


def test_slurm_supervised_server_loses_a_node(slurm, models, tmp_path):
    """`pipeinfer launch -- serve` in `salloc --no-kill -N 3`: the supervised server's job is a job step on h0, h1,
    h2. h2's link goes down while three answers stream; the supervisor re-forms the job as a step on h0 and h1, and
    every answer equals its no-failure answer. Slurm then marks h2 down and keeps the job (--no-kill): the server
    still answers."""
    refs = job_references(models["q8"])
    srv = Server(["-m", str(models["q8"]), "--mode", "iterative", "-c", "2048", "--stall-timeout", "3"], None,
                 tmp_path / "sup.log", timeout=180, env=slurm,
                 command=["salloc", "--no-kill", "-N", "3", *PIPEINFER, "launch", "--", "serve"])
    try:
        stream_through_a_cut(srv, refs)
        assert "re-forming the pipeline without rank 2 (host h2)" in srv.text()
        wait_until(lambda: "down" in _run(["sinfo", "-h", "-n", "h2", "-o", "%t"], slurm).stdout, 120,
                   "Slurm never marked h2 down")
        after = srv.stream({"model": "t-q8", "prompt": JOBS[0][0], "max_tokens": JOBS[0][1], "temperature": 0.0})
        assert universal_newlines(after) == refs[0], srv.text()[-2000:]
    finally:
        code = _interrupt(srv)
        subprocess.run(["ip", "link", "set", "pi-h2", "up"], check=True)
    assert code == 0, srv.text()[-3000:]
    wait_until(lambda: "idle" in _run(["sinfo", "-h", "-n", "h2", "-o", "%t"], slurm).stdout, 90,
               "h2 did not come back to idle")


def test_slurm_rejoin_after_a_short_outage(slurm, models, tmp_path):
    """`--rejoin` in an allocation: h2's link is down for a few seconds (less than Slurm takes to mark it down);
    the job re-forms on h0 and h1, then a one-task srun step on h2 (its probe) succeeds and the job is re-planned
    on all three nodes, whose next answer is the no-failure one."""
    from pipeinfer.supervisor.launch import PROBE_TIMEOUT_S
    from pipeinfer.supervisor.supervisor import REJOIN_CHECK_S
    ref = reference(models["q8"], 100)
    srv = Server(["-m", str(models["q8"]), "--mode", "iterative", "-c", "2048", "--stall-timeout", "3", "--rejoin"],
                 None, tmp_path / "sup.log", timeout=180, env=slurm,
                 command=["salloc", "--no-kill", "-N", "3", *PIPEINFER, "launch", "--", "serve"])
    try:
        subprocess.run(["ip", "link", "set", "pi-h2", "down"], check=True)
        got = srv.stream({"model": "t-q8", "prompt": PROMPT_TEXT, "max_tokens": 100, "temperature": 0.0})
        assert universal_newlines(got) == ref, srv.text()[-2000:]
        assert srv.health()["lost"] == ["rank 2 (host h2)"]
        subprocess.run(["ip", "link", "set", "pi-h2", "up"], check=True)
        wait_until(lambda: (h := srv.health())["ranks"] == 3 and h["phase"] == "serving", REJOIN_CHECK_S +
                   PROBE_TIMEOUT_S + 60, lambda: srv.text()[-3000:], every=1)
        assert "h2 answer(s) again: re-planning the pipeline on 3 slot(s) (was 2)" in srv.text()
        again = srv.stream({"model": "t-q8", "prompt": PROMPT_TEXT, "max_tokens": 100, "temperature": 0.0})
        assert universal_newlines(again) == ref, srv.text()[-2000:]
    finally:
        subprocess.run(["ip", "link", "set", "pi-h2", "up"], check=True)
        code = _interrupt(srv)
    assert code == 0, srv.text()[-3000:]

def _submit_service(slurm: dict, models, folder: Path, port: int) -> tuple[str, dict]:
    """slurm-serve.sbatch submitted from `folder` with the team's key file there (chmod 600) and no stage cache of
    the tests': stage files go to each node's scratch. (the job's id, the environment it was given)"""
    keys = folder / "pipeinfer-keys.txt"
    keys.write_text(f"# the team\n{KEY}\n")
    keys.chmod(0o600)
    env = {k: v for k, v in slurm.items() if k not in ("PIPEINFER_STAGE_CACHE", "PIPEINFER_CACHE")}
    env.update(PIPEINFER_PORT=str(port))
    sub = subprocess.run(["sbatch", "--parsable", "-N", "3", "-o", str(folder / "serve.out"), str(SERVE_SCRIPT),
                          "-m", str(models["q8"]), "--mode", "iterative", "-c", "2048"], capture_output=True,
                         text=True, env=env, cwd=folder, timeout=60)
    assert sub.returncode == 0, sub.stderr
    return sub.stdout.strip().split(";")[0], env


def _address(folder: Path, out: Path, env: dict, timeout: float = 240) -> str:
    """The base URL launch/cluster/slurm-address.py prints from the job's address file once the server answers."""
    p = subprocess.run([sys.executable, str(ROOT / "launch" / "cluster" / "slurm-address.py"),
                        str(folder / "pipeinfer-serve.address"), "--wait", str(timeout)], capture_output=True,
                       text=True, env=env, timeout=timeout + 60)
    assert p.returncode == 0, (p.stderr, out.read_text()[-3000:] if out.exists() else "")
    return p.stdout.strip().removesuffix("/v1")


def _ask(base: str, key: str | None, max_tokens: int = 600) -> dict:
    body = json.dumps({"model": "t-q8", "prompt": PROMPT_TEXT, "max_tokens": max_tokens, "temperature": 0.0,
                       "top_p": 0.95, "seed": 0}).encode()
    headers = {"Content-Type": "application/json", **({"Authorization": f"Bearer {key}"} if key else {})}
    req = urllib.request.Request(base + "/v1/completions", body, headers)
    return json.loads(urllib.request.urlopen(req, timeout=300).read())


def test_slurm_service_with_a_key_file_and_node_local_cache(slurm, models, tmp_path):
    """launch/cluster/slurm-serve.sbatch serves on the allocation's first node (h0): its address file holds h0's
    address (Slurm's NodeAddr), which slurm-address.py turns into the base URL; the key comes from the team's key
    file (a request without it gets 401; the key is in no command line: not in `scontrol show job`, not in the
    job's output); each node's stage files are on its node-local scratch (SLURM_TMPDIR; the job has no
    PIPEINFER_STAGE_CACHE). Slurm's end-of-allocation stop (the batch shell's SIGTERM; here on demand with `scancel --batch
    --signal=TERM`): the answer in flight completes, the job ends with exit code 0, the address file is gone."""
    refs = job_references(models["q8"])
    port = free_port()
    out = tmp_path / "serve.out"
    job, env = _submit_service(slurm, models, tmp_path, port)
    try:
        base = _address(tmp_path, out, env)
        assert base == f"http://10.77.0.1:{port}"   # h0's NodeAddr: the batch script runs on the first node
        with pytest.raises(urllib.error.HTTPError) as refused:
            _ask(base, None, 4)
        assert refused.value.code == 401
        answer: dict = {}
        asking = threading.Thread(target=lambda: answer.update(_ask(base, KEY)))
        asking.start()
        wait_until(lambda: (h := _get(base + "/health")) and h["generating"], 60, "the request never started")
        assert KEY not in _job_record(job, slurm) and KEY not in out.read_text()
        assert _run(["scancel", "--batch", "--signal=TERM", job], slurm).returncode == 0
        asking.join(300)
        assert answer["choices"][0]["finish_reason"] == "length", answer
        state = wait_until(lambda: _job_state(job, slurm) in ("COMPLETED", "FAILED", "CANCELLED") and
                           _job_record(job, slurm), 120, lambda: out.read_text()[-3000:], every=1)
        assert "JobState=COMPLETED" in state and "ExitCode=0:0" in state, (state, out.read_text()[-3000:])
        assert f"pipeinfer: serving on h0:{port}; from your machine: ssh -N -L {port}:h0:{port} " in out.read_text()
    finally:
        _run(["scancel", job], slurm)
    assert universal_newlines(answer["choices"][0]["text"]) == refs[0]
    assert not (tmp_path / "pipeinfer-serve.address").exists()
    state_dir = Path(slurm["SLURM_CONF"]).parent
    for node in ("h0", "h1", "h2"):
        assert list((state_dir / f"tmp-{node}" / "pipeinfer" / "stages").glob(f"{models['q8'].stem}.*")), node


@pytest.mark.slow
def test_slurm_service_requeues_itself_near_the_time_limit(slurm, models, tmp_path):
    """Slurm's signal before the time limit (`--signal=B:USR1@300`; here on demand): the service drains, requeues
    itself (`scontrol requeue`), Slurm starts the same job again (Restarts=1), its address file names where it
    serves now, and it answers with the same text."""
    port = free_port()
    out = tmp_path / "serve.out"
    job, env = _submit_service(slurm, models, tmp_path, port)
    try:
        base = _address(tmp_path, out, env)
        first = _ask(base, KEY, 24)["choices"][0]["text"]
        assert _run(["scancel", "--batch", "--signal=USR1", job], slurm).returncode == 0
        wait_until(lambda: "Restarts=1" in _job_record(job, slurm), 120, lambda: out.read_text()[-3000:], every=1)
        again = _address(tmp_path, out, env, timeout=400)   # Slurm holds a requeued job ~2 minutes
        assert _ask(again, KEY, 24)["choices"][0]["text"] == first
        assert f"requeueing job {job}" in out.read_text() and f"start 1 of job {job}" in out.read_text()
    finally:
        _run(["scancel", job], slurm)


def _interrupt(srv: Server) -> int:
    """Ctrl-C in the allocation's shell: SIGINT to `pipeinfer launch` and the server it runs, not to salloc (whose
    own SIGINT gives the allocation up under the server's feet); salloc's status once they are done."""
    for pid in tagged_pids(srv.tag):
        try:
            cmd = open(f"/proc/{pid}/cmdline", "rb").read().split(b"\0")
        except OSError:
            continue
        if b"pipeinfer" in cmd and (b"launch" in cmd or b"serve" in cmd):
            os.kill(pid, signal.SIGINT)
    try:
        return srv.proc.wait(timeout=90)
    finally:
        srv.stop()


def _get(url: str) -> dict | None:
    try:
        return json.loads(urllib.request.urlopen(url, timeout=5).read())
    except OSError:
        return None


def _job_record(job: str, env: dict) -> str:
    return _run(["scontrol", "show", "job", "-o", job], env, timeout=30).stdout


def _job_state(job: str, env: dict) -> str:
    m = re.search(r"JobState=(\w+)", _job_record(job, env))
    return m.group(1) if m else ""



def test_slurm_batch_script_writes_every_answer(slurm, models, tmp_path):
    """launch/cluster/slurm-batch.sbatch: a file of prompts through a 3-node allocation, each answer the one process's, a
    JSON line on the job's output and a row in the results CSV."""
    prompts = ["ba ki lo", "lo ki ba", "ki ki"]
    (tmp_path / "prompts.txt").write_text("".join(json.dumps({"prompt": p, "n_predict": 24}) + "\n" for p in prompts))
    out, results = tmp_path / "batch.out", tmp_path / "results.csv"
    sub = _run(["sbatch", "--wait", "-N", "3", "-o", str(out), str(ROOT / "launch" / "cluster" / "slurm-batch.sbatch"),
                str(tmp_path / "prompts.txt"), str(results), "-m", str(models["q8"]), "--mode", "iterative",
                "--no-chat", "-t", "1", "-q"], slurm, timeout=600)
    assert sub.returncode == 0, out.read_text()[-3000:]
    answers = [json.loads(line) for line in out.read_text().splitlines() if line.startswith("{")]
    for p in prompts:
        alone = _run(PIPEINFER + ["generate", "-m", str(models["q8"]), "-p", p, "--no-chat", "-n", "24", "-q",
                                  "--mode", "iterative"], slurm)
        assert [a["text"] for a in answers if a["prompt"] == p] == [alone.stdout[:-1]], (p, answers)
    assert len(results.read_text().splitlines()) == 1 + len(prompts)


def test_slurm_open_mpi_under_pmix(slurm, models):
    """With mpi4py loading Open MPI (MPI4PY_MPIABI=openmpi), `pipeinfer launch` in an allocation passes srun
    --mpi=pmix (Open MPI speaks PMIx, not PMI-1): one 3-rank job, the one process's text."""
    if shutil.which("ompi_info") is None:
        pytest.skip("needs Open MPI (apt-get install openmpi-bin)")
    env = dict(slurm, MPI4PY_MPIABI="openmpi")
    one = _run(PIPEINFER + _generate_args(models), env)
    p = _run(["salloc", "-N", "3", *PIPEINFER, "launch", "--", *_generate_args(models)], env)
    assert p.returncode == 0, p.stderr[-3000:]
    assert p.stdout == one.stdout and " --mpi=pmix " in p.stderr
