"""Weights travel: only rank 0's host needs the model file; a rank whose host lacks it gets its stage file over MPI.

Start-up only (ranks/startup.py calls `obtain` where a rank needs its stage file, the probe of --layer-split auto,
or, on a draft rank, the draft model): nothing here runs per token.

One call is collective over the ranks that take part:
1. rank 0 sends the model's cheap fingerprint (handshake.model_fingerprint); a rank whose host has a file with that
   fingerprint at rank 0's path writes its stage itself, as before. When every rank does, that is all.
2. Otherwise rank 0 names the model by its content (core/stagecache.model_identity: the content hash of the whole
   file, or of a split GGUF's parts in order, once, remembered by path, size, mtime and inode), and every other rank
   looks in its host's weights cache
   for the file it needs under that name, checked (size, sampled digest). A rank whose host has another file under
   the same path (a different model, or a copy cut short) is never served it: it takes the cache's or rank 0's
   bytes. When rank 0 has not hashed the model yet, it hashes it in a thread while the first file travels (once per
   file; 0.1 s per GiB here from the page cache, a disk's read rate from a disk): the hosts then look for the
   model's files by its cheap fingerprint, recorded beside each cached file; only when some host may hold one does
   rank 0 wait for the hash before the hosts look by it. Each host learns the identity its file is cached under
   with the file's end (TAG_END).
3. Rank 0 works out each missing file's layout (engine/stagefile.stage_layout: the stage's bytes without writing
   them) and checks, before any byte is sent, that every receiving host has room: otherwise one line naming the
   host, what it needs and what it has, and every rank exits 1.
4. A receiving host that holds other stage files of the model (a re-formed or re-planned pipeline: its old
   layers) names them, checked whole (stagecache.holdings); rank 0 makes each file's recipe
   (engine/stagefile.recipe): the tensors a held file has are copied from it on the host, only the rest travels.
5. Rank 0 streams each file's travelling bytes in CHUNK-byte pieces of the file, one receiving rank at a time (its
   link carries every byte, so sending to several at once would only finish all of them late), IN_FLIGHT pieces in
   flight, numpy uint8 buffers (no pickling) on a communicator of their own. The receiver assembles the file,
   hashes it, compares the digest rank 0 computed of the whole file, and only then links it into its cache
   (stagecache.IncomingFile: a lost sender leaves nothing behind). Waiting sleeps between tests of the request
   (never a blocking MPI call: the recipe's "Waiting politely").
6. Rank 0 prints each host's progress (bytes, rate, time left) as one updating line on a terminal and a summary
   line per host (what travelled, and what the host already held); `-q` quiets it (set_quiet).
"""
from __future__ import annotations

import os
import sys
import time
from dataclasses import replace
from pathlib import Path

import numpy as np

from ..core import stagecache
from ..core.errors import UserError
from ..core.stagecache import Item, Need, fmt_bytes
from ..engine.stagefile import StageFileError
from ..wire.hosts import host_name
from ..wire.transport import polite_barrier, wait_politely

CHUNK = 8 << 20      # bytes per message: 67 ms at 1 Gbit/s
IN_FLIGHT = 4        # messages in flight each way
SLICE = 1 << 20      # bytes hashed or written between two tests of the requests in flight
TAG_DATA, TAG_END = 1, 2
DIGEST = stagecache.DIGEST_BYTES
END_BYTES = 2 * DIGEST  # TAG_END: the digest of the file as assembled, then the model's (its identity)
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
    answers = comm.allgather(has)
    if all(answers):
        return None
    comm = comm_weights or comm.Dup()
    try:
        return _obtain(comm, src, fp, None if has else want, poll_s, fmt, what)
    finally:
        if comm_weights is None:
            comm.Free()


def _same(path: Path, fp: str) -> bool:
    from .handshake import model_fingerprint
    try:
        return path.is_file() and model_fingerprint(path) == fp
    except (OSError, ValueError):
        return False


