"""Weights travel: only rank 0's host needs the model file; a rank whose host lacks it gets its stage file over MPI.

Start-up only (ranks/startup.py calls `obtain` where a rank needs its stage file, the probe of --layer-split auto,
or, on a draft rank, the draft model): nothing here runs per token.

One call is collective over the ranks that take part:
1. rank 0 sends the model's cheap fingerprint (handshake.model_fingerprint); a rank whose host has a file with that
   fingerprint at rank 0's path writes its stage itself, as before. When every rank does, that is all.
2. Otherwise rank 0 names the model by its content (core/stagecache.model_identity: sha256 of the whole file, once,
   remembered by path, size, mtime and inode), and every other rank looks in its host's weights cache for the file
   it needs under that name, checked (size, sampled digest). A rank whose host has another file under the same path
   (a different model, or a copy cut short) is never served it: it takes the cache's or rank 0's bytes.
3. Rank 0 works out each missing file's layout (engine/stagefile.stage_layout: the stage's bytes without writing
   them) and checks, before any byte is sent, that every receiving host has room: otherwise one line naming the
   host, what it needs and what it has, and every rank exits 1.
4. Rank 0 streams each file in CHUNK-byte pieces, one receiving rank at a time (its link carries every byte, so
   sending to several at once would only finish all of them late), IN_FLIGHT pieces in flight, numpy uint8 buffers
   (no pickling) on a communicator of their own. The receiver hashes what it writes, compares the sha256 rank 0
   computed of what it read, and only then links the file into its cache (stagecache.IncomingFile: a lost sender
   leaves nothing behind). Waiting sleeps between tests of the request (never a blocking MPI call: the recipe's
   "Waiting politely").
5. Rank 0 prints each host's progress (bytes, rate, time left) as one updating line on a terminal and a summary
   line per host; `-q` quiets it (set_quiet).
"""
from __future__ import annotations

import hashlib
import os
import sys
import time
from pathlib import Path

import numpy as np

from ..core import stagecache
from ..core.errors import UserError
from ..core.stagecache import Item, Need, fmt_bytes
from ..wire.hosts import host_name

CHUNK = 8 << 20      # bytes per message: 67 ms at 1 Gbit/s
IN_FLIGHT = 4        # messages in flight each way
TAG_DATA, TAG_END = 1, 2
PROGRESS_EVERY_S = 0.25
# tests only: the sender sleeps this long after each message, so that a test can kill it mid-transfer
THROTTLE_S = float(os.environ.get("PIPEINFER_WEIGHTS_THROTTLE_S", "0") or 0)
CHUNK = int(os.environ.get("PIPEINFER_WEIGHTS_CHUNK", CHUNK))

_quiet = False
last_report: list[dict] = []  # rank 0: what the last obtain moved, one dict per receiving rank (tests, benchmarks)


def set_quiet(quiet: bool) -> None:
    """-q: no progress or summary lines."""
    global _quiet
    _quiet = quiet


def local_view(path: str | os.PathLike) -> Path:
    return stagecache.host_view(path)


def obtain(comm, src: str, want: tuple | None, poll_s: float = 0.0005, fmt: int = 0, what: str = "stage file",
           comm_weights=None) -> Path | None:
    """Collective over comm. want: ("stage", start, end, with_vocab), ("whole",) or ("vocab",) of rank 0's file
    src, or None (this rank needs nothing). Returns None when this rank's host has src itself (the caller derives its
    file from it, as without this module), else the path of the file in this host's weights cache."""
    from .handshake import model_fingerprint
    rank = comm.Get_rank()
    fp = comm.bcast(model_fingerprint(src) if rank == 0 else None, root=0)
    mine = local_view(src)
    has = rank == 0 or want is None or _same(mine, fp)
    answers = comm.allgather((has, None if has else want[0]))
    if all(h for h, _ in answers):
        return None
    comm = comm_weights or comm.Dup()
    try:
        parse = any(kind not in (None, "whole") for _, kind in answers)
        return _obtain(comm, src, None if has else want, poll_s, fmt, what, parse)
    finally:
        if comm_weights is None:
            comm.Free()


def _same(path: Path, fp: str) -> bool:
    from .handshake import model_fingerprint
    try:
        return path.is_file() and model_fingerprint(path) == fp
    except (OSError, ValueError):
        return False


