"""Wire protocol between pipeline ranks: message kinds, tags and buffer layouts, declared once.

Every pipeline operation is a *transaction*: a fixed-size header on TAG_BEGIN, then the payloads that
the header announces, each on its kind's own tag (the paper's design):

    DECODE  (rank r -> r+1):  | HEADER | META i32[n_meta] on TAG_META | ACTIV f32[n_tokens, n_embd] on TAG_ACTIV |
    RESULT  (last -> head):   | HEADER | TOKENS i32[n_outputs] on TAG_TOKENS |
    KV      (rank r -> r+1):  | HEADER | KV_OPS i32[n_ops, 5] on TAG_KV |
    SAMPLING(rank r -> r+1):  | HEADER | SAMPLING i64[4] on TAG_SAMPLING |
    SHUTDOWN(rank r -> r+1):  | HEADER |
    CANCEL  (out of band, comm_cancel, last -> ... -> 1): i32[k] run ids on TAG_CANCEL

Why the order holds: MPI does not let two messages with the same (sender, receiver, communicator, tag)
overtake each other. Headers all travel on TAG_BEGIN, so a stage reads transaction headers in exactly
the order its predecessor issued them. A stage handles one transaction at a time (single-threaded) and
reads that transaction's payloads before the next header; the payloads of one kind travel on one tag
in the same order as their headers, so the next message on TAG_META is always this transaction's.
Each stage forwards transactions in the order it handled them, so every stage sees the head's order.
Cancelled runs still pass a DECODE header (flag CANCELLED, no payload) so positions in the stream and
the head's FIFO of results stay aligned.

A RESULT carries one token id per output row, not the row's logits: the target's token after that row,
drawn by the last stage exactly as verification draws it (verify.sample_at: arg-max, or a sample seeded
by (seed, position) with the generation's SAMPLING parameters, which the head sends before its prompt).
That is 4 bytes per row instead of n_vocab x 4 (607,744 bytes for Qwen2.5's 151,936-token vocabulary).
"""
from __future__ import annotations

import enum
from dataclasses import dataclass

import numpy as np

PROTOCOL_VERSION = 3


class Tag(enum.IntEnum):
    BEGIN = 1      # transaction header, HEADER layout
    META = 2       # DECODE metadata, META layout
    ACTIV = 3      # hidden states f32[n_tokens, n_embd]
    KV = 5         # KV ops i32[n_ops, 5]
    CANCEL = 6     # i32[k] run ids (on comm_cancel)
    SAMPLING = 7   # i64[4]: SAMPLING layout
    TOKENS = 8     # i32[n_outputs]: the target's token after each output row (4 was LOGITS, protocol 2)


class Kind(enum.IntEnum):
    DECODE = 1
    RESULT = 2
    KV = 3
    SHUTDOWN = 4
    SAMPLING = 5


class Flag(enum.IntFlag):
    NONE = 0
    SPECULATIVE = 1   # may be cancelled; a non-speculative run is never cut short
    CANCELLED = 2     # skipped or aborted upstream: no payload follows


class KvOp(enum.IntEnum):
    RM = 1     # seq_rm(seq_src, p0, p1)
    CP = 2     # seq_cp(seq_src, seq_dst, p0, p1)
    KEEP = 3   # seq_keep(seq_src)
    COMPACT = 4  # keep only seq_src, repacked into cells 0..n-1 in position order (stage.py)


# HEADER: i32[8]
HEADER_LEN = 8
H_KIND, H_RUN, H_N_TOKENS, H_N_META, H_FLAGS, H_PARENT, H_N_OUTPUTS, H_N_EMBD = range(HEADER_LEN)
NO_RUN = -1


@dataclass
class Header:
    kind: Kind
    run_id: int = NO_RUN
    n_tokens: int = 0      # DECODE: tokens in the batch; KV: number of ops
    n_meta: int = 0        # DECODE: length of the META payload
    flags: Flag = Flag.NONE
    parent_id: int = NO_RUN  # DECODE: run whose cells this run builds on (cancelled with it)
    n_outputs: int = 0     # DECODE/RESULT: rows of logits the head wants back
    n_embd: int = 0        # DECODE: width of ACTIV (0 when the payload is token ids only)

    def pack(self) -> np.ndarray:
        return np.array([self.kind, self.run_id, self.n_tokens, self.n_meta, self.flags,
                         self.parent_id, self.n_outputs, self.n_embd], dtype=np.int32)

    @classmethod
    def unpack(cls, buf: np.ndarray) -> "Header":
        if buf.shape != (HEADER_LEN,) or buf.dtype != np.int32:
            raise ValueError(f"malformed header: shape {buf.shape} dtype {buf.dtype}")
        kind = int(buf[H_KIND])
        if kind not in Kind._value2member_map_:
            raise ValueError(f"unknown transaction kind {kind}")
        return cls(Kind(kind), int(buf[H_RUN]), int(buf[H_N_TOKENS]), int(buf[H_N_META]), Flag(int(buf[H_FLAGS])),
                   int(buf[H_PARENT]), int(buf[H_N_OUTPUTS]), int(buf[H_N_EMBD]))


