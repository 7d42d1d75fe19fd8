"""Start-up agreement: every rank runs the same build, the same model file and the same layer plan.

Checked once, before any model loads (build) and before the first decode (layer plan); a rank that differs from
rank 0 is refused with one line naming it and its host. A rank whose model file differs (or is missing) is not
refused: it receives its stage file from rank 0 (ranks/weights.py, which uses `model_fingerprint` to tell).

The model's identity is cheap but identifying (`model_fingerprint`): the file size, then sha256 over the
GGUF header (every metadata key and value, the tensor names, shapes, types and offsets), the first MiB of
tensor data and the last MiB of the file. Measured on Qwen2.5-Coder-1.5B (1.1 GB, a 5.9 MB header): 15 ms
(the header is parsed at start-up anyway), against 1.45 s for sha256 of the whole file with the file in the
page cache (more from disk, on every rank, at every start). The parts hashed catch another model, another
quantization, another version of the same model (its metadata or tensor layout) and a truncated or
differently padded copy; what they miss is a copy corrupted only in its middle, which no check at start-up
sees (llama.cpp does not verify tensor data either).

A build is pipeinfer's version, the protocol version, a digest of the package's own source files and
llama-cpp-python's version: a host with an edited checkout or another llama.cpp is refused, since both
can change the numbers that cross the wire (and so exactness).
"""
from __future__ import annotations

import functools
import hashlib
import os
from pathlib import Path

MIB = 1 << 20


def model_fingerprint(path: str | os.PathLike) -> str:
    """'SIZE:SHA256[:16]' of the header, the first MiB of tensor data and the last MiB (see module docstring); of a
    split GGUF, the parts' sizes summed and their fingerprints hashed in order (a host whose later part differs is
    another model)."""
    from ..engine.ggufheader import model_files
    parts = []
    for f in model_files(path):
        st = os.stat(f)
        parts.append(_fingerprint(os.path.abspath(f), st.st_size, st.st_mtime_ns))
    if len(parts) == 1:
        return parts[0]
    size = sum(int(p.split(":")[0]) for p in parts)
    return f"{size}:{hashlib.sha256(','.join(parts).encode()).hexdigest()[:16]}"


@functools.lru_cache(maxsize=8)
def _fingerprint(path: str, size: int, mtime_ns: int) -> str:
    from ..engine.ggufheader import read_file_header
    h = read_file_header(path)
    data_start = min((t.offset for t in h.tensors.values()), default=size)
    sha = hashlib.sha256()
    with open(path, "rb") as f:
        _hash_range(f, sha, 0, min(data_start + MIB, size))  # header + metadata + tensor infos + first MiB
        _hash_range(f, sha, max(0, size - MIB), size)         # last MiB
    return f"{size}:{sha.hexdigest()[:16]}"


def _hash_range(f, sha, start: int, end: int) -> None:
    f.seek(start)
    left = end - start
    while left > 0:
        chunk = f.read(min(left, 4 * MIB))
        if not chunk:
            break
        sha.update(chunk)
        left -= len(chunk)


@functools.lru_cache(maxsize=1)
def build_id() -> str:
    from importlib.metadata import PackageNotFoundError, version

    from .. import __version__
    from ..core.protocol import PROTOCOL_VERSION
    sha = hashlib.sha256()
    root = Path(__file__).resolve().parents[1]  # every module of the package, in every role package
    for p in sorted(root.rglob("*.py")):
        sha.update(str(p.relative_to(root)).encode() + b"\0" + p.read_bytes())
    try:
        llama = version("llama_cpp_python")
    except PackageNotFoundError:
        llama = "unknown"
    return f"pipeinfer {__version__} (protocol {PROTOCOL_VERSION}, sources {sha.hexdigest()[:12]}), " \
           f"llama-cpp-python {llama}"


def first_disagreement(values: list, what: str, who) -> str | None:
    """One line naming the first rank whose value differs from rank 0's, or None when all agree.
    who(rank) names a rank (liveness.Liveness.who)."""
    for r, v in enumerate(values):
        if v != values[0]:
            return f"{who(r)} {what}: {v} (rank 0 has {values[0]})"
    return None
