"""A fast reader of GGUF headers: metadata and tensor locations without gguf.GGUFReader's full parse.

gguf.GGUFReader builds numpy views of every field and tensor (about 20 s for Qwen2.5-1.5B's 151,936
vocabulary strings on a loaded 2-core machine); start-up needs a handful of scalars, the vocabulary
size and one tensor's location, so we walk the header once with struct and skip what we don't need.
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
    offset: int             # absolute file offset of the data

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


def read_header(path, keep_arrays: tuple[str, ...] = ()) -> Header:
    """Metadata and tensor infos. Arrays are replaced by their length unless their key is in keep_arrays.

    Cached per (file, size, mtime): start-up reads the same header from the CLI, the runner and the
    head's embedder; callers must not modify the result.
    """
    st = os.stat(path)
    return _read_header(os.fspath(path), st.st_size, st.st_mtime_ns, tuple(keep_arrays))


@functools.lru_cache(maxsize=8)
def _read_header(path: str, size: int, mtime_ns: int, keep_arrays: tuple[str, ...]) -> Header:
    with open(path, "rb") as f:
        buf = f.read(1 << 20)
        pos = 0

        def need(n):
            nonlocal buf, pos
            if pos + n > len(buf):
                buf = buf[pos:] + f.read(max(n, 1 << 20))
                base[0] += pos
                pos = 0
                if n > len(buf):
                    raise NotGGUF(f"truncated GGUF header: the file ends in its {phase[0]}")

        base = [0]
        phase = ["fixed header"]

        def unpack(fmt):
            nonlocal pos
            size = struct.calcsize(fmt)
            need(size)
            v = struct.unpack_from(fmt, buf, pos)[0]
            pos += size
            return v

        def string():
            nonlocal pos
            n = unpack("<Q")
            need(n)
            s = bytes(buf[pos:pos + n])
            pos += n
            return s

        def skip(itype, n):
            """Past an array of n values of itype without decoding them (a vocabulary's 151,936 strings and as many
            merges: 0.05 s here, against 0.5 s value by value)."""
            nonlocal pos
            if itype in _SCALAR:
                size = struct.calcsize(_SCALAR[itype]) * n
                need(size)
                pos += size
            elif itype == _STRING:
                length = struct.Struct("<Q").unpack_from
                for _ in range(n):
                    if pos + 8 > len(buf):
                        need(8)
                    pos += 8 + length(buf, pos)[0]
                    if pos > len(buf):
                        over = pos - len(buf)
                        pos = len(buf)
                        need(over)
                        pos += over
            else:
                for _ in range(n):
                    value(itype, False)

        def value(vtype, keep):
            if vtype in _SCALAR:
                return unpack(_SCALAR[vtype])
            if vtype == _STRING:
                return string().decode("utf-8", errors="replace")
            if vtype == _ARRAY:
                itype, n = unpack("<I"), unpack("<Q")
                if keep:
                    return [string() if itype == _STRING else value(itype, True) for _ in range(n)]
                skip(itype, n)
                return n
            raise NotGGUF(f"unknown GGUF value type {vtype}")

        need(4)
        if buf[:4] != b"GGUF":
            raise NotGGUF("GGUF magic missing")
        pos = 4
        version, n_tensors, n_kv = unpack("<I"), unpack("<Q"), unpack("<Q")
        if version < 2 or n_kv > 1 << 20 or n_tensors > 1 << 24:
            raise NotGGUF(f"unsupported GGUF version {version} or corrupt counts")
        fields, spans = {}, {}
        for i in range(n_kv):
            phase[0] = f"metadata (key {i + 1} of {n_kv})"
            key = string().decode()
            at = base[0] + pos
            vtype = unpack("<I")
            fields[key] = value(vtype, key in keep_arrays)
            spans[key] = (vtype, at, base[0] + pos)
        infos = []
        for i in range(n_tensors):
            phase[0] = f"tensor infos ({i + 1} of {n_tensors})"
            name = string().decode()
            n_dims = unpack("<I")
            shape = tuple(unpack("<Q") for _ in range(n_dims))
            infos.append((name, shape, unpack("<I"), unpack("<Q")))
        end = base[0] + pos
        align = int(fields.get("general.alignment", 32))
        start = (end + align - 1) // align * align
        tensors = {n: TensorInfo(n, s, t, start + o) for n, s, t, o in infos}
        return Header(fields, tensors, spans)


def tensor_rows(path, info: TensorInfo) -> np.ndarray:
    """A 2-D tensor as a read-only memmap of raw rows: uint8[ne1, bytes_per_row]."""
    return np.memmap(path, dtype=np.uint8, mode="r", offset=info.offset, shape=(info.shape[1], info.row_bytes))
