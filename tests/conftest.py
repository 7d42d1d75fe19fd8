"""Shared fixtures: synthetic GGUF models, a per-session stage cache (helpers.py holds the shared functions)."""
import os
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))
from synth import PERTURB_FOR_AGREEMENT, make_llama_gguf  # noqa: E402
# shared helpers live in helpers.py; these names stay importable from here for the modules that still do
from helpers import MPIEXEC, PROMPT, ROOT, cli, mpirun  # noqa: E402,F401
from pipeinfer.engine.kernels import UNUSED_EXTRA_BUFFERS, drop_extra_buffer_types  # noqa: E402

# The tests' references load models with llama_cpp.Llama directly: on a CPU with AMX they would put the weights in
# llama.cpp's AMX buffer (whose matmul crashed on the q8_0 models) and not run the kernels pipeinfer runs
drop_extra_buffer_types(UNUSED_EXTRA_BUFFERS)


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



@pytest.fixture
def no_lltokenizer(monkeypatch):
    """Constraints compiled without llguidance's tokenizer (the API tests' fake models have no vocabulary)."""
    from pipeinfer.engine import grammar
    monkeypatch.setattr(grammar, "lltokenizer", lambda tok: None)