@dataclass
class Batch:
    """One run's batch, as every stage needs it.

    tokens/pos/output: i32[n]; seq_ids: one list of sequence ids per token (a tree token shared by several
    branches carries all their ids); prefix_ops: KV ops i32[k, 5] a stage applies *before* decoding
    (making the run's sequences see the canonical prefix and its parent's cells).
    """
    tokens: np.ndarray
    pos: np.ndarray
    seq_ids: list[list[int]]
    output: np.ndarray
    prefix_ops: np.ndarray

    @property
    def n_tokens(self) -> int:
        return len(self.tokens)

    @property
    def n_outputs(self) -> int:
        return int(self.output.sum())

    @property
    def output_pos(self) -> np.ndarray:
        """Positions of the output rows, in row order: i32[n_outputs]."""
        return self.pos[self.output != 0]

    # META: | n i32 | n_ops i32 | tokens[n] | pos[n] | output[n] | n_seq[n] | seq_ids[sum n_seq] | ops[n_ops*5] |
    def pack_meta(self) -> np.ndarray:
        n = self.n_tokens
        n_seq = np.array([len(s) for s in self.seq_ids], dtype=np.int32)
        flat = np.array([s for ids in self.seq_ids for s in ids], dtype=np.int32)
        ops = np.asarray(self.prefix_ops, dtype=np.int32).reshape(-1, 5)
        return np.concatenate([np.array([n, len(ops)], dtype=np.int32), self.tokens.astype(np.int32),
                               self.pos.astype(np.int32), self.output.astype(np.int32), n_seq, flat,
                               ops.ravel()]).astype(np.int32, copy=False)

    @classmethod
    def unpack_meta(cls, meta: np.ndarray) -> "Batch":
        if len(meta) < 2:
            raise ValueError(f"malformed META: {len(meta)} ints, need at least 2")
        n, n_ops = int(meta[0]), int(meta[1])
        if n < 0 or n_ops < 0 or len(meta) < 2 + 4 * n:
            raise ValueError(f"malformed META: n={n} n_ops={n_ops} len={len(meta)}")
        o = 2
        tokens, pos, output, n_seq = (meta[o + k * n:o + (k + 1) * n] for k in range(4))
        o += 4 * n
        if (n_seq < 1).any():
            raise ValueError("malformed META: a token without sequence ids")
        flat = meta[o:o + int(n_seq.sum())]
        o += int(n_seq.sum())
        if len(meta) != o + 5 * n_ops:
            raise ValueError(f"malformed META: expected {o + 5 * n_ops} ints, got {len(meta)}")
        ops = meta[o:].reshape(n_ops, 5)
        bounds = np.concatenate([[0], np.cumsum(n_seq)])
        seq_ids = [flat[bounds[i]:bounds[i + 1]].tolist() for i in range(n)]
        return cls(tokens.copy(), pos.copy(), seq_ids, output.copy(), ops.copy())


# SAMPLING: i64[4] | temp (f64 bits) | top_p (f64 bits) | top_k | seed mod 2**63 |
def pack_sampling(sp) -> np.ndarray:
    floats = np.array([sp.temp, sp.top_p], dtype=np.float64).view(np.int64)
    return np.concatenate([floats, np.array([sp.top_k, sp.seed % 2**63], dtype=np.int64)])


def unpack_sampling(buf: np.ndarray):
    from .verify import SamplingParams
    if buf.shape != (4,) or buf.dtype != np.int64:
        raise ValueError(f"malformed SAMPLING: shape {buf.shape} dtype {buf.dtype}")
    temp, top_p = buf[:2].view(np.float64).tolist()
    return SamplingParams(temp, int(buf[2]), top_p, int(buf[3]))


def kv_ops(*ops: tuple[int, int, int, int, int]) -> np.ndarray:
    """Rows of (KvOp, seq_src, seq_dst, p0, p1) as i32[k, 5]."""
    return np.array(ops, dtype=np.int32).reshape(-1, 5)


def rm(seq: int, p0: int = -1, p1: int = -1) -> tuple[int, int, int, int, int]:
    return (KvOp.RM, seq, -1, p0, p1)


def cp(src: int, dst: int, p0: int = -1, p1: int = -1) -> tuple[int, int, int, int, int]:
    return (KvOp.CP, src, dst, p0, p1)


def compact(seq: int) -> tuple[int, int, int, int, int]:
    return (KvOp.COMPACT, seq, -1, -1, -1)
