"""Wire protocol between pipeline ranks: message kinds, tags and buffer layouts, declared once.

Every pipeline operation is a *transaction*: a fixed-size header on TAG_BEGIN, then the payloads that
the header announces, each on its kind's own tag (the paper's design):

    DECODE  (rank r -> r+1):  | HEADER | META i32[n_meta] on TAG_META | ACTIV f32[n_tokens, n_embd] on TAG_ACTIV |
        and, when the header's n_rules > 0, the head sends the last stage directly:
                 (0 -> last): | RULES i32[n_rules] on TAG_RULES |  (a run's masks and biases, even when cancelled)
    RESULT  (last -> head):   | HEADER | TOKENS i32[n_outputs] on TAG_TOKENS |
                                       | LOGPROBS i32[n_outputs, n_embd] on TAG_LOGPROBS | (when n_embd > 0)
                                       | MTP i32[3] on TAG_MTP | (flag MTP: the target's own MTP head's proposal)
    KV      (rank r -> r+1):  | HEADER | KV_OPS i32[n_ops, 5] on TAG_KV |
    SAMPLING(rank r -> r+1):  | HEADER | SAMPLING i64[n_tokens, 6] on TAG_SAMPLING |  (one row per group of rows)
    SHUTDOWN(rank r -> r+1):  | HEADER |
    CANCEL  (out of band, comm_cancel, last -> ... -> 1): i32[k] run ids on TAG_CANCEL
    STAGE_STATS (out of band, comm_cancel, stage r -> 0): f64[STATS_LEN] on TAG_STAGE_STATS, a StageReport

Why the order holds: MPI does not let two messages with the same (sender, receiver, communicator, tag)
overtake each other. Headers all travel on TAG_BEGIN, so a stage reads transaction headers in exactly
the order its predecessor issued them. A stage handles one transaction at a time (single-threaded) and
reads that transaction's payloads before the next header; the payloads of one kind travel on one tag
in the same order as their headers, so the next message on TAG_META is always this transaction's.
Each stage forwards transactions in the order it handled them, so every stage sees the head's order.
A STAGE_STATS report travels on its own tag, which no other receive takes (every receive names its tag and source),
so it never stands in the way of a transaction or a cancellation: a stage sends one at most every REPORT_EVERY_S
while it serves, rank 0 takes them whenever it polls and, at shutdown, every one up to the count the stage's final
statistics give.
Cancelled runs still pass a DECODE header (flag CANCELLED, no payload) so positions in the stream and
the head's FIFO of results stay aligned.

A RESULT carries one token id per output row, not the row's logits: the target's token after that row,
drawn by the last stage exactly as verification draws it (verify.sample_at: arg-max, or a sample seeded
by (seed, position) with the generation's SAMPLING parameters, which the head sends before its prompt; a run
shared by several generations draws each one's rows by its own: SAMPLING then holds a group of rows per generation).
That is 4 bytes per row instead of n_vocab x 4 (607,744 bytes for Qwen2.5's 151,936-token vocabulary).
A request's constraint and biases (core/decoding.py) reach the last stage as a run's RULES: a bit mask of the
allowed tokens per output row (n_vocab / 8 bytes: 18,992 for Qwen2.5) and sparse (row, token, bias) entries; the
log-probabilities asked for come back as the chosen token's and the top k per row, not as the rows' logits.

Inside a stage run by a tensor group (ranks/group.py), the leader mirrors each of its engine's operations to the
group's other members on the group's own communicator, in order, before it runs it:

    DECODE  (leader -> member):  | HEADER | META on TAG_META | ACTIV f32[n_tokens, n_embd] on TAG_ACTIV |
    KV, CLEAR, SHUTDOWN (leader -> member): | HEADER | (KV: KV_OPS on TAG_KV) |
    SLICE_LOGITS (member -> leader, the last stage's group): f32[n_outputs, the member's vocabulary rows] on TAG_SLICE_LOGITS,
        or with flag ARGMAX (every row greedy, no rules, no log-probabilities asked) f32[n_outputs, 2]: each row's
        largest logit and its index in the member's rows (tokens below 2^24 are exact in f32)
The partial sums inside a decode are an all-gather of the group (engine/group_sums.py), no tag.

The draft beside the pipeline (draftahead.py) talks to the head on a communicator of its own, one
message per operation, each one i32 array (so a thread drafter uses the same packing):

    DRAFT_CTRL (head -> drafter, TAG_DRAFT_CTRL):  | CTRL i32[CTRL_LEN] | tokens i32[n_new] | text bytes, padded |
    PROPOSAL   (drafter -> head, TAG_PROPOSAL):    | PROP i32[PROP_LEN] | tokens i32[n] | probs f32[n] (as i32) |
                                                    alts i32[n] | alt_probs f32[n] (as i32) |
               (alts: the draft's runner-up at each position, -1 where it has none; the head's tree siblings)
"""
from __future__ import annotations

import enum
from dataclasses import dataclass

import numpy as np

