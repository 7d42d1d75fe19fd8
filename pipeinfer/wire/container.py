"""Ranks inside pipeinfer's image (launch/image): `pipeinfer launch --image IMAGE` starts each host's MPICH proxy, and
the ranks it forks, in a container of IMAGE on that host (podman or docker; the host's network, IPC and host name,
so MPI, shared memory and the messages' host names are the host's own). Inside a Slurm allocation each task of the
job step (srun) starts its rank in a container instead (step_command).

Hydra reaches a host through its ssh launcher; `pipeinfer-image-exec` (main below) stands in for ssh: it runs
ssh (or $PIPEINFER_IMAGE_SSH) to the host with `bash -c '... podman run ... IMAGE hydra_pmi_proxy ...'` as the
command (each host needs bash and podman, or docker). The image's
MPICH is the pinned wheel, so the launcher here and every proxy are of one version. What a container sees of its
host: the pipeinfer cache (models fetched there, stage files, received weights) at the image's cache folder, and
each folder of $PIPEINFER_IMAGE_VOLUMES that the host has, at the same path (launch adds the folders of the paths
in the job's arguments: the model, a --results file, the supervisor's socket). The variables, all read by the
launcher's environment (launch sets the first two):
- PIPEINFER_IMAGE: the image;
- PIPEINFER_IMAGE_VOLUMES: host folders, ":"-separated;
- PIPEINFER_IMAGE_RUNTIME: podman (default) or docker, on every host;
- PIPEINFER_IMAGE_SSH: how a host is reached [ssh];
- PIPEINFER_IMAGE_CACHE: each host's cache folder ({host}: its name) [$HOME/.cache/pipeinfer there];
- PIPEINFER_IMAGE_OPTIONS: more options for `podman run` (e.g. --ulimit or --cpuset-cpus).
"""
from __future__ import annotations

import os
import shlex
import shutil
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path

IMAGE_ENV = "PIPEINFER_IMAGE"
VOLUMES_ENV = "PIPEINFER_IMAGE_VOLUMES"
RUNTIME_ENV = "PIPEINFER_IMAGE_RUNTIME"
SSH_ENV = "PIPEINFER_IMAGE_SSH"
CACHE_ENV = "PIPEINFER_IMAGE_CACHE"
OPTIONS_ENV = "PIPEINFER_IMAGE_OPTIONS"

RANK_PYTHON = "/opt/pipeinfer/bin/python"  # the image's venv (launch/image/Containerfile)
IMAGE_CACHE = "/root/.cache/pipeinfer"     # the cache folder of pipeinfer in the image (its user is root)
EXEC_NAME = "pipeinfer-image-exec"         # the ssh stand-in (pyproject's scripts)
PROXY = "hydra_pmi_proxy"
# variables of this host's install and cache that mean nothing inside the image (launcher.DEFAULT_ENV_FORWARD
# forwards them otherwise)
HOST_ONLY = frozenset({"PATH", "LD_LIBRARY_PATH", "PYTHONPATH", "VIRTUAL_ENV", "PIPEINFER_CACHE",
                       "PIPEINFER_STAGE_CACHE"})
SSH_OPTIONS_WITH_VALUE = "BbcDEeFIiJLlmOopQRSWw"


def in_image(environ: Mapping[str, str]) -> bool:
    """Whether this job's ranks run in the image (`launch --image`)."""
    return bool(environ.get(IMAGE_ENV))


def rank_python(environ: Mapping[str, str]) -> str:
    """The Python every rank runs: the image's where the ranks run in it, else this one's (the same install)."""
    return RANK_PYTHON if in_image(environ) else sys.executable


def env_forward(names: Sequence[str], environ: Mapping[str, str]) -> list[str]:
    """The variables to forward to the ranks: in the image, none that name this host's install or cache."""
    return [n for n in names if not (in_image(environ) and n in HOST_ONLY)]