def _obtain(comm, src: str, fp: str, want: tuple | None, poll_s: float, fmt: int, what: str) -> Path | None:
    rank = comm.Get_rank()
    source = _Source(src) if rank == 0 else None
    polite_barrier(comm, poll_s)  # the others wait for rank 0 without a blocking MPI call (which spins a core)
    ident = comm.bcast(source.ident if rank == 0 else None, root=0)  # None: rank 0 is hashing the model
    d = stagecache.weights_dir()
    if want is not None:
        stagecache.sweep_partials(d)
    if ident is None:
        unsure = want is not None and stagecache.may_hold(fp, d)
        if any(comm.allgather(unsure)):  # a host may hold a file of this model: it looks by the model's identity
            if rank == 0:
                source.identity(sending=False)
            polite_barrier(comm, poll_s)
            ident = comm.bcast(source.ident if rank == 0 else None, root=0)
    item = _item(ident or "", want, fmt) if want is not None else None
    status, path, holds = "none", None, ()
    if item is not None:
        path = stagecache.cached(item, d=d) if ident else None
        status = "cached" if path is not None else "need"
        if status == "need" and ident:
            holds = stagecache.holdings(item, d)
    free = stagecache.free_override()
    need = Need(rank, host_name(), status, free if free is not None else stagecache.free_bytes(d) if item else 0,
                str(d), holds)
    needs = comm.allgather((need, want))
    plan = None
    if rank == 0:
        t0 = time.perf_counter()
        plan = source.plan(needs)
        if isinstance(plan, tuple) and plan[0] and not _quiet:
            recipes = plan[1]
            _log(f"[pipeinfer] weights: {len(plan[0])} file(s) to send, "
                 f"{fmt_bytes(sum(rc.wire_bytes() for rc in recipes.values()))}, laid out "
                 f"in {time.perf_counter() - t0:.1f} s")
    polite_barrier(comm, poll_s)
    plan = comm.bcast(plan, root=0)
    if isinstance(plan, str):
        raise UserError(plan)
    order, recipes = plan
    if rank == 0:
        source.send_all(comm, order, [n for n, _ in needs], poll_s, what)
    elif rank in order:
        path = _receive(comm, item, recipes[rank], poll_s, Path(src).name, fp, d)
    # no barrier here: a host whose file has arrived loads it (and probes its exact batch limit) while rank 0 sends
    # the next host its file; the caller's next collective is a polite one (startup.py: after loading)
    return path if item is not None else None


def _item(ident: str, want: tuple, fmt: int) -> Item:
    kind = want[0]
    if kind == "stage":
        return Item(ident, want[1], want[2], bool(want[3]), fmt)
    if kind == "vocab":
        return Item(ident, -1, -1, True, fmt)  # the target's key-values, no tensors (a draft rank's tokenizer)
    return Item(ident)


class _Source:
    """Rank 0's side of one obtain: the model file src, its identity (known, or hashed in a thread: the hash is C
    code that releases the GIL, so the hash runs while the first file travels), the layout of each file to send and its
    recipe."""

    def __init__(self, src: str):
        from concurrent.futures import ThreadPoolExecutor

        from ..engine.ggufheader import model_files
        self.src = src
        self.files = model_files(src)  # a split GGUF's parts in order (each layout's pieces name theirs), or src
        self.layouts: dict = {}  # receiving rank -> StageLayout
        self.recipes: dict = {}  # receiving rank -> Recipe
        self._reader = None
        self.ident = stagecache.known_identity(src, parts=self.files[1:])
        self._hashing = None
        if self.ident is None:
            pool = ThreadPoolExecutor(1, thread_name_prefix="pipeinfer-model-hash")
            self._hashing = pool.submit(stagecache.model_identity, src, None, self.files[1:])
            pool.shutdown(wait=False)

    def identity(self, sending: bool = True) -> str:
        """The model's content hash (hex), waiting for the hash if it is still running (sending: while a file travels,
        or before the hosts look in their caches)."""
        if self.ident is None:
            self.ident, dt = self._hashing.result()
            if not _quiet:
                size = sum(os.path.getsize(f) for f in self.files)
                when = "while the first file travelled" if sending else "before the hosts looked in their caches"
                _log(f"[pipeinfer] weights: identified {Path(self.src).name} by its {stagecache.HASH} in {dt:.1f} s "
                     f"({dt / (size / 2**30):.2f} s/GiB; once per file on this host, {when})")
        return self.ident

    def reader(self):
        from ..engine.stagefile import HeaderReader
        if self._reader is None:
            self._reader = HeaderReader(self.src)
        return self._reader

    def layout(self, want: tuple):
        from ..engine.stagefile import stage_layout, vocab_layout, whole_layout
        if want[0] == "stage":
            return stage_layout(self.src, want[1], want[2], bool(want[3]), reader=self.reader())
        if want[0] == "vocab":
            return vocab_layout(self.src, reader=self.reader())
        return whole_layout(self.src, reader=self.reader() if len(self.files) > 1 else None)

    def plan(self, needs: list):
        """(receivers in order, each one's Recipe) or the one-line refusal of a host without room. A receiver's
        recipe takes from the files its host already holds every tensor they have (a re-formed pipeline's host
        keeps its old layers: only the ones it lacks travel)."""
        from ..engine.stagefile import recipe
        recipes = {}
        for need, want in needs:
            if need.status != "need":
                continue
            layout = self.layout(want)
            held = {name: self.layout(("stage", a, b, v)) for name, a, b, v in need.holds}
            self.layouts[need.rank] = layout
            recipes[need.rank] = self.recipes[need.rank] = recipe(layout, held)
        plain = [n for n, _ in needs]
        msg = stagecache.disk_shortfall(plain, {r: rc.size for r, rc in recipes.items()},
                                        who=lambda r: f"rank {r}")
        if msg:
            return msg
        return stagecache.send_order(plain, {r: rc.wire_bytes() for r, rc in recipes.items()}), recipes

    def send_all(self, comm, order: list[int], needs: list[Need], poll_s: float, what: str) -> None:
        global last_report
        last_report = []
        fds = [os.open(f, os.O_RDONLY) for f in self.files]
        try:
            for r in order:
                host = needs[r].host
                rc = self.recipes[r]
                t0 = time.perf_counter()
                show = _Progress(f"rank {r} ({host})", rc.wire_bytes())
                _send_one(comm, r, self.layouts[r], rc, fds, poll_s, show, self.identity)
                dt = time.perf_counter() - t0
                kept = rc.size - rc.wire_bytes()
                show.done(dt, kept)
                last_report.append({"rank": r, "host": host, "bytes": rc.wire_bytes(), "kept": kept, "seconds": dt,
                                    "what": what})
        finally:
            for fd in fds:
                os.close(fd)


