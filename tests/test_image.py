"""pipeinfer's image (launch/image), built from Debian's and PyPI's packages and run with podman as users run it: on
the emulated hosts (network namespaces, each its own disk view, only h0 holding the model), MPI across the containers
(`pipeinfer launch --image`), `generate` equal to this checkout's venv token for token, a supervised server
answering an OpenAI request and re-forming when a container's host is lost, `doctor` and `plan` with no network, and
a host without AVX-512 loading the AVX2 build of llama.cpp.

The first build takes about 10 minutes on 2 cores (llama.cpp once per CPU generation); podman keeps its steps, so
later runs rebuild only pipeinfer's own files (seconds)."""
from __future__ import annotations

import json
import os
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from helpers import (JOBS, NETNS, PROMPT_TEXT, ROOT, Server, job_references, real_model, stream_through_a_cut,
                     universal_newlines)

pytestmark = [pytest.mark.mpi, pytest.mark.slow]

MPI_TCP = ["--mpi-arg=-iface", "--mpi-arg=brpi", "--mpi-arg=-genv", "--mpi-arg=UCX_TLS", "--mpi-arg=tcp",
           "--mpi-arg=-genv", "--mpi-arg=FI_PROVIDER", "--mpi-arg=tcp"]
LIB = "/opt/pipeinfer/lib/python3.11/site-packages/llama_cpp/lib"


@pytest.fixture(scope="module")
def hosts(podman_env, tmp_path_factory):
    """Emulated hosts h0, h1, h2 (launch/cluster/netns-cluster.sh) and their hostfiles."""
    up = subprocess.run(["bash", str(NETNS), "up", "3"], capture_output=True, text=True, env=podman_env, timeout=120)
    assert up.returncode == 0, up.stderr[-2000:]
    d = tmp_path_factory.mktemp("hosts")
    (d / "two").write_text("h0\nh1\n")
    (d / "three").write_text("h0\nh1\nh2\n")
    try:
        yield d
    finally:
        subprocess.run(["bash", str(NETNS), "down", "3"], capture_output=True, env=podman_env, timeout=120)


def _on_hosts(podman_env: dict, disks: Path, model_dir: Path) -> dict:
    """The launcher's environment for containers on the emulated hosts: Hydra's ssh launcher reaches a host through
    netns-exec (entering its network namespace alone, as runc needs the machine's cgroup mounts); each host its own
    cache; the model's folder hidden on every host but h0."""
    ssh = (f"env NETNS_ENTER=nsenter NETNS_DISKS={disks} NETNS_HIDE={model_dir} "
           f"{ROOT / 'launch' / 'cluster' / 'netns-exec'}")
    return dict(podman_env, PIPEINFER_IMAGE_SSH=ssh, PIPEINFER_IMAGE_CACHE=str(disks / "cache-{host}"))


def _launch(image: str, hostfile: Path, args: list[str], env: dict, timeout: float = 300):
    return subprocess.run([sys.executable, "-m", "pipeinfer", "launch", "--image", image, "--hostfile", str(hostfile),
                           *MPI_TCP, "--", *args], capture_output=True, text=True, env=env, timeout=timeout)


