"""Tensor-group slices: one rank's share of every layer of a stage, as a GGUF llama.cpp loads as it is.

A stage run by a group of G ranks (ranks/group.py) splits each of its layers G ways:
- attention by KV-head groups: each rank holds the query heads of its KV heads (attn_q, attn_k, attn_v rows, their
  biases) and the matching input columns of attn_output; its KV cache holds its own heads only. With more ranks than
  KV heads, each KV head is held by G / n_head_kv ranks, which split its query heads;
- the feed-forward columns: ffn_gate and ffn_up rows, ffn_down input columns (for MoE layers the same within every
  expert; the router is whole on every rank);
- on the last stage the output projection by vocabulary rows (the logits gathered by the leader).
Each rank's attention and feed-forward outputs are partial sums of the whole layer's; the group adds them before
each residual add (group.GroupReduce). Biases added after a partial sum (attn_output, ffn_down) stay with rank 0.

Quantized data is cut as it is, never re-quantized: rows (a matrix's output dimension) anywhere, input columns on the
type's block boundaries (Q4_K and Q6_K: 256 values). A rank's share follows its speed (unequal slices are fine).

llama.cpp's qwen2 loader sizes attn_q and attn_output at {n_embd, n_embd} whatever the head count
(src/models/qwen2.cpp:38-39), so a qwen2 slice is written as a seed_oss file: llama.cpp's seed_oss graph is qwen2's
operation for operation (RMS norms, q/k/v with optional biases, NeoX RoPE, the SiLU feed-forward; models/seed-oss.cpp),
its loader sizes q by the file's heads x key_length, and it names the feed-forward's input norm
post_attention_norm where qwen2 names it ffn_norm. (Written as llama, whose RoPE pairs are adjacent, the q/k rows
would have to be reordered within each head, which changes the order q.k adds its products: one process against such
a file agreed on 98.2% of the story prompt's 512 teacher-forced tokens.)
"""
from __future__ import annotations

import math
import os
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from ..core.files import write_atomically
from .stagefile import StageFileError, _add_dummy_vocab, _derived, _field, _stage_metadata, _write_tensors, \
    _writer_for, source_reader

SLICE_FORMAT = 2  # bump when a slice file's layout changes: invalidates the cache



@dataclass(frozen=True)
class Written:
    """What a family's slice file is written as: an architecture whose loader sizes attention by the file's heads,
    whose graph is the family's, and the tensors it names otherwise (source suffix -> written suffix)."""
    arch: str
    renames: tuple[tuple[str, str], ...] = ()


# Architectures a group slices, and what each is written as (see the module docstring for qwen2 -> seed_oss)
WRITTEN_AS = {"llama": Written("llama"),
              "qwen2": Written("seed_oss", renames=(("ffn_norm.weight", "post_attention_norm.weight"),))}

# Why the families a group cannot slice are refused (the rest: not yet described to the slicer)
NOT_SLICED = {
    "qwen3next": "its gated delta-net layers keep a recurrent state per sequence computed from all of a layer's "
                 "heads together (models/qwen3next.cpp), which a rank holding some heads cannot update",
    "lfm2": "its short-convolution layers keep one state over the whole embedding per sequence, which a rank "
            "holding some columns cannot update",
    "mamba": "its recurrent state spans the whole inner dimension, which a rank holding some columns cannot update",
    "jamba": "its mamba layers' recurrent state spans the whole inner dimension",
}


class SliceError(StageFileError):
    """A model or group a slice cannot be cut for (one line naming why)."""


@dataclass(frozen=True)
class Slice:
    """Rank `index` of a group whose members' shares of the work are `shares` (any positive weights)."""
    index: int
    shares: tuple[float, ...]

    @property
    def size(self) -> int:
        return len(self.shares)

    def key(self) -> tuple:
        return (self.index, *(round(s / sum(self.shares), 6) for s in self.shares))


def cut(n_units: int, shares: tuple[float, ...], minimum: int = 1) -> list[tuple[int, int]]:
    """[a, b) of each member when n_units are shared by `shares`, in member order, by largest remainder, each at
    least `minimum` units (SliceError when there are too few)."""
    g = len(shares)
    if n_units < g * minimum:
        raise SliceError(f"{n_units} units cannot be shared by {g} ranks")
    total = sum(shares)
    exact = [n_units * s / total for s in shares]
    counts = [max(minimum, math.floor(x)) for x in exact]
    while sum(counts) > n_units:
        i = max((k for k in range(g) if counts[k] > minimum), key=lambda k: counts[k] - exact[k])
        counts[i] -= 1
    order = sorted(range(g), key=lambda k: exact[k] - counts[k], reverse=True)
    for k in range(n_units - sum(counts)):
        counts[order[k % g]] += 1
    bounds, a = [], 0
    for c in counts:
        bounds.append((a, a + c))
        a += c
    return bounds


