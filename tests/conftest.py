"""Shared fixtures: synthetic GGUF models, a per-session stage cache, pipeinfer's image (helpers.py holds the shared
functions)."""
import os
import resource
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))
from synth import PERTURB_FOR_AGREEMENT, make_llama_gguf  # noqa: E402
# shared helpers live in helpers.py; these names stay importable from here for the modules that still do
from helpers import MPIEXEC, PROMPT, ROOT, cli, mpirun, netns_unavailable  # noqa: E402,F401
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


# ---------------------------------------------------------------- pipeinfer's image (tests/test_image.py, Slurm)
def _runtime_unavailable() -> str | None:
    if not shutil.which("podman"):
        return "podman is not installed (apt-get install podman runc debootstrap)"
    if not shutil.which("debootstrap"):
        return "debootstrap is not installed (apt-get install debootstrap)"
    return netns_unavailable()


@pytest.fixture(scope="session")
def podman_env(tmp_path_factory) -> dict:
    """This machine's podman settings: runc (crun refuses the hybrid cgroup mounts of some VMs) and default ulimits
    no higher than this process may set (podman's default 1048576 open files fails where the hard limit is lower)."""
    why = _runtime_unavailable()
    if why:
        pytest.skip(why)
    conf = tmp_path_factory.mktemp("podman") / "containers.conf"
    nofile = resource.getrlimit(resource.RLIMIT_NOFILE)[1]
    conf.write_text(f'[containers]\ndefault_ulimits = ["nofile={nofile}:{nofile}", "nproc=32768:32768"]\n'
                    f'[engine]\nruntime = "runc"\n')
    return dict(os.environ, CONTAINERS_CONF=str(conf),
                PATH=os.path.dirname(sys.executable) + os.pathsep + os.environ["PATH"])


@pytest.fixture(scope="session")
def image(podman_env) -> str:
    """The image, built (or brought up to date from podman's cached steps) by launch/image/build.sh."""
    tag = "localhost/pipeinfer:test"
    p = subprocess.run(["bash", str(ROOT / "launch" / "image" / "build.sh"), tag], capture_output=True, text=True,
                       env=podman_env, timeout=3600)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    print(p.stdout.splitlines()[-1])  # "[image] TAG built in N s (SIZE)"
    return tag


@pytest.fixture(scope="module")
def arch_model(tmp_path_factory):
    """synth_arch.make_arch_gguf's model of a variant by name ("f32" or "q8_0"), written once per test module."""
    from synth_arch import make_arch_gguf
    d, made = tmp_path_factory.mktemp("arch"), {}

    def get(name, qtype="f32"):
        if (name, qtype) not in made:
            made[name, qtype] = make_arch_gguf(d / f"{name}-{qtype}.gguf", name, qtype=qtype)
        return made[name, qtype]
    return get