PROTOCOL_VERSION = 10


class ProtocolError(ValueError):
    """A message that breaks the protocol (a bug, another build, or a corrupted link): refused before use."""


class Tag(enum.IntEnum):
    BEGIN = 1      # transaction header, HEADER layout
    META = 2       # DECODE metadata, META layout
    ACTIV = 3      # hidden states f32[n_tokens, n_embd]
    KV = 5         # KV ops i32[n_ops, 5]
    CANCEL = 6     # i32[k] run ids (on comm_cancel)
    SAMPLING = 7   # i64[4]: SAMPLING layout
    TOKENS = 8     # i32[n_outputs]: the target's token after each output row (tag 4 is unused)
    DRAFT_CTRL = 9  # head -> drafter: DRAFT_CTRL layout
    PROPOSAL = 10  # drafter -> head: PROPOSAL layout
    RULES = 11     # head -> last stage: RULES layout, i32[n_rules]
    LOGPROBS = 12  # RESULT: LOGPROBS layout, i32[n_outputs, n_embd]
    STAGE_STATS = 13  # stage -> head (on comm_cancel): StageReport, f64[STATS_LEN]
    MTP = 14       # RESULT: MTP layout, i32[MTP_LEN]
    SLICE_LOGITS = 15  # group member -> its leader (on the group's comm): f32[n_outputs, its vocabulary rows]


class Kind(enum.IntEnum):
    DECODE = 1
    RESULT = 2
    KV = 3
    SHUTDOWN = 4
    SAMPLING = 5
    CLEAR = 6      # group leader -> its members: forget every KV cell (StageEngine.clear_kv)


class Flag(enum.IntFlag):
    NONE = 0
    SPECULATIVE = 1   # may be cancelled; a non-speculative run is never cut short
    CANCELLED = 2     # skipped or aborted upstream: no payload follows
    MTP = 4           # RESULT: an MTP proposal follows the tokens (engine/mtp.py)
    ARGMAX = 8        # a tensor group's DECODE: members send each output row's largest logit and where, not the row


class KvOp(enum.IntEnum):
    RM = 1     # seq_rm(seq_src, p0, p1)
    CP = 2     # seq_cp(seq_src, seq_dst, p0, p1)
    KEEP = 3   # seq_keep(seq_src)
    COMPACT = 4  # keep only seq_src (and the seq_src of the COMPACT ops right after it), repacked into cells
                 # 0..n-1 in position order, one sequence after another (stage.py)


# HEADER: i32[9]
HEADER_LEN = 9
H_KIND, H_RUN, H_N_TOKENS, H_N_META, H_FLAGS, H_PARENT, H_N_OUTPUTS, H_N_EMBD, H_N_RULES = range(HEADER_LEN)
NO_RUN = -1


@dataclass
class Header:
    kind: Kind
    run_id: int = NO_RUN
    n_tokens: int = 0      # DECODE: tokens in the batch; KV: number of ops
    n_meta: int = 0        # DECODE: length of the META payload
    flags: Flag = Flag.NONE
    parent_id: int = NO_RUN  # DECODE: run whose cells this run builds on (cancelled with it)
    n_outputs: int = 0     # DECODE/RESULT: output rows the head wants the target's token of
    n_embd: int = 0        # DECODE: width of ACTIV (0 when the payload is token ids only); RESULT: of LOGPROBS
    n_rules: int = 0       # DECODE: length of the RULES the head sends the last stage for this run (0: none)

    def pack(self) -> np.ndarray:
        return np.array([self.kind, self.run_id, self.n_tokens, self.n_meta, self.flags,
                         self.parent_id, self.n_outputs, self.n_embd, self.n_rules], dtype=np.int32)

    @classmethod
    def unpack(cls, buf: np.ndarray) -> "Header":
        if not isinstance(buf, np.ndarray) or buf.shape != (HEADER_LEN,) or buf.dtype != np.int32:
            raise ProtocolError(f"malformed header: {getattr(buf, 'shape', None)} {getattr(buf, 'dtype', type(buf))}")
        kind = int(buf[H_KIND])
        if kind not in Kind._value2member_map_:
            raise ProtocolError(f"unknown transaction kind {kind}")
        flags = int(buf[H_FLAGS])
        if flags & ~int(Flag.SPECULATIVE | Flag.CANCELLED | Flag.MTP | Flag.ARGMAX):
            raise ProtocolError(f"unknown flags {flags:#x}")
        return cls(Kind(kind), int(buf[H_RUN]), int(buf[H_N_TOKENS]), int(buf[H_N_META]), Flag(flags),
                   int(buf[H_PARENT]), int(buf[H_N_OUTPUTS]), int(buf[H_N_EMBD]), int(buf[H_N_RULES]))