def _obtain(comm, src: str, want: tuple | None, poll_s: float, fmt: int, what: str, parse: bool) -> Path | None:
    rank = comm.Get_rank()
    ident = None
    if rank == 0:
        if stagecache.known_identity(src) is None:
            _start_reading(src, parse)  # the GGUF parse (Python) runs while the sha256 (C, without the GIL) does
        ident, dt = stagecache.model_identity(src)
        if dt > 0 and not _quiet:
            size = os.path.getsize(src)
            _log(f"[pipeinfer] weights: identified {Path(src).name} by its sha256 in {dt:.1f} s "
                 f"({dt / (size / 2**30):.2f} s/GiB; once per file on this host)")
    _polite_barrier(comm, poll_s)  # the others wait for rank 0 without a blocking MPI call (which spins a core)
    ident = comm.bcast(ident, root=0)
    d = stagecache.weights_dir()
    item = _item(ident, want, fmt) if want is not None else None
    status, path = "none", None
    if item is not None:
        stagecache.sweep_partials(d)
        path = stagecache.cached(item, d=d)
        status = "cached" if path is not None else "need"
    free = stagecache.free_override()
    need = Need(rank, host_name(), status, free if free is not None else stagecache.free_bytes(d) if item else 0,
                str(d))
    needs = comm.allgather((need, want))
    plan = None
    if rank == 0:
        t0 = time.perf_counter()
        plan = _plan(src, needs, fmt)
        if isinstance(plan, tuple) and plan[0] and not _quiet:
            _log(f"[pipeinfer] weights: {len(plan[0])} file(s) to send, {fmt_bytes(sum(plan[1].values()))}, laid out "
                 f"in {time.perf_counter() - t0:.1f} s")
    _polite_barrier(comm, poll_s)
    plan = comm.bcast(plan, root=0)
    if isinstance(plan, str):
        raise UserError(plan)
    order, sizes = plan
    if rank == 0:
        _reading.clear()
        _send_all(comm, src, order, sizes, [n for n, _ in needs], fmt, poll_s, what)
    elif rank in order:
        path = _receive(comm, item, sizes[rank], poll_s, Path(src).name, d)
    _polite_barrier(comm, poll_s)
    return path if item is not None else None


def _item(ident: str, want: tuple, fmt: int) -> Item:
    kind = want[0]
    if kind == "stage":
        return Item(ident, want[1], want[2], bool(want[3]), fmt)
    if kind == "vocab":
        return Item(ident, -1, -1, True, fmt)  # the target's key-values, no tensors (a draft rank's tokenizer)
    return Item(ident)


def _layout(src: str, want: tuple, reader):
    from ..engine.stagefile import stage_layout, vocab_layout, whole_layout
    if want[0] == "stage":
        return stage_layout(src, want[1], want[2], bool(want[3]), reader=reader)
    if want[0] == "vocab":
        return vocab_layout(src, reader=reader)
    return whole_layout(src)


_layouts: dict = {}  # rank 0, this call: (src, want) -> StageLayout
_reading: dict = {}  # rank 0: the source's stagefile.HeaderReader (in a thread: overlaps the sha256)


def _start_reading(src: str, parse: bool) -> None:
    import threading

    from ..engine.stagefile import HeaderReader

    def parse():
        try:
            _reading["reader"] = HeaderReader(src)
        except Exception as e:  # noqa: BLE001 - reported where the reader is needed
            _reading["error"] = e
    _reading.clear()
    if not parse:
        return
    _reading["thread"] = threading.Thread(target=parse, name="pipeinfer-gguf-parse", daemon=True)
    _reading["thread"].start()


def _reader(src: str):
    from ..engine.stagefile import HeaderReader
    if "thread" in _reading:
        _reading.pop("thread").join()
    if "error" in _reading:
        raise _reading.pop("error")
    if "reader" not in _reading:
        _reading["reader"] = HeaderReader(src)
    return _reading["reader"]


def _plan(src: str, needs: list, fmt: int):
    """Rank 0: (receivers in order, bytes each) or the one-line refusal of a host without room."""
    _layouts.clear()
    sizes = {}
    for need, want in needs:
        if need.status != "need":
            continue
        layout = _layout(src, want, _reader(src) if want[0] != "whole" else None)
        _layouts[need.rank] = layout
        sizes[need.rank] = layout.size
    plain = [n for n, _ in needs]
    msg = stagecache.disk_shortfall(plain, sizes, who=lambda r: f"rank {r}")
    if msg:
        return msg
    return stagecache.send_order(plain, sizes), sizes


# ---------------------------------------------------------------- sending (rank 0)
def _send_all(comm, src: str, order: list[int], sizes: dict, needs: list[Need], fmt: int, poll_s: float,
              what: str) -> None:
    global last_report
    last_report = []
    fd = os.open(src, os.O_RDONLY)
    try:
        for r in order:
            host = needs[r].host
            t0 = time.perf_counter()
            show = _Progress(f"rank {r} ({host})", sizes[r])
            _send_one(comm, r, _layouts[r], fd, poll_s, show)
            dt = time.perf_counter() - t0
            show.done(dt)
            last_report.append({"rank": r, "host": host, "bytes": sizes[r], "seconds": dt, "what": what})
    finally:
        os.close(fd)
        _layouts.clear()


