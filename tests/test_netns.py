"""A real 3-rank generation across 3 network namespaces joined by 1 Gbit/s rate-limited veth links."""
import json
import os
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


def test_three_hosts_over_emulated_ethernet(models, tmp_path):
    why = _can_make_namespaces()
    if why:
        pytest.skip(why)
    cfg = {"model": str(models["f32"]), "prompt": PROMPT, "n": 32, "mode": "pipeinfer",
           "draft": str(models["draft60"])}
    (tmp_path / "cfg.json").write_text(json.dumps(cfg))
    env = dict(os.environ, MPIEXEC=str(os.path.join(os.path.dirname(sys.executable), "mpiexec")),
               PATH=os.path.dirname(sys.executable) + os.pathsep + os.environ["PATH"])
    p = subprocess.run(["bash", str(ROOT / "launch" / "netns-cluster.sh"), "run", "3", "--",
                        sys.executable, "-m", "mpi4py", str(ROOT / "tests" / "mpi_gen.py"), f"@{tmp_path}/cfg.json"],
                       capture_output=True, text=True, timeout=300, env=env)
    assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-3000:]
    out = json.loads(next(l for l in p.stdout.splitlines() if l.startswith("RESULT "))[7:])
    single = mpirun(1, dict(cfg, mode="iterative"))
    assert out["tokens"] == single["tokens"]
    assert len(out["ranges"]) == 3
    # the namespaces, links and host entries are gone afterwards
    assert "h0" not in subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout.split()
    assert "pipeinfer-netns" not in open("/etc/hosts").read()
