"""The liveness hub: the watcher process beside rank 0 that names a lost or silent rank and ends the job.

Rank 0 starts it (`python -m pipeinfer.wire.hub CONFIG_JSON`, liveness.Liveness) in a session of its own,
so that mpiexec's clean-up, which kills the ranks' process groups, does not take it. It prints
`PORT <port> <addresses>` on stdout, closes it, and then watches every rank's connection.

What the hub concludes about a rank (liveness.Word names the lines):
  BYE then EOF                  a clean end
  ABORTING                      that rank's own error line says why the job ends: stay quiet
  STOPPING                      a stop was asked for (a signal): what ends from now on is no failure: stay quiet,
                                and tell rank 0 (STOP) when the signal went to another rank alone
  EOF without either            the process is gone (killed, crashed): LOST, seen at once, since the kernel
                                closes its socket before mpiexec even learns that it exited; when mpiexec then
                                ends the others, the rank named is the first lost (first_lost)
  no line for stall_timeout     stopped (SIGSTOP), hung, or its host or network is down: SILENT

On a failure it prints the one line, sends rank 0 END_JOB and waits up to ROW_WAIT_S for ROW_WRITTEN, writes
the --results row itself from rank 0's last ROW snapshot otherwise, then sends END_JOB to every rank still
connected (liveness.py's docstring tells the whole story).
"""
from __future__ import annotations

import json
import os
import select
import socket
import sys
import time

from .hosts import host_name, who
from .liveness import CONNECT_TIMEOUT_S, Word, debug_log, line_of, parse_line, stderr_line, warn

ROW_WAIT_S = 5.0       # how long the hub waits for rank 0 to write the row itself
STOP_GRACE_S = 0.5     # a stop signal to a rank other than 0 reaches rank 0 through the hub unless it had its own
LOST = "lost"          # a rank's state once its connection closed without BYE, ABORTING or ROW_WRITTEN
LOST_TOGETHER_S = 0.5  # connections that close this close together went down together (see first_lost)


