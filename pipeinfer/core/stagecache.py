"""The weights cache of a host: stage files (and whole draft files) that travelled from another host, kept by content.

A rank whose host lacks the model file receives its stage file from rank 0 (ranks/weights.py) and keeps it here,
under ``$PIPEINFER_CACHE/weights`` (``~/.cache/pipeinfer/weights``), named by what it holds, never by where the
source lies on another host: the source model's identity (the content hash of the whole GGUF), the layer range,
whether it carries the vocabulary and STAGE_FORMAT. The next start on that host finds it and nothing travels; a
re-form that gives the host another range moves only that range. The folder holds nothing but those files and
``index.json``:

- ``identity``: what a model file on this host is, the content hash of its bytes, remembered by (path, size, mtime,
  inode) so that a 40 GB file is read once, not at every start; a split GGUF's, the hash of its parts' bytes in
  order, remembered by every part's;
- ``files``: each cached file's size, digest (checked as it arrived, before llama.cpp ever opened it), a sampled
  digest (size, first and last MiB: checked at every start, so a truncated or overwritten file is fetched again),
  its source model, and when it was last used (``pipeinfer models prune`` drops the least recently used first).

A file is written where no other process can see it (O_TMPFILE, linked into place when complete and checked;
a named ``.partial`` file where the file system has no O_TMPFILE, swept at the next start when its writer is
gone), so a sender lost mid-transfer leaves nothing half-written here.

The content hash is xxh3-128 (``HASH``): its job is to catch damage, on a wire or a disk, and to tell models apart,
not to resist an adversary (the hosts and rank 0's file are the user's own; llama.cpp's ``rpc-server -c`` keys its
cache by a 64-bit FNV hash for the same reason). Measured here: 27 GiB/s on one core, against sha256's 1.7 GiB/s
(with SHA-NI) and blake3's 4.4. Every byte that travels is hashed on both ends, and the model once, by cores that
also move the bytes (here, two cores emulate three hosts): with sha256 the link waited for the hash.

Everything in this module is pure or touches only this host's files; the transfer is ranks/weights.py.
"""
from __future__ import annotations

import ctypes
import fcntl
import json
import os
import shutil
import time
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable

import xxhash

from .files import node_cache_dir

MIB = 1 << 20
INDEX = "index.json"
PARTIAL = ".partial"
HASH_CHUNK = 8 * MIB
HASH = "xxh3-128"  # the content hash of every digest here (module docstring), written in the index
DIGEST_BYTES = 16


def content_hash(data: bytes = b""):
    """A new hasher of the cache's content hash, fed data (update, digest: DIGEST_BYTES, hexdigest)."""
    return xxhash.xxh3_128(data)


def weights_dir() -> Path:
    """This host's weights cache: ``$PIPEINFER_WEIGHTS_CACHE`` or ``node_cache_dir() / "weights"``."""
    env = os.environ.get("PIPEINFER_WEIGHTS_CACHE")
    return Path(env).expanduser() if env else node_cache_dir() / "weights"


def host_view(path: str | os.PathLike) -> Path:
    """Where this host sees rank 0's path. ``$PIPEINFER_HOST_ROOT`` (tests: one "host" per rank on one machine)
    puts a rank's file system view under a folder of its own; otherwise the path itself."""
    root = os.environ.get("PIPEINFER_HOST_ROOT")
    return Path(root) / Path(os.path.abspath(path)).relative_to("/") if root else Path(path)


