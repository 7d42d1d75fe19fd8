"""Stage files: a GGUF holding only a range of another GGUF's layers.

llama.cpp refuses a file whose tensor count disagrees with `{arch}.block_count`, so each stage is a file
of its own: tensors blk.{a}..blk.{b-1} renamed blk.0.., raw (quantized) data copied as is, per-layer
metadata arrays sliced to the range. A stage that does not produce logits gets a 4-token dummy
vocabulary and [4, n_embd] embedding/output tensors, so marking all its rows as outputs (needed to
capture hidden states) costs no vocabulary-sized projection. Files are cached, keyed by the source's
identity (path, size, mtime) and the range.
"""
from __future__ import annotations

import hashlib
import os
import struct
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from ..core.files import derived_path, write_atomically

STAGE_FORMAT = 2  # bump when the stage file layout changes: invalidates the cache

# Architectures whose graph depends on the layer index only through metadata we can carry over.
# llama/qwen2/qwen3: no index-dependent rule. gemma3: every 6th layer is global attention with another
# RoPE base, derived from the index unless the per-layer array `sliding_window_pattern` is present;
# we write that array (the whole model's pattern, sliced), which llama.cpp reads first.
SPLITTABLE = {"llama", "qwen2", "qwen3", "gemma3"}
SWA_PERIOD = {"gemma3": 6}


class StageFileError(ValueError):
    """A model that cannot be split as asked (one-line message for the user)."""


@dataclass(frozen=True)
class ModelInfo:
    arch: str
    n_layer: int
    n_embd: int
    n_vocab: int


def read_info(path: str | os.PathLike) -> ModelInfo:
    """Architecture and sizes from a GGUF header (fast: see ggufheader.py)."""
    from .ggufheader import NotGGUF, read_header
    try:
        header = read_header(path)
        fields = header.fields
    except (NotGGUF, OSError, UnicodeDecodeError, struct.error) as e:
        raise StageFileError(f"{path}: not a GGUF file ({e})") from None
    arch = fields.get("general.architecture")
    if arch is None:
        raise StageFileError(f"{path}: GGUF without general.architecture")
    n_layer, n_embd = fields.get(f"{arch}.block_count"), fields.get(f"{arch}.embedding_length")
    if n_layer is None or n_embd is None:
        raise StageFileError(f"{path}: GGUF lacks {arch}.block_count or {arch}.embedding_length")
    _check_tensor_data(path, header.tensors)
    return ModelInfo(arch, int(n_layer), int(n_embd), int(fields.get("tokenizer.ggml.tokens", 0)))


def _check_tensor_data(path, tensors) -> None:
    """Every tensor's data lies inside the file (a truncated copy fails here, not inside llama.cpp)."""
    size = os.path.getsize(path)
    for t in tensors.values():
        try:
            end = t.offset + t.nbytes
        except (ValueError, KeyError):
            raise StageFileError(f"{path}: tensor {t.name} has ggml type {t.ggml_type}, unknown to this build") from None
        if end > size:
            raise StageFileError(f"{path}: truncated GGUF: tensor {t.name} needs bytes up to {end:,}, "
                                 f"the file has {size:,} (an incomplete download or copy?)")


def _field(reader, key):
    f = reader.fields.get(key)
    return None if f is None else f.contents()


def check_splittable(info: ModelInfo, n_stages: int) -> None:
    if n_stages > 1 and info.arch not in SPLITTABLE:
        raise StageFileError(
            f"architecture '{info.arch}' is not verified for layer splitting (renumbering layers may change "
            f"the model); supported: {', '.join(sorted(SPLITTABLE))}; run it on 1 rank instead")


def stage_path(src: str | os.PathLike, start: int, end: int, with_vocab: bool) -> Path:
    label = f"L{start}-{end}{'' if with_vocab else '.novocab'}"
    return derived_path(src, label, "gguf", start, end, with_vocab, STAGE_FORMAT)