def exec_path() -> str:
    """The ssh stand-in Hydra runs (its launcher-exec): beside this Python, else on PATH."""
    beside = Path(sys.executable).with_name(EXEC_NAME)
    found = str(beside) if os.access(beside, os.X_OK) else shutil.which(EXEC_NAME)
    if found is None:
        raise RuntimeError(f"{EXEC_NAME} is not installed beside {sys.executable} (pip install -e . installs it)")
    return found


def launcher_args() -> list[str]:
    """MPICH launcher options that start every host's proxy in the image."""
    return ["-launcher", "ssh", "-launcher-exec", exec_path()]


def volumes_for(args: Sequence[str], cwd: str | None = None) -> list[str]:
    """The folders the ranks need of this host, at the same path in the container: the folder of every existing path
    among `args` (a word or the value of --opt=value; relative ones from cwd; a word without "/" only where it is a
    file there, so that `--mode pipeinfer` in a checkout is no path), each once, in order, none inside another."""
    cwd = cwd or os.getcwd()
    out: list[str] = []
    for word in args:
        value = word.split("=", 1)[1] if word.startswith("--") and "=" in word else word
        if not value or value.startswith("-") or ("/" not in value and not os.path.isfile(os.path.join(cwd, value))):
            continue
        path = Path(cwd, value).resolve() if not os.path.isabs(value) else Path(value)
        folder = path if path.is_dir() else path.parent
        if path.exists() or folder.is_dir():
            if str(folder) not in out and str(folder) != "/":
                out.append(str(folder))
    return [f for f in out if not any(Path(f).is_relative_to(o) and f != o for o in out)]


def _volumes(environ: Mapping[str, str]) -> list[str]:
    """The host folders of VOLUMES_ENV."""
    return [v for v in environ.get(VOLUMES_ENV, "").split(":") if v]


def with_volumes(environ: Mapping[str, str], folders: Sequence[str]) -> dict[str, str]:
    """`environ`'s image variables with `folders` added to the volumes (nothing added outside the image)."""
    if not in_image(environ) or not folders:
        return {}
    have = _volumes(environ)
    return {VOLUMES_ENV: ":".join(have + [f for f in folders if f not in have])}


def split_ssh_argv(argv: Sequence[str]) -> tuple[list[str], str, list[str]]:
    """(ssh options, host, command words) of the way Hydra calls its ssh launcher: `[opts] [USER@]HOST CMD...`."""
    opts: list[str] = []
    i = 0
    while i < len(argv) and argv[i].startswith("-"):
        opt = argv[i]
        opts.append(opt)
        i += 1
        if opt == "--":
            opts.pop()
            break
        letters = opt[1:]
        for k, c in enumerate(letters):
            if c in SSH_OPTIONS_WITH_VALUE:
                if k == len(letters) - 1:
                    if i >= len(argv):
                        raise ValueError(f"ssh option -{c} needs a value")
                    opts.append(argv[i])
                    i += 1
                break
    if i >= len(argv):
        raise ValueError("no host given (usage: pipeinfer-image-exec [ssh options] HOST COMMAND...)")
    return opts, argv[i], list(argv[i + 1:])


def _run_script(environ: Mapping[str, str], host: str, run_options: str, command: str) -> str:
    """A bash script that runs `command` in the image on the host the shell word `host` names: the host's cache
    (CACHE_ENV, {host} replaced) at the image's cache folder, each folder of VOLUMES_ENV that the host has at its own
    path, the host's network, IPC and name, then `run_options` and OPTIONS_ENV."""
    image = environ.get(IMAGE_ENV)
    if not image:
        raise ValueError(f"{IMAGE_ENV} is not set: which image to run")
    cache = shlex.quote(environ[CACHE_ENV]) if environ.get(CACHE_ENV) else '"$HOME/.cache/pipeinfer"'
    volumes = " ".join(shlex.quote(v) for v in _volumes(environ)
                       if v != IMAGE_CACHE) or '""'  # (the image's cache folder is the host's cache already)
    run = [environ.get(RUNTIME_ENV, "podman"), "run", "--rm", "--init", "--network", "host", "--ipc", "host",
           "--uts", "host"]
    return (f'host={host}; cache={cache}; cache=${{cache//"{{host}}"/$host}}; mkdir -p "$cache" && '
            f'vols=(-v "$cache:{IMAGE_CACHE}"); for v in {volumes}; do [ -e "$v" ] && vols+=(-v "$v:$v"); done; '
            f'exec {shlex.join(run)} {run_options} "${{vols[@]}}" {environ.get(OPTIONS_ENV, "")} '
            f'{shlex.quote(image)} {command}')