# ---------------------------------------------------------------- keys
@dataclass(frozen=True)
class Item:
    """A file a rank needs: layers [start, end) of a model (with or without its vocabulary), the whole file
    (start = end = 0: a draft model) or its key-values alone (start = end = -1: the target's vocabulary on a host
    that runs only the draft)."""
    model_id: str           # content hash (hex) of the source GGUF
    start: int = 0
    end: int = 0
    with_vocab: bool = True
    fmt: int = 0            # STAGE_FORMAT (0 for a whole file)

    @property
    def whole(self) -> bool:
        return self.start == self.end == 0

    def file_name(self) -> str:
        if self.whole:
            return f"{self.model_id[:32]}.whole.gguf"
        if self.vocab_only:
            return f"{self.model_id[:32]}.vocab.s{self.fmt}.gguf"
        vocab = "" if self.with_vocab else ".novocab"
        return f"{self.model_id[:32]}.L{self.start}-{self.end}{vocab}.s{self.fmt}.gguf"

    @property
    def vocab_only(self) -> bool:
        return self.start == self.end == -1

    def label(self) -> str:
        if self.vocab_only:
            return "vocabulary"
        return "whole file" if self.whole else f"layers {self.start}-{self.end - 1}" + ("" if self.with_vocab else
                                                                                       " (no vocabulary)")


# ---------------------------------------------------------------- the index
@contextmanager
def locked_index(d: Path | None = None, write: bool = True):
    """The index of cache folder d, locked against the other ranks of this host (and saved on leaving when
    write)."""
    d = d or weights_dir()
    d.mkdir(parents=True, exist_ok=True)
    with open(d / ".lock", "a+") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        index = read_index(d)
        stale = index.pop("stale", [])
        yield index
        if write:
            for name in stale:  # indexed under another content hash: names and digests that nothing matches now
                (d / name).unlink(missing_ok=True)
            tmp = d / f"{INDEX}.tmp{os.getpid()}"
            tmp.write_text(json.dumps(index, indent=1, sort_keys=True))
            os.replace(tmp, d / INDEX)


def read_index(d: Path) -> dict:
    try:
        index = json.loads((d / INDEX).read_text())
    except (OSError, ValueError):
        index = {}
    if index and index.get("hash") != HASH:  # written by a pipeinfer with another content hash
        index = {"stale": sorted(index.get("files", {}))}
    index["hash"] = HASH
    index.setdefault("identity", {})
    index.setdefault("files", {})
    return index


def identity_key(path: str | os.PathLike, parts: tuple = ()) -> str:
    """path|size|mtime|inode, and each further part's size|mtime|inode (parts: a split GGUF's files after the
    first)."""
    st = os.stat(path)
    key = f"{os.path.abspath(path)}|{st.st_size}|{st.st_mtime_ns}|{st.st_ino}"
    for p in parts:
        st = os.stat(p)
        key += f"|{st.st_size}|{st.st_mtime_ns}|{st.st_ino}"
    return key


def file_digest(path: str | os.PathLike, start: int = 0, end: int | None = None, hasher=None) -> str:
    """The content hash (hex) of bytes [start, end) of a file (fed to hasher, when given, after what it has)."""
    hasher = hasher or content_hash()
    with open(path, "rb") as f:
        f.seek(start)
        left = (os.path.getsize(path) if end is None else end) - start
        while left > 0:
            chunk = f.read(min(left, HASH_CHUNK))
            if not chunk:
                break
            hasher.update(chunk)
            left -= len(chunk)
    return hasher.hexdigest()


def known_identity(path: str | os.PathLike, d: Path | None = None, parts: tuple = ()) -> str | None:
    """The model's identity if the index has it (nothing hashed); parts: a split GGUF's files after path."""
    with locked_index(d, write=False) as index:
        return index["identity"].get(identity_key(path, parts))


def model_identity(path: str | os.PathLike, d: Path | None = None, parts: tuple = ()) -> tuple[str, float]:
    """(content hash of the whole file, or of a split GGUF's files path, *parts in order; seconds spent hashing it
    now: 0 when the index knew it). Remembered by (path, size, mtime, inode) of each file: a file replaced or touched
    is hashed again."""
    key = identity_key(path, parts)
    with locked_index(d, write=False) as index:
        known = index["identity"].get(key)
    if known:
        return known, 0.0
    t0 = time.perf_counter()
    hasher = content_hash()
    for f in (path, *parts):
        file_digest(f, hasher=hasher)
    digest = hasher.hexdigest()
    dt = time.perf_counter() - t0
    with locked_index(d) as index:
        ids = index["identity"]
        for k in [k for k in ids if k.split("|")[0] == key.split("|")[0]]:
            del ids[k]  # the same path's older identities
        ids[key] = digest
    return digest, dt


