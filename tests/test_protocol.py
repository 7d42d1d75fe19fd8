"""Wire protocol: frozen numbers, HEADER and META layouts, malformed input."""
from __future__ import annotations

import numpy as np
import pytest

from pipeinfer.core import protocol
from pipeinfer.core.kvplan import commit_ops, prefix_ops
from pipeinfer.core.protocol import (HEADER_LEN, NO_RUN, Batch, Flag, Header, Kind, KvOp, Tag, cp, kv_ops, pack_sampling, rm,
                                unpack_sampling)
from pipeinfer.core.sampling import Drawing, SamplingParams, group_rows, joined_sampling, one_sampling


# ---------------------------------------------------------------- frozen numbers (a static_assert)
# Ranks of different builds talk to each other: these numbers are the wire format and must never change.
# A new member needs a new number (and PROTOCOL_VERSION + 1), never a reused one.
def test_frozen_tags():
    assert {m.name: int(m) for m in Tag} == {"BEGIN": 1, "META": 2, "ACTIV": 3, "KV": 5, "CANCEL": 6,
                                             "SAMPLING": 7, "TOKENS": 8, "DRAFT_CTRL": 9,
                                             "PROPOSAL": 10, "RULES": 11,
                                             "LOGPROBS": 12, "STAGE_STATS": 13, "MTP": 14,
                                             "SLICE_LOGITS": 15}  # 4 (LOGITS, protocol 2)
                                                                                            # is retired


def test_frozen_draft_layouts():
    assert {m.name: int(m) for m in protocol.Ctrl} == {"BEGIN": 1, "STEER": 2, "END": 3}
    assert (protocol.CTRL_LEN, protocol.PROP_LEN, protocol.KEEP_ALL, protocol.PPM) == (9, 4, -1, 1_000_000)
    assert (protocol.C_KIND, protocol.C_EPOCH, protocol.C_KEEP, protocol.C_NEW, protocol.C_HORIZON, protocol.C_CHUNK,
            protocol.C_PMIN, protocol.C_AUX, protocol.C_TEXT) == tuple(range(9))
    assert (protocol.P_EPOCH, protocol.P_POS, protocol.P_N, protocol.P_STOPPED) == (0, 1, 2, 3)


def test_frozen_kinds():
    assert {m.name: int(m) for m in Kind} == {"DECODE": 1, "RESULT": 2, "KV": 3, "SHUTDOWN": 4, "SAMPLING": 5,
                                               "CLEAR": 6}


def test_frozen_flags():
    assert (int(Flag.NONE), int(Flag.SPECULATIVE), int(Flag.CANCELLED), int(Flag.MTP)) == (0, 1, 2, 4)
    assert {m.name: int(m) for m in Flag if m.value} == {"SPECULATIVE": 1, "CANCELLED": 2, "MTP": 4, "ARGMAX": 8}
    assert protocol.MTP_LEN == 3


def test_frozen_kv_ops():
    assert {m.name: int(m) for m in KvOp} == {"RM": 1, "CP": 2, "KEEP": 3, "COMPACT": 4}


def test_frozen_header_layout():
    assert protocol.PROTOCOL_VERSION == 10  # 10: a tensor group's LOGITS and CLEAR
    assert HEADER_LEN == 9 and NO_RUN == -1
    assert (protocol.H_KIND, protocol.H_RUN, protocol.H_N_TOKENS, protocol.H_N_META, protocol.H_FLAGS,
            protocol.H_PARENT, protocol.H_N_OUTPUTS, protocol.H_N_EMBD, protocol.H_N_RULES) == tuple(range(9))
    assert (protocol.SAMPLING_LEN, protocol.RULES_HEAD, protocol.MAX_TOP_LOGPROBS) == (6, 3, 20)


def test_frozen_stage_stats_layout():
    assert protocol.STATS_FIELDS == ("rank", "n_reports", "n_decoded", "n_tokens", "n_cancelled_before",
                                     "n_cancelled_mid", "n_kv_txns", "t_busy_s", "t_idle_s", "bytes_sent")
    assert protocol.STATS_LEN == 10 and protocol.STAGE_COUNTERS == protocol.STATS_FIELDS[2:]


# ---------------------------------------------------------------- STAGE_STATS
def test_stage_report_round_trip():
    rep = protocol.StageReport(3, n_reports=7, n_decoded=120, n_tokens=2**40 + 1, n_cancelled_before=4,
                               n_cancelled_mid=2, n_kv_txns=9, t_busy_s=12.5, t_idle_s=0.125, bytes_sent=6_291_456)
    buf = rep.pack()
    assert buf.dtype == np.float64 and buf.shape == (protocol.STATS_LEN,)
    assert buf.tolist()[:3] == [3.0, 7.0, 120.0]
    back = protocol.StageReport.unpack(buf, 3)
    assert back == rep and type(back.n_tokens) is int and type(back.t_busy_s) is float


