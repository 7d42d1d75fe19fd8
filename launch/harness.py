"""What the tests and the scripts of launch/ share, in one place: where the repository is (ROOT) and how a script in
a group of launch/ (bench/, cluster/, twin/, docgen/) puts it and other groups on its path (on_path); the MPI
launcher beside this interpreter and the `pipeinfer` command under it (MPIEXEC, pipeinfer_cmd); a job's processes
found by a tag in their environment (set on the command that starts it, inherited by its MPI ranks and a
supervisor's jobs), so that a test or a benchmark ends its own processes and never another job's; a free loopback
port; a headless Chromium; whether the emulated cluster (launch/cluster/netns-cluster.sh) can run here; a results
CSV written (write_csv). Beside it,
launch/quiet.py (timing on a shared machine) and launch/charts.py (the benchmarks' bar chart). A script of a group
starts with

    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # launch/: the shared harness
    from harness import ROOT, on_path

tests/helpers.py puts launch/ on the path; nothing here imports the tests."""
from __future__ import annotations

import csv
import os
import shutil
import signal
import socket
import subprocess
import sys
import uuid
from pathlib import Path

LAUNCH = Path(__file__).resolve().parent  # launch/: this module, quiet.py, charts.py and the groups' folders
ROOT = LAUNCH.parent                        # the repository
CLUSTER = LAUNCH / "cluster"                # the emulated cluster: netns-cluster.sh, netns-exec, slurm-netns.sh
MPIEXEC = str(Path(sys.executable).parent / "mpiexec")  # the mpich wheel's launcher, beside this interpreter


def on_path(*groups: str, pythonpath: bool = False) -> None:
    """Put the repository (pipeinfer imported from this checkout) and these groups of launch/ (e.g. "bench" for a
    script that imports bench/serve_load.py from another group) first on sys.path; pythonpath: the repository first
    on PYTHONPATH too, for the processes the script starts."""
    sys.path[:0] = [str(ROOT), *(str(LAUNCH / g) for g in groups)]
    if pythonpath:
        os.environ["PYTHONPATH"] = os.pathsep.join(
            dict.fromkeys(p for p in [str(ROOT), *os.environ.get("PYTHONPATH", "").split(os.pathsep)] if p))


def pipeinfer_cmd(n_ranks: int | None = None, module: str = "pipeinfer") -> list[str]:
    """`python -m mpi4py -m pipeinfer` (or another module), under `mpiexec -n N` when n_ranks is given."""
    cmd = [sys.executable, "-m", "mpi4py", "-m", module]
    return [MPIEXEC, "-n", str(n_ranks), *cmd] if n_ranks is not None else cmd


JOB_TAG = "PIPEINFER_JOB_TAG"  # set on the command a test starts; its MPI ranks (and a supervisor's jobs) inherit it


def write_csv(path, rows: list[dict], fields: list[str] | None = None, **writer_options) -> Path:
    """rows as a CSV at path (its folder made if need be), one column per key of the first row unless `fields` names
    them; writer_options go to csv.DictWriter (restval, extrasaction)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(rows[0]) if fields is None else fields, **writer_options)
        w.writeheader()
        w.writerows(rows)
    return path


def new_tag() -> str:
    return uuid.uuid4().hex


def tagged_env(tag: str, env: dict | None = None, **more) -> dict:
    return dict(env if env is not None else os.environ, **more, **{JOB_TAG: tag})


def _environ(pid: str) -> dict[str, str]:
    raw = Path(f"/proc/{pid}/environ").read_bytes().decode(errors="replace")
    return dict(kv.split("=", 1) for kv in raw.split("\0") if "=" in kv)


def tagged_pids(tag: str) -> list[int]:
    """Every process (launchers, proxies, ranks) whose environment carries the tag."""
    out = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            if _environ(pid).get(JOB_TAG) == tag:
                out.append(int(pid))
        except OSError:  # gone, or not ours to read
            continue
    return out


def rank_pids(tag: str, attached: bool = False) -> dict[int, int]:
    """rank -> pid of the pipeinfer ranks of the job with this tag (MPICH's PMI_RANK, Open MPI's
    OMPI_COMM_WORLD_RANK). attached: only a supervised job's ranks (`pipeinfer attach`), not the supervisor's
    one-rank `pipeinfer --version` probes."""
    out = {}
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            env = _environ(pid)
            if env.get(JOB_TAG) != tag:
                continue
            cmd = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        rank = env.get("PMI_RANK", env.get("OMPI_COMM_WORLD_RANK"))
        if rank is not None and b"pipeinfer" in cmd and (not attached or b"attach" in cmd):
            out[int(rank)] = int(pid)
    return out


def kill_tagged(tag: str) -> None:
    """SIGKILL whatever of the job is left (a frozen rank would hold the machine)."""
    for pid in tagged_pids(tag):
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def headless_chromium(*extra_args: str):
    """A headless Chromium under selenium (Debian's chromium and chromium-driver): the page tests, the load test's
    watching browser (launch/bench/serve_load.py) and the README's screenshot (launch/docgen/page_shot.py)."""
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service
    opts = webdriver.ChromeOptions()
    opts.binary_location = shutil.which("chromium") or shutil.which("chromium-browser") or ""
    for a in ("--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage", *extra_args):
        opts.add_argument(a)
    return webdriver.Chrome(service=Service(shutil.which("chromedriver")), options=opts)


def netns_unavailable() -> str | None:
    """Why the emulated cluster (launch/cluster/netns-cluster.sh) cannot run here, or None."""
    if os.geteuid() != 0:
        return "needs root to create network namespaces"
    if not shutil.which("ip") or not shutil.which("tc"):
        return "needs iproute2 (ip, tc)"
    probe = subprocess.run(["ip", "netns", "add", "pipeinfer-probe"], capture_output=True, text=True)
    if probe.returncode != 0:
        return f"cannot create a network namespace here: {probe.stderr.strip()}"
    subprocess.run(["ip", "netns", "del", "pipeinfer-probe"], capture_output=True)
    return None
