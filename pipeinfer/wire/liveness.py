"""Liveness: a rank that goes silent or is lost is named, and the job ends, within --stall-timeout.

A small watcher process, the *hub* (hub.py), runs beside rank 0 on its host (started by rank 0 in a session
of its own, so that mpiexec's clean-up, which kills the ranks' process groups, does not take it). Every rank
keeps a TCP connection to it, beside MPI (not through it), and a daemon thread on each rank sends a
heartbeat line every `interval` seconds (a thread, not the poll loops: a rank inside a long decode, loading
a model, or idle between `serve` requests still beats; the thread makes no MPI call). Rank 0's heartbeat
carries the runs in flight, and every half second it sends the hub a snapshot of the --results row. The
lines on the connection are declared once, in `Word`; this module is the rank's side of them.

A rank ends with BYE (a clean end) or ABORTING (its own error line says why the job ends); a connection
that closes without either is a LOST rank, and one without a line for stall_timeout a SILENT one (hub.py).
A rank asked to stop (SIGINT, SIGTERM, SIGUSR1: cli/guard.StopSignals) first sends STOPPING: from then on the
hub names no rank, since the launcher may end them itself (Open MPI's mpirun kills its ranks 1 s after its SIGTERM);
when that rank is not rank 0, the hub tells rank 0 (STOP), which stops the job as if it had the signal itself.
On a failure the hub prints the one line ("pipeinfer: error: rank 1 (host h1, pid 42) went silent: ..."),
asks rank 0 (when alive) to finish the text on stdout and write the --results row marked `failed: ...`,
writes that row itself from the last snapshot when rank 0 cannot (it is the lost or silent one, or
mpiexec killed it first), then tells every rank still connected to end the job (MPI_Abort, exit code
FAILURE_EXIT_CODE; when a rank died, MPICH's mpiexec may end the job first with its own code, 9 for
`kill -9`). The hub's line reaches the user through rank 0's stderr, which mpiexec keeps reading until the
hub exits. A worker that loses the hub (rank 0's host went down, or its own link) ends the job itself, and
exits itself when its proxy, cut off from mpiexec, does not kill it.

The hub listens on an ephemeral port (PIPEINFER_LIVENESS_PORT fixes it, for firewalls); a rank that cannot
connect within CONNECT_TIMEOUT_S prints a warning and is not watched.
"""
from __future__ import annotations

import enum
import json
import os
import secrets
import select
import socket
import subprocess
import sys
import threading
import time
from typing import Callable

from .hosts import host_name, who

FAILURE_EXIT_CODE = 3  # a rank was lost or went silent (1: bad input, 2: internal error, 130: interrupted)
CONNECT_TIMEOUT_S = 20.0
ROW_EVERY_S = 0.5      # rank 0's --results snapshot to the hub
ABORT_GRACE_S = 2.0    # after MPI_Abort returns, how long the proxy has to end the job before the rank exits itself

_current: "Liveness | None" = None
_failure_hook: Callable[[str], None] | None = None
_row_provider: Callable[[], tuple[str, dict] | None] | None = None
_stop_reason: str | None = None  # announce_stop's: a stop was asked for on this rank
_stop_hook: Callable[[str], None] | None = None


class Word(str, enum.Enum):
    """The first word of each line on the liveness connection (`line_of` writes one, `parse_line` reads it);
    some carry an argument after one space."""
    HELLO = "pipeinfer"   # rank -> hub, first line: "pipeinfer NONCE RANK" (the nonce keeps strangers out)
    HEARTBEAT = "h"       # both ways, every interval; rank 0's carries its runs in flight ("h 2")
    ROW = "R"             # rank 0 -> hub: JSON [results path, the --results row so far], when it changed
    BYE = "b"             # rank -> hub: a clean end (EOF follows)
    ABORTING = "a"        # rank -> hub: this rank ends the job on purpose; its own error line says why
    STOPPING = "s"        # rank -> hub: a stop was asked for (a signal, "s SIGTERM"): ranks that end now are no failure
    STOP = "S"            # hub -> rank 0: stop the job cleanly, as asked on another rank ("S SIGTERM on rank 2")
    ROW_WRITTEN = "W"     # rank 0 -> hub, answering END_JOB: the text is finished and the failed row written
    END_JOB = "X"         # hub -> rank: the job ends, the rest of the line says why (rank 0 writes the row first)


