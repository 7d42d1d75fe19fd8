"""pipeinfer's image against this checkout's venv on the same emulated hosts: the same `pipeinfer launch ... --
generate` run from the venv (every host its install) and with --image (every rank in a container of the image),
each as a first start on new hosts (empty caches: the layers travel, stage files are cut, exact batch limits are
probed) and again (warm caches), side by side in one run, rounds in an order that rotates, medians. Also the image's
size, its archive (what `podman save` writes, and gzip -1 of it) and the seconds to save and load it.

    python launch/bench/bench_image.py [--image localhost/pipeinfer:0.1.0] [--rounds 2] [-n 64]
                                       [--out results/bench_image.csv]

Needs root, podman and the image (launch/image/build.sh). 2 hosts, one rank of 1 thread each (ranks x threads = 2,
this machine's cores); the default target with no draft (--mode iterative), the model on h0 only.
startup: the command's wall time to its first token (wall time - generation time); tokens/s: the generation's own.
Prints the ratios image / venv.
"""
from __future__ import annotations

import argparse
import gzip
import os
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # launch/: the shared harness
import quiet  # noqa: E402
from harness import CLUSTER, JOB_TAG, ROOT, new_tag, on_path, write_csv  # noqa: E402
from quiet import generation_row, run_quietly, timed  # noqa: E402

on_path()
from pipeinfer import __version__  # noqa: E402
from pipeinfer.engine.models import resolve_model  # noqa: E402

BIN = Path(sys.executable).parent
PROMPT = "Write a Python function that checks whether a number is prime."
MPI_TCP = ["-iface", "brpi", "-genv", "UCX_TLS", "tcp", "-genv", "FI_PROVIDER", "tcp"]


def podman_env(folder: Path) -> dict:
    """podman as the tests run it here: runc, default ulimits within this process's hard limits (docs/containers.md,
    "When podman refuses")."""
    conf = folder / "containers.conf"
    nofile = resource.getrlimit(resource.RLIMIT_NOFILE)[1]
    conf.write_text(f'[containers]\ndefault_ulimits = ["nofile={nofile}:{nofile}", "nproc=32768:32768"]\n'
                    '[engine]\nruntime = "runc"\n')
    return dict(os.environ, CONTAINERS_CONF=str(conf), PATH=f"{BIN}{os.pathsep}{os.environ['PATH']}")


def archive(image: str, folder: Path, env: dict) -> dict:
    """The image's size, its docker-archive's (and gzip -1 of that) and the seconds `podman save` takes and `podman
    load` into a store without the image (as on a new host) takes."""
    size = int(subprocess.run(["podman", "image", "inspect", image, "--format", "{{.Size}}"], env=env, check=True,
                              capture_output=True, text=True).stdout)
    tar = folder / "image.tar"
    t = time.monotonic()
    subprocess.run(["podman", "save", "--format", "docker-archive", "-o", str(tar), image], env=env, check=True,
                   capture_output=True)
    save_s = time.monotonic() - t
    with open(tar, "rb") as f:
        gz = len(gzip.compress(f.read(), compresslevel=1))
    subprocess.run(["podman", "rmi", image], env=env, check=True, capture_output=True)
    t = time.monotonic()
    subprocess.run(["podman", "load", "-q", "-i", str(tar)], env=env, check=True, capture_output=True)
    load_s = time.monotonic() - t
    out = {"image_mb": round(size / 1e6), "archive_mb": round(tar.stat().st_size / 1e6), "gzip_mb": round(gz / 1e6),
           "save_s": round(save_s, 2), "load_s": round(load_s, 2)}
    tar.unlink()
    return out


