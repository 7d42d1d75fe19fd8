"""Shared fixtures: synthetic GGUF models and a helper that runs ranks under mpiexec."""
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))
from synth import PROMPT_TOKENS, PERTURB_FOR_AGREEMENT, make_llama_gguf  # noqa: E402
from pipeinfer.engine.kernels import UNUSED_EXTRA_BUFFERS, drop_extra_buffer_types  # noqa: E402

# The tests' references load models with llama_cpp.Llama directly: on a CPU with AMX they would put the weights in
# llama.cpp's AMX buffer (whose matmul crashed on the q8_0 models) and not run the kernels pipeinfer runs
drop_extra_buffer_types(UNUSED_EXTRA_BUFFERS)

ROOT = Path(__file__).resolve().parent.parent
MPIEXEC = shutil.which("mpiexec", path=str(Path(sys.executable).parent)) or shutil.which("mpiexec")


@pytest.fixture(scope="session", autouse=True)
def _isolated_stage_cache(tmp_path_factory):
    # stage files of synthetic models go to a per-session cache; real models keep using the user cache
    os.environ.setdefault("PIPEINFER_STAGE_CACHE", str(tmp_path_factory.mktemp("stages")))


@pytest.fixture(scope="session")
def models(tmp_path_factory):
    d = tmp_path_factory.mktemp("models")
    return {
        "f32": make_llama_gguf(d / "t-f32.gguf", n_layer=4),
        "q8": make_llama_gguf(d / "t-q8.gguf", n_layer=4, qtype="q8_0"),
        "six": make_llama_gguf(d / "t6.gguf", n_layer=6),
        "draft90": make_llama_gguf(d / "d90.gguf", n_layer=4, perturb=PERTURB_FOR_AGREEMENT[4][0.9]),
        "draft60": make_llama_gguf(d / "d60.gguf", n_layer=4, perturb=PERTURB_FOR_AGREEMENT[4][0.6]),
        "draft30": make_llama_gguf(d / "d30.gguf", n_layer=4, perturb=PERTURB_FOR_AGREEMENT[4][0.3]),
    }


def mpirun(n: int, cfg: dict, timeout: float = 180) -> dict:
    """Run tests/mpi_gen.py on n ranks; returns rank 0's JSON result."""
    cmd = [MPIEXEC, "-n", str(n), sys.executable, "-m", "mpi4py", str(ROOT / "tests" / "mpi_gen.py"), json.dumps(cfg)]
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    assert p.returncode == 0, f"exit {p.returncode}\n{p.stdout[-3000:]}\n{p.stderr[-3000:]}"
    line = next(l for l in p.stdout.splitlines() if l.startswith("RESULT "))
    return json.loads(line[len("RESULT "):])


def cli(args: list[str], n: int | None = None, timeout: float = 120, env=None) -> subprocess.CompletedProcess:
    """Run the pipeinfer CLI, under mpiexec -n n when n is given."""
    base = [sys.executable, "-m", "mpi4py", "-m", "pipeinfer"]
    cmd = ([MPIEXEC, "-n", str(n)] + base if n else base) + args
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env)


PROMPT = PROMPT_TOKENS
