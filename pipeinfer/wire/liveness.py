"""Liveness: a rank that goes silent or is lost is named, and the job ends, within --stall-timeout.

A small watcher process, the *hub*, runs beside rank 0 on its host (started by rank 0 in a session of its
own, so that mpiexec's clean-up, which kills the ranks' process groups, does not take it). Every rank
keeps a TCP connection to it, beside MPI (not through it), and a daemon thread on each rank sends a
heartbeat line every `interval` seconds (a thread, not the poll loops: a rank inside a long decode, loading
a model, or idle between `serve` requests still beats; the thread makes no MPI call). Rank 0's heartbeat
carries the runs in flight, and every half second it sends the hub a snapshot of the --results row.

What the hub concludes about a rank:
  "b" (goodbye) then EOF        a clean end
  "a" (aborting on purpose)     that rank's own error line says why the job ends: stay quiet
  EOF without either            the process is gone (killed, crashed): LOST, seen at once, since the kernel
                                closes its socket before mpiexec even learns that it exited
  no line for stall_timeout     stopped (SIGSTOP), hung, or its host or network is down: SILENT

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

FAILURE_EXIT_CODE = 3  # a rank was lost or went silent (1: bad input, 2: internal error, 130: interrupted)
CONNECT_TIMEOUT_S = 20.0
ROW_EVERY_S = 0.5      # rank 0's --results snapshot to the hub
ROW_WAIT_S = 5.0       # how long the hub waits for rank 0 to write the row itself
ABORT_GRACE_S = 2.0    # after MPI_Abort returns, how long the proxy has to end the job before the rank exits itself

_current: "Liveness | None" = None
_failure_hook: Callable[[str], None] | None = None
_row_provider: Callable[[], tuple[str, dict] | None] | None = None


def host_name() -> str:
    """This rank's host as reports name it: $PIPEINFER_HOST if set (emulated clusters), else the hostname."""
    return os.environ.get("PIPEINFER_HOST") or socket.gethostname()


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


def announce_abort() -> None:
    """Tell the hub that this rank ends the job on purpose (its own error line says why)."""
    if _current is not None:
        _current.close("a")