def _send_one(comm, dest: int, layout, fd: int, poll_s: float, show) -> None:
    from mpi4py import MPI
    sha = hashlib.sha256()
    bufs = [np.empty(min(CHUNK, max(layout.size, 1)), np.uint8) for _ in range(IN_FLIGHT)]
    reqs: list = [None] * IN_FLIGHT
    off = i = 0
    while off < layout.size:
        k = i % IN_FLIGHT
        if reqs[k] is not None:
            _wait(reqs[k], poll_s)
        n = layout.read(fd, off, bufs[k])
        view = bufs[k][:n]
        sha.update(view)
        reqs[k] = comm.Isend([view, MPI.BYTE], dest=dest, tag=TAG_DATA)
        off += n
        i += 1
        show.update(off)
        if THROTTLE_S:
            time.sleep(THROTTLE_S)
    for req in reqs:
        if req is not None:
            _wait(req, poll_s)
    digest = np.frombuffer(sha.digest(), np.uint8).copy()
    _wait(comm.Isend([digest, MPI.BYTE], dest=dest, tag=TAG_END), poll_s)


# ---------------------------------------------------------------- receiving
def _receive(comm, item: Item, size: int, poll_s: float, model_name: str, d: Path) -> Path:
    from mpi4py import MPI
    incoming = stagecache.IncomingFile(d, item.file_name())
    try:
        sha = hashlib.sha256()
        n_chunks = (size + CHUNK - 1) // CHUNK
        bufs = [np.empty(min(CHUNK, max(size, 1)), np.uint8) for _ in range(min(IN_FLIGHT, max(n_chunks, 1)))]
        reqs: list = [None] * len(bufs)

        def post(i):
            k = i % len(bufs)
            n = min(CHUNK, size - i * CHUNK)
            reqs[k] = comm.Irecv([bufs[k][:n], MPI.BYTE], source=0, tag=TAG_DATA)

        for i in range(min(len(bufs), n_chunks)):
            post(i)
        for i in range(n_chunks):
            k = i % len(bufs)
            _wait(reqs[k], poll_s)
            n = min(CHUNK, size - i * CHUNK)
            view = bufs[k][:n]
            sha.update(view)
            incoming.write(view)
            if i + len(bufs) < n_chunks:
                post(i + len(bufs))
        digest = np.empty(32, np.uint8)
        _wait(comm.Irecv([digest, MPI.BYTE], source=0, tag=TAG_END), poll_s)
        if digest.tobytes() != sha.digest():
            raise UserError(f"rank {comm.Get_rank()} ({host_name()}): the {item.label()} of {model_name} arrived "
                            f"damaged (sha256 differs from what rank 0 sent); nothing was kept: start again")
        path = incoming.commit()
    except BaseException:
        incoming.discard()
        raise
    stagecache.record(item, path, sha.hexdigest(), model_name, d)
    return path


# ---------------------------------------------------------------- waiting and telling
def _wait(req, poll_s: float) -> None:
    """Until req completes, testing it between short sleeps (a blocking wait would spin a core in MPICH)."""
    sleep = min(2e-5, poll_s)
    while not req.Test():
        time.sleep(sleep)
        sleep = min(sleep * 2, poll_s)


def _polite_barrier(comm, poll_s: float) -> None:
    _wait(comm.Ibarrier(), poll_s)


class _Progress:
    """Rank 0's line for one receiving host: updated in place on a terminal, a summary line at the end."""

    def __init__(self, who: str, total: int):
        self.who, self.total = who, total
        self.t0 = time.perf_counter()
        self.next = 0.0
        self.tty = sys.stderr.isatty() and not _quiet

    def update(self, done: int) -> None:
        now = time.perf_counter()
        if self.tty and now >= self.next:
            self.next = now + PROGRESS_EVERY_S
            sys.stderr.write("\r\x1b[K[pipeinfer] weights: " + stagecache.progress_line(self.who, done, self.total,
                                                                                        now - self.t0))
            sys.stderr.flush()

    def done(self, seconds: float) -> None:
        if _quiet:
            return
        if self.tty:
            sys.stderr.write("\r\x1b[K")
        rate = self.total / seconds if seconds > 0 else 0.0
        _log(f"[pipeinfer] weights: sent {self.who} {fmt_bytes(self.total)} ({self.total:,} bytes) in {seconds:.1f} s "
             f"({fmt_bytes(rate)}/s, {rate * 8 / 1e6:.0f} Mbit/s)")


def _log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)