# ---------------------------------------------------------------- sending (rank 0)
def _chunks(size: int):
    """[lo, hi) of each message's part of a file, in order."""
    for lo in range(0, size, CHUNK):
        yield lo, min(lo + CHUNK, size)


def _send_one(comm, dest: int, layout, rc, fds: list[int], poll_s: float, show, identity) -> None:
    """Stream the wire bytes of one file (rc: its Recipe) to rank dest, chunk by chunk, IN_FLIGHT messages in
    flight; then its end: the digest of the whole file as it is to be (the held bytes too: the receiver checks what
    it assembled, end to end) and the model's (identity(): the name the host caches the file under)."""
    from mpi4py import MPI
    hasher = stagecache.content_hash()
    size = min(CHUNK, max(layout.size, 1))
    reads = [np.empty(size, np.uint8) for _ in range(IN_FLIGHT)]  # sent as they are when a chunk travels whole
    packs = [np.empty(size, np.uint8) for _ in range(IN_FLIGHT)] if rc.local else None
    reqs: list = [None] * IN_FLIGHT
    i = sent = 0
    for lo, hi in _chunks(layout.size):
        k = i % IN_FLIGHT
        if reqs[k] is not None:
            wait_politely(reqs[k], poll_s)
            reqs[k] = None
        n = layout.read(fds, lo, reads[k])
        _in_slices(reads[k][:n], [hasher.update], reqs)
        parts = rc.wire(lo, hi)
        if not parts:
            continue
        if parts == [(lo, hi)]:
            out, m = reads[k], n
        else:
            out, m = packs[k], rc.pack(lo, reads[k][:n], packs[k])
        reqs[k] = comm.Isend([out[:m], MPI.BYTE], dest=dest, tag=TAG_DATA)
        i += 1
        sent += m
        show.update(sent)
        if THROTTLE_S:
            time.sleep(THROTTLE_S)
    for req in reqs:
        if req is not None:
            wait_politely(req, poll_s)
    end = np.frombuffer(hasher.digest() + bytes.fromhex(identity()), np.uint8).copy()
    wait_politely(comm.Isend([end, MPI.BYTE], dest=dest, tag=TAG_END), poll_s)


