"""Timing on a shared machine: run a benchmark command only while nothing else uses the CPU, and run it
again when something else did during it (this project's machine has 2 cores, shared with other work).

    from quiet import run_quietly
    proc, foreign_pct = run_quietly(cmd, env=..., cwd=...)

Foreign CPU is the CPU time of processes outside this script's process tree, sampled with psutil.
With BENCH_PAUSE_OTHERS=1 (a machine you own, where your own test jobs run beside the benchmark), other
Python and MPI processes are paused (SIGSTOP) for the length of each timed run and resumed after it,
instead of waiting for them to finish.
"""
from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import psutil

QUIET_PCT = 5.0        # foreign CPU, in % of one core averaged over a run, that still counts as quiet
MAX_WAIT_S = 900.0     # give up waiting for a quiet machine after this (then measure anyway, and say so)


OWN_ENV: dict[str, str] = {}  # a process whose environment has these values is the runs' own (ranks srun started)


def _tagged(pid: int) -> bool:
    if not OWN_ENV:
        return False
    try:
        env = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    except OSError:
        return False
    return all(f"{k}={v}".encode() in env for k, v in OWN_ENV.items())


def _ours() -> set[int]:
    """This process, its children, those OWN_ENV marks, and the kernel's threads (kthreadd, pid 2, and its
    children): these do the runs' own network work (softirqs of the emulated cluster's shaped links), not other
    users'."""
    me = psutil.Process(os.getpid())
    kernel = {2} | {p.pid for p in psutil.Process(2).children()} if psutil.pid_exists(2) else set()
    tagged = {p.pid for p in psutil.process_iter(["pid"]) if _tagged(p.info["pid"])}
    return {me.pid} | {p.pid for p in me.children(recursive=True)} | kernel | tagged


def _foreign_cpu_s() -> float:
    ours, total = _ours(), 0.0
    for p in psutil.process_iter(["pid", "cpu_times"]):
        if p.info["pid"] in ours or p.info["cpu_times"] is None:
            continue
        total += p.info["cpu_times"].user + p.info["cpu_times"].system
    return total


class _Meter:
    """Foreign CPU seconds over an interval; processes that start and end inside it are caught by sampling."""

    def __init__(self, every_s: float = 0.5):
        self.every_s, self.cpu_s, self._stop = every_s, 0.0, threading.Event()
        self._seen: dict[int, float] = {}
        self._thread = threading.Thread(target=self._loop, daemon=True)

    def _sample(self) -> None:
        ours = _ours()
        for p in psutil.process_iter(["pid", "cpu_times"]):
            pid, ct = p.info["pid"], p.info["cpu_times"]
            if pid in ours or ct is None:
                continue
            now = ct.user + ct.system
            before = self._seen.get(pid)
            if before is not None:
                self.cpu_s += max(0.0, now - before)
            elif self._started:
                self.cpu_s += now  # a process born during the interval: all of its time is in it
            self._seen[pid] = now

    def _loop(self) -> None:
        while not self._stop.wait(self.every_s):
            self._sample()

    def __enter__(self):
        self._started = False
        self._sample()
        self._started = True
        self._thread.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join()
        self._sample()


def wait_quiet(window_s: float = 3.0, log=print) -> bool:
    """Wait until other processes used < QUIET_PCT of a core for window_s; False if MAX_WAIT_S passed."""
    t_end, said = time.monotonic() + MAX_WAIT_S, False
    while time.monotonic() < t_end:
        with _Meter() as m:
            time.sleep(window_s)
        if 100 * m.cpu_s / window_s < QUIET_PCT:
            return True
        if not said:
            log(f"  (waiting for other work on this machine to finish: {100 * m.cpu_s / window_s:.0f}% of a core)")
            said = True
    return False


PAUSABLE = ("python", "mpiexec", "hydra_pmi_proxy", "pytest")


