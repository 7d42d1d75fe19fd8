"""A fast reader of GGUF headers: metadata and tensor locations without gguf.GGUFReader's full parse.

gguf.GGUFReader builds numpy views of every field and tensor (about 20 s for Qwen2.5-1.5B's 151,936
vocabulary strings on a loaded 2-core machine); start-up needs a handful of scalars, the vocabulary
size and one tensor's location, so we walk the header once with struct and skip what we don't need.

A split GGUF (llama.cpp's gguf-split set, gguf_parts.py) reads as one model from its first part: the first part's
key-values, every part's tensors, each TensorInfo naming the file that holds its data (`file`).
"""
from __future__ import annotations

import functools
import math
import os
import struct
from dataclasses import dataclass

import numpy as np

_SCALAR = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q", 12: "<d"}
_STRING, _ARRAY = 8, 9


class NotGGUF(ValueError):
    pass


@dataclass(frozen=True)
class TensorInfo:
    name: str
    shape: tuple[int, ...]  # ggml order: ne[0] (row length) first
    ggml_type: int
    offset: int             # absolute offset of the data in `file`
    file: str = ""          # the file holding the data: the one read, or a part of a split GGUF

    @property
    def row_bytes(self) -> int:
        """Bytes of one row (ne[0] values); ValueError/KeyError for a ggml type the gguf package does not know."""
        import gguf
        block, type_size = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType(self.ggml_type)]
        return self.shape[0] // block * type_size

    @property
    def nbytes(self) -> int:
        return self.row_bytes * math.prod(self.shape[1:])


@dataclass
class Header:
    fields: dict            # key -> scalar / str / list (arrays kept when asked, else their length)
    tensors: dict[str, TensorInfo]
    spans: dict = None      # key -> (value type, first byte of its type tag, end of its value): the raw bytes
    files: tuple[str, ...] = ()  # the model's files: the parts of a split GGUF in order, or the one file


def read_header(path, keep_arrays: tuple[str, ...] = ()) -> Header:
    """Metadata and tensor infos of a model: a GGUF, or a split GGUF from its first part (the first part's
    key-values, every part's tensors; gguf_parts.SplitSetError for a later part or a missing one). Arrays are
    replaced by their length unless their key is in keep_arrays.

    Cached per (file, size, mtime) of every part: start-up reads the same header from the CLI, the runner and the
    head's embedder; callers must not modify the result.
    """
    from .gguf_parts import SPLIT_COUNT, SPLIT_NO, is_split, part_paths
    first = read_file_header(path, keep_arrays)
    no, count = first.fields.get(SPLIT_NO), first.fields.get(SPLIT_COUNT)
    if not is_split(no, count):
        return first
    stats = []
    for f in part_paths(path, no, count):
        st = os.stat(f)
        stats.append((f, st.st_size, st.st_mtime_ns))
    return _read_set(tuple(stats), tuple(keep_arrays))


def model_files(path) -> tuple[str, ...]:
    """The files of the model at path, validated: its parts in order for a split GGUF, else (path,)."""
    return read_header(path).files


def model_size(path) -> int:
    """Bytes of the model at path: the sum of its parts for a split GGUF (whose parts are always named
    NAME-0000K-of-0000N.gguf: llama.cpp finds them by name); any other file's own size, unread."""
    from .gguf_parts import part_name
    if part_name(path) is None:
        return os.path.getsize(path)
    return sum(os.path.getsize(f) for f in model_files(path))


def read_file_header(path, keep_arrays: tuple[str, ...] = ()) -> Header:
    """One file's own header (a part of a split GGUF as it is: its split keys, its share of the tensors)."""
    st = os.stat(path)
    return _read_header(os.fspath(path), st.st_size, st.st_mtime_ns, tuple(keep_arrays))


@functools.lru_cache(maxsize=8)
def _read_set(stats: tuple[tuple[str, int, int], ...], keep_arrays: tuple[str, ...]) -> Header:
    """The header of a split GGUF from its parts' (path, size, mtime) in order."""
    from .gguf_parts import SPLIT_COUNT, SPLIT_NO, SPLIT_TENSORS, SplitSetError, check_part, check_tensor_count
    files = tuple(f for f, _, _ in stats)
    first = read_file_header(files[0], keep_arrays)
    tensors = dict(first.tensors)
    for i, f in enumerate(files[1:], 1):
        part = read_file_header(f)
        check_part(f, i, len(files), part.fields.get(SPLIT_NO), part.fields.get(SPLIT_COUNT))
        twice = next((n for n in part.tensors if n in tensors), None)
        if twice is not None:
            raise SplitSetError(f"split GGUF {files[0]}: tensor {twice} is in two parts (parts of different sets?)")
        tensors.update(part.tensors)
    check_tensor_count(files[0], len(tensors), first.fields.get(SPLIT_TENSORS))
    return Header(first.fields, tensors, first.spans, files)


