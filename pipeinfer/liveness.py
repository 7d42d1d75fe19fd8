"""Liveness: every rank learns, within --stall-timeout, that another went silent or was lost.

A star of TCP connections, rank 0 in the middle, beside MPI (not through it): each worker rank connects
to rank 0 at start-up, and on every connection both ends send a one-byte heartbeat every `interval`
seconds from a daemon thread (a thread, not the poll loops: a rank inside a long decode, loading a model
or, on rank 0 under `serve`, idle between requests still beats, and the thread makes no MPI call).

What a peer's end of the connection says:
  b"h"  heartbeat            b"b"  goodbye: a clean end follows
  b"a"  "I am aborting on purpose": its own error line is on its way; stay quiet about it
  EOF without b"b"/b"a"      the process is gone (killed, crashed): LOST, noticed at once (the kernel
                             closes its socket), before mpiexec's clean-up kills the rest of the job
  nothing for stall_timeout  the process is stopped (SIGSTOP), hung in the kernel, or its host or the
                             network is down: SILENT

Rank 0 reports a worker that is lost or silent; a worker reports rank 0 (after a short delay that grows
with its rank, so that one line is printed even when every worker notices). Reporting calls the failure
hook (the CLI's: finish the text on stdout, write the --results row marked failed, print one line), then
ends the job with MPI_Abort (exit code FAILURE_EXIT_CODE). Under MPICH's Hydra, a rank that dies makes
mpiexec kill the whole job within milliseconds: rank 0 gets its line and row out first because it
notices the lost connection before Hydra's clean-up reaches it (measured in launch/failures.py).

Why TCP and not MPI heartbeats: a heartbeat through MPI from a second thread would need MPI calls
concurrent with the main thread's, and MPI cannot tell us that a peer process is gone (Hydra kills us
first). The port is ephemeral on rank 0 (PIPEINFER_LIVENESS_PORT fixes it, for firewalls); a worker that
cannot connect within CONNECT_TIMEOUT_S prints a warning and runs without liveness.
"""
from __future__ import annotations

import os
import secrets
import select
import socket
import sys
import threading
import time
from typing import Callable

FAILURE_EXIT_CODE = 3  # a rank was lost or went silent (1: bad input, 2: internal error, 130: interrupted)
CONNECT_TIMEOUT_S = 20.0
HB, BYE, ABORTING = b"h", b"b", b"a"

_current: "Liveness | None" = None
_failure_hook: Callable[[str], None] | None = None


def host_name() -> str:
    """This rank's host as reports name it: $PIPEINFER_HOST if set (emulated clusters), else the hostname."""
    return os.environ.get("PIPEINFER_HOST") or socket.gethostname()


def name_of(rank: int) -> str:
    """'rank R (host H, pid P)' when the liveness channel knows the hosts, else 'rank R'."""
    return _current.who(rank) if _current is not None else f"rank {rank}"


def set_failure_hook(fn: Callable[[str], None] | None) -> None:
    """fn(message) runs (once, on the reporting rank, in the liveness thread) before the job is aborted."""
    global _failure_hook
    _failure_hook = fn


def announce_abort() -> None:
    """Tell the peers that this rank is ending the job on purpose (its own error line says why)."""
    if _current is not None:
        _current.close(ABORTING)