def line_of(word: Word, arg: object = None) -> str:
    """One line of the liveness channel: the word, then ' arg' when there is one."""
    return f"{word.value}\n" if arg is None else f"{word.value} {arg}\n"


def parse_line(line: bytes) -> tuple[str, str]:
    """(word, the rest) of one received line, without its newline."""
    word, _, rest = line.decode(errors="replace").partition(" ")
    return word, rest


def name_of(rank: int) -> str:
    """'rank R (host H, pid P)' when the liveness channel knows the hosts, else 'rank R'."""
    return _current.who(rank) if _current is not None else f"rank {rank}"


def set_failure_hook(fn: Callable[[str], None] | None) -> None:
    """Rank 0: fn(message) finishes the text and writes the --results row (status failed: message) before the
    job is aborted; it runs in the liveness thread."""
    global _failure_hook
    _failure_hook = fn


def set_row_provider(fn: Callable[[], tuple[str, dict] | None] | None) -> None:
    """Rank 0: fn() -> (results path, the row so far) or None; the hub writes it when rank 0 cannot."""
    global _row_provider
    _row_provider = fn


def set_stop_hook(fn: Callable[[str], None] | None) -> None:
    """Rank 0: fn(why) stops the job cleanly when a stop was asked for on another rank (a signal to that rank
    alone); it runs in the liveness thread."""
    global _stop_hook
    _stop_hook = fn


def announce_abort() -> None:
    """Tell the hub that this rank ends the job on purpose (its own error line says why)."""
    if _current is not None:
        _current.close(Word.ABORTING)


def announce_stop(why: str) -> None:
    """Tell the hub that a stop was asked for (why: the signal's name), so that ranks the launcher ends from here on
    (Open MPI's mpirun kills them 1 s after its SIGTERM) are not reported as lost. Safe in a signal handler: it
    sends now only when the liveness lock is free, else the liveness thread sends it within half an interval."""
    global _stop_reason
    _stop_reason = _stop_reason or why
    live = _current
    if live is not None:
        live.send_stop_if_free()


def available_memory() -> int:
    """Bytes this host can give a new process (Linux: MemAvailable)."""
    import psutil
    return int(psutil.virtual_memory().available)