@dataclass(frozen=True)
class Limits:
    """What a rank accepts: every header is checked against these before any payload is received, so the
    buffers a header makes us allocate (`payload_shapes`) are bounded."""
    n_batch: int      # tokens per run
    n_embd: int       # width of ACTIV (every stage of one model has the same)
    n_vocab: int      # token ids are in [0, n_vocab)
    n_seq_max: int    # sequence ids are in [0, n_seq_max)
    n_ctx: int        # positions are in [0, n_ctx)

    @property
    def max_ops(self) -> int:
        """KV ops in one transaction or one run's prefix (kvplan: a few per sequence and per retired node)."""
        return 8 * (self.n_seq_max + self.n_batch) + 16

    def max_rules(self, n_outputs: int) -> int:
        """RULES of a run with n_outputs rows: a mask row each and a bias per token of the vocabulary at most."""
        return RULES_HEAD + n_outputs * (mask_words(self.n_vocab) + 3 * self.n_vocab)

    @property
    def max_meta(self) -> int:
        n = self.n_batch
        return 2 + 4 * n + n * self.n_seq_max + 5 * self.max_ops


WORKER_KINDS = frozenset({Kind.DECODE, Kind.KV, Kind.SAMPLING, Kind.SHUTDOWN})  # what a stage takes from rank - 1
HEAD_KINDS = frozenset({Kind.RESULT})                                            # what the head takes from the last


def check_header(hdr: Header, lim: Limits, kinds: frozenset, last_run: int) -> None:
    """Refuse a header that this rank cannot take (kind, sizes, run id order), before its payload is received.
    last_run: the newest DECODE/RESULT run id this rank took from the same sender (NO_RUN before the first)."""
    def bad(why: str):
        raise ProtocolError(f"{hdr.kind.name} header {why}")
    if hdr.kind not in kinds:
        raise ProtocolError(f"unexpected transaction {hdr.kind.name} (this rank takes {sorted(k.name for k in kinds)})")
    if hdr.kind in (Kind.DECODE, Kind.RESULT):
        if hdr.run_id <= last_run:
            bad(f"with run id {hdr.run_id} after run {last_run}: runs arrive in launch order")
        if not 1 <= hdr.n_tokens <= lim.n_batch:
            bad(f"with n_tokens {hdr.n_tokens}, outside 1..{lim.n_batch} (n_batch)")
        if not 0 <= hdr.n_outputs <= hdr.n_tokens:
            bad(f"with n_outputs {hdr.n_outputs}, outside 0..{hdr.n_tokens} (n_tokens)")
        if not (hdr.parent_id == NO_RUN or 0 <= hdr.parent_id < hdr.run_id):
            bad(f"with parent run {hdr.parent_id}, not an earlier run than {hdr.run_id}")
        if not 0 <= hdr.n_rules <= (lim.max_rules(hdr.n_outputs) if hdr.kind == Kind.DECODE else 0):
            bad(f"with n_rules {hdr.n_rules}, outside 0..{lim.max_rules(hdr.n_outputs)}")
    if hdr.kind == Kind.RESULT and not hdr.flags & Flag.CANCELLED and hdr.n_embd not in LOGPROB_WIDTHS:
        bad(f"with n_embd {hdr.n_embd}: LOGPROBS rows are 0 or 1 + 2k ints wide, k <= {MAX_TOP_LOGPROBS}")
    if hdr.kind == Kind.DECODE and not hdr.flags & Flag.CANCELLED:
        if hdr.n_embd != lim.n_embd:
            bad(f"with n_embd {hdr.n_embd}, the model's is {lim.n_embd}")
        lo = 2 + 5 * hdr.n_tokens
        if not lo <= hdr.n_meta <= lim.max_meta:
            bad(f"with n_meta {hdr.n_meta}, outside {lo}..{lim.max_meta}")
    if hdr.kind == Kind.KV and not 1 <= hdr.n_tokens <= lim.max_ops:
        bad(f"with {hdr.n_tokens} ops, outside 1..{lim.max_ops}")
    if hdr.kind == Kind.SAMPLING and not 1 <= hdr.n_tokens <= lim.n_batch:
        bad(f"with {hdr.n_tokens} groups, outside 1..{lim.n_batch} (n_batch)")


def payload_shapes(hdr: Header) -> list[tuple[Tag, tuple[int, ...], type]]:
    """The payloads a (checked) header announces, in the order they follow it."""
    if hdr.flags & Flag.CANCELLED or hdr.kind == Kind.SHUTDOWN:
        return []
    if hdr.kind == Kind.DECODE:
        return [(Tag.META, (hdr.n_meta,), np.int32), (Tag.ACTIV, (hdr.n_tokens, hdr.n_embd), np.float32)]
    if hdr.kind == Kind.RESULT:
        logprobs = [(Tag.LOGPROBS, (hdr.n_outputs, hdr.n_embd), np.int32)] if hdr.n_embd else []
        mtp = [(Tag.MTP, (MTP_LEN,), np.int32)] if hdr.flags & Flag.MTP else []
        return [(Tag.TOKENS, (hdr.n_outputs,), np.int32)] + logprobs + mtp
    if hdr.kind == Kind.KV:
        return [(Tag.KV, (hdr.n_tokens, 5), np.int32)]
    return [(Tag.SAMPLING, (hdr.n_tokens, SAMPLING_LEN), np.int64)]