class Liveness:
    def __init__(self, comm, stall_timeout_s: float, interval_s: float | None = None):
        global _current
        self.rank, self.size = comm.Get_rank(), comm.Get_size()
        self.stall = float(stall_timeout_s)
        self.interval = interval_s or max(0.05, min(1.0, self.stall / 4))
        self.hosts: list[tuple[str, int]] = comm.allgather((host_name(), os.getpid()))
        self.in_flight: Callable[[], int] | None = None  # rank 0: runs in flight, for the message
        self._lock = threading.Lock()
        self._closed = False
        self._reported = False
        self._peers: dict[int, socket.socket] = {}      # rank -> connection
        self._last: dict[int, float] = {}
        self._quiet: set[int] = set()                    # said goodbye or announced its abort
        self._lost: dict[int, float] = {}                # connection closed without a word: when
        self._listener = None
        if self.rank == 0:
            self._listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            self._listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            self._listener.bind(("", int(os.environ.get("PIPEINFER_LIVENESS_PORT", "0"))))
            self._listener.listen(self.size)
            self._listener.setblocking(False)
            info = (secrets.token_hex(8), self._listener.getsockname()[1], _addresses())
        else:
            info = None
        self.nonce, port, addrs = comm.bcast(info, root=0)
        self._unjoined = set(range(1, self.size)) if self.rank == 0 else set()
        self._t_start = time.monotonic()
        if self.rank != 0:
            same_host = self.hosts[0][0] == self.hosts[self.rank][0]
            sock = _connect([("127.0.0.1", port)] * same_host + [(a, port) for a in addrs], self.nonce, self.rank)
            if sock is None:
                _warn(f"rank {self.rank}: cannot reach rank 0 ({self.hosts[0][0]}) on TCP port {port} for heartbeats; "
                      f"a lost or silent rank will not be detected (PIPEINFER_LIVENESS_PORT fixes the port)")
            else:
                self._add(0, sock)
        _current = self
        self._thread = threading.Thread(target=self._loop, name="pipeinfer-liveness", daemon=True)
        self._thread.start()

    # ---------------------------------------------------------------- naming
    def who(self, rank: int) -> str:
        host, pid = self.hosts[rank]
        return f"rank {rank} (host {host}, pid {pid})"

    # ---------------------------------------------------------------- the thread
    def _add(self, rank: int, sock: socket.socket) -> None:
        sock.setblocking(False)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self._peers[rank] = sock
        self._last[rank] = time.monotonic()

    def _loop(self) -> None:
        pending: list[socket.socket] = []  # accepted, hello not read yet (rank 0)
        next_beat = 0.0
        while True:
            with self._lock:
                if self._closed:
                    return
                now = time.monotonic()
                if now >= next_beat:
                    for sock in self._peers.values():
                        _send(sock, HB)
                    next_beat = now + self.interval
            rlist = list(self._peers.values()) + pending + ([self._listener] if self._unjoined else [])
            try:
                ready, _, _ = select.select(rlist, [], [], self.interval / 2)
            except (OSError, ValueError):  # closed under us by close()
                ready = []
            with self._lock:
                if self._closed:
                    return
                for s in ready:
                    if s is self._listener:
                        try:
                            conn, _ = s.accept()
                            conn.settimeout(5.0)
                            pending.append(conn)
                        except OSError:
                            pass
                    elif s in pending:
                        pending.remove(s)
                        rank = _read_hello(s, self.nonce)
                        if rank in self._unjoined:
                            self._unjoined.discard(rank)
                            self._add(rank, s)
                        else:
                            s.close()
                    else:
                        self._receive(next(r for r, p in self._peers.items() if p is s))
                failure = self._check(time.monotonic())
            if failure:
                self._report(*failure)
                return

    def _receive(self, rank: int) -> None:
        sock = self._peers[rank]
        try:
            data = sock.recv(4096)
        except (BlockingIOError, InterruptedError):
            return
        except OSError:
            data = b""
        if data:
            self._last[rank] = time.monotonic()
            if BYE in data or ABORTING in data:
                self._quiet.add(rank)
            return
        del self._peers[rank]
        sock.close()
        if rank not in self._quiet:
            self._lost[rank] = time.monotonic()

    def _check(self, now: float) -> tuple[str, float] | None:
        """(message, delay before reporting) for the first failure this rank reports, or None."""
        watch = range(1, self.size) if self.rank == 0 else (0,)
        for r in watch:
            if r in self._quiet:
                continue
            if r in self._lost:
                return (f"{self.who(r)} was lost: its process ended without a word (killed, crashed, or its host "
                        f"went down)", self._delay(0.5))
            if r in self._last and self.stall > 0 and now - self._last[r] > self.stall:
                return (f"{self.who(r)} went silent: no message from it for {self.stall:g} s{self._work()} "
                        f"(stopped, hung, or its host or network is down)", self._delay(1.0))
        if self.rank == 0 and self._unjoined and self.stall > 0 and now - self._t_start > max(CONNECT_TIMEOUT_S, self.stall) + 5:
            _warn(f"ranks {sorted(self._unjoined)} never joined the heartbeat channel: they are not watched")
            self._unjoined.clear()
        return None

    def _delay(self, step: float) -> float:
        # rank 0 reports at once; worker k waits a little longer than worker k-1, so one line comes out
        return 0.0 if self.rank == 0 else min(5.0, step * (self.rank - 1))

    def _work(self) -> str:
        if self.rank != 0 or self.in_flight is None:
            return ""
        try:
            n = self.in_flight()
        except Exception:  # noqa: BLE001 - a description only
            return ""
        return f" while {n} run{'s' * (n != 1)} {'were' if n != 1 else 'was'} in flight" if n else " (no run in flight)"

    def _report(self, msg: str, delay: float) -> None:
        if delay:
            time.sleep(delay)
        with self._lock:
            if self._closed or self._reported:
                return
            self._reported = True
        hook = _failure_hook
        if hook is not None:
            try:
                hook(msg)
            except Exception as e:  # noqa: BLE001 - the report must still go out
                _warn(f"pipeinfer: while reporting the failure: {e!r}")
        print(f"pipeinfer: error{f' (rank {self.rank})' if self.rank else ''}: {msg}", file=sys.stderr, flush=True)
        self.close(ABORTING)
        time.sleep(0.3)  # let mpiexec forward the line: MPI_Abort's clean-up can drop what is still in the pipe
        from mpi4py import MPI
        MPI.COMM_WORLD.Abort(FAILURE_EXIT_CODE)

    # ---------------------------------------------------------------- ending
    def close(self, word: bytes = BYE) -> None:
        """Say goodbye (or that we abort on purpose) to every peer and stop watching."""
        global _current
        with self._lock:
            if self._closed:
                return
            self._closed = True
            for sock in self._peers.values():
                _send(sock, word)
                try:
                    sock.close()
                except OSError:
                    pass
            self._peers.clear()
            if self._listener is not None:
                self._listener.close()
        if _current is self:
            _current = None