def ensure_stage_file(src: str | os.PathLike, start: int, end: int, with_vocab: bool) -> Path:
    """Path of the stage file for layers [start, end) of src, written on first use."""
    out = stage_path(src, start, end, with_vocab)
    if not out.exists():
        write_atomically(out, lambda tmp: write_stage_file(src, tmp, start, end, with_vocab))
    return out


def write_stage_file(src, dst, start: int, end: int, with_vocab: bool) -> None:
    import gguf
    reader = gguf.GGUFReader(str(src), "r")
    arch = _field(reader, "general.architecture")
    n_layer = int(_field(reader, f"{arch}.block_count"))
    n_embd = int(_field(reader, f"{arch}.embedding_length"))
    if not (0 <= start < end <= n_layer):
        raise StageFileError(f"layer range [{start}, {end}) outside the model's {n_layer} layers")
    check_splittable(ModelInfo(arch, n_layer, n_embd, 0), 2 if (start, end) != (0, n_layer) else 1)

    writer = gguf.GGUFWriter(str(dst), arch)
    for field in reader.fields.values():
        name = field.name
        if name.startswith("GGUF.") or name == "general.architecture":
            continue
        if not with_vocab and name.startswith("tokenizer."):
            continue
        vtype = field.types[0]
        value = field.contents()
        sub_type = field.types[-1] if vtype == gguf.GGUFValueType.ARRAY else None
        if name == f"{arch}.block_count":
            value = end - start
        elif vtype == gguf.GGUFValueType.ARRAY and name.startswith(f"{arch}.") and len(value) == n_layer:
            value = value[start:end]  # per-layer metadata (head counts, window flags, ...)
        writer.add_key_value(name, value, vtype, sub_type=sub_type)
    if arch in SWA_PERIOD and f"{arch}.attention.sliding_window_pattern" not in reader.fields:
        period = SWA_PERIOD[arch]
        pattern = [il % period < period - 1 for il in range(n_layer)][start:end]
        writer.add_array(f"{arch}.attention.sliding_window_pattern", pattern)
    if not with_vocab:
        _add_dummy_vocab(writer, gguf)

    tensors = []  # (new name, data, type)
    for t in reader.tensors:
        name = t.name
        if name.startswith("blk."):
            il = int(name.split(".")[1])
            if not start <= il < end:
                continue
            name = f"blk.{il - start}." + name.split(".", 2)[2]
        elif not with_vocab and name in ("token_embd.weight", "output.weight"):
            # [4, n_embd] stand-ins: never used for hidden-state input, projection of 4 rows is free
            tensors.append((name, np.zeros((4, n_embd), dtype=np.float32), gguf.GGMLQuantizationType.F32))
            continue
        tensors.append((name, t.data, t.tensor_type))
    _write_tensors(writer, tensors)


def _write_tensors(writer, tensors: list) -> None:
    """Finish a GGUFWriter whose key-values are added: header, key-values, tensor infos, then each (name, data,
    type) tensor's raw data, and close it."""
    for name, data, ttype in tensors:
        writer.add_tensor_info(name, data.shape, data.dtype, data.nbytes, ttype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    for _, data, _ in tensors:
        writer.write_tensor_data(np.ascontiguousarray(data))
    writer.close()


def _add_dummy_vocab(writer, gguf, n: int = 4) -> None:
    # SentencePiece-style ("llama") n-token vocabulary: loads and reports n_vocab = n (the strings are never used)
    writer.add_tokenizer_model("llama")
    writer.add_token_list(["<unk>", "<s>", "</s>", "a"] + [f"<t{i}>" for i in range(4, n)])
    writer.add_token_scores([0.0] * n)
    writer.add_token_types([gguf.TokenType.UNKNOWN, gguf.TokenType.CONTROL, gguf.TokenType.CONTROL]
                           + [gguf.TokenType.NORMAL] * (n - 3))
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)


# ================================================================ a draft with a pruned output head
PRUNED_FORMAT = 1  # bump when the pruned-head file layout changes


