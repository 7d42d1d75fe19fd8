"""The emulated Ethernet cluster (launch/netns-cluster.sh): real ranks in network namespaces joined by
rate-limited veth links, with MPI traffic forced onto the links and measured."""
import json
import os
import re
import shutil
import subprocess
import sys

import pytest

from conftest import PROMPT, ROOT, mpirun

pytestmark = pytest.mark.mpi


def _can_make_namespaces() -> str | None:
    if os.geteuid() != 0:
        return "needs root to create network namespaces"
    if not shutil.which("ip") or not shutil.which("tc"):
        return "needs iproute2 (ip, tc)"
    probe = subprocess.run(["ip", "netns", "add", "pipeinfer-probe"], capture_output=True, text=True)
    if probe.returncode != 0:
        return f"cannot create a network namespace here: {probe.stderr.strip()}"
    subprocess.run(["ip", "netns", "del", "pipeinfer-probe"], capture_output=True)
    return None


def _netns_run(args: list[str], timeout: float = 300, **env_extra) -> subprocess.CompletedProcess:
    why = _can_make_namespaces()
    if why:
        pytest.skip(why)
    env = dict(os.environ, MPIEXEC=str(os.path.join(os.path.dirname(sys.executable), "mpiexec")),
               PATH=os.path.dirname(sys.executable) + os.pathsep + os.environ["PATH"], **env_extra)
    return subprocess.run(["bash", str(ROOT / "launch" / "netns-cluster.sh"), "run"] + args,
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


def test_run_refuses_when_mpi_bypasses_the_links():
    """Without forcing TCP, MPICH's UCX uses shared memory between namespaces: `run` must say so and stop."""
    p = _netns_run(["2", "--", "true"], timeout=120, NETNS_RATE="100mbit", NETNS_MPI_TCP="0")
    assert p.returncode != 0
    errors = [l for l in p.stderr.splitlines() if l.startswith("netns-cluster: MPI traffic")]
    assert len(errors) == 1 and "not crossing the emulated network" in errors[0], p.stderr[-2000:]
    assert _probe_mbit(p.stderr) > 200
    _cleaned_up()