def check_kv_ops(ops: np.ndarray, lim: Limits) -> None:
    """KV ops i32[k, 5] a stage may apply: known op, sequence ids in range (-1: every sequence, where llama.cpp
    allows it), positions >= -1 (-1: open end)."""
    if not isinstance(ops, np.ndarray) or ops.ndim != 2 or ops.shape[1] != 5 or ops.dtype != np.int32:
        raise ProtocolError(f"malformed KV ops: {getattr(ops, 'shape', None)} {getattr(ops, 'dtype', type(ops))}")
    if len(ops) > lim.max_ops:
        raise ProtocolError(f"{len(ops)} KV ops, more than {lim.max_ops}")
    for op, src, dst, p0, p1 in ops.tolist():
        if op not in KvOp._value2member_map_:
            raise ProtocolError(f"unknown KV op {op}")
        lo_src = -1 if op == KvOp.RM else 0
        if not lo_src <= src < lim.n_seq_max:
            raise ProtocolError(f"KV op {KvOp(op).name} on sequence {src}, outside {lo_src}..{lim.n_seq_max - 1}")
        if op == KvOp.CP and not 0 <= dst < lim.n_seq_max:
            raise ProtocolError(f"KV op CP to sequence {dst}, outside 0..{lim.n_seq_max - 1}")
        if p0 < -1 or p1 < -1 or (p1 >= 0 and p0 > p1):
            raise ProtocolError(f"KV op {KvOp(op).name} with positions [{p0}, {p1})")


def check_tokens(tokens: np.ndarray, lim: Limits) -> None:
    """A RESULT's token ids: one per output row, each in the vocabulary."""
    if len(tokens) and not ((tokens >= 0) & (tokens < lim.n_vocab)).all():
        raise ProtocolError(f"RESULT token id outside 0..{lim.n_vocab - 1}: {tokens.tolist()[:8]}")


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

    @classmethod
    def chain(cls, tokens, pos0: int, last_only: bool = False) -> "Batch":
        """Consecutive tokens of sequence 0 at positions pos0.., no KV ops first: every row an output, or
        only the last (a prompt chunk whose earlier logits nobody reads)."""
        tokens = np.asarray(tokens, dtype=np.int32)
        n = len(tokens)
        output = np.zeros(n, dtype=np.int32) if last_only else np.ones(n, dtype=np.int32)
        output[-1:] = 1
        return cls(tokens, np.arange(pos0, pos0 + n, dtype=np.int32), [[0]] * n, output, kv_ops())

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
    def unpack_meta(cls, meta: np.ndarray, lim: Limits | None = None, hdr: Header | None = None) -> "Batch":
        """The batch from a META payload; ProtocolError for anything malformed. With `lim` (and the DECODE
        `hdr` it came with), every value is checked: what a stage then hands to llama.cpp is in range."""
        if not isinstance(meta, np.ndarray) or meta.ndim != 1 or meta.dtype != np.int32:
            raise ProtocolError(f"malformed META: {getattr(meta, 'shape', None)} {getattr(meta, 'dtype', type(meta))}")
        if len(meta) < 2:
            raise ProtocolError(f"malformed META: {len(meta)} ints, need at least 2")
        n, n_ops = int(meta[0]), int(meta[1])
        if n < 0 or n_ops < 0 or len(meta) < 2 + 4 * n:
            raise ProtocolError(f"malformed META: n={n} n_ops={n_ops} len={len(meta)}")
        o = 2
        tokens, pos, output, n_seq = (meta[o + k * n:o + (k + 1) * n] for k in range(4))
        o += 4 * n
        if (n_seq < 1).any():
            raise ProtocolError("malformed META: a token without sequence ids")
        n_ids = int(n_seq.astype(np.int64).sum())
        if len(meta) != o + n_ids + 5 * n_ops:
            raise ProtocolError(f"malformed META: expected {o + n_ids + 5 * n_ops} ints, got {len(meta)}")
        flat = meta[o:o + n_ids]
        o += n_ids
        ops = meta[o:].reshape(n_ops, 5)
        if lim is not None:
            _check_meta(n, tokens, pos, output, n_seq, flat, ops, lim, hdr)
        bounds = np.concatenate([[0], np.cumsum(n_seq, dtype=np.int64)])
        seq_ids = [flat[bounds[i]:bounds[i + 1]].tolist() for i in range(n)]
        return cls(tokens.copy(), pos.copy(), seq_ids, output.copy(), ops.copy())


