"""mpi4py channel for transactions: buffer-interface sends of numpy arrays, polite waiting.

Sends are non-blocking (Isend) so a stage never stalls on a slow receiver; each send's buffers are
kept alive with its request until the request completes, and completed requests are pruned. Waiting
never sits in a blocking MPI call: MPICH busy-polls there and steals the CPU from a neighbouring rank's
decode on a shared machine (measured 90x slower), so we Iprobe and sleep `poll_s` between probes.
"""
from __future__ import annotations

import time
from typing import Callable

import numpy as np
from mpi4py import MPI

from ..core.protocol import HEADER_LEN, Header, ProtocolError, Tag

MAX_PENDING_SENDS = 64  # bound on in-flight Isends before we wait for the oldest


class Transport:
    def __init__(self, comm_pipe: MPI.Comm, comm_cancel: MPI.Comm, poll_s: float = 0.0005):
        self.pipe = comm_pipe
        self.cancel_comm = comm_cancel
        self.poll_s = poll_s
        self._pending: list[tuple[MPI.Request, tuple]] = []
        self.t_wait_s = 0.0  # time spent waiting for a message (pipeline idle time on this rank)
        self.bytes_sent = 0  # payload and header bytes this rank sent (cancellations included)

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

    def send_cancel(self, dest: int, run_ids: list[int]) -> None:
        self._isend(self.cancel_comm, np.asarray(run_ids, dtype=np.int32), dest, Tag.CANCEL)

    def flush(self) -> None:
        """Wait (politely) until every send of this rank has completed."""
        for req, _ in self._pending:
            self._wait_request(req)
        self._pending.clear()

    def _wait_request(self, req: MPI.Request) -> None:
        while not req.Test():
            time.sleep(self.poll_s)

    # ---- receiving
    def wait_header(self, source: int, while_idle: Callable[[], None] | None = None) -> Header:
        """Block politely for the next transaction header from `source`, running while_idle between probes."""
        t0 = time.perf_counter()
        while not self.pipe.Iprobe(source=source, tag=Tag.BEGIN):
            if while_idle is not None:
                while_idle()
            time.sleep(self.poll_s)
        self.t_wait_s += time.perf_counter() - t0
        return self.recv_header(source)

    def header_ready(self, source: int) -> bool:
        return self.pipe.Iprobe(source=source, tag=Tag.BEGIN)

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
        while not comm.Iprobe(source=source, tag=tag, status=status):  # payloads follow closely; still polite
            time.sleep(self.poll_s)
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
        if not comm.Iprobe(source=source, tag=tag, status=status):
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


def polite_barrier(comm: MPI.Comm, poll_s: float = 0.0005) -> None:
    """A barrier that sleeps while it waits (a blocking MPI_Barrier busy-polls, see module docstring)."""
    req = comm.Ibarrier()
    while not req.Test():
        time.sleep(poll_s)