@functools.lru_cache(maxsize=8)
def _read_header(path: str, size: int, mtime_ns: int, keep_arrays: tuple[str, ...]) -> Header:
    with open(path, "rb") as f:
        cur = _Cursor(f)
        if cur.take(4) != b"GGUF":
            raise NotGGUF("GGUF magic missing")
        version, n_tensors, n_kv = cur.unpack("<I"), cur.unpack("<Q"), cur.unpack("<Q")
        if version < 2 or n_kv > 1 << 20 or n_tensors > 1 << 24:
            raise NotGGUF(f"unsupported GGUF version {version} or corrupt counts")
        fields, spans = {}, {}
        for i in range(n_kv):
            cur.phase = f"metadata (key {i + 1} of {n_kv})"
            key = cur.string().decode()
            at = cur.offset
            vtype = cur.unpack("<I")
            fields[key] = cur.value(vtype, key in keep_arrays)
            spans[key] = (vtype, at, cur.offset)
        infos = []
        for i in range(n_tensors):
            cur.phase = f"tensor infos ({i + 1} of {n_tensors})"
            name = cur.string().decode()
            n_dims = cur.unpack("<I")
            shape = tuple(cur.unpack("<Q") for _ in range(n_dims))
            infos.append((name, shape, cur.unpack("<I"), cur.unpack("<Q")))
        align = int(fields.get("general.alignment", 32))
        start = (cur.offset + align - 1) // align * align
        tensors = {n: TensorInfo(n, s, t, start + o, path) for n, s, t, o in infos}
        return Header(fields, tensors, spans, (path,))


class _Cursor:
    """Reads a GGUF header front to back through a 1 MiB window of the file."""
    _LENGTH = struct.Struct("<Q").unpack_from

    def __init__(self, f):
        self.f = f
        self.buf = f.read(1 << 20)
        self.pos = 0    # in buf
        self.base = 0   # file offset of buf[0]
        self.phase = "fixed header"

    @property
    def offset(self) -> int:
        return self.base + self.pos

    def need(self, n: int) -> None:
        """At least n bytes in the window from pos (NotGGUF where the file ends first)."""
        if self.pos + n > len(self.buf):
            self.buf = self.buf[self.pos:] + self.f.read(max(n, 1 << 20))
            self.base += self.pos
            self.pos = 0
            if n > len(self.buf):
                raise NotGGUF(f"truncated GGUF header: the file ends in its {self.phase}")

    def take(self, n: int) -> bytes:
        self.need(n)
        self.pos += n
        return bytes(self.buf[self.pos - n:self.pos])

    def unpack(self, fmt: str):
        size = struct.calcsize(fmt)
        self.need(size)
        v = struct.unpack_from(fmt, self.buf, self.pos)[0]
        self.pos += size
        return v

    def string(self) -> bytes:
        return self.take(self.unpack("<Q"))

    def value(self, vtype: int, keep: bool):
        if vtype in _SCALAR:
            return self.unpack(_SCALAR[vtype])
        if vtype == _STRING:
            return self.string().decode("utf-8", errors="replace")
        if vtype == _ARRAY:
            itype, n = self.unpack("<I"), self.unpack("<Q")
            if keep:
                return [self.string() if itype == _STRING else self.value(itype, True) for _ in range(n)]
            self.skip(itype, n)
            return n
        raise NotGGUF(f"unknown GGUF value type {vtype}")

    def skip(self, itype: int, n: int) -> None:
        """Past an array of n values of itype without decoding them (a vocabulary's 151,936 strings and as many
        merges: 0.05 s here, against 0.5 s value by value)."""
        if itype in _SCALAR:
            self.take(struct.calcsize(_SCALAR[itype]) * n)
        elif itype == _STRING:
            for _ in range(n):
                if self.pos + 8 > len(self.buf):
                    self.need(8)
                self.pos += 8 + self._LENGTH(self.buf, self.pos)[0]
                if self.pos > len(self.buf):  # the string runs past the window
                    over = self.pos - len(self.buf)
                    self.pos = len(self.buf)
                    self.take(over)
        else:
            for _ in range(n):
                self.value(itype, False)


def tensor_rows(path, info: TensorInfo) -> np.ndarray:
    """A 2-D tensor as a read-only memmap of raw rows: uint8[ne1, bytes_per_row], from the file holding it (a part of
    the split GGUF at path)."""
    return np.memmap(info.file or path, dtype=np.uint8, mode="r", offset=info.offset,
                     shape=(info.shape[1], info.row_bytes))
