"""One launch of the pipeline's MPI job, a child process of the supervisor: the launcher in a session of its own (so
that it is killed with what it started), its output in a log file, and the wait for its rank 0 to attach.
"""
from __future__ import annotations

import os
import socket
import subprocess
import time
from pathlib import Path

from ..core.errors import UserError
from ..wire.launcher import launcher_env
from .failures import EndedJob, StartFailed, last_error

START_TIMEOUT_S = 600.0                # the least a supervised job may take to start (--start-timeout: the limit)
START_BYTES_PER_S = 50 * 2 ** 20       # a model's bytes start at no slower than this (read, cut, sent over a
                                       # 1 Gbit/s link shared with others, loaded): a 135 GiB model gets 46 minutes


def start_timeout_s(model_bytes: int, given: float | None = None) -> float:
    """Seconds a supervised job may take until its rank 0 attaches: `given` (--start-timeout), else
    max(START_TIMEOUT_S, the models' bytes at START_BYTES_PER_S)."""
    if given is not None:
        return float(given)
    return max(START_TIMEOUT_S, model_bytes / START_BYTES_PER_S)


def models_bytes(paths) -> int:
    """The bytes of the model files at `paths` (a split GGUF's parts summed; None and unreadable ones count 0)."""
    from ..engine.ggufheader import model_size
    total = 0
    for path in filter(None, paths):
        try:
            total += model_size(path)
        except (OSError, ValueError):
            total += os.path.getsize(path) if os.path.isfile(path) else 0
    return total


class ChildJob:
    """The launcher's process of one job, its log and one host per rank (`n_target` of them the target's slots)."""

    def __init__(self, command: list[str], env: dict, hosts: list[str], n_target: int, log_path: str,
                 start_timeout: float = START_TIMEOUT_S):
        self.hosts, self.n_target, self.log_path = hosts, n_target, log_path
        self.start_timeout = start_timeout
        with open(log_path, "w") as job_log:
            self.process = subprocess.Popen(command, stdin=subprocess.DEVNULL, stdout=job_log, env=launcher_env(env),
                                            stderr=subprocess.STDOUT, start_new_session=True)

    def await_rank0(self, listener: socket.socket) -> socket.socket:
        """The connection of the job's rank 0 once it attaches; StartFailed where the job ends first."""
        deadline = time.monotonic() + self.start_timeout
        while True:
            if self.process.poll() is not None:
                raise StartFailed(f"the pipeline did not start on {self.n_target} slot(s): "
                                  f"{last_error(self.log())}", self.ended(pids=[]))  # none listed yet
            if time.monotonic() > deadline:
                self.kill()
                raise UserError(f"the pipeline did not start in {self.start_timeout:.0f} s (--start-timeout SECONDS "
                                "gives it longer)")
            try:
                return listener.accept()[0]
            except socket.timeout:
                continue

    def log(self) -> str:
        try:
            return Path(self.log_path).read_text(errors="replace")
        except OSError:
            return ""

    def ended(self, pids: list[int]) -> EndedJob:
        """What is known of the job once it ended; `pids`: its ranks' as rank 0 listed them when it attached."""
        return EndedJob(self.log(), self.hosts, self.n_target, pids, self.process.returncode)

    def wait_or_kill(self, timeout: float) -> None:
        """Let the job end by itself within `timeout` seconds, else kill it."""
        try:
            self.process.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.kill()

    def kill(self) -> None:
        if self.process.poll() is None:
            try:
                os.killpg(self.process.pid, 9)
            except ProcessLookupError:
                pass
            self.process.wait()