def sampled_digest(path: str | os.PathLike) -> str:
    """size:digest of the first and last MiB: what a start checks of a cached file (cheap, catches truncation,
    another file put in its place, a copy cut short)."""
    size = os.path.getsize(path)
    hasher = content_hash()
    with open(path, "rb") as f:
        hasher.update(f.read(MIB))
        f.seek(max(0, size - MIB))
        hasher.update(f.read(MIB))
    return f"{size}:{hasher.hexdigest()[:32]}"


def cached(item: Item, size: int | None = None, d: Path | None = None) -> Path | None:
    """The cached file of item when it is whole (size as expected and as indexed, its sampled digest unchanged, and
    a file written since it was indexed, by its mtime or inode, checked whole against its digest), its last use
    updated; None otherwise. A file that fails the check is deleted (it is fetched again)."""
    d = d or weights_dir()
    path = d / item.file_name()
    with locked_index(d) as index:
        entry = index["files"].get(item.file_name())
        ok = entry is not None and path.is_file()
        if ok:
            st = path.stat()
            ok = st.st_size == entry["size"] and (size is None or size == entry["size"]) \
                and sampled_digest(path) == entry["sample"]
            if ok and entry.get("stat") != _stat_key(st):
                ok = file_digest(path) == entry["digest"]
                entry["stat"] = _stat_key(st)
        if not ok:
            index["files"].pop(item.file_name(), None)
            path.unlink(missing_ok=True)
            return None
        entry["last_use"] = time.time()
    return path


def holdings(item: Item, d: Path | None = None) -> tuple[tuple[str, int, int, bool], ...]:
    """The other stage files of item's model (same stage format) in this host's cache that can give item bytes (a
    layer in common, or both with the vocabulary): (file name, start, end, with_vocab), each checked whole against
    the digest it was indexed with (a file that fails is dropped, never used). What a re-formed pipeline's host
    keeps, so that only the layers it lacks travel."""
    d = d or weights_dir()
    if item.whole or item.vocab_only:
        return ()
    with locked_index(d, write=False) as index:
        files = dict(index["files"])
    out = []
    for name, e in sorted(files.items()):
        start, end = e.get("range", (0, 0))
        if name == item.file_name() or e.get("model") != item.model_id or e.get("format") != item.fmt \
                or start < 0 or start == end == 0:
            continue
        if not (start < item.end and item.start < end) and not (item.with_vocab and e.get("with_vocab")):
            continue
        path = d / name
        if not path.is_file() or path.stat().st_size != e["size"] or file_digest(path) != e["digest"]:
            with locked_index(d) as index:
                index["files"].pop(name, None)
            path.unlink(missing_ok=True)
            continue
        out.append((name, start, end, bool(e.get("with_vocab"))))
    return tuple(out)


def record(item: Item, path: Path, digest: str, model_name: str, d: Path | None = None, source_fp: str = "") -> None:
    """Index a file just linked into place; source_fp: the model's cheap fingerprint (handshake.model_fingerprint),
    by which a host looks for it while rank 0 has yet to hash the model (may_hold)."""
    d = d or weights_dir()
    with locked_index(d) as index:
        index["files"][item.file_name()] = {
            "size": path.stat().st_size, "digest": digest, "sample": sampled_digest(path), "model": item.model_id,
            "model_name": model_name, "range": [item.start, item.end], "with_vocab": item.with_vocab,
            "format": item.fmt, "source_fp": source_fp, "stat": _stat_key(path.stat()), "last_use": time.time(),
            "created": time.time()}


def _stat_key(st: os.stat_result) -> list[int]:
    """What changes when a file is written or replaced: its mtime (ns) and inode."""
    return [st.st_mtime_ns, st.st_ino]