@pytest.mark.parametrize("change, why", [
    (lambda b: b[:-1], "malformed"),
    (lambda b: b.astype(np.float32), "malformed"),
    (lambda b: np.where(np.arange(len(b)) == 7, -1.0, b), "negative or non-finite"),
    (lambda b: np.where(np.arange(len(b)) == 8, np.nan, b), "negative or non-finite"),
    (lambda b: np.where(np.arange(len(b)) == 2, 1.5, b), "not whole"),
    (lambda b: np.where(np.arange(len(b)) == 0, 2.0, b), "of rank 2"),
    (lambda b: np.where(np.arange(len(b)) == 1, 0.0, b), "report 0"),
])
def test_a_malformed_stage_report_is_refused(change, why):
    buf = protocol.StageReport(1, n_reports=1, n_decoded=5, t_busy_s=1.0).pack()
    with pytest.raises(protocol.ProtocolError, match=why):
        protocol.StageReport.unpack(change(buf), 1)


# ---------------------------------------------------------------- HEADER
def test_header_pack_layout_and_round_trip():
    h = Header(Kind.DECODE, run_id=17, n_tokens=5, n_meta=40, flags=Flag.SPECULATIVE | Flag.CANCELLED,
               parent_id=12, n_outputs=3, n_embd=1536, n_rules=77)
    buf = h.pack()
    assert buf.dtype == np.int32 and buf.shape == (HEADER_LEN,)
    assert buf.tolist() == [1, 17, 5, 40, 3, 12, 3, 1536, 77]
    back = Header.unpack(buf)
    assert back == h
    assert isinstance(back.kind, Kind) and isinstance(back.flags, Flag)
    assert back.flags & Flag.CANCELLED and back.flags & Flag.SPECULATIVE


@pytest.mark.parametrize("h", [
    Header(Kind.RESULT, 3, n_outputs=4, flags=Flag.CANCELLED),
    Header(Kind.KV, n_tokens=7),
    Header(Kind.SHUTDOWN),
    Header(Kind.DECODE, 2**31 - 1, 1, 6, Flag.NONE, NO_RUN, 1, 0),
])
def test_header_round_trip(h):
    assert Header.unpack(h.pack()) == h


def test_header_defaults():
    h = Header(Kind.SHUTDOWN)
    assert h.pack().tolist() == [4, -1, 0, 0, 0, -1, 0, 0, 0]


@pytest.mark.parametrize("kind", [0, 7, -1, 99])
def test_header_unknown_kind(kind):
    buf = Header(Kind.KV).pack()
    buf[protocol.H_KIND] = kind
    with pytest.raises(ValueError, match=f"unknown transaction kind {kind}"):
        Header.unpack(buf)


@pytest.mark.parametrize("buf", [
    np.zeros(8, dtype=np.int32),
    np.zeros(10, dtype=np.int32),
    np.zeros((3, 3), dtype=np.int32),
    np.ones(9, dtype=np.int64),
    np.ones(9, dtype=np.float32),
])
def test_header_wrong_shape_or_dtype(buf):
    with pytest.raises(ValueError, match="malformed header"):
        Header.unpack(buf)


# ---------------------------------------------------------------- KV op helpers
def test_kv_op_rows():
    assert rm(3) == (KvOp.RM, 3, -1, -1, -1)
    assert rm(3, 5, 9) == (1, 3, -1, 5, 9)
    assert cp(0, 5, 0, 10) == (2, 0, 5, 0, 10)
    ops = kv_ops(rm(1), cp(1, 0, 4, 6))
    assert ops.dtype == np.int32 and ops.tolist() == [[1, 1, -1, -1, -1], [2, 1, 0, 4, 6]]
    assert kv_ops().shape == (0, 5)


# ---------------------------------------------------------------- META
def _tree_batch() -> Batch:
    # last accepted token in seq 0 and both branches, then two branches of depth 2 (a SpecInfer-style tree)
    return Batch(tokens=np.array([11, 21, 22, 31, 32], dtype=np.int32),
                 pos=np.array([9, 10, 10, 11, 11], dtype=np.int32),
                 seq_ids=[[0, 5, 6], [5], [6], [5], [6]],
                 output=np.array([1, 1, 1, 0, 1], dtype=np.int32),
                 prefix_ops=prefix_ops([5, 6], 9, 3, 9))


def _same(a: Batch, b: Batch) -> None:
    for f in ("tokens", "pos", "output", "prefix_ops"):
        x, y = getattr(a, f), getattr(b, f)
        assert np.array_equal(np.asarray(x).reshape(np.shape(y)), y), f
    assert a.seq_ids == b.seq_ids


def test_meta_layout():
    b = _tree_batch()
    meta = b.pack_meta()
    assert meta.dtype == np.int32
    n, n_ops = 5, len(b.prefix_ops)
    assert meta[:2].tolist() == [n, n_ops]
    assert meta[2:7].tolist() == [11, 21, 22, 31, 32]
    assert meta[7:12].tolist() == [9, 10, 10, 11, 11]
    assert meta[12:17].tolist() == [1, 1, 1, 0, 1]
    assert meta[17:22].tolist() == [3, 1, 1, 1, 1]
    assert meta[22:29].tolist() == [0, 5, 6, 5, 6, 5, 6]
    assert meta[29:].reshape(-1, 5).tolist() == b.prefix_ops.tolist()
    assert len(meta) == 2 + 4 * n + 7 + 5 * n_ops


