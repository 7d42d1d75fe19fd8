"""mpi4py channel for transactions: buffer-interface sends of numpy arrays, polite waiting.

Sends are non-blocking (Isend) so a stage never stalls on a slow receiver; each send's buffers are
kept alive with its request until the request completes, and completed requests are pruned. Waiting
never sits in a blocking MPI call: MPICH busy-polls there and steals the CPU from a neighbouring rank's
decode on a shared machine (measured 90x slower), so we Iprobe and sleep `poll_s` between probes.
Each probe asks twice (`arrived`): MPICH's Iprobe only makes progress when it finds nothing, so a
message that came in during a sleep is seen one probe late. A payload that follows its header is
already on its way, so its wait starts with short sleeps.
"""
from __future__ import annotations

import math
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Callable

import numpy as np
from mpi4py import MPI

from ..core.protocol import HEADER_LEN, Header, ProtocolError, Tag

MAX_PENDING_SENDS = 64  # bound on in-flight Isends before we wait for the oldest
PAYLOAD_FIRST_SLEEP_S = 2e-5  # a payload's wait sleeps this long first, doubling up to poll_s


def arrived(comm: MPI.Comm, source: int, tag: int, status: MPI.Status | None = None) -> bool:
    """Is a message from `source` on `tag` waiting? MPICH's Iprobe, finding nothing queued, makes progress
    (which may pull the message in) and answers False without looking again, so a message that arrived
    while this rank slept would be seen only a poll interval later: ask a second time at once (tests/mpi_probe.py:
    one Iprobe finds no such message, two find every one). In the 2-rank pipeline the head had the payload behind
    a result's header 0.60 ms late, and now at once (launch/bench/bench_overhead.py)."""
    return comm.Iprobe(source=source, tag=tag, status=status) or comm.Iprobe(source=source, tag=tag, status=status)


FINE_POLL_S = 5e-5   # sleep between probes while a header is due
FINE_LEAD_S = 1e-3   # fine polling starts this long before the next header is due ...
FINE_SPAN_S = 5e-3   # ... and lasts at most this long per wait (it costs about 12% of a core while it lasts)