# ---------------------------------------------------------------- receiving
def _receive(comm, item: Item, recipe, poll_s: float, model_name: str, fingerprint: str, cache_dir: Path) -> Path:
    """Assemble item's file from the wire and the held files its recipe names (stagecache.Recipe), check its digest
    against rank 0's, and only then link it into the cache, under the model's identity the end message names (item's
    may be "": rank 0 was still hashing the model), with the model's fingerprint beside it."""
    from mpi4py import MPI
    incoming = stagecache.IncomingFile(cache_dir, item.file_name() if item.model_id else f"unnamed{item.file_name()}")
    held = {name: os.open(cache_dir / name, os.O_RDONLY) for _, _, name, _ in recipe.local}
    try:
        hasher = stagecache.content_hash()
        chunks = list(_chunks(recipe.size))
        wired = [(lo, hi, recipe.wire_bytes(lo, hi)) for lo, hi in chunks]
        wired = [c for c in wired if c[2]]
        bufs = [np.empty(min(CHUNK, max(recipe.size, 1)), np.uint8) for _ in range(min(IN_FLIGHT, max(len(wired), 1)))]
        reqs: dict = {}

        def post(j):
            reqs[j] = comm.Irecv([bufs[j % len(bufs)][:wired[j][2]], MPI.BYTE], source=0, tag=TAG_DATA)

        for j in range(min(len(bufs), len(wired))):
            post(j)
        def repost(j):  # message j's buffer is free: the message len(bufs) later goes into it
            if j + len(bufs) < len(wired):
                post(j + len(bufs))

        chunk = np.empty(min(CHUNK, max(recipe.size, 1)), np.uint8)
        j = 0  # the next message
        for lo, hi in chunks:
            wire = None  # this chunk's wire bytes, when it has some
            if j < len(wired) and wired[j][0] == lo:
                wait_politely(reqs.pop(j), poll_s)
                wire = bufs[j % len(bufs)][:wired[j][2]]
            whole = wire is not None and len(wire) == hi - lo
            view = wire if whole else chunk[:hi - lo]  # a chunk that travelled whole: its bytes as they arrived
            if not whole:
                try:
                    recipe.unpack(lo, view[:0] if wire is None else wire, held, view)
                except StageFileError as e:
                    raise UserError(f"rank {comm.Get_rank()} ({host_name()}): {e} (in its weights cache): "
                                    f"`pipeinfer models prune --model {item.model_id[:12]}` there and start again") \
                        from None
                if wire is not None:
                    repost(j)  # unpacked: its buffer takes a message while this chunk is hashed and written
            _in_slices(view, [hasher.update, incoming.write], reqs.values())
            if wire is not None:
                if whole:
                    repost(j)
                j += 1
        end = np.empty(END_BYTES, np.uint8)
        wait_politely(comm.Irecv([end, MPI.BYTE], source=0, tag=TAG_END), poll_s)
        item = replace(item, model_id=end[DIGEST:].tobytes().hex())
        if end[:DIGEST].tobytes() != hasher.digest():
            raise UserError(f"rank {comm.Get_rank()} ({host_name()}): the {item.label()} of {model_name} arrived "
                            f"damaged (its digest differs from what rank 0 sent); nothing was kept: start again")
        path = incoming.commit(item.file_name())
    except BaseException:
        incoming.discard()
        raise
    finally:
        for fd in held.values():
            os.close(fd)
    stagecache.record(item, path, hasher.hexdigest(), model_name, cache_dir, source_fp=fingerprint)
    return path


# ---------------------------------------------------------------- waiting and telling
def _in_slices(view: np.ndarray, work: list, pending) -> None:
    """Each of work (hashing, writing) on view, SLICE bytes at a time, testing the pending requests between slices:
    MPI moves a message's bytes only inside MPI calls, so a long stretch of work between them would idle the link."""
    for a in range(0, len(view), SLICE):
        part = view[a:a + SLICE]
        for w in work:
            w(part)
        for req in pending:
            if req is not None:
                req.Test()



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

    def done(self, seconds: float, kept: int = 0) -> None:
        """kept: bytes of the file the host took from what it already held."""
        if _quiet:
            return
        rate = self.total / seconds if seconds > 0 else 0.0
        held = f"; {fmt_bytes(kept)} ({kept:,} bytes) of the file it already held" if kept else ""
        _log(f"[pipeinfer] weights: sent {self.who} {fmt_bytes(self.total)} ({self.total:,} bytes) in {seconds:.1f} s "
             f"({fmt_bytes(rate)}/s, {rate * 8 / 1e6:.0f} Mbit/s){held}")


def _log(msg: str) -> None:
    """A line on stderr; on a terminal, in place of a progress line (the model's identity can arrive under one)."""
    if sys.stderr.isatty():
        sys.stderr.write("\r\x1b[K")
    print(msg, file=sys.stderr, flush=True)