def _send(sock: socket.socket, data: bytes) -> None:
    try:
        sock.send(data)
    except (BlockingIOError, InterruptedError):  # its buffer is full (a stopped peer): skip this beat
        pass
    except OSError:
        pass  # gone: the receiving side notices


def _addresses() -> list[str]:
    """Rank 0's IPv4 addresses a worker may reach it on: non-loopback first (psutil), then the hostname's."""
    out: list[str] = []
    try:
        import psutil
        for addrs in psutil.net_if_addrs().values():
            out += [a.address for a in addrs if a.family == socket.AF_INET and not a.address.startswith("127.")]
    except Exception:  # noqa: BLE001
        pass
    try:
        out += [socket.gethostbyname(host_name())]
    except OSError:
        pass
    return list(dict.fromkeys(out))


def _connect(addrs: list[tuple[str, int]], nonce: str, rank: int) -> socket.socket | None:
    deadline = time.monotonic() + CONNECT_TIMEOUT_S
    while time.monotonic() < deadline:
        for addr in addrs:
            try:
                s = socket.create_connection(addr, timeout=2.0)
            except OSError:
                continue
            try:
                s.sendall(f"pipeinfer {nonce} {rank}\n".encode())
                return s
            except OSError:
                s.close()
        time.sleep(0.2)
    return None


def _read_hello(sock: socket.socket, nonce: str) -> int | None:
    try:
        data = b""
        while not data.endswith(b"\n") and len(data) < 100:  # byte by byte: heartbeats follow the line
            chunk = sock.recv(1)
            if not chunk:
                return None
            data += chunk
        word, got, rank = data.decode().split()
        return int(rank) if word == "pipeinfer" and got == nonce else None
    except (OSError, ValueError):
        return None


def _warn(msg: str) -> None:
    print(f"[pipeinfer] warning: {msg}", file=sys.stderr, flush=True)