def _check_meta(n, tokens, pos, output, n_seq, flat, ops, lim: Limits, hdr: Header | None) -> None:
    if hdr is not None and n != hdr.n_tokens:
        raise ProtocolError(f"META of {n} tokens under a header of {hdr.n_tokens}")
    if not 1 <= n <= lim.n_batch:
        raise ProtocolError(f"META of {n} tokens, outside 1..{lim.n_batch}")
    if not ((tokens >= 0) & (tokens < lim.n_vocab)).all():
        raise ProtocolError(f"META token id outside 0..{lim.n_vocab - 1}")
    if not ((pos >= 0) & (pos < lim.n_ctx)).all():
        raise ProtocolError(f"META position outside 0..{lim.n_ctx - 1}")
    if not ((output == 0) | (output == 1)).all():
        raise ProtocolError("META output flags other than 0/1")
    if hdr is not None and int(output.sum()) != hdr.n_outputs:
        raise ProtocolError(f"META marks {int(output.sum())} output rows, the header {hdr.n_outputs}")
    if (n_seq > lim.n_seq_max).any() or not ((flat >= 0) & (flat < lim.n_seq_max)).all():
        raise ProtocolError(f"META sequence id outside 0..{lim.n_seq_max - 1}")
    check_kv_ops(ops, lim)


# SAMPLING: i64[n_groups, 6], a row per group of a run's consecutive output rows (verify.Drawing) |
#           temp (f64 bits) | top_p (f64 bits) | top_k | seed mod 2**63 | top_logprobs (-1: none) | n_rows (last: 0) |
SAMPLING_LEN = 6


def pack_sampling(sampling) -> np.ndarray:
    """verify.RunSampling -> i64[n_groups, SAMPLING_LEN] (the header's n_tokens is n_groups)."""
    out = np.empty((len(sampling), SAMPLING_LEN), np.int64)
    for row, d in zip(out, sampling):
        sp = d.params
        row[:2] = np.array([sp.temp, sp.top_p], dtype=np.float64).view(np.int64)
        row[2:] = (sp.top_k, sp.seed % 2**63, -1 if d.top_logprobs is None else d.top_logprobs, d.n_rows)
    return out


def unpack_sampling(buf: np.ndarray):
    """verify.RunSampling: every group's rows explicit but the last's (0: the rest), every value in range."""
    from .sampling import Drawing, SamplingParams
    if not isinstance(buf, np.ndarray) or buf.ndim != 2 or buf.shape[1:] != (SAMPLING_LEN,) or not len(buf) \
            or buf.dtype != np.int64:
        raise ProtocolError(f"malformed SAMPLING: {getattr(buf, 'shape', None)} {getattr(buf, 'dtype', type(buf))}")
    out = []
    for i, row in enumerate(buf):
        temp, top_p = row[:2].view(np.float64).tolist()
        top_k, seed, k, n_rows = (int(x) for x in row[2:])
        last = i == len(buf) - 1
        if not (np.isfinite(temp) and temp >= 0 and 0 < top_p <= 1 and top_k >= 0 and seed >= 0
                and -1 <= k <= MAX_TOP_LOGPROBS and (n_rows == 0 if last else n_rows >= 1)):
            raise ProtocolError(f"SAMPLING out of range: temp {temp} top_p {top_p} top_k {top_k} seed {seed} "
                                f"top_logprobs {k} rows {n_rows} (group {i + 1} of {len(buf)})")
        out.append(Drawing(SamplingParams(temp, top_k, top_p, seed), None if k < 0 else k, n_rows))
    return tuple(out)


# RULES: i32[n_rules] | n_rows | n_words | n_bias | mask u32[n_rows, n_words] (as i32; n_words 0: no mask) |
#        bias rows i32[n_bias] | bias tokens i32[n_bias] | bias values f32[n_bias] (as i32) |
RULES_HEAD = 3


def mask_words(n_vocab: int) -> int:
    """32-bit words of one row's mask: bit t of word t // 32 (least significant first) allows token t."""
    return (n_vocab + 31) // 32