@dataclass
class ArrivalWindow:
    """When, within a wait for the next header from one source, that header is due: a steady pipeline sends
    at a steady rhythm, so the recent waits that had to sleep say when the next one ends. A rank probes every
    poll_s, and every FINE_POLL_S inside the window [lower quartile of the recent waits - FINE_LEAD_S,
    + FINE_SPAN_S], so that it notices a header about 0.1 ms after it arrived instead of half a poll_s
    later, while polling finely only for a few ms per wait."""
    recent: deque = field(default_factory=lambda: deque(maxlen=8))  # seconds the last waits lasted

    def window(self) -> tuple[float, float]:
        """(from, until): seconds into a wait during which it polls finely; empty until a wait was recorded."""
        if not self.recent:
            return math.inf, math.inf
        due = sorted(self.recent)[len(self.recent) // 4]
        start = max(0.0, due - FINE_LEAD_S)
        return start, start + FINE_SPAN_S

    def record(self, waited_s: float) -> None:
        """A wait that slept ended after waited_s (one that found its header waiting says nothing of when it came)."""
        if waited_s > 0:
            self.recent.append(waited_s)


def poll_sleep_s(waited_s: float, window: tuple[float, float], poll_s: float) -> float:
    """How long to sleep before the next probe, waited_s into a wait: finely inside the window, never past
    its start, else poll_s."""
    start, until = window
    if start <= waited_s < until:
        return min(FINE_POLL_S, poll_s)
    if waited_s < start:
        return min(poll_s, max(start - waited_s, 0.0))
    return poll_s


class Transport:
    def __init__(self, comm_pipe: MPI.Comm, comm_cancel: MPI.Comm, poll_s: float = 0.0005):
        self.pipe = comm_pipe
        self.cancel_comm = comm_cancel
        self.poll_s = poll_s
        self._pending: list[tuple[MPI.Request, tuple]] = []
        self.t_wait_s = 0.0  # time spent waiting for a message (pipeline idle time on this rank)
        self._wait_t0: float | None = None  # when the wait under way began (waited_s counts it live)
        self.bytes_sent = 0  # payload and header bytes this rank sent (cancellations included)
        self._arrivals: dict[int, ArrivalWindow] = {}  # by source: when its next header is due
        self._report: tuple[MPI.Request, np.ndarray] | None = None  # the STAGE_STATS send in flight, its buffer

    # ---- sending
    def _isend(self, comm: MPI.Comm, buf: np.ndarray, dest: int, tag: int) -> None:
        buf = np.ascontiguousarray(buf)
        self.bytes_sent += buf.nbytes
        self._pending.append((comm.Isend(buf, dest=dest, tag=tag), (buf,)))
        if len(self._pending) > MAX_PENDING_SENDS:
            self._pending = [(r, b) for r, b in self._pending if not r.Test()]
            while len(self._pending) > MAX_PENDING_SENDS:
                self._wait_request(self._pending.pop(0)[0])

    def send(self, dest: int, header: Header, *payloads: tuple[Tag, np.ndarray]) -> None:
        """One transaction: the header on TAG_BEGIN, then each payload on its own tag."""
        self._isend(self.pipe, header.pack(), dest, Tag.BEGIN)
        for tag, arr in payloads:
            self._isend(self.pipe, arr, dest, tag)

    def send_payload(self, dest: int, tag: Tag, arr: np.ndarray) -> None:
        """One payload without a header (its size known to the receiver: a tensor group's SLICE_LOGITS)."""
        self._isend(self.pipe, arr, dest, tag)

    def send_cancel(self, dest: int, run_ids: list[int]) -> None:
        self._isend(self.cancel_comm, np.asarray(run_ids, dtype=np.int32), dest, Tag.CANCEL)

    def post_report(self, dest: int, buf: np.ndarray) -> bool:
        """Send a STAGE_STATS report (f64, protocol.StageReport) out of band, unless the last one is still in flight:
        whether it went. One at a time, its buffer kept until it completes; not counted in bytes_sent (not pipeline
        traffic). Its 80 bytes go eagerly in every MPI, so the send completes without rank 0's receive (flush at the
        end of serving never waits for rank 0, which takes the reports only after it)."""
        if self._report is not None and not self._report[0].Test():
            return False
        buf = np.array(buf, dtype=np.float64)  # a copy of its own: the caller's may change before the send ends
        self._report = (self.cancel_comm.Isend(buf, dest=dest, tag=Tag.STAGE_STATS), buf)
        return True

    def take_report(self, source: int, length: int) -> np.ndarray | None:
        """The next STAGE_STATS report waiting from `source` (f64[length]), or None (never blocks)."""
        status = MPI.Status()
        if not arrived(self.cancel_comm, source, Tag.STAGE_STATS, status):
            return None
        if status.Get_count(MPI.BYTE) != 8 * length:
            raise bad_message(source, f"{status.Get_count(MPI.BYTE)} bytes of STAGE_STATS, expected {8 * length}")
        buf = np.empty(length, dtype=np.float64)
        self.cancel_comm.Recv(buf, source=source, tag=Tag.STAGE_STATS)
        return buf

    def flush(self) -> None:
        """Wait (politely) until every send of this rank has completed (the last report too)."""
        for req, _ in self._pending:
            self._wait_request(req)
        self._pending.clear()
        if self._report is not None:
            self._wait_request(self._report[0])
            self._report = None

    def waited_s(self) -> float:
        """t_wait_s with the wait under way counted so far: this rank's idle time, live (on the waiting thread: from
        another, the end of a wait could be counted twice for a moment)."""
        t0 = self._wait_t0
        return self.t_wait_s + (max(0.0, time.perf_counter() - t0) if t0 is not None else 0.0)

    def _wait_request(self, req: MPI.Request) -> None:
        wait_politely(req, self.poll_s)

    # ---- receiving
    def wait_header(self, source: int, while_idle: Callable[[], None] | None = None) -> Header:
        """Block politely for the next transaction header from `source`, running while_idle between probes
        (probing finely only while the header is due: ArrivalWindow)."""
        t0 = self._wait_t0 = time.perf_counter()
        if not arrived(self.pipe, source, Tag.BEGIN):
            rhythm = self._arrivals.setdefault(source, ArrivalWindow())
            window = rhythm.window()
            while True:
                if while_idle is not None:
                    while_idle()
                time.sleep(poll_sleep_s(time.perf_counter() - t0, window, self.poll_s))
                if arrived(self.pipe, source, Tag.BEGIN):
                    break
            rhythm.record(time.perf_counter() - t0)
        self.t_wait_s += time.perf_counter() - t0
        self._wait_t0 = None
        return self.recv_header(source)

    def header_ready(self, source: int) -> bool:
        return arrived(self.pipe, source, Tag.BEGIN)

    def recv_header(self, source: int) -> Header:
        buf = np.empty(HEADER_LEN, dtype=np.int32)
        self._recv(self.pipe, buf, source, Tag.BEGIN)
        try:
            return Header.unpack(buf)
        except ProtocolError as e:
            raise bad_message(source, e) from None

    def recv_array(self, source: int, tag: Tag, shape: tuple[int, ...], dtype) -> np.ndarray:
        """The next payload on `tag` from `source`; its size must match what the header announced."""
        buf = np.empty(shape, dtype=dtype)
        self._recv(self.pipe, buf, source, tag)
        return buf

    def _recv(self, comm: MPI.Comm, buf: np.ndarray, source: int, tag: int) -> None:
        """Receive the next message on `tag` into buf, which it must fill exactly (checked before Recv)."""
        status = MPI.Status()
        sleep_s = min(PAYLOAD_FIRST_SLEEP_S, self.poll_s)
        while not arrived(comm, source, tag, status):  # payloads follow their header closely; still polite
            time.sleep(sleep_s)
            sleep_s = min(2 * sleep_s, self.poll_s)
        n = status.Get_count(MPI.BYTE)
        if n != buf.nbytes:
            raise bad_message(source, f"{n} bytes on tag {Tag(tag).name}, its header announced {buf.nbytes}")
        comm.Recv(buf, source=source, tag=tag)

    def poll_cancel(self, source: int) -> list[int]:
        """Run ids cancelled by messages already waiting from `source` (never blocks)."""
        ids: list[int] = []
        while (buf := self.try_recv_i32(self.cancel_comm, source, Tag.CANCEL)) is not None:
            ids.extend(buf.tolist())
        return ids

    def send_i32(self, dest: int, tag: Tag, buf: np.ndarray) -> None:
        """One self-describing i32 message on the pipe communicator (its size is the message's)."""
        self._isend(self.pipe, np.asarray(buf, dtype=np.int32), dest, tag)

    def try_recv_i32(self, comm: MPI.Comm, source: int, tag: Tag) -> np.ndarray | None:
        """The next i32 message of any size on `tag` from `source`, or None when none is waiting (never blocks)."""
        status = MPI.Status()
        if not arrived(comm, source, tag, status):
            return None
        buf = np.empty(status.Get_count(MPI.BYTE) // 4, dtype=np.int32)
        comm.Recv(buf, source=source, tag=tag)
        return buf


def bad_message(source: int, why) -> ProtocolError:
    """The one-line error for a message from `source` that breaks the protocol (naming its host)."""
    if getattr(why, "named", False):
        return why
    from mpi4py import MPI

    from .liveness import name_of
    err = ProtocolError(f"rank {MPI.COMM_WORLD.Get_rank()} refused a message from {name_of(source)}: {why} "
                        f"(another build on that host, or a corrupted link?)")
    err.named = True
    return err


def wait_politely(req: MPI.Request, poll_s: float) -> None:
    """Until req completes, testing it between sleeps that grow from 20 us to poll_s: a blocking MPI wait would
    spin a core in MPICH (module docstring), a long first sleep would add latency to a message already due."""
    sleep = min(2e-5, poll_s)
    while not req.Test():
        time.sleep(sleep)
        sleep = min(sleep * 2, poll_s)


def polite_barrier(comm: MPI.Comm, poll_s: float = 0.0005) -> None:
    """A barrier that sleeps while it waits (a blocking MPI_Barrier busy-polls, see module docstring)."""
    wait_politely(comm.Ibarrier(), poll_s)