def may_hold(source_fp: str, d: Path | None = None) -> bool:
    """Whether this host's cache may hold a file of the model with that fingerprint: one recorded with it, or one
    recorded without any (by an older pipeinfer). When no host may, rank 0 need not finish hashing the model before
    it sends."""
    d = d or weights_dir()
    if not (d / INDEX).is_file():
        return False
    with locked_index(d, write=False) as index:
        return any(e.get("source_fp") in (source_fp, None, "") for e in index["files"].values())


# ---------------------------------------------------------------- writing a file nobody sees until it is whole
_AT_FDCWD, _AT_SYMLINK_FOLLOW = -100, 0x400


class IncomingFile:
    """A file being received: invisible (O_TMPFILE) or a named .partial file until `commit`, which links it into
    place under its final name; `discard` (or a dead process) leaves nothing behind."""

    def __init__(self, d: Path, name: str):
        self.d, self.name = d, name
        d.mkdir(parents=True, exist_ok=True)
        self.partial: Path | None = None
        tmpfile = getattr(os, "O_TMPFILE", None)
        try:
            if tmpfile is None:
                raise OSError("no O_TMPFILE")
            self.fd = os.open(d, tmpfile | os.O_WRONLY, 0o644)
        except OSError:
            self.partial = d / f"{name}.{os.getpid()}{PARTIAL}"
            self.fd = os.open(self.partial, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)

    def write(self, buf) -> None:
        view = memoryview(buf)
        while view:
            n = os.write(self.fd, view)
            view = view[n:]

    def commit(self, name: str | None = None) -> Path:
        """Link the file into place under name (else the one it was opened with)."""
        self.name = name or self.name
        final = self.d / self.name
        os.fsync(self.fd)
        if self.partial is None:
            tmp = self.d / f"{self.name}.{os.getpid()}.link"
            tmp.unlink(missing_ok=True)
            libc = ctypes.CDLL(None, use_errno=True)
            if libc.linkat(_AT_FDCWD, f"/proc/self/fd/{self.fd}".encode(), _AT_FDCWD, str(tmp).encode(),
                           _AT_SYMLINK_FOLLOW) != 0:
                err = ctypes.get_errno()
                raise OSError(err, f"cannot link the received file into {self.d}: {os.strerror(err)}")
            os.replace(tmp, final)
        else:
            os.replace(self.partial, final)
        os.close(self.fd)
        self.fd = -1
        return final

    def discard(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1
        if self.partial is not None:
            self.partial.unlink(missing_ok=True)


def sweep_partials(d: Path | None = None) -> list[Path]:
    """Delete .partial files whose writer is gone (a host without O_TMPFILE, after a lost sender); returns them."""
    d = d or weights_dir()
    gone = []
    for p in d.glob(f"*{PARTIAL}"):
        try:
            pid = int(p.name[:-len(PARTIAL)].rsplit(".", 1)[1])
        except (ValueError, IndexError):
            pid = -1
        if pid <= 0 or not _alive(pid):
            p.unlink(missing_ok=True)
            gone.append(p)
    for p in d.glob("*.link"):
        p.unlink(missing_ok=True)
    return gone


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


# ---------------------------------------------------------------- planning (pure)
@dataclass(frozen=True)
class Need:
    """One rank's answer to rank 0: what it has of the item it needs, and room for it."""
    rank: int
    host: str
    status: str             # "local" (its host has the model: it writes its stage itself), "cached", "need"
    free: int = 0           # bytes free in its weights cache folder
    folder: str = ""        # that folder (ranks of one host may share it)
    holds: tuple = ()       # (file name, start, end, with_vocab) of its host's other stage files of the model


def disk_shortfall(needs: list[Need], sizes: dict[int, int], who=lambda r: f"rank {r}") -> str | None:
    """One line naming the first host whose cache folder lacks room for what its ranks are to receive (ranks of one
    host with one folder add up), or None. sizes: bytes each receiving rank gets."""
    by_place: dict[tuple[str, str], list[Need]] = {}
    for n in needs:
        if n.status == "need":
            by_place.setdefault((n.host, n.folder), []).append(n)
    for (host, folder), group in by_place.items():
        want = sum(sizes[n.rank] for n in group)
        if want > group[0].free:
            ranks = ", ".join(who(n.rank) for n in group)
            verb = "needs" if len(group) == 1 else "need"
            return (f"host {host} has no room for the weights it lacks: {ranks} {verb} {fmt_bytes(want)} in {folder}, "
                    f"which has {fmt_bytes(group[0].free)} free (free some space, or `pipeinfer models prune` there)")
    return None


def send_order(needs: list[Need], sizes: dict[int, int]) -> list[int]:
    """Receivers in the order rank 0 serves them: one at a time, since rank 0's link carries every byte anyway
    (all at once would finish every host at the same late moment); largest first. A host loads its file (and
    measures its exact batch limit) as soon as it has it, while rank 0 sends the next host its file, and that work
    grows with the file: served largest first, the host whose file arrives last has the least of it left."""
    return sorted((n.rank for n in needs if n.status == "need"), key=lambda r: (-sizes[r], r))


def prune_plan(files: dict[str, dict], bound: int | None = None, model: str | None = None) -> list[str]:
    """The cached files to delete: every file of `model` (a model id or its prefix, or a model name), or the least
    recently used until the rest fit in `bound` bytes."""
    if model is not None:
        return sorted(n for n, e in files.items()
                      if e.get("model", "").startswith(model) or e.get("model_name") == model)
    if bound is None:
        return []
    total = sum(e["size"] for e in files.values())
    out = []
    for name, e in sorted(files.items(), key=lambda kv: (kv[1].get("last_use", 0), kv[0])):
        if total <= bound:
            break
        out.append(name)
        total -= e["size"]
    return out


def prune(bound: int | None = None, model: str | None = None, d: Path | None = None) -> list[tuple[str, int]]:
    """Delete what prune_plan names; returns (name, size) of each."""
    d = d or weights_dir()
    with locked_index(d) as index:
        gone = []
        for name in prune_plan(index["files"], bound, model):
            gone.append((name, index["files"].pop(name)["size"]))
            (d / name).unlink(missing_ok=True)
    return gone


def listing(d: Path | None = None) -> list[dict]:
    """The cached files, most recently used first: name, size, source model, range, last use."""
    d = d or weights_dir()
    if not (d / INDEX).exists():
        return []
    index = read_index(d)
    out = [dict(e, name=n, present=(d / n).is_file()) for n, e in index["files"].items()]
    return sorted(out, key=lambda e: -e.get("last_use", 0))


def parse_size(text: str) -> int:
    """'20G', '500M', '1.5GB', '123' (bytes) -> bytes."""
    t = text.strip().upper().rstrip("B").rstrip("I")
    mult = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40}
    if t and t[-1] in mult:
        return int(float(t[:-1]) * mult[t[-1]])
    return int(float(t))


def fmt_bytes(n: float) -> str:
    for unit, size in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if abs(n) >= size:
            return f"{n / size:.1f} {unit}"
    return f"{int(n)} B"


def progress_line(host: str, done: int, total: int, seconds: float) -> str:
    """'h1: 120.3 MB of 412.0 MB, 117.2 MB/s, 2.5 s left'."""
    rate = done / seconds if seconds > 0 else 0.0
    left = (total - done) / rate if rate > 0 else float("inf")
    eta = f"{left:.1f} s left" if left != float("inf") else "starting"
    return f"{host}: {fmt_bytes(done)} of {fmt_bytes(total)}, {fmt_bytes(rate)}/s, {eta}"


def free_bytes(d: Path) -> int:
    d.mkdir(parents=True, exist_ok=True)
    return shutil.disk_usage(d).free


def free_override() -> int | None:
    """``$PIPEINFER_WEIGHTS_FREE`` (bytes): the room a host reports, for tests of a full disk."""
    v = os.environ.get("PIPEINFER_WEIGHTS_FREE")
    return int(v) if v else None


def names(items: Iterable[Item]) -> list[str]:
    return [i.file_name() for i in items]