@dataclass
class RowRules:
    """What the last stage does to a run's output rows' logits before it draws their tokens (verify.row_tokens):
    add the biases, then keep only the tokens each row's mask allows."""
    mask: np.ndarray | None      # i32[n_rows, mask_words(n_vocab)] or None (no constraint)
    bias_row: np.ndarray         # i32[n_bias]: the output row of each bias
    bias_token: np.ndarray       # i32[n_bias]
    bias_value: np.ndarray       # f32[n_bias]

    @classmethod
    def joined(cls, parts: list[tuple["RowRules | None", int]]) -> "RowRules | None":
        """The rules of a run made of several runs, each (its rules or None, its output rows) in row order: each
        one's masks and biases on its own rows, every token allowed on the rows of runs without a mask (None when
        no part has rules)."""
        if all(r is None for r, _ in parts):
            return None
        words = next((r.mask.shape[1] for r, _ in parts if r is not None and r.mask is not None), 0)
        masks, rows, tokens, values, at = [], [], [], [], 0
        for r, n in parts:
            if words:
                masks.append(r.mask if r is not None and r.mask is not None else np.full((n, words), -1, np.int32))
            if r is not None:
                rows.append(r.bias_row + at)
                tokens.append(r.bias_token)
                values.append(r.bias_value)
            at += n
        cat = (lambda xs, dt: np.concatenate(xs).astype(dt) if xs else np.empty(0, dt))
        return cls(np.concatenate(masks).astype(np.int32) if words else None, cat(rows, np.int32),
                   cat(tokens, np.int32), cat(values, np.float32))

    def pack(self, n_rows: int) -> np.ndarray:
        words = 0 if self.mask is None else self.mask.shape[1]
        head = np.array([n_rows, words, len(self.bias_row)], dtype=np.int32)
        mask = np.empty(0, np.int32) if self.mask is None else self.mask.astype(np.int32, copy=False).ravel()
        return np.concatenate([head, mask, self.bias_row.astype(np.int32), self.bias_token.astype(np.int32),
                               self.bias_value.astype(np.float32).view(np.int32)])

    @classmethod
    def unpack(cls, buf: np.ndarray, lim: Limits | None, n_rows: int) -> "RowRules":
        """The rules of a run of n_rows output rows; ProtocolError for anything malformed (with `lim`, every
        value checked against the vocabulary)."""
        if not isinstance(buf, np.ndarray) or buf.ndim != 1 or buf.dtype != np.int32 or len(buf) < RULES_HEAD:
            raise ProtocolError(f"malformed RULES: {getattr(buf, 'shape', None)} {getattr(buf, 'dtype', type(buf))}")
        rows, words, n_bias = (int(x) for x in buf[:RULES_HEAD])
        n_vocab = lim.n_vocab if lim is not None else None  # without limits: the layout is checked, not the ids
        words_fit = words == 0 or (words > 0 and (n_vocab is None or words == mask_words(n_vocab)))
        if rows != n_rows or not words_fit or n_bias < 0:
            raise ProtocolError(f"RULES of {rows} rows x {words} words, {n_bias} biases for a run of {n_rows} rows")
        o = RULES_HEAD + rows * words
        if len(buf) != o + 3 * n_bias:
            raise ProtocolError(f"malformed RULES: expected {o + 3 * n_bias} ints, got {len(buf)}")
        mask = buf[RULES_HEAD:o].reshape(rows, words) if words else None
        bias_row, bias_token = buf[o:o + n_bias], buf[o + n_bias:o + 2 * n_bias]
        bias_value = buf[o + 2 * n_bias:].view(np.float32)
        if n_bias and not (((bias_row >= 0) & (bias_row < rows)).all() and
                           (bias_token >= 0).all() and (n_vocab is None or (bias_token < n_vocab).all()) and
                           np.isfinite(bias_value).all()):
            raise ProtocolError("RULES bias outside its run's rows, the vocabulary, or not finite")
        return cls(mask, bias_row, bias_token, bias_value)


# MTP: i32[3] | position the proposal is for | its token | its probability in millionths |: the target's MTP head
# after the run's last row and the target's token after that row (engine/mtp.py)
MTP_LEN = 3


def pack_mtp(pos: int, token: int, prob: float) -> np.ndarray:
    return np.array([pos, token, round(prob * PPM)], dtype=np.int32)


def unpack_mtp(buf: np.ndarray, n_vocab: int | None = None) -> tuple[int, int, float]:
    """(position, token, probability) of an MTP payload; ProtocolError for anything out of range."""
    if buf.shape != (MTP_LEN,):
        raise ProtocolError(f"malformed MTP: shape {buf.shape}")
    pos, token, ppm = (int(v) for v in buf)
    if pos < 0 or token < 0 or (n_vocab is not None and token >= n_vocab) or not 0 <= ppm <= PPM:
        raise ProtocolError(f"malformed MTP: position {pos}, token {token}, probability {ppm} ppm")
    return pos, token, ppm / PPM


# LOGPROBS: i32[n_outputs, 1 + 2k] per row | chosen token's logprob (f32 bits) | top k ids | their logprobs (f32 bits) |
MAX_TOP_LOGPROBS = 20
LOGPROB_WIDTHS = frozenset([0] + [1 + 2 * k for k in range(MAX_TOP_LOGPROBS + 1)])


def pack_logprobs(chosen: np.ndarray, top_ids: np.ndarray, top_logprobs: np.ndarray) -> np.ndarray:
    """f32[n], i32[n, k], f32[n, k] -> i32[n, 1 + 2k]."""
    return np.concatenate([chosen.astype(np.float32).reshape(-1, 1).view(np.int32), top_ids.astype(np.int32),
                           top_logprobs.astype(np.float32).view(np.int32)], axis=1)