class Liveness:
    def __init__(self, comm, stall_timeout_s: float, interval_s: float | None = None):
        global _current
        self.rank, self.size = comm.Get_rank(), comm.Get_size()
        self.stall = float(stall_timeout_s)
        self.interval = interval_s or max(0.05, min(1.0, self.stall / 4 if self.stall else 1.0))
        self.hosts: list[tuple[str, int]] = comm.allgather((host_name(), os.getpid()))
        # each rank's host's available memory (bytes) before this job loads a model: what a supervisor that re-forms
        # the job on fewer hosts checks the model's shares against (supervisor/supervisor.py)
        self.mem_available: list[int] = comm.allgather(available_memory())
        self.in_flight: Callable[[], int] | None = None  # rank 0: runs in flight, for the hub's message
        self._lock = threading.Lock()
        self._closed = False
        self._stop_sent = False
        self._sock: socket.socket | None = None
        self._hub = None
        info = self._start_hub() if self.rank == 0 else None
        info = comm.bcast(info, root=0)
        if info is None:
            if self.rank == 0:
                warn("the liveness hub did not start: a lost or silent rank will not be detected")
            return
        nonce, port, addrs = info
        same_host = self.hosts[0][0] == self.hosts[self.rank][0]
        self._sock = _connect([("127.0.0.1", port)] * same_host + [(a, port) for a in addrs], nonce, self.rank)
        if self._sock is None:
            warn(f"rank {self.rank}: cannot reach the liveness hub on {self.hosts[0][0]}, TCP port {port}; this "
                 f"rank is not watched (PIPEINFER_LIVENESS_PORT fixes the port)")
            return
        self._sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        _current = self
        # the thread must get the GIL quickly once the hub says the job ends; it sleeps in select() otherwise,
        # so the main thread pays nothing for the shorter interval
        sys.setswitchinterval(min(sys.getswitchinterval(), 0.001))
        self._thread = threading.Thread(target=self._loop, name="pipeinfer-liveness", daemon=True)
        self._thread.start()

    def who(self, rank: int) -> str:
        return who(rank, self.hosts)

    def _start_hub(self):
        nonce = secrets.token_hex(8)
        cfg = {"nonce": nonce, "stall": self.stall, "interval": self.interval, "hosts": self.hosts,
               "port": int(os.environ.get("PIPEINFER_LIVENESS_PORT", "0"))}
        env = {k: v for k, v in os.environ.items() if not k.startswith(("PMI_", "PMIX_", "OMPI_", "HYDRA_"))}
        try:
            self._hub = subprocess.Popen([sys.executable, "-m", "pipeinfer.wire.hub", json.dumps(cfg)],
                                         stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, env=env,
                                         start_new_session=True)
            line = self._hub.stdout.readline().decode().split()
            self._hub.stdout.close()
            return nonce, int(line[1]), line[2].split(",") if len(line) > 2 and line[2] else []
        except (OSError, ValueError, IndexError):
            return None

    # ---------------------------------------------------------------- the thread
    def _loop(self) -> None:
        next_beat = next_row = 0.0
        last_row = None
        buf = b""
        last_rx = prev = time.monotonic()
        while True:
            now = time.monotonic()
            if now - prev > max(5.0, self.stall / 2):
                # this thread itself did not run for a while (the machine or VM was paused, or the process was
                # starved): what it did not see says nothing about the hub; measure silence afresh
                debug_log(f"rank {self.rank}: liveness thread did not run for {now - prev:.1f} s")
                last_rx = now
            prev = now
            if self.stall > 0 and now - last_rx > self.stall + 2 * self.interval:
                debug_log(f"rank {self.rank}: nothing from the hub for {now - last_rx:.1f} s")
                self._hub_gone()  # rank 0's host is down or cut off (no FIN arrives from a dead host)
                return
            with self._lock:
                if self._closed:
                    return
                self._send_stop()
                if now >= next_beat:
                    n = _call(self.in_flight) if self.rank == 0 else None
                    self._send(line_of(Word.HEARTBEAT, n))
                    next_beat = now + self.interval
                if self.rank == 0 and now >= next_row and _row_provider is not None:
                    row = _call(_row_provider)
                    if row is not None and row != last_row:
                        self._send(line_of(Word.ROW, json.dumps(row, default=str)))
                        last_row = row
                    next_row = now + ROW_EVERY_S
            try:
                ready, _, _ = select.select([self._sock], [], [], self.interval / 2)
            except (OSError, ValueError):
                ready = []
            if not ready:
                continue
            with self._lock:
                if self._closed:
                    return
                try:
                    data = self._sock.recv(4096)
                except (BlockingIOError, InterruptedError):
                    continue
                except OSError:
                    data = b""
            if not data:
                debug_log(f"rank {self.rank}: EOF from the hub")
                self._hub_gone()
                return
            last_rx = time.monotonic()
            buf += data
            while b"\n" in buf:
                line, buf = buf.split(b"\n", 1)
                word, rest = parse_line(line)
                if word == Word.END_JOB:
                    self._end_job(rest)
                    return
                if word == Word.STOP and _stop_hook is not None:
                    _stop_hook(rest)

    def _hub_gone(self) -> None:
        with self._lock:
            if self._closed:
                return
        if self.rank == 0:
            warn("the liveness hub ended: ranks are no longer watched")
            return
        # rank 0's host went down (or its session was killed): nobody else will end this job
        time.sleep(min(5.0, 0.5 * (self.rank - 1)))  # one line, from the lowest rank that notices
        self._end_job(f"{self.who(0)} is unreachable: the liveness hub on its host stopped answering (host down "
                      f"or network cut?)", print_line=True)

    def _end_job(self, msg: str, print_line: bool = False) -> None:
        """The hub (or, without it, this rank) decided that the job ends: rank 0 finishes the text and the
        --results row, then every rank aborts the job."""
        if print_line:
            stderr_line(f"pipeinfer: error (rank {self.rank}): {msg}")
        if self.rank == 0 and _failure_hook is not None:
            try:
                _failure_hook(msg)
            except Exception as e:  # noqa: BLE001 - the job must still end
                warn(f"while reporting the failure: {e!r}")
        self.close(Word.ROW_WRITTEN if self.rank == 0 else Word.ABORTING)
        time.sleep(0.3)  # let mpiexec forward what was written before MPI_Abort's clean-up
        from mpi4py import MPI
        MPI.COMM_WORLD.Abort(FAILURE_EXIT_CODE)
        # MPICH's MPI_Abort returns when called from this thread and leaves the killing to its proxy; a proxy cut
        # off from mpiexec (this host's link is down) never kills, and the rank would run on forever
        time.sleep(ABORT_GRACE_S)
        os._exit(FAILURE_EXIT_CODE)

    def send_stop_if_free(self) -> None:
        """STOPPING now, unless the lock is held (a signal handler may run in a thread that holds it)."""
        if self._lock.acquire(blocking=False):
            try:
                self._send_stop()
            finally:
                self._lock.release()

    def _send_stop(self) -> None:
        """STOPPING, once, when a stop was asked for on this rank (the caller holds the lock)."""
        if _stop_reason and not self._stop_sent and not self._closed and self._sock is not None:
            self._send(line_of(Word.STOPPING, _stop_reason))
            self._stop_sent = True

    def _send(self, text: str) -> None:
        try:
            self._sock.send(text.encode())
        except (BlockingIOError, InterruptedError):  # its buffer is full: skip this beat
            pass
        except OSError:
            pass

    # ---------------------------------------------------------------- ending
    def close(self, word: Word = Word.BYE) -> None:
        """Say goodbye (BYE), that we abort on purpose (ABORTING) or that the row is written (ROW_WRITTEN), and
        stop."""
        global _current
        with self._lock:
            if self._closed:
                return
            self._closed = True
            if self._sock is not None:
                self._sock.setblocking(True)
                self._sock.settimeout(1.0)
                try:
                    self._sock.sendall(line_of(word).encode())
                except OSError:
                    pass
                try:
                    self._sock.close()
                except OSError:
                    pass
        if _current is self:
            _current = None