def first_lost(lost_at: dict[int, float], last_heard: dict[int, float]) -> int:
    """The rank to name of those whose connections closed without a word (rank -> when the hub saw it): the first
    to close; of those that closed together (within LOST_TOGETHER_S, or in one wake-up of a busy hub: mpiexec ends
    every rank once one dies, within milliseconds), the one the hub heard from last the longest ago (a rank stopped,
    hung or killed stops sending first, while the ones mpiexec ended sent their heartbeats until then), then the
    lowest."""
    first = min(lost_at.values())
    together = [r for r, t in lost_at.items() if t - first <= LOST_TOGETHER_S]
    return min(together, key=lambda r: (last_heard.get(r, 0.0), r))


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
        self.state: dict[int, str] = {}   # the rank's last word (BYE, ABORTING, ROW_WRITTEN), or LOST
        self.lost_at: dict[int, float] = {}  # when the hub saw a LOST rank's connection close
        self.in_flight: int | None = None
        self.row: tuple[str, dict] | None = None
        self.quiet = False                # some rank aborts on purpose (its line says why), or a stop was asked for
        self.stopping: dict[int, tuple[str, float]] = {}  # ranks asked to stop: (why, when)
        self.stop_passed_on = False       # rank 0 was told of a stop asked for on another rank (STOP)
        self.t0 = time.monotonic()

    def serve(self) -> None:
        pending: list[socket.socket] = []
        next_beat = 0.0
        prev = time.monotonic()
        while True:
            now = time.monotonic()
            if now - prev > max(5.0, self.stall / 2):
                # the hub itself did not run for a while (the machine or VM was paused): the ranks' silence
                # over that time says nothing about them; measure afresh
                debug_log(f"hub: did not run for {now - prev:.1f} s")
                for r in self.last:
                    self.last[r] = now
            prev = now
            if now >= next_beat:
                for s in list(self.conns.values()):
                    _hub_send(s, line_of(Word.HEARTBEAT))
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
            self._pass_stop_on(time.monotonic())
            ended = (Word.BYE, Word.ROW_WRITTEN)
            if self.quiet or (self.state and all(self.state.get(r) in ended for r in range(self.n))):
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
                self.state[r] = LOST
                self.lost_at[r] = time.monotonic()
            return
        self.last[r] = time.monotonic()
        self.bufs[r] += data
        while b"\n" in self.bufs[r]:
            line, self.bufs[r] = self.bufs[r].split(b"\n", 1)
            word, rest = parse_line(line)
            if word == Word.HEARTBEAT and r == 0 and rest and rest != "None":
                self.in_flight = int(rest)
            elif word == Word.ROW and r == 0:
                try:
                    path, row = json.loads(rest)
                    self.row = (path, row)
                except ValueError:
                    pass
            elif word in (Word.BYE, Word.ROW_WRITTEN):
                self.state[r] = word
            elif word == Word.ABORTING:
                self.state[r] = word
                self.quiet = True
            elif word == Word.STOPPING:
                # a requested stop: the ranks end by themselves, or the launcher ends them (Open MPI's mpirun kills
                # them 1 s after its SIGTERM); a rank gone without BYE from now on is no failure to report
                debug_log(f"hub: rank {r} asked to stop ({rest})")
                self.quiet = True
                self.stopping.setdefault(r, (rest, time.monotonic()))

    def _pass_stop_on(self, now: float) -> None:
        """A stop asked for on another rank alone (rank 0 has said nothing for STOP_GRACE_S; a launcher signals
        every rank at once): tell rank 0, which stops the job cleanly as if it had the signal itself."""
        if self.stop_passed_on or 0 in self.stopping or 0 not in self.conns:
            return
        late = [(r, why) for r, (why, t) in sorted(self.stopping.items()) if now - t >= STOP_GRACE_S]
        if late:
            r, why = late[0]
            _hub_send(self.conns[0], line_of(Word.STOP, f"{why} on rank {r}"))
            self.stop_passed_on = True

    def _check(self, now: float) -> tuple[int, str] | None:
        lost = {r: self.lost_at[r] for r in range(self.n) if self.state.get(r) == LOST}
        if lost:
            r = first_lost(lost, self.last)
            return r, (f"{who(r, self.hosts)} was lost: its process ended without a word (killed, crashed, or its "
                       f"host went down)")
        if self.stall > 0:
            for r in sorted(self.conns):
                if now - self.last[r] > self.stall:
                    work = ""
                    if self.in_flight is not None and r != 0:
                        n = self.in_flight
                        work = f" while {n} run{'s' * (n != 1)} {'were' if n != 1 else 'was'} in flight" if n else \
                            " (no run in flight)"
                    return r, (f"{who(r, self.hosts)} went silent: no message from it for {self.stall:g} s{work} "
                               f"(stopped, hung, or its host or network is down)")
        return None

    def _fail(self, bad: int, msg: str) -> None:
        stderr_line(f"pipeinfer: error: {msg}")
        # rank 0 finishes its text and writes the row when it can; otherwise the hub writes the last snapshot
        if bad != 0 and 0 in self.conns:
            _hub_send(self.conns[0], line_of(Word.END_JOB, msg))
            t_end = time.monotonic() + ROW_WAIT_S
            while 0 in self.conns and self.state.get(0) != Word.ROW_WRITTEN and time.monotonic() < t_end:
                ready, _, _ = select.select([self.conns[0]], [], [], 0.1)
                if ready:
                    self._receive(0)
        if self.state.get(0) != Word.ROW_WRITTEN:
            self._write_row(msg)
        for r, s in list(self.conns.items()):
            if r != bad:
                _hub_send(s, line_of(Word.END_JOB, msg))  # every rank still there ends the job (MPI_Abort)
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
            warn(f"the liveness hub could not write the --results row to {path}: {e}")


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
        return int(rank) if word == Word.HELLO and got == nonce else None
    except (OSError, ValueError):
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


def hub_main(argv: list[str]) -> None:
    cfg = json.loads(argv[0])
    hub = Hub(cfg)
    sys.stdout.write(f"PORT {hub.listener.getsockname()[1]} {','.join(_addresses())}\n")
    sys.stdout.flush()
    sys.stdout.close()
    try:
        hub.serve()
        debug_log(f"hub: serve returned; state {hub.state}, connections {sorted(hub.conns)}, quiet {hub.quiet}")
    except BaseException as e:
        debug_log(f"hub: {e!r}")
        raise


if __name__ == "__main__":
    hub_main(sys.argv[1:])