def unpack_logprobs(buf: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    k = (buf.shape[1] - 1) // 2
    return buf[:, 0].view(np.float32), buf[:, 1:1 + k], buf[:, 1 + k:].view(np.float32)


def kv_ops(*ops: tuple[int, int, int, int, int]) -> np.ndarray:
    """Rows of (KvOp, seq_src, seq_dst, p0, p1) as i32[k, 5]."""
    return np.array(ops, dtype=np.int32).reshape(-1, 5)


def rm(seq: int, p0: int = -1, p1: int = -1) -> tuple[int, int, int, int, int]:
    return (KvOp.RM, seq, -1, p0, p1)


def cp(src: int, dst: int, p0: int = -1, p1: int = -1) -> tuple[int, int, int, int, int]:
    return (KvOp.CP, src, dst, p0, p1)


def compact(seq: int) -> tuple[int, int, int, int, int]:
    return (KvOp.COMPACT, seq, -1, -1, -1)


# STAGE_STATS: f64[STATS_LEN], StageReport's fields in declaration order (counts are whole numbers, exact in f64)
REPORT_EVERY_S = 1.0  # a stage reports at most this often (and only what changed)


@dataclass(frozen=True)
class StageReport:
    """A stage's running counters (worker.StageStats' names) as rank 0 takes them while the pipeline serves."""
    rank: int
    n_reports: int = 0            # reports this stage has sent, this one included (rank 0 takes all at shutdown)
    n_decoded: int = 0            # runs decoded to the end
    n_tokens: int = 0             # tokens in those runs' batches
    n_cancelled_before: int = 0   # runs skipped: cancelled before this stage started them
    n_cancelled_mid: int = 0      # runs aborted in the middle of their decode
    n_kv_txns: int = 0            # KV transactions applied
    t_busy_s: float = 0.0         # time inside llama_decode
    t_idle_s: float = 0.0         # time waiting for a transaction (rank 0: for a result or a request)
    bytes_sent: int = 0           # pipeline bytes this rank sent (reports not counted)

    def pack(self) -> np.ndarray:
        return np.array([getattr(self, f) for f in STATS_FIELDS], dtype=np.float64)

    @classmethod
    def unpack(cls, buf: np.ndarray, source: int) -> "StageReport":
        """The report `source` sent; ProtocolError for anything malformed or not its own."""
        if not isinstance(buf, np.ndarray) or buf.shape != (STATS_LEN,) or buf.dtype != np.float64:
            raise ProtocolError(f"malformed STAGE_STATS: {getattr(buf, 'shape', None)} {getattr(buf, 'dtype', None)}")
        if not (np.isfinite(buf).all() and (buf >= 0).all()):
            raise ProtocolError(f"STAGE_STATS with a negative or non-finite value: {buf.tolist()}")
        values = dict(zip(STATS_FIELDS, buf.tolist()))
        whole = [f for f in STATS_FIELDS if f not in _STATS_SECONDS]
        if any(values[f] != int(values[f]) for f in whole) or values["rank"] != source or values["n_reports"] < 1:
            raise ProtocolError(f"STAGE_STATS of rank {values['rank']:g}, report {values['n_reports']:g} from rank "
                                f"{source}, or a count that is not whole")
        return cls(**{f: v if f in _STATS_SECONDS else int(v) for f, v in values.items()})


STATS_FIELDS = tuple(StageReport.__dataclass_fields__)
STATS_LEN = len(STATS_FIELDS)
STAGE_COUNTERS = STATS_FIELDS[2:]  # what only grows while a stage serves (not rank, n_reports)
_STATS_SECONDS = frozenset({"t_busy_s", "t_idle_s"})


# ---------------------------------------------------------------- the draft beside the pipeline (draftahead.py)
class Ctrl(enum.IntEnum):
    BEGIN = 1  # a new generation: tokens = the prompt, text = the user's prompt text, aux = chat flag
    STEER = 2  # draft on context[:n_keep] + tokens (n_keep = KEEP_ALL: the context as it is) up to `horizon`
    END = 3    # the session ends


KEEP_ALL = -1
# DRAFT_CTRL header: i32[CTRL_LEN]
CTRL_LEN = 9
C_KIND, C_EPOCH, C_KEEP, C_NEW, C_HORIZON, C_CHUNK, C_PMIN, C_AUX, C_TEXT = range(CTRL_LEN)
PPM = 1_000_000  # probabilities travel as integer parts per million


@dataclass
class DraftCtrl:
    kind: Ctrl
    epoch: int = 0         # the context's version: proposals of an older epoch are stale
    n_keep: int = KEEP_ALL
    tokens: list[int] = None
    horizon: int = 0       # draft up to this position (exclusive)
    n_chunk: int = 1       # draft tokens per drafter call (the head's micro-batch size)
    p_min: float = 0.0     # stop a chain at a token below this confidence (the head's cutoff)
    aux: int = 0
    text: str = ""

    def pack(self) -> np.ndarray:
        toks = np.asarray(self.tokens or [], dtype=np.int32)
        raw = self.text.encode()
        text = np.frombuffer(raw + b"\0" * (-len(raw) % 4), dtype=np.int32)
        head = np.array([self.kind, self.epoch, self.n_keep, len(toks), self.horizon, self.n_chunk,
                         round(self.p_min * PPM), self.aux, len(raw)], dtype=np.int32)
        return np.concatenate([head, toks, text])

    @classmethod
    def unpack(cls, buf: np.ndarray, n_ctx: int, n_vocab: int) -> "DraftCtrl":
        if not isinstance(buf, np.ndarray) or buf.ndim != 1 or buf.dtype != np.int32 or len(buf) < CTRL_LEN:
            raise ProtocolError(f"malformed DRAFT_CTRL: {getattr(buf, 'shape', None)} {getattr(buf, 'dtype', None)}")
        kind, epoch, n_keep, n_new, horizon, n_chunk, p_ppm, aux, n_text = (int(x) for x in buf[:CTRL_LEN])
        if kind not in Ctrl._value2member_map_:
            raise ProtocolError(f"unknown DRAFT_CTRL kind {kind}")
        if not (0 <= n_new <= n_ctx and 0 <= n_text <= 4 * n_ctx * 16 and
                len(buf) == CTRL_LEN + n_new + (n_text + 3) // 4):
            raise ProtocolError(f"DRAFT_CTRL sizes: {n_new} tokens, {n_text} text bytes in {len(buf)} ints")
        if not (epoch >= 0 and KEEP_ALL <= n_keep <= n_ctx and 0 <= horizon <= n_ctx and 1 <= n_chunk <= n_ctx
                and 0 <= p_ppm <= PPM):
            raise ProtocolError(f"DRAFT_CTRL out of range: epoch {epoch} keep {n_keep} horizon {horizon} "
                                f"chunk {n_chunk} p_min {p_ppm}ppm")
        toks = buf[CTRL_LEN:CTRL_LEN + n_new]
        if not ((toks >= 0) & (toks < n_vocab)).all():
            raise ProtocolError(f"DRAFT_CTRL token id outside 0..{n_vocab - 1}")
        text = buf[CTRL_LEN + n_new:].tobytes()[:n_text].decode(errors="replace")
        return cls(Ctrl(kind), epoch, n_keep, toks.tolist(), horizon, n_chunk, p_ppm / PPM, aux, text)


# PROPOSAL header: i32[PROP_LEN]
PROP_LEN = 4
P_EPOCH, P_POS, P_N, P_STOPPED = range(PROP_LEN)
CLOSED_EPOCH = -1  # the drafter's answer to END, its last message (empty): a link left with no message unreceived


@dataclass
class Proposal:
    epoch: int
    pos: int               # position of tokens[0]
    tokens: list[int]
    probs: list[float]
    stopped: bool = False  # the chain ends here: the next token was below p_min (or nothing to propose)
    alts: list[int] | None = None         # the runner-up at each position (-1: none); None: none anywhere
    alt_probs: list[float] | None = None  # ... and its probability

    def pack(self) -> np.ndarray:
        n = len(self.tokens)
        head = np.array([self.epoch, self.pos, n, int(self.stopped)], dtype=np.int32)
        alts = np.full(n, -1, np.int32) if self.alts is None else np.asarray(self.alts, dtype=np.int32)
        alt_probs = np.zeros(n, np.float32) if self.alt_probs is None else np.asarray(self.alt_probs, dtype=np.float32)
        return np.concatenate([head, np.asarray(self.tokens, dtype=np.int32),
                               np.asarray(self.probs, dtype=np.float32).view(np.int32), alts, alt_probs.view(np.int32)])

    @classmethod
    def unpack(cls, buf: np.ndarray, n_ctx: int, n_vocab: int) -> "Proposal":
        if not isinstance(buf, np.ndarray) or buf.ndim != 1 or buf.dtype != np.int32 or len(buf) < PROP_LEN:
            raise ProtocolError(f"malformed PROPOSAL: {getattr(buf, 'shape', None)} {getattr(buf, 'dtype', None)}")
        epoch, pos, n, stopped = (int(x) for x in buf[:PROP_LEN])
        if not ((epoch >= 0 or (epoch == CLOSED_EPOCH and n == 0)) and 0 <= pos <= n_ctx and 0 <= n <= n_ctx and stopped in (0, 1)
                and len(buf) == PROP_LEN + 4 * n):
            raise ProtocolError(f"PROPOSAL out of range: epoch {epoch} pos {pos} n {n} in {len(buf)} ints")
        toks, probs, alts, alt_probs = (buf[PROP_LEN + k * n:PROP_LEN + (k + 1) * n] for k in range(4))
        probs, alt_probs = probs.view(np.float32), alt_probs.view(np.float32)
        if not (((toks >= 0) & (toks < n_vocab)).all() and ((alts >= -1) & (alts < n_vocab)).all()
                and (np.isfinite(probs) & (probs >= 0) & (probs <= 1)).all()
                and (np.isfinite(alt_probs) & (alt_probs >= 0) & (alt_probs <= 1)).all()):
            raise ProtocolError("PROPOSAL token id or probability out of range")
        return cls(epoch, pos, toks.tolist(), probs.astype(np.float64).tolist(), bool(stopped), alts.tolist(),
                   alt_probs.astype(np.float64).tolist())
