"""Ranks in pipeinfer's image (wire/container.py, launch/image): the ssh stand-in Hydra runs, the container command a
host's shell runs (run here by a real sh against a podman that prints its arguments), the folders a job mounts,
launch --image, the supervised server's jobs, and the build's choice of llama.cpp's CPU variants. The image itself
is built and run in tests/test_image.py."""
from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest
from click.testing import CliRunner

from pipeinfer.cli.main import main
from pipeinfer.wire import container
from pipeinfer.wire.launcher import Host, build_command

ROOT = Path(__file__).resolve().parents[1]
PROXY_ARGS = ["--control-port", "h0:4040", "--rmk", "user", "--proxy-id", "1"]


@pytest.fixture(autouse=True)
def _mpi4py_loads_the_mpich_wheel(monkeypatch):
    for name in [k for k in os.environ if k.startswith(("MPI4PY_", "PIPEINFER_IMAGE", "SLURM_"))]:
        monkeypatch.delenv(name)


@pytest.mark.parametrize("argv, expected", [
    # as Hydra calls its ssh launcher
    (["-x", "h1", '"/venv/bin/hydra_pmi_proxy"', *PROXY_ARGS],
     (["-x"], "h1", ['"/venv/bin/hydra_pmi_proxy"', *PROXY_ARGS])),
    (["-p", "2222", "-oBatchMode=yes", "-o", "X=y", "me@n3", "cmd"],
     (["-p", "2222", "-oBatchMode=yes", "-o", "X=y"], "me@n3", ["cmd"])),
    (["-xTp22", "n4", "a", "b"], (["-xTp22"], "n4", ["a", "b"])),
    (["--", "n5", "c"], ([], "n5", ["c"])),
])
def test_ssh_arguments(argv, expected):
    assert container.split_ssh_argv(argv) == expected


@pytest.mark.parametrize("argv, why", [([], "no host given"), (["-x"], "no host given"), (["-p"], "-p needs a value")])
def test_ssh_arguments_missing(argv, why):
    with pytest.raises(ValueError, match=why):
        container.split_ssh_argv(argv)