@pytest.mark.parametrize("batch", [
    _tree_batch(),
    Batch(np.array([7], np.int32), np.array([0], np.int32), [[0]], np.array([1], np.int32), kv_ops()),
    Batch(np.arange(6, dtype=np.int32), np.arange(6, dtype=np.int32), [[0]] * 6,
          np.array([0, 0, 0, 0, 0, 1], np.int32), kv_ops()),
    Batch(np.array([4, 5], np.int32), np.array([20, 21], np.int32), [[9], [9]], np.array([1, 1], np.int32),
          commit_ops(1, 10, 14, [1, 2, 3], {1: 10, 2: 12}, 9)),
])
def test_meta_round_trip(batch):
    back = Batch.unpack_meta(batch.pack_meta())
    _same(batch, back)
    assert back.n_tokens == batch.n_tokens and back.n_outputs == batch.n_outputs
    assert back.prefix_ops.shape == (len(batch.prefix_ops), 5)


def test_meta_round_trip_survives_buffer_reuse():
    meta = _tree_batch().pack_meta()
    back = Batch.unpack_meta(meta)
    meta[:] = -7  # a receive buffer reused for the next message must not change a batch already unpacked
    _same(_tree_batch(), back)


def test_batch_counts():
    b = _tree_batch()
    assert b.n_tokens == 5 and b.n_outputs == 4


def _valid_meta() -> list[int]:
    return _tree_batch().pack_meta().tolist()


@pytest.mark.parametrize("meta", [
    pytest.param(_valid_meta()[:-1], id="ops truncated"),
    pytest.param(_valid_meta() + [0], id="trailing int"),
    pytest.param(_valid_meta()[:10], id="shorter than 4n"),
    pytest.param([-1, 0], id="negative n"),
    pytest.param([1, -1, 7, 0, 1, 1, 0], id="negative n_ops"),
    pytest.param([2, 0, 7, 8, 0, 1, 1, 1, 1, 1, 0], id="n_seq sum larger than payload"),
    pytest.param([1, 1, 7, 0, 1, 1, 0, 1, 2, 3], id="op row incomplete"),
    pytest.param([], id="empty"),
    pytest.param([3], id="one int"),
    pytest.param([2, 0, 7, 8, 0, 1, 1, 1, 2, -1, 0], id="negative n_seq"),
])
def test_meta_malformed_rejected(meta):
    with pytest.raises(ValueError, match="malformed META"):
        Batch.unpack_meta(np.array(meta, dtype=np.int32))


@pytest.mark.parametrize("sp", [SamplingParams(), SamplingParams(0.7, 40, 0.95, 12345), SamplingParams(1.5, 0, 1.0, -3),
                                SamplingParams(2.0, 5, 0.5, 2**70 + 9)])
def test_sampling_round_trip(sp):
    (got,) = unpack_sampling(pack_sampling(one_sampling(sp)))
    assert got.top_logprobs is None and got.n_rows == 0
    assert unpack_sampling(pack_sampling(one_sampling(sp, 5)))[0].top_logprobs == 5
    assert (got.params.temp, got.params.top_k, got.params.top_p) == (sp.temp, sp.top_k, sp.top_p)
    assert got.params.seed % 2**63 == sp.seed % 2**63  # sample_at seeds its RNG with seed mod 2**63
    with pytest.raises(ValueError, match="malformed SAMPLING"):
        unpack_sampling(np.zeros(3, np.int64))


def test_sampling_groups_round_trip_and_their_rows_are_checked():
    """A shared run's SAMPLING: a group per generation, every group's rows explicit but the last's."""
    a, b = SamplingParams(), SamplingParams(0.9, 0, 1.0, 77)
    groups = joined_sampling([(one_sampling(a), 2), (one_sampling(a), 1), (one_sampling(b, 3), 0),
                              (one_sampling(b, 3), 1), (one_sampling(a), 1)])
    assert groups == (Drawing(a, None, 3), Drawing(b, 3, 1), Drawing(a, None, 0))
    assert unpack_sampling(pack_sampling(groups)) == groups
    assert [r for _, r in group_rows(groups, 6)] == [slice(0, 3), slice(3, 4), slice(4, 6)]
    with pytest.raises(ValueError, match="for a run of 3"):
        group_rows(groups, 3)  # the explicit groups already name 4 rows
    bad = pack_sampling(groups)
    bad[-1, 5] = 2  # the last group's rows are the rest, never explicit
    with pytest.raises(ValueError, match="out of range"):
        unpack_sampling(bad)
    with pytest.raises(ValueError, match="malformed SAMPLING"):
        unpack_sampling(bad[:0])