def job(install: str, image: str, model: str, disks: Path, args: list[str], env: dict, first: bool) -> dict:
    """One `pipeinfer launch` of generate on h0 and h1; `disks` holds each host's caches, emptied for a `first`
    start (also when run_quietly runs it again)."""
    hosts = disks.parent / "hosts"
    hosts.write_text("h0\nh1\n")
    netns = dict(NETNS_DISKS=str(disks), NETNS_HIDE=str(Path(model).parent))
    if install == "image":
        ssh = " ".join(["env", "NETNS_ENTER=nsenter", *(f"{k}={v}" for k, v in netns.items()),
                        str(CLUSTER / "netns-exec")])
        env = dict(env, PIPEINFER_IMAGE_SSH=ssh, PIPEINFER_IMAGE_CACHE=str(disks / "cache-{host}"))
        launch = ["--image", image, *(f"--mpi-arg={a}" for a in MPI_TCP)]
    else:
        env = dict(env, **netns)
        launch = [f"--mpi-arg={a}" for a in [*MPI_TCP, "-launcher", "ssh", "-launcher-exec",
                                              str(CLUSTER / "netns-exec")]]
    cmd = [sys.executable, "-m", "pipeinfer", "launch", "--hostfile", str(hosts), *launch, "--", "generate",
           "-m", model, *args, "--json"]
    if first:
        cmd = ["bash", "-c", 'rm -rf "$0" && mkdir "$0" && exec "$@"', str(disks), *cmd]
    proc, pct = run_quietly(timed(cmd), env=dict(env, **quiet.OWN_ENV))
    if proc.returncode:
        raise SystemExit(f"{install} failed ({proc.returncode}):\n{proc.stderr[-3000:]}")
    return {"install": install, **generation_row(proc, pct)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--image", default=f"localhost/pipeinfer:{__version__}")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("-n", type=int, default=64)
    ap.add_argument("--out", default=str(ROOT / "results" / "bench_image.csv"))
    a = ap.parse_args()
    model = str(resolve_model("qwen2.5-coder-1.5b"))
    args = ["-p", PROMPT, "-n", str(a.n), "-t", "1", "--mode", "iterative", "--ignore-eos"]
    work = Path(tempfile.mkdtemp(prefix="pipeinfer-bench-image-"))
    env = podman_env(work)
    sizes = archive(a.image, work, env)
    print(f"image {a.image}: {sizes}", flush=True)
    up = subprocess.run(["bash", str(CLUSTER / "netns-cluster.sh"), "up", "2"], env=env, capture_output=True, text=True)
    if up.returncode:
        raise SystemExit(f"netns-cluster.sh up 2: {up.stderr[-2000:]}")
    rows = []
    try:
        quiet.OWN_ENV = {JOB_TAG: new_tag()}  # the containers' processes are not this process's children
        for r in range(a.rounds):
            for install in (["venv", "image"] if r % 2 == 0 else ["image", "venv"]):
                disks = work / f"r{r}-{install}" / "disks"
                disks.mkdir(parents=True)
                for start in ("first", "warm"):
                    row = {"round": r, "start": start,
                           **job(install, a.image, model, disks, args, env, first=start == "first")}
                    print(f"round {r} {install:5s} {start:5s} start {row['startup_s']:6.2f} s  "
                          f"{row['tokens_per_s']:6.2f} tokens/s  (foreign CPU {row['foreign_cpu_pct']}%)", flush=True)
                    rows.append(row)
    finally:
        subprocess.run(["bash", str(CLUSTER / "netns-cluster.sh"), "down", "2"], env=env, capture_output=True)
        shutil.rmtree(work, ignore_errors=True)
    texts = {row.pop("text") for row in rows}
    med = {(i, s): {k: statistics.median(row[k] for row in rows if (row["install"], row["start"]) == (i, s))
                    for k in ("startup_s", "tokens_per_s")} for i in ("venv", "image") for s in ("first", "warm")}
    for row in rows:
        row.update(same_text=len(texts) == 1, **sizes)
    for s in ("first", "warm"):
        v, i = med[("venv", s)], med[("image", s)]
        print(f"{s} start: image {i['startup_s']:.2f} s / venv {v['startup_s']:.2f} s = "
              f"x{i['startup_s'] / v['startup_s']:.3f};"
              f" tokens/s image {i['tokens_per_s']:.2f} / venv {v['tokens_per_s']:.2f} = "
              f"x{i['tokens_per_s'] / v['tokens_per_s']:.3f}")
    print(f"2 emulated hosts (1 Gbit/s), iterative, {a.n} tokens, medians of {a.rounds} rounds; same text: "
          f"{len(texts) == 1}")
    write_csv(a.out, rows)
    print(f"wrote {a.out}")


if __name__ == "__main__":
    main()