def _venv_tokens(args: list[str]) -> list[int]:
    p = subprocess.run([sys.executable, "-m", "pipeinfer", *args, "--mode", "iterative", "--json"],
                       capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, p.stderr[-2000:]
    return json.loads(p.stdout)["tokens"]


def test_generate_on_two_hosts_from_the_image(image, hosts, podman_env, models, tmp_path):
    """PipeInfer with a draft model on h0 and h1, each rank in a container: the venv's tokens; h1 has no model and
    receives its layers from h0 into its own cache."""
    args = ["generate", "-m", str(models["q8"]), "--draft", str(models["draft90"]), "-p", PROMPT_TEXT, "--no-chat",
            "-n", "48", "-t", "1"]
    env = _on_hosts(podman_env, tmp_path, models["q8"].parent)
    p = _launch(image, hosts / "two", [*args, "--mode", "pipeinfer", "--json"], env)
    assert p.returncode == 0, p.stderr[-3000:]
    out = json.loads(p.stdout)
    assert out["tokens"] == _venv_tokens(args)
    assert out["ranges"] == [[0, 2], [2, 4]] and out["stats"]["n_draft_accepted"] > 0
    assert "sent rank 1 (h1)" in p.stderr
    assert list((tmp_path / "cache-h1" / "weights").glob("*.gguf")) and \
        not list((tmp_path / "cache-h0" / "weights").glob("*.gguf"))


@pytest.mark.real
def test_real_qwen_on_two_hosts_from_the_image(image, hosts, podman_env, tmp_path):
    """The real Qwen2.5-Coder-1.5B on h0 and h1 from the image (its llama.cpp built for every CPU generation, the
    best for this CPU loaded at run time) gives the venv's tokens (llama.cpp built for this CPU alone)."""
    model = Path(real_model("qwen2.5-coder-1.5b"))
    args = ["generate", "-m", str(model), "--prompt-name", "code", "-n", "64", "-t", "1"]
    p = _launch(image, hosts / "two", [*args, "--json"], _on_hosts(podman_env, tmp_path, model.parent), timeout=900)
    assert p.returncode == 0, p.stderr[-3000:]
    assert json.loads(p.stdout)["tokens"] == _venv_tokens(args)


def test_a_served_request_and_a_lost_host(image, hosts, podman_env, models, tmp_path):
    """`launch --image -- serve` on h0, h1, h2: one OpenAI request answered as the venv answers it; h2's link cut
    while three answers stream, the server re-forms on h0 and h1 and every answer is whole and the same."""
    env = _on_hosts(podman_env, tmp_path, models["q8"].parent)
    refs = job_references(models["q8"])
    srv = Server(["-m", str(models["q8"]), "--mode", "iterative", "-c", "2048", "--stall-timeout", "3"], None,
                 tmp_path / "serve.log", timeout=240, env=env,
                 command=[sys.executable, "-m", "pipeinfer", "launch", "--image", image, "--hostfile",
                          str(hosts / "three"), *MPI_TCP, "--", "serve"])
    try:
        from openai import OpenAI
        client = OpenAI(base_url=srv.base_url, api_key="none", max_retries=0)
        prompt, n = JOBS[0][:2]
        answer = client.completions.create(model="t-q8", prompt=prompt, max_tokens=n, temperature=0)
        assert universal_newlines(answer.choices[0].text) == refs[0]
        assert srv.health()["ranks"] == 3
        stream_through_a_cut(srv, refs)
    finally:
        code = srv.stop()
    assert code == 0, srv.text()[-3000:]
    assert "re-forming the pipeline without rank 2 (host h2)" in srv.text()


def test_doctor_and_plan_with_no_network(image, podman_env, tmp_path):
    """Inside the image with no network at all: `doctor` checks the host, `plan` prices described machines."""
    machines = tmp_path / "machines"
    machines.write_text("a # pipeinfer: cores=16 mem=64 link=1000\nb # pipeinfer: cores=16 mem=64 link=1000\n")
    run = ["podman", "run", "--rm", "--network", "none", "-v", f"{tmp_path}:{tmp_path}", image]
    doctor = subprocess.run([*run, "bash", "-c", f"echo localhost > {tmp_path}/h && pipeinfer doctor --hostfile "
                             f"{tmp_path}/h"], capture_output=True, text=True, env=podman_env, timeout=300)
    assert doctor.returncode == 0 and "no problem found" in doctor.stdout, doctor.stdout + doctor.stderr
    plan = subprocess.run([*run, "pipeinfer", "plan", "--machines", str(machines), "--model-size", "70b-q4_k_m"],
                          capture_output=True, text=True, env=podman_env, timeout=300)
    assert plan.returncode == 0 and "pipeinfer launch" in plan.stdout, plan.stdout + plan.stderr


def test_a_host_without_avx512_loads_the_avx2_build(image, podman_env, models, tmp_path):
    """The AVX-512 builds hidden (as on a host whose CPU lacks them): ggml loads the Haswell (AVX2) build and the
    tokens are this CPU's own."""
    hidden = [f"-v=/dev/null:{LIB}/libggml-cpu-{v}.so" for v in ("skylakex", "icelake", "zen4")]
    args = ["generate", "-m", str(models["q8"]), "-p", PROMPT_TEXT, "--no-chat", "-n", "24", "-t", "1"]
    p = subprocess.run(["podman", "run", "--rm", "--network", "none", *hidden, "-v",
                        f"{models['q8'].parent}:{models['q8'].parent}", image, "bash", "-c",
                        "python -c 'import llama_cpp; llama_cpp.llama_backend_init(); "
                        "print(sorted({l.split()[-1] for l in open(\"/proc/self/maps\") if \"libggml-cpu\" in l}))' "
                        f"&& pipeinfer {shlex.join(args)} --mode iterative --json"],
                       capture_output=True, text=True, env=podman_env, timeout=300)
    assert p.returncode == 0, p.stderr[-2000:]
    loaded, answer = p.stdout.splitlines()[0], p.stdout.splitlines()[-1]
    assert loaded == f"['{LIB}/libggml-cpu-haswell.so']"
    assert json.loads(answer)["tokens"] == _venv_tokens(args)