class Liveness:
    def __init__(self, comm, stall_timeout_s: float, interval_s: float | None = None):
        global _current
        self.rank, self.size = comm.Get_rank(), comm.Get_size()
        self.stall = float(stall_timeout_s)
        self.interval = interval_s or max(0.05, min(1.0, self.stall / 4 if self.stall else 1.0))
        self.hosts: list[tuple[str, int]] = comm.allgather((host_name(), os.getpid()))
        self.in_flight: Callable[[], int] | None = None  # rank 0: runs in flight, for the hub's message
        self._lock = threading.Lock()
        self._closed = False
        self._sock: socket.socket | None = None
        self._hub = None
        info = self._start_hub() if self.rank == 0 else None
        info = comm.bcast(info, root=0)
        if info is None:
            if self.rank == 0:
                _warn("the liveness hub did not start: a lost or silent rank will not be detected")
            return
        nonce, port, addrs = info
        same_host = self.hosts[0][0] == self.hosts[self.rank][0]
        self._sock = _connect([("127.0.0.1", port)] * same_host + [(a, port) for a in addrs], nonce, self.rank)
        if self._sock is None:
            _warn(f"rank {self.rank}: cannot reach the liveness hub on {self.hosts[0][0]}, TCP port {port}; this "
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
        host, pid = self.hosts[rank]
        return f"rank {rank} (host {host}, pid {pid})"

    def _start_hub(self):
        nonce = secrets.token_hex(8)
        cfg = {"nonce": nonce, "stall": self.stall, "interval": self.interval, "hosts": self.hosts,
               "port": int(os.environ.get("PIPEINFER_LIVENESS_PORT", "0"))}
        env = {k: v for k, v in os.environ.items() if not k.startswith(("PMI_", "PMIX_", "OMPI_", "HYDRA_"))}
        try:
            self._hub = subprocess.Popen([sys.executable, "-m", "pipeinfer.wire.liveness", json.dumps(cfg)],
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
                _log(f"rank {self.rank}: liveness thread did not run for {now - prev:.1f} s")
                last_rx = now
            prev = now
            if self.stall > 0 and now - last_rx > self.stall + 2 * self.interval:
                _log(f"rank {self.rank}: nothing from the hub for {now - last_rx:.1f} s")
                self._hub_gone()  # rank 0's host is down or cut off (no FIN arrives from a dead host)
                return
            with self._lock:
                if self._closed:
                    return
                if now >= next_beat:
                    n = _call(self.in_flight) if self.rank == 0 else None
                    self._send(f"h {n}\n" if n is not None else "h\n")
                    next_beat = now + self.interval
                if self.rank == 0 and now >= next_row and _row_provider is not None:
                    row = _call(_row_provider)
                    if row is not None and row != last_row:
                        self._send("R " + json.dumps(row, default=str) + "\n")
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
                _log(f"rank {self.rank}: EOF from the hub")
                self._hub_gone()
                return
            last_rx = time.monotonic()
            buf += data
            while b"\n" in buf:
                line, buf = buf.split(b"\n", 1)
                if line.startswith(b"X "):
                    self._end_job(line[2:].decode(errors="replace"))
                    return

    def _hub_gone(self) -> None:
        with self._lock:
            if self._closed:
                return
        if self.rank == 0:
            _warn("the liveness hub ended: ranks are no longer watched")
            return
        # rank 0's host went down (or its session was killed): nobody else will end this job
        time.sleep(min(5.0, 0.5 * (self.rank - 1)))  # one line, from the lowest rank that notices
        self._end_job(f"{self.who(0)} is unreachable: the liveness hub on its host stopped answering (host down "
                      f"or network cut?)", print_line=True)

    def _end_job(self, msg: str, print_line: bool = False) -> None:
        """The hub (or, without it, this rank) decided that the job ends: rank 0 finishes the text and the
        --results row, then every rank aborts the job."""
        if print_line:
            _line(f"pipeinfer: error (rank {self.rank}): {msg}")
        if self.rank == 0 and _failure_hook is not None:
            try:
                _failure_hook(msg)
            except Exception as e:  # noqa: BLE001 - the job must still end
                _warn(f"while reporting the failure: {e!r}")
        self.close("W" if self.rank == 0 else "a")  # rank 0: the row is written
        time.sleep(0.3)  # let mpiexec forward what was written before MPI_Abort's clean-up
        from mpi4py import MPI
        MPI.COMM_WORLD.Abort(FAILURE_EXIT_CODE)
        # MPICH's MPI_Abort returns when called from this thread and leaves the killing to its proxy; a proxy cut
        # off from mpiexec (this host's link is down) never kills, and the rank would run on forever
        time.sleep(ABORT_GRACE_S)
        os._exit(FAILURE_EXIT_CODE)

    def _send(self, text: str) -> None:
        try:
            self._sock.send(text.encode())
        except (BlockingIOError, InterruptedError):  # its buffer is full: skip this beat
            pass
        except OSError:
            pass

    # ---------------------------------------------------------------- ending
    def close(self, word: str = "b") -> None:
        """Say goodbye ("b"), that we abort on purpose ("a") or that the row is written ("W"), and stop."""
        global _current
        with self._lock:
            if self._closed:
                return
            self._closed = True
            if self._sock is not None:
                self._sock.setblocking(True)
                self._sock.settimeout(1.0)
                try:
                    self._sock.sendall(f"{word}\n".encode())
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
                s.sendall(f"pipeinfer {nonce} {rank}\n".encode())
                s.setblocking(False)
                return s
            except OSError:
                s.close()
        time.sleep(0.2)
    return None


def _addresses() -> list[str]:
    """The hub's IPv4 addresses a rank may reach it on: non-loopback first (psutil), then the hostname's."""
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


def _line(text: str) -> None:
    try:
        sys.stderr.flush()
        os.write(sys.stderr.fileno(), (text + "\n").encode())
    except (OSError, ValueError):
        pass


def _warn(msg: str) -> None:
    _line(f"[pipeinfer] warning: {msg}")


def _log(msg: str) -> None:
    """Debugging aid: PIPEINFER_LIVENESS_LOG=FILE appends what the hub and the rank threads decide."""
    path = os.environ.get("PIPEINFER_LIVENESS_LOG")
    if path:
        with open(path, "a") as f:
            f.write(f"{time.time():.3f} pid {os.getpid()}: {msg}\n")


# ==================================================================== the hub process
class Hub:
    def __init__(self, cfg: dict):
        self.nonce, self.stall, self.interval = cfg["nonce"], float(cfg["stall"]), float(cfg["interval"])
        self.hosts = [tuple(h) for h in cfg["hosts"]]
        self.n = len(self.hosts)
        self.listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self.listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.listener.bind(("", int(cfg.get("port", 0))))
        self.listener.listen(self.n + 4)
        self.conns: dict[int, socket.socket] = {}
        self.bufs: dict[int, bytes] = {}
        self.last: dict[int, float] = {}
        self.state: dict[int, str] = {}   # "b" bye, "a" aborting, "W" row written, "lost"
        self.in_flight: int | None = None
        self.row: tuple[str, dict] | None = None
        self.quiet = False                # some rank aborts on purpose: its line says why
        self.t0 = time.monotonic()

    def who(self, r: int) -> str:
        host, pid = self.hosts[r]
        return f"rank {r} (host {host}, pid {pid})"

    def serve(self) -> None:
        pending: list[socket.socket] = []
        next_beat = 0.0
        prev = time.monotonic()
        while True:
            now = time.monotonic()
            if now - prev > max(5.0, self.stall / 2):
                # the hub itself did not run for a while (the machine or VM was paused): the ranks' silence
                # over that time says nothing about them; measure afresh
                _log(f"hub: did not run for {now - prev:.1f} s")
                for r in self.last:
                    self.last[r] = now
            prev = now
            if now >= next_beat:
                for s in list(self.conns.values()):
                    _hub_send(s, "h\n")
                next_beat = now + self.interval
            socks = [self.listener] + pending + list(self.conns.values())
            ready, _, _ = select.select(socks, [], [], self.interval / 2)
            for s in ready:
                if s is self.listener:
                    conn, _ = s.accept()
                    conn.settimeout(5.0)
                    pending.append(conn)
                elif s in pending:
                    pending.remove(s)
                    r = _read_hello(s, self.nonce)
                    if r is not None and 0 <= r < self.n and r not in self.conns and r not in self.state:
                        s.setblocking(False)
                        self.conns[r], self.bufs[r], self.last[r] = s, b"", time.monotonic()
                    else:
                        s.close()
                else:
                    self._receive(next(r for r, c in self.conns.items() if c is s))
            if self.quiet or (self.state and all(self.state.get(r) in ("b", "W") for r in range(self.n))):
                if not self.conns:
                    return  # a clean end, or a deliberate abort whose ranks are gone
                if self.quiet and time.monotonic() - self.t0 > 3600:
                    return
                continue
            failure = self._check(time.monotonic())
            if failure:
                self._fail(*failure)
                return
            if not self.conns and time.monotonic() - self.t0 > CONNECT_TIMEOUT_S + 10:
                return  # nobody joined, or everyone left

    def _receive(self, r: int) -> None:
        s = self.conns[r]
        try:
            data = s.recv(65536)
        except (BlockingIOError, InterruptedError):
            return
        except OSError:
            data = b""
        if not data:
            del self.conns[r]
            s.close()
            if r not in self.state:
                self.state[r] = "lost"
            return
        self.last[r] = time.monotonic()
        self.bufs[r] += data
        while b"\n" in self.bufs[r]:
            line, self.bufs[r] = self.bufs[r].split(b"\n", 1)
            word, _, rest = line.decode(errors="replace").partition(" ")
            if word == "h" and r == 0 and rest and rest != "None":
                self.in_flight = int(rest)
            elif word == "R" and r == 0:
                try:
                    path, row = json.loads(rest)
                    self.row = (path, row)
                except ValueError:
                    pass
            elif word in ("b", "W"):
                self.state[r] = word
            elif word == "a":
                self.state[r] = "a"
                self.quiet = True

    def _check(self, now: float) -> tuple[int, str] | None:
        lost = [r for r in range(self.n) if self.state.get(r) == "lost"]
        if lost:
            r = lost[0]
            return r, f"{self.who(r)} was lost: its process ended without a word (killed, crashed, or its host went down)"
        if self.stall > 0:
            for r in sorted(self.conns):
                if now - self.last[r] > self.stall:
                    work = ""
                    if self.in_flight is not None and r != 0:
                        n = self.in_flight
                        work = f" while {n} run{'s' * (n != 1)} {'were' if n != 1 else 'was'} in flight" if n else \
                            " (no run in flight)"
                    return r, (f"{self.who(r)} went silent: no message from it for {self.stall:g} s{work} (stopped, "
                               f"hung, or its host or network is down)")
        return None

    def _fail(self, bad: int, msg: str) -> None:
        _line(f"pipeinfer: error: {msg}")
        # rank 0 finishes its text and writes the row when it can; otherwise the hub writes the last snapshot
        if bad != 0 and 0 in self.conns:
            _hub_send(self.conns[0], f"X {msg}\n")
            t_end = time.monotonic() + ROW_WAIT_S
            while 0 in self.conns and self.state.get(0) != "W" and time.monotonic() < t_end:
                ready, _, _ = select.select([self.conns[0]], [], [], 0.1)
                if ready:
                    self._receive(0)
        if self.state.get(0) != "W":
            self._write_row(msg)
        for r, s in list(self.conns.items()):
            if r != bad:
                _hub_send(s, f"X {msg}\n")  # every rank still there ends the job (MPI_Abort)
        t_end = time.monotonic() + 10
        while self.conns and time.monotonic() < t_end:
            ready, _, _ = select.select(list(self.conns.values()), [], [], 0.2)
            for s in ready:
                self._receive(next(r for r, c in self.conns.items() if c is s))
        if self.conns:  # nobody could end the job (every rank left is stopped): end the ranks on this host
            me = host_name()
            for r in self.conns:
                if self.hosts[r][0] == me:
                    try:
                        os.kill(self.hosts[r][1], 9)
                    except OSError:
                        pass

    def _write_row(self, msg: str) -> None:
        if not self.row or not self.row[0]:
            return
        path, row = self.row
        row = dict(row, status=f"failed: {msg}")
        try:
            from ..core.results import read_results
            rows = read_results(path)
            if rows and rows[-1].get("status") == row["status"]:
                return  # rank 0 wrote it before it was killed
            from ..core.results import append_result
            append_result(path, row)
        except (OSError, ValueError) as e:
            _line(f"[pipeinfer] warning: the liveness hub could not write the --results row to {path}: {e}")


def _hub_send(s: socket.socket, text: str) -> None:
    try:
        s.send(text.encode())
    except OSError:
        pass


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


def hub_main(argv: list[str]) -> None:
    cfg = json.loads(argv[0])
    hub = Hub(cfg)
    sys.stdout.write(f"PORT {hub.listener.getsockname()[1]} {','.join(_addresses())}\n")
    sys.stdout.flush()
    sys.stdout.close()
    try:
        hub.serve()
        _log(f"hub: serve returned; state {hub.state}, connections {sorted(hub.conns)}, quiet {hub.quiet}")
    except BaseException as e:
        _log(f"hub: {e!r}")
        raise


if __name__ == "__main__":
    hub_main(sys.argv[1:])
