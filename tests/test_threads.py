"""Threads and numerics on the shape of a real cluster: a rank with no -t takes the cores it may run on, shared with
the ranks of its host (core/cpus.py); and the greedy answer does not depend on how many threads, ranks or hosts run
the model (engine/kernels.kv_cache_types: one value type on any thread count)."""
import json
import os
import subprocess
import sys

import pytest

from helpers import MPIEXEC, PROMPT, ROOT, cli, mpirun, real_model
from pipeinfer.core import cpus

HERE_CORES = cpus.physical_cores(cpus.affinity())


def _gen(n: int, cfg: dict, env: dict | None = None) -> dict:
    if env is None:
        return mpirun(n, cfg)
    cmd = [MPIEXEC, "-n", str(n), sys.executable, "-m", "mpi4py", str(ROOT / "tests" / "mpi_gen.py"), json.dumps(cfg)]
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=180, env=dict(os.environ, **env))
    assert p.returncode == 0, p.stderr[-3000:]
    return json.loads(next(l for l in p.stdout.splitlines() if l.startswith("RESULT "))[7:])


@pytest.mark.mpi
def test_ranks_on_one_host_share_its_cores(models):
    cfg = {"model": str(models["q8"]), "prompt": PROMPT, "n": 4, "threads": None}
    assert _gen(1, cfg)["threads"] == [HERE_CORES]
    assert _gen(2, cfg)["threads"] == [cpus.share(HERE_CORES, 2, i) for i in range(2)]


@pytest.mark.mpi
def test_a_slurm_task_takes_the_cpus_slurm_gave_it(models):
    cfg = {"model": str(models["q8"]), "prompt": PROMPT, "n": 4, "threads": None}
    assert _gen(1, cfg, {"SLURM_CPUS_PER_TASK": "1"})["threads"] == [1]


@pytest.mark.mpi
def test_threads_given_are_threads_used(models):
    cfg = {"model": str(models["q8"]), "prompt": PROMPT, "n": 4, "threads": "2,1"}
    assert _gen(2, cfg)["threads"] == [2, 1]


# prompts no setting of pipeinfer was tuned on; the first parted at its 41st token between an f16 value cache on
# 1 thread and a bf16 one on 2
HELD_OUT = ["The history of the printing press begins",
            "In mathematics, a prime number is a natural number greater than 1 that"]


@pytest.mark.real
@pytest.mark.mpi
@pytest.mark.parametrize("text", HELD_OUT)
def test_the_greedy_answer_is_the_same_on_any_threads_ranks_and_hosts(text):
    """One process on 1 and on 2 threads, 2 ranks on 2+1 threads, 3 ranks on 1 thread each: the same 64 tokens."""
    path = real_model("qwen2.5-coder-1.5b")
    runs = {}
    for n, threads in [(1, "1"), (1, "2"), (2, "2,1"), (3, "1")]:
        p = cli(["generate", "-m", path, "--mode", "iterative", "-t", threads, "-n", "64", "-p", text, "--no-chat",
                 "--json", "-q"], n=n, timeout=600)
        assert p.returncode == 0, p.stderr[-3000:]
        out = json.loads(p.stdout.strip().splitlines()[-1])
        assert out["threads"] == [int(t) for t in threads.split(",")] * (n if "," not in threads else 1)
        runs[(n, threads)] = out["tokens"]
    first = runs[(1, "1")]
    assert len(first) == 64
    for key, tokens in runs.items():
        assert tokens == first, f"{key} parts from one process on 1 thread at token {_parting(first, tokens)}"


def _parting(a: list[int], b: list[int]) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
