"""srun against mpiexec on the same emulated hosts: the same `pipeinfer generate`, started by a real Slurm's srun
(launch/cluster/slurm-netns.sh: slurmctld, one slurmd per network namespace) and by MPICH's mpiexec over the emulated
cluster's ssh stand-in (launch/cluster/netns-exec), side by side in one run, rounds in an order that rotates, medians:

    python launch/bench/bench_slurm.py [--hosts 2] [--rounds 3] [-n 64] [--mode pipeinfer] [--out results/bench_slurm.csv]

Needs root and Debian's slurmctld, slurmd, slurm-client and munge. Each host is a rank of 1 thread (2 hosts: ranks x
threads = 2, this machine's cores); the default target, its default draft beside rank 0 (pipeinfer mode).
start-up: the command's wall time to its first token (wall time - generation time); tokens/s: pipeinfer's own
generation speed; same_text: the two launchers' texts are identical. Prints the ratios srun / mpiexec.
"""
from __future__ import annotations

import argparse
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # launch/: the shared harness
import quiet  # noqa: E402
from harness import CLUSTER, JOB_TAG, MPIEXEC, ROOT, new_tag, on_path, write_csv  # noqa: E402
from quiet import generation_row, run_quietly, timed  # noqa: E402

on_path()
from pipeinfer.wire.slurm import SRUN_ENV  # noqa: E402

BIN = Path(sys.executable).parent
PROMPT = "Write a Python function that checks whether a number is prime."
# MPI over the links (netns-cluster.sh: UCX would take shared memory between namespaces of one kernel)
LINK_ENV = {"UCX_TLS": "tcp", "FI_PROVIDER": "tcp"}


def slurm(state: Path, *args: str) -> None:
    env = dict(os.environ, SLURM_NETNS_DIR=str(state), PATH=f"{BIN}{os.pathsep}{os.environ['PATH']}", **LINK_ENV)
    p = subprocess.run(["bash", str(CLUSTER / "slurm-netns.sh"), *args], env=env, capture_output=True,
                       text=True, timeout=300)
    if p.returncode:
        raise SystemExit(f"slurm-netns.sh {' '.join(args)}: {p.stderr[-2000:]}")


def job(launcher: str, n_hosts: int, args: list[str], state: Path) -> dict:
    generate = [str(BIN / "python"), "-m", "mpi4py", "-m", "pipeinfer", "generate", *args, "--json"]
    env = dict(os.environ, PATH=f"{BIN}{os.pathsep}{os.environ['PATH']}", SLURM_CONF=str(state / "slurm.conf"),
               **LINK_ENV, **quiet.OWN_ENV)
    hostfile = None
    if launcher == "srun":  # as `pipeinfer launch` runs it: the mpich wheel on its OFI netmod (wire/slurm.SRUN_ENV)
        env.update(SRUN_ENV["mpich"])
        cmd = ["srun", "--mpi=pmi2", "-N", str(n_hosts), "-n", str(n_hosts), "--cpu-bind=none", *generate]
    else:
        hostfile = Path(tempfile.mkstemp(suffix=".hosts")[1])
        hostfile.write_text("".join(f"h{i}:1\n" for i in range(n_hosts)))
        cmd = [MPIEXEC, "-iface", "brpi", "-f", str(hostfile), "-launcher", "ssh", "-launcher-exec",
               str(CLUSTER / "netns-exec"), *[a for k, v in LINK_ENV.items() for a in ("-genv", k, v)],
               "-n", str(n_hosts), *generate]
    try:
        proc, pct = run_quietly(timed(cmd), env=env)
    finally:
        if hostfile:
            hostfile.unlink()
    if proc.returncode:
        raise SystemExit(f"{launcher} failed ({proc.returncode}):\n{proc.stderr[-3000:]}")
    return {"launcher": launcher, **generation_row(proc, pct)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--hosts", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("-n", type=int, default=64)
    ap.add_argument("--mode", default="pipeinfer")
    ap.add_argument("--out", default=str(ROOT / "results" / "bench_slurm.csv"))
    a = ap.parse_args()
    args = ["-p", PROMPT, "-n", str(a.n), "-t", "1", "--mode", a.mode, "--ignore-eos"]
    state = Path(tempfile.mkdtemp(prefix="pipeinfer-bench-slurm-"))
    os.chmod(state, 0o755)
    slurm(state / "s", "up", str(a.hosts))
    rows = []
    try:
        quiet.OWN_ENV = {JOB_TAG: new_tag()}  # srun's ranks are not this process's children: their tag marks them
        job("srun", a.hosts, args, state / "s")  # warm-up: stage files, exact batch limits, page cache
        for r in range(a.rounds):
            order = ["srun", "mpiexec"] if r % 2 == 0 else ["mpiexec", "srun"]
            for launcher in order:
                row = {"round": r, **job(launcher, a.hosts, args, state / "s")}
                print(f"round {r} {launcher:8s} start-up {row['startup_s']:6.2f} s  {row['tokens_per_s']:6.2f} "
                      f"tokens/s  (foreign CPU {row['foreign_cpu_pct']}%)", flush=True)
                rows.append(row)
    finally:
        slurm(state / "s", "down")
        shutil.rmtree(state, ignore_errors=True)
    texts = {row["text"] for row in rows}
    for row in rows:
        row["same_text"] = len(texts) == 1
        row.pop("text")
    med = {lc: {k: statistics.median(row[k] for row in rows if row["launcher"] == lc)
                for k in ("startup_s", "tokens_per_s")} for lc in ("srun", "mpiexec")}
    print(f"{a.hosts} emulated hosts (1 Gbit/s), {a.mode}, {a.n} tokens, medians of {a.rounds} rounds: start-up srun "
          f"{med['srun']['startup_s']:.2f} s / mpiexec {med['mpiexec']['startup_s']:.2f} s = "
          f"x{med['srun']['startup_s'] / med['mpiexec']['startup_s']:.3f}; tokens/s srun "
          f"{med['srun']['tokens_per_s']:.2f} / mpiexec {med['mpiexec']['tokens_per_s']:.2f} = "
          f"x{med['srun']['tokens_per_s'] / med['mpiexec']['tokens_per_s']:.3f}; same text: {len(texts) == 1}")
    write_csv(a.out, rows)
    print(f"wrote {a.out}")


if __name__ == "__main__":
    main()