def head_tokens(tokens: list[bytes], token_types: list[int], n_keep: int) -> np.ndarray:
    """The token ids a pruned draft head keeps, at most n_keep (int32, sorted): the most frequent tokens.

    A BPE vocabulary numbers its merged tokens in merge order, i.e. by how often the tokenizer's training
    text made them, and lists its base alphabet (single characters, or bytes) by frequency too; Gemma's
    SentencePiece-converted vocabulary puts the merges first and the 26,000-character alphabet after them.
    So the head keeps: every special token a model may emit (gguf token types UNKNOWN, CONTROL but not the
    `<unused...>` placeholders, USER_DEFINED, BYTE), the n_keep / 16 lowest-id single characters and the
    lowest-id merged tokens up to n_keep: the frequency-ranked draft vocabulary of FR-Spec (Zhao et al.,
    2025) without a corpus of our own."""
    special, chars, merged = [], [], []
    for i, (text, kind) in enumerate(zip(tokens, token_types)):
        if kind == 1:  # NORMAL
            (chars if len(text.decode("utf-8", errors="replace")) == 1 else merged).append(i)
        elif kind in (2, 4, 6) or (kind == 3 and not text.startswith(b"<unused")):
            special.append(i)
    n_chars = min(len(chars), n_keep // 16)
    keep = special[:n_keep] + chars[:n_chars]
    keep += merged[:max(0, n_keep - len(keep))]
    return np.sort(np.array(keep, dtype=np.int32))


def pruned_head_path(src: str | os.PathLike, keep: np.ndarray) -> Path:
    # keyed by the kept ids themselves: a file's rows always match the ids its logits are scattered to
    ids = hashlib.sha256(np.ascontiguousarray(keep, dtype=np.int32).tobytes()).hexdigest()[:16]
    return derived_path(src, f"head{len(keep)}", "gguf", ids, PRUNED_FORMAT)


def ensure_pruned_head(src: str | os.PathLike, n_keep: int) -> tuple[Path, np.ndarray]:
    """(path of src with its output head pruned to n_keep tokens, the kept token ids), written on first use."""
    from .ggufheader import read_header
    fields = read_header(src, keep_arrays=("tokenizer.ggml.tokens", "tokenizer.ggml.token_type")).fields
    tokens, types = fields.get("tokenizer.ggml.tokens"), fields.get("tokenizer.ggml.token_type")
    if not isinstance(tokens, list) or not isinstance(types, list) or len(types) != len(tokens):
        raise StageFileError(f"{src}: --draft-head needs the GGUF's token list and token types")
    keep = head_tokens(tokens, types, n_keep)
    out = pruned_head_path(src, keep)
    if not out.exists():
        write_atomically(out, lambda tmp: write_pruned_head(src, tmp, keep))
    return out, keep


def write_pruned_head(src, dst, keep: np.ndarray) -> None:
    """src with a vocabulary of len(keep) tokens: the output projection (and the embedding table, which a
    tied model projects with) keeps only rows `keep`, raw data copied as is.

    Only the output head changes: logits row k of the pruned model is logit keep[k] of src, computed by the
    same kernel over the same row. Its input must come as embeddings (stage.TokenEmbedder on src), since
    its own table no longer holds every token; the tokenizer fields become a placeholder vocabulary of
    len(keep) tokens (text goes through src's own tokenizer)."""
    import gguf
    reader = gguf.GGUFReader(str(src), "r")
    arch = _field(reader, "general.architecture")
    writer = gguf.GGUFWriter(str(dst), arch)
    for field in reader.fields.values():
        name = field.name
        if name.startswith("GGUF.") or name in ("general.architecture", f"{arch}.vocab_size") \
                or name.startswith("tokenizer."):
            continue
        vtype = field.types[0]
        sub_type = field.types[-1] if vtype == gguf.GGUFValueType.ARRAY else None
        writer.add_key_value(name, field.contents(), vtype, sub_type=sub_type)
    if f"{arch}.vocab_size" in reader.fields:
        writer.add_key_value(f"{arch}.vocab_size", len(keep), gguf.GGUFValueType.UINT32)
    _add_dummy_vocab(writer, gguf, len(keep))
    _write_tensors(writer, [(t.name, t.data[keep] if t.name in ("token_embd.weight", "output.weight") else t.data,
                             t.tensor_type) for t in reader.tensors])