def _fake_runtime(tmp_path: Path) -> Path:
    """A `podman` that prints each argument it gets on a line of its own."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    fake = bin_dir / "podman"
    fake.write_text('#!/bin/sh\nfor a in "$@"; do echo "$a"; done\n')
    fake.chmod(0o755)
    return bin_dir


def _run_on_host(command: str, tmp_path: Path, **env) -> list[str]:
    bin_dir = _fake_runtime(tmp_path)
    p = subprocess.run(["sh", "-c", command], capture_output=True, text=True, timeout=30,
                       env={"PATH": f"{bin_dir}:/usr/bin:/bin", "HOME": str(tmp_path / "home"), **env})
    assert p.returncode == 0, p.stderr
    return p.stdout.splitlines()


def test_the_container_a_host_runs(tmp_path):
    """The host's cache (its own, by {host}) at the image's cache folder, each volume the host has at its path (one
    it lacks left out), the host's network, IPC and name, PIPEINFER_HOST, the image's own proxy."""
    models = tmp_path / "models"
    models.mkdir()
    environ = {container.IMAGE_ENV: "localhost/pipeinfer:1", container.CACHE_ENV: str(tmp_path / "c-{host}"),
               container.VOLUMES_ENV: f"{models}:{tmp_path / 'only-elsewhere'}:{container.IMAGE_CACHE}",
               container.OPTIONS_ENV: "--ulimit nofile=1024:1024"}
    command = container.container_command("h1", ['"/venv/bin/hydra_pmi_proxy"', *PROXY_ARGS], environ)
    args = _run_on_host(command, tmp_path)
    assert args == ["run", "--rm", "--init", "--network", "host", "--ipc", "host", "--uts", "host",
                    "-e", "PIPEINFER_HOST", "-v", f"{tmp_path}/c-h1:{container.IMAGE_CACHE}",
                    "-v", f"{models}:{models}", "--ulimit", "nofile=1024:1024", "localhost/pipeinfer:1",
                    "hydra_pmi_proxy", *PROXY_ARGS]
    assert (tmp_path / "c-h1").is_dir()


def test_the_default_cache_is_the_hosts_own(tmp_path):
    command = container.container_command("n2", ["hydra_pmi_proxy"], {container.IMAGE_ENV: "img",
                                                                       container.RUNTIME_ENV: "podman"})
    args = _run_on_host(command, tmp_path)
    assert args[args.index("-v") + 1] == f"{tmp_path}/home/.cache/pipeinfer:{container.IMAGE_CACHE}"
    with pytest.raises(ValueError, match=container.IMAGE_ENV):
        container.container_command("n2", ["hydra_pmi_proxy"], {})


def test_the_ssh_stand_in_runs_ssh_with_the_container(tmp_path):
    """pipeinfer-image-exec as Hydra starts it: the ssh of PIPEINFER_IMAGE_SSH gets the options, the host and one
    command; a call without a host is one line and a non-zero exit."""
    env = {**os.environ, container.IMAGE_ENV: "img", container.SSH_ENV: "echo SSH"}
    exe = Path(sys.executable).with_name(container.EXEC_NAME)
    p = subprocess.run([str(exe), "-x", "n1", "/v/bin/hydra_pmi_proxy", "--proxy-id", "0"], capture_output=True,
                       text=True, env=env, timeout=30)
    assert p.returncode == 0 and p.stdout.startswith("SSH -x n1 bash -c 'host=n1; "), p.stdout + p.stderr
    assert p.stdout.rstrip().endswith("img hydra_pmi_proxy --proxy-id 0'")
    p = subprocess.run([str(exe), "-x"], capture_output=True, text=True, env=env, timeout=30)
    assert p.returncode != 0 and p.stderr.strip().count("\n") == 0 and "no host given" in p.stderr


def test_the_folders_a_job_needs(tmp_path, monkeypatch):
    """The folder of each path among the arguments (a word, --opt=value, relative), once, none inside another; a
    prompt is not a path."""
    (tmp_path / "m").mkdir()
    (tmp_path / "m" / "sub").mkdir()
    (tmp_path / "m" / "a.gguf").write_bytes(b"")
    (tmp_path / "out").mkdir()
    (tmp_path / "work").mkdir()
    (tmp_path / "work" / "rel.gguf").write_bytes(b"")
    monkeypatch.chdir(tmp_path / "work")
    args = ["generate", "-m", f"{tmp_path}/m/a.gguf", f"--results={tmp_path}/out/r.csv", "-p", "hi there / you",
            "--draft", "rel.gguf", "--prompt-file", f"{tmp_path}/m/sub/p.txt", "-n", "8"]
    assert container.volumes_for(args) == [f"{tmp_path}/m", f"{tmp_path}/out", f"{tmp_path}/work"]
    assert container.volumes_for([*args, str(tmp_path)]) == [str(tmp_path)]
    assert container.volumes_for(["-p", "hello", "-n", "3", "/"]) == []
    (tmp_path / "work" / "pipeinfer").mkdir()  # a checkout's package folder is no path of --mode pipeinfer
    assert container.volumes_for(["--mode", "pipeinfer"]) == []


def test_a_job_in_the_image_runs_the_images_python(tmp_path):
    """In the image: the image's Python, and nothing of this host's install or cache forwarded to the ranks."""
    environ = {"PATH": "/usr/bin", "VIRTUAL_ENV": "/v", "PIPEINFER_CACHE": "/c", "PIPEINFER_X": "1",
               container.IMAGE_ENV: "img", container.VOLUMES_ENV: "/m"}
    cmd = build_command([Host("a"), Host("b")], 2, "mpich", ["generate"], hostfile=tmp_path / "h", environ=environ)
    assert cmd[cmd.index("-genvlist") + 1] == "PIPEINFER_IMAGE,PIPEINFER_IMAGE_VOLUMES,PIPEINFER_X"
    assert cmd[-6:] == [container.RANK_PYTHON, "-m", "mpi4py", "-m", "pipeinfer", "generate"]
    plain = build_command([Host("a")], 1, "mpich", ["generate"], hostfile=tmp_path / "h", environ={"PATH": "/b"})
    assert plain[plain.index("-genvlist") + 1] == "PATH" and plain[-6] == sys.executable


def test_launch_image_dry_run(models, tmp_path):
    """launch --image: Hydra's ssh launcher is the stand-in, the ranks run the image's Python, the model's folder
    and this host's cache are mounted; nothing is left in this process's environment."""
    hf = tmp_path / "hosts"
    hf.write_text("h0\nh1\n")
    res = CliRunner().invoke(main, ["launch", "--image", "localhost/pipeinfer:t", "--hostfile", str(hf), "--dry-run",
                                    "--", "generate", "-m", str(models["q8"]), "-n", "4"])
    assert res.exit_code == 0, res.output
    first = res.output.splitlines()[0]
    assert first.startswith("PIPEINFER_IMAGE=localhost/pipeinfer:t PIPEINFER_IMAGE_VOLUMES=")
    assert f"{models['q8'].parent}" in first.split()[1]
    assert f"-launcher ssh -launcher-exec {Path(sys.executable).with_name(container.EXEC_NAME)} " in first
    assert f" {container.RANK_PYTHON} -m mpi4py -m pipeinfer generate -m {models['q8']}" in first
    assert container.IMAGE_ENV not in os.environ


def test_the_supervised_servers_jobs_run_in_the_image(models, tmp_path):
    """launch --image -- serve: the server's jobs start in the image, rank 0 reaching the server's socket through
    its work folder, mounted."""
    hf = tmp_path / "hosts"
    hf.write_text("h0\nh1\n")
    res = CliRunner().invoke(main, ["launch", "--image", "img:1", "--hostfile", str(hf), "--dry-run", "--",
                                    "serve", "-m", str(models["q8"]), "--port", "9000"])
    assert res.exit_code == 0, res.output
    lines = res.output.splitlines()
    assert lines[0].startswith("PIPEINFER_IMAGE=img:1 ") and "-launcher-exec" in lines[0]
    job = lines[2]
    socket_dir = job.split()[-1].rsplit("/", 1)[0]
    assert job.startswith("# PIPEINFER_IMAGE_VOLUMES=") and socket_dir in job.split()[1], job
    assert f" {container.RANK_PYTHON} -m mpi4py -m pipeinfer attach " in job


def test_image_refusal(models, tmp_path, monkeypatch):
    """--image with mpi4py on Open MPI (the image's MPI is the mpich wheel): one line, no traceback."""
    hf = tmp_path / "hosts"
    hf.write_text("h0\n")
    args = ["launch", "--image", "img", "--hostfile", str(hf), "--dry-run", "--", "generate", "-m", str(models["q8"])]
    monkeypatch.setenv("MPI4PY_MPIABI", "openmpi")
    from pipeinfer.wire import launcher
    if launcher.mpi4py_library().kind == "openmpi":
        res = CliRunner().invoke(main, args)
        assert res.exit_code != 0 and "MPICH" in res.output and "Traceback" not in res.output


def test_a_slurm_task_runs_its_rank_in_the_image(tmp_path):
    """A task of an srun step (bash, as srun starts it): the container with the PMI descriptor passed on by number
    (--preserve-fds), the step's variables by name (this host's cache folders emptied), the node's own cache
    ({host}: SLURMD_NODENAME), the volumes the node has, then the rank's command."""
    models = tmp_path / "models"
    models.mkdir()
    environ = {container.IMAGE_ENV: "img:2", container.CACHE_ENV: str(tmp_path / "c-{host}"),
               container.VOLUMES_ENV: f"{models}:{tmp_path / 'elsewhere'}"}
    prefix = container.step_command(environ)
    assert prefix[:2] == ["bash", "-c"] and prefix[-1] == container.RANK_PYTHON
    bin_dir = _fake_runtime(tmp_path)
    p = subprocess.run([*prefix, "-m", "mpi4py", "-m", "pipeinfer", "generate"], capture_output=True, text=True,
                       timeout=30, env={"PATH": f"{bin_dir}:/usr/bin:/bin", "PMI_FD": "6", "SLURMD_NODENAME": "n7"})
    assert p.returncode == 0, p.stderr
    args = p.stdout.splitlines()
    assert args[:12] == ["run", "--rm", "--init", "--network", "host", "--ipc", "host", "--uts", "host",
                         "--preserve-fds", "4", "-e"]
    passed = [args[i + 1] for i, a in enumerate(args) if a == "-e"]
    assert passed[:3] == ["PMI_*", "SLURM_*", "PIPEINFER_*"] and "PIPEINFER_CACHE=" in passed
    mounts = [args[i + 1] for i, a in enumerate(args) if a == "-v"]
    assert mounts == [f"{tmp_path}/c-n7:{container.IMAGE_CACHE}", f"{models}:{models}"]
    assert args[-7:] == ["img:2", container.RANK_PYTHON, "-m", "mpi4py", "-m", "pipeinfer", "generate"]


def test_docker_cannot_run_a_slurm_task(models, tmp_path, monkeypatch):
    """Docker has no --preserve-fds for Slurm's PMI descriptor: launch --image in an allocation with
    PIPEINFER_IMAGE_RUNTIME=docker is one line before anything starts."""
    from pipeinfer.wire import slurm
    monkeypatch.setattr(slurm, "hostnames", lambda nodelist: ["n1", "n2"])
    monkeypatch.setenv("SLURM_JOB_ID", "7")
    monkeypatch.setenv("SLURM_JOB_NODELIST", "n[1-2]")
    monkeypatch.setenv(container.RUNTIME_ENV, "docker")
    res = CliRunner().invoke(main, ["launch", "--image", "img", "--dry-run", "--", "generate", "-m", str(models["q8"])])
    assert res.exit_code != 0 and "runs podman" in res.output and "Traceback" not in res.output, res.output
    assert res.output.count("\n") == 1


def test_the_srun_step_of_a_job_in_the_image(tmp_path):
    """srun_command under --image: the step's tasks run step_command, then `-m mpi4py -m pipeinfer ARGS`."""
    from pipeinfer.wire.slurm import srun_command
    environ = {container.IMAGE_ENV: "img"}
    cmd, _ = srun_command([Host("n1"), Host("n2")], 2, "mpich", ["generate"], task_file=str(tmp_path / "t"),
                          environ=environ)
    prefix = container.step_command(environ)
    at = cmd.index("bash")
    assert cmd[at:at + len(prefix)] == prefix and cmd[at + len(prefix):] == ["-m", "mpi4py", "-m", "pipeinfer",
                                                                              "generate"]


def _variants_module():
    spec = importlib.util.spec_from_file_location("llama_variants", ROOT / "launch" / "image" / "llama_variants.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


GGML_CMAKE = """if (GGML_CPU_ALL_VARIANTS)
    if (GGML_SYSTEM_ARCH STREQUAL "x86")
        ggml_add_cpu_backend_variant(x64)
        ggml_add_cpu_backend_variant(sse42              SSE42)
        ggml_add_cpu_backend_variant(haswell            SSE42 AVX F16C FMA AVX2 BMI2)
        if (NOT MSVC)
            ggml_add_cpu_backend_variant(zen4           SSE42 AVX F16C FMA AVX2 BMI2 AVX512 AVX512_VBMI)
            ggml_add_cpu_backend_variant(sapphirerapids SSE42 AVX F16C FMA AVX2 BMI2 AVX512 AMX_TILE AMX_INT8)
        endif()
    elseif(GGML_SYSTEM_ARCH STREQUAL "ARM")
            ggml_add_cpu_backend_variant(armv8.0_1)
"""


def test_the_images_cpu_variants():
    """The image's llama.cpp: the chosen x86 variants (no AMX one: its path crashes on 2+ rows), the other
    architectures' lines untouched, and each variant's library installed beside libllama."""
    v = _variants_module()
    kept = v.keep_variants(GGML_CMAKE)
    assert "(x64)" in kept and "(haswell " in kept and "(zen4 " in kept and "(armv8.0_1)" in kept
    assert "sse42" not in kept and "sapphirerapids" not in kept and "AMX" not in kept
    assert "sapphirerapids" not in v.VARIANTS
    top = v.install_variants("    llama_cpp_python_install_target(ggml-cpu)\n")
    assert [f"llama_cpp_python_install_target(ggml-cpu-{name})" in top for name in v.VARIANTS] == [True] * len(
        v.VARIANTS)