@dataclass(frozen=True)
class Heads:
    """A member's attention heads: query heads [q0, q1), KV heads [kv0, kv1)."""
    q0: int
    q1: int
    kv0: int
    kv1: int


def head_slices(n_head: int, n_head_kv: int, shares: tuple[float, ...]) -> list[Heads]:
    """Each member's heads: whole KV groups by share while there are as many KV heads as members; else each KV head
    held by G / n_head_kv members, which split its query heads evenly."""
    g = len(shares)
    if n_head % n_head_kv:
        raise SliceError(f"{n_head} query heads do not group over {n_head_kv} KV heads")
    per_kv = n_head // n_head_kv
    if g <= n_head_kv:
        return [Heads(a * per_kv, b * per_kv, a, b) for a, b in cut(n_head_kv, shares)]
    if g % n_head_kv or per_kv % (g // n_head_kv):
        raise SliceError(f"a group of {g} cannot share {n_head_kv} KV heads of {per_kv} query heads each "
                         f"(needs a group size dividing the KV heads, or a multiple of them dividing the query heads)")
    r = g // n_head_kv
    q_each = per_kv // r
    return [Heads(m // r * per_kv + m % r * q_each, m // r * per_kv + (m % r + 1) * q_each, m // r, m // r + 1)
            for m in range(g)]


def column_slices(n_cols: int, block: int, shares: tuple[float, ...]) -> list[tuple[int, int]]:
    """Input columns of a matrix cut on its quantization's blocks of `block` values: [a, b) per member."""
    if n_cols % block:
        raise SliceError(f"{n_cols} columns are not whole blocks of {block}")
    return [(a * block, b * block) for a, b in cut(n_cols // block, shares)]


# ---------------------------------------------------------------- files
def slice_path(src: str | os.PathLike, start: int, end: int, with_vocab: bool, part: Slice) -> Path:
    label = f"L{start}-{end}{'' if with_vocab else '.novocab'}.tp{part.index}of{part.size}"
    return _derived(src, label, "gguf", start, end, with_vocab, *part.key(), SLICE_FORMAT)


def ensure_slice_file(src: str | os.PathLike, start: int, end: int, with_vocab: bool, part: Slice) -> Path:
    """Path of this member's slice of layers [start, end) of src, written on first use."""
    out = slice_path(src, start, end, with_vocab, part)
    if not out.exists():
        write_atomically(out, lambda tmp: write_slice_file(src, tmp, start, end, with_vocab, part))
    return out


def vocab_slices(src: str | os.PathLike, shares: tuple[float, ...]) -> list[tuple[int, int]]:
    """Each member's rows of the output projection (the last stage's vocabulary), as write_slice_file cuts them."""
    from .ggufheader import read_header
    tensors = read_header(src).tensors
    out = tensors.get("output.weight") or tensors["token_embd.weight"]
    return cut(int(out.shape[1]), shares)


def check_sliceable(arch: str) -> None:
    if arch in NOT_SLICED:
        raise SliceError(f"{arch} cannot run in a tensor group: {NOT_SLICED[arch]}")
    if arch not in WRITTEN_AS:
        raise SliceError(f"{arch} cannot run in a tensor group yet (groups slice: {', '.join(sorted(WRITTEN_AS))}); "
                         f"run it as pipeline stages")


@dataclass(frozen=True)
class _Shape:
    n_embd: int
    n_head: int
    n_head_kv: int
    head_dim: int
    n_ff: int
    n_vocab: int


def _shape(reader, arch: str) -> _Shape:
    def scalar(key):
        value = _field(reader, f"{arch}.{key}")
        if isinstance(value, list):
            raise SliceError(f"{arch}.{key} varies by layer: a tensor group needs every layer alike")
        return None if value is None else int(value)
    n_embd, n_head = scalar("embedding_length"), scalar("attention.head_count")
    n_head_kv = scalar("attention.head_count_kv") or n_head
    head_dim = scalar("attention.key_length") or n_embd // n_head
    if (scalar("attention.value_length") or head_dim) != head_dim:
        raise SliceError("keys and values of different widths: a tensor group needs them alike")
    tensors = {t.name: t for t in reader.tensors}
    out = tensors.get("output.weight", tensors["token_embd.weight"])
    return _Shape(n_embd, n_head, n_head_kv, head_dim, scalar("feed_forward_length"), int(out.shape[1]))


def _block(tensor) -> int:
    import gguf
    return gguf.GGML_QUANT_SIZES[tensor.tensor_type][0]


def _cols(tensor, a: int, b: int) -> np.ndarray:
    """Input columns [a, b) of a tensor (whole blocks): its data's last axis holds each row's bytes (or values)."""
    import gguf
    block, nbytes = gguf.GGML_QUANT_SIZES[tensor.tensor_type]
    if a % block or b % block:
        raise SliceError(f"{tensor.name}: columns {a}..{b} cut through its blocks of {block}")
    per_value = tensor.data.shape[-1] / int(tensor.shape[0])  # bytes (or elements) per input value
    return np.ascontiguousarray(tensor.data[..., int(a * per_value):int(b * per_value)])


def write_slice_file(src, dst, start: int, end: int, with_vocab: bool, part: Slice) -> None:
    """Member part.index's slice of layers [start, end) of src (module docstring); with_vocab: the last stage, its
    vocabulary rows of the output projection."""
    import gguf
    reader = source_reader(src)
    arch = _field(reader, "general.architecture")
    check_sliceable(arch)
    shape = _shape(reader, arch)
    written, renames = WRITTEN_AS[arch].arch, dict(WRITTEN_AS[arch].renames)
    heads = head_slices(shape.n_head, shape.n_head_kv, part.shares)[part.index]
    n_all = int(_field(reader, f"{arch}.block_count"))
    hd = shape.head_dim
    tensors = {t.name: t for t in reader.tensors}
    down = tensors.get("blk.0.ffn_down.weight") or tensors.get("blk.0.ffn_down_exps.weight")
    if down is None:
        raise SliceError(f"{arch}: no ffn_down in layer 0, nothing to slice the feed-forward by")
    ff0, ff1 = column_slices(shape.n_ff, _block(down), part.shares)[part.index]
    v0, v1 = cut(shape.n_vocab, part.shares)[part.index]
    o_block = _block(tensors["blk.0.attn_output.weight"])
    if (heads.q0 * hd) % o_block or (heads.q1 * hd) % o_block:
        raise SliceError(f"a group of {part.size} would cut attn_output's {o_block}-value blocks between heads of "
                         f"{hd} values (query heads {heads.q0}..{heads.q1}): use a group size dividing the KV heads")

    writer = _writer_for(reader, dst, written)
    own = {
        "attention.head_count": heads.q1 - heads.q0,
        "attention.head_count_kv": heads.kv1 - heads.kv0,
        "attention.key_length": hd,
        "attention.value_length": hd,
        "rope.dimension_count": hd,
        "feed_forward_length": ff1 - ff0,
    }
    uint32 = gguf.GGUFValueType.UINT32
    for name, value, vtype, sub_type in _stage_metadata(reader, arch, n_all, n_all, start, end, False):
        if name.startswith(f"{arch}."):
            key = name[len(arch) + 1:]
            if key in own:
                continue
            name = f"{written}.{key}"
        writer.add_key_value(name, value, vtype, sub_type=sub_type)
    for key, value in own.items():
        writer.add_key_value(f"{written}.{key}", value, uint32)
    n_rows = v1 - v0 if with_vocab else 4
    _add_dummy_vocab(writer, gguf, n_rows)

    q_rows, kv_rows = np.arange(heads.q0 * hd, heads.q1 * hd), np.arange(heads.kv0 * hd, heads.kv1 * hd)
    out = []
    for t in reader.tensors:
        name = t.name
        if name.startswith("blk."):
            il = int(name.split(".")[1])
            if not start <= il < end:
                continue
            rest = name.split(".", 2)[2]
            data = _sliced(t, rest, q_rows, kv_rows, (heads.q0 * hd, heads.q1 * hd), (ff0, ff1), part.index)
            if data is not None:
                out.append((f"blk.{il - start}.{renames.get(rest, rest)}", data, t.tensor_type))
        elif name in ("token_embd.weight", "output.weight"):
            if with_vocab:
                out.append((name, np.ascontiguousarray(t.data[v0:v1]), t.tensor_type))
            else:
                out.append((name, np.zeros((4, shape.n_embd), dtype=np.float32), gguf.GGMLQuantizationType.F32))
        elif name == "output.bias":
            out.append((name, np.ascontiguousarray(t.data[v0:v1]) if with_vocab else np.zeros(4, np.float32),
                        t.tensor_type))
        else:
            out.append((name, t.data, t.tensor_type))
    _write_tensors(writer, out)


def _sliced(t, rest: str, q_rows, kv_rows, q_cols: tuple[int, int], ff: tuple[int, int], index: int):
    """A layer tensor's slice (None: not in this member's file)."""
    kind, _, what = rest.rpartition(".")
    if kind == "attn_q":
        return np.ascontiguousarray(t.data[q_rows])
    if kind in ("attn_k", "attn_v"):
        return np.ascontiguousarray(t.data[kv_rows])
    if kind == "attn_output":
        return _cols(t, *q_cols) if what == "weight" else (t.data if index == 0 else None)
    if kind in ("ffn_gate", "ffn_up", "ffn_gate_exps", "ffn_up_exps"):
        return np.ascontiguousarray(t.data[..., ff[0]:ff[1], :] if t.data.ndim == 3 else t.data[ff[0]:ff[1]])
    if kind in ("ffn_down", "ffn_down_exps"):
        return _cols(t, *ff) if what == "weight" else (t.data if index == 0 else None)
    if kind in ("attn_qkv",) or "shexp" in kind:
        raise SliceError(f"{rest}: a tensor group cannot slice it yet")
    return t.data  # norms, the router: whole on every member