def _call(fn):
    try:
        return fn() if fn is not None else None
    except Exception:  # noqa: BLE001 - a description only
        return None


def _connect(addrs: list[tuple[str, int]], nonce: str, rank: int) -> socket.socket | None:
    deadline = time.monotonic() + CONNECT_TIMEOUT_S
    while time.monotonic() < deadline:
        for addr in addrs:
            try:
                s = socket.create_connection(addr, timeout=2.0)
            except OSError:
                continue
            try:
                s.sendall(line_of(Word.HELLO, f"{nonce} {rank}").encode())
                s.setblocking(False)
                return s
            except OSError:
                s.close()
        time.sleep(0.2)
    return None


# ---------------------------------------------------------------- what the rank threads and the hub write
def stderr_line(text: str) -> None:
    """One line straight to stderr's file descriptor (from a thread, or a process whose stdout is closed)."""
    try:
        sys.stderr.flush()
        os.write(sys.stderr.fileno(), (text + "\n").encode())
    except (OSError, ValueError):
        pass


def warn(msg: str) -> None:
    stderr_line(f"[pipeinfer] warning: {msg}")


def debug_log(msg: str) -> None:
    """Debugging aid: PIPEINFER_LIVENESS_LOG=FILE appends what the hub and the rank threads decide."""
    path = os.environ.get("PIPEINFER_LIVENESS_LOG")
    if path:
        with open(path, "a") as f:
            f.write(f"{time.time():.3f} pid {os.getpid()}: {msg}\n")