def container_command(host: str, words: Sequence[str], environ: Mapping[str, str]) -> str:
    """The command line that runs `words` (Hydra's proxy) in the image on `host`, as ssh hands it to that host's
    shell (the words joined with spaces), PIPEINFER_HOST passed on."""
    # the image's own proxy, on its PATH (Hydra gives this host's path to it, in double quotes)
    words = [PROXY if w.strip('"').endswith("/" + PROXY) else w for w in words]
    return "bash -c " + shlex.quote(_run_script(environ, shlex.quote(host), "-e PIPEINFER_HOST", " ".join(words)))


# what a task of a Slurm step passes into its container: the PMI connection's and the step's variables, and those
# pipeinfer, MPI and llama.cpp read (podman and docker take a trailing * as every variable so named); this host's
# cache folders are emptied
STEP_ENV = ("PMI_*", "SLURM_*", "PIPEINFER_*", "MPIR_*", "FI_*", "UCX_*", "MPI4PY_*", "GGML_*", "LLAMA_*", "OMP_*")


def step_command(environ: Mapping[str, str]) -> list[str]:
    """What each task of a Slurm job step runs in place of the rank's Python: the image's Python in a container on
    the task's node, with the step's variables (STEP_ENV) and the task's PMI connection: Slurm's pmi2 plugin gives
    each task an open descriptor (PMI_FD), which --preserve-fds passes on with its number (podman's option: Docker
    has none, nor its variables by a trailing *)."""
    if environ.get(RUNTIME_ENV, "podman") != "podman":
        raise ValueError(f"--image in a Slurm allocation runs podman ({RUNTIME_ENV}={environ[RUNTIME_ENV]}: it cannot "
                         "pass Slurm's PMI descriptor into the container); with Apptainer see docs/containers.md")
    passed = " ".join(f"-e {shlex.quote(name)}" for name in STEP_ENV)
    options = f"--preserve-fds $(( fd > 2 ? fd - 2 : 0 )) {passed} -e PIPEINFER_CACHE= -e PIPEINFER_STAGE_CACHE="
    # podman passes descriptors 3 .. 2+N: those below PMI_FD that the task lacks are opened on /dev/null
    descriptors = 'fd=${PMI_FD:-0}; for ((f = 3; f < fd; f++)); do [ -e /proc/$$/fd/$f ] || eval "exec $f</dev/null"; done; '
    return ["bash", "-c", descriptors + _run_script(environ, '"$SLURMD_NODENAME"', options, '"$@"'), "pipeinfer-step",
            RANK_PYTHON]


def main(argv: Sequence[str] | None = None) -> None:
    """pipeinfer-image-exec [ssh options] HOST COMMAND...: ssh to HOST running COMMAND in the image there."""
    argv = list(sys.argv[1:] if argv is None else argv)
    try:
        opts, host, words = split_ssh_argv(argv)
        remote = container_command(host.split("@")[-1], words, os.environ)
    except ValueError as e:
        sys.exit(f"{EXEC_NAME}: {e}")
    ssh = shlex.split(os.environ.get(SSH_ENV, "ssh"))
    os.execvp(ssh[0], [*ssh, *opts, host, remote])