PAUSE_SLICE_S, BREATHE_S = 40.0, 1.0  # paused jobs run 1 s in every 41: their own watchdogs see no long silence


def _others_now() -> list[psutil.Process]:
    """Other Python/MPI processes (not ours, not our ancestors), listed before our run starts: a process
    our run starts is never among them."""
    me = psutil.Process(os.getpid())
    keep = _ours() | {p.pid for p in me.parents()}
    return [p for p in psutil.process_iter(["pid", "name"])
            if p.info["pid"] not in keep and (p.info["name"] or "").startswith(PAUSABLE)]


def _signal(procs: list[psutil.Process], sig: int) -> None:
    for p in procs:
        with contextlib.suppress(psutil.Error):
            p.send_signal(sig)


@contextlib.contextmanager
def _others_paused():
    """SIGSTOP the other Python/MPI processes that exist now for the block, letting them breathe for
    BREATHE_S every PAUSE_SLICE_S; SIGCONT them after. (Ones started during the block are not paused: the
    meter sees them, and the run is measured again.)"""
    others = _others_now()
    done = threading.Event()
    _signal(others, signal.SIGSTOP)

    def slices() -> None:
        while not done.wait(PAUSE_SLICE_S):
            _signal(others, signal.SIGCONT)
            time.sleep(BREATHE_S)
            if not done.is_set():
                _signal(others, signal.SIGSTOP)

    t = threading.Thread(target=slices, daemon=True)
    t.start()
    try:
        yield
    finally:
        done.set()
        t.join()
        _signal(others, signal.SIGCONT)


def run_quietly(cmd: list[str], tries: int = 6, log=print, **kw) -> tuple[subprocess.CompletedProcess, float]:
    """Run cmd while the machine is quiet; again if other processes used > QUIET_PCT of a core during it.
    Returns the process and the foreign CPU (% of one core) during the run that was kept."""
    pause = os.environ.get("BENCH_PAUSE_OTHERS") == "1"
    for attempt in range(tries):
        if not pause:
            wait_quiet(log=log)
        t0 = time.monotonic()
        with _others_paused() if pause else contextlib.nullcontext(), _Meter() as m:
            proc = subprocess.run(cmd, capture_output=True, text=True, **kw)
        pct = 100 * m.cpu_s / max(1e-9, time.monotonic() - t0)
        if pct < QUIET_PCT or proc.returncode != 0 or attempt == tries - 1:
            return proc, pct
        log(f"  (other work used {pct:.0f}% of a core during the run: measuring again)")
    raise AssertionError("unreachable")


def timed(cmd: list[str]) -> list[str]:
    """cmd, its wall time printed on stderr at the end (run_quietly waits for a quiet machine before it starts, and
    may run it again: time the run itself, `elapsed(proc)`)."""
    return [sys.executable, "-c", "import subprocess, sys, time; t = time.monotonic(); r = subprocess.run(sys.argv[1:]); "
            "print(f'ELAPSED {time.monotonic() - t:.3f}', file=sys.stderr); sys.exit(r.returncode)", *cmd]


def elapsed(proc) -> float:
    return float(re.findall(r"ELAPSED ([\d.]+)", proc.stderr)[-1])


def generation_row(proc, pct: float) -> dict:
    """A timed() run of `pipeinfer generate --json` as a benchmark row: its wall time, its start-up to the first
    token (the wall time less the generation's own), its tokens/s and text, and the CPU other work used meanwhile."""
    wall = elapsed(proc)
    out = json.loads(proc.stdout)
    st = out["stats"]
    gen_s = st["n_generated"] / st["gen_tokens_per_s"] if st["gen_tokens_per_s"] else 0.0
    return {"wall_s": round(wall, 3), "startup_s": round(wall - gen_s, 3),
            "tokens_per_s": round(st["gen_tokens_per_s"], 3), "text": out["text"], "foreign_cpu_pct": round(pct, 1)}
