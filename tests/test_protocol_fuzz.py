"""Fuzzing the receive path (issue 13): random and mutated headers, META payloads, SAMPLING and KV-op buffers.

Every decoder and check that a received message goes through must either accept it (and then everything it
accepted is in range, and the payload sizes a header announces are bounded by protocol.Limits) or raise
ProtocolError (a ValueError): never another exception, a hang (hypothesis deadline) or a large allocation
(tracemalloc).
"""
import tracemalloc

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pipeinfer.core.kvplan import commit_ops, prefix_ops
from pipeinfer.core.protocol import (HEAD_KINDS, HEADER_LEN, NO_RUN, WORKER_KINDS, Batch, Flag, Header, Kind, KvOp, Limits,
                                ProtocolError, check_header, check_kv_ops, check_tokens, pack_sampling, payload_shapes,
                                unpack_sampling)
from pipeinfer.core.sampling import SamplingParams, one_sampling

LIM = Limits(n_batch=512, n_embd=1536, n_vocab=151936, n_seq_max=10, n_ctx=4096)
FUZZ = settings(max_examples=400, deadline=500, suppress_health_check=[HealthCheck.too_slow])
I32 = st.one_of(st.integers(-3, 20), st.integers(-2**31, 2**31 - 1),
                st.sampled_from([0, 1, -1, 2**31 - 1, -2**31, 512, 513, 1536, 4096, 151936]))
ALLOC_LIMIT = 4 << 20  # bytes: a few MiB at most for buffers of a few hundred ints


def _bounded(fn, *args):
    """fn(*args) -> (result or the ProtocolError raised); fails on any other exception or a big allocation."""
    tracemalloc.start()
    try:
        return fn(*args)
    except ProtocolError as e:
        assert isinstance(e, ValueError)
        return e
    finally:
        _, peak = tracemalloc.get_traced_memory()
        tracemalloc.stop()
        assert peak < ALLOC_LIMIT, f"{fn.__name__} allocated {peak} bytes"


def payload_bytes(hdr: Header) -> int:
    """The bytes a checked header makes a rank allocate for its payloads."""
    return sum(int(np.prod(shape, dtype=np.int64)) * np.dtype(dt).itemsize for _, shape, dt in payload_shapes(hdr))


def _max_payload(lim: Limits) -> int:
    return max(4 * lim.max_meta + 4 * lim.n_batch * lim.n_embd, 4 * lim.n_batch, 20 * lim.max_ops, 32)


# ---------------------------------------------------------------- headers
def _valid_headers():
    return st.sampled_from([
        Header(Kind.DECODE, 7, 3, 2 + 5 * 3 + 5, Flag.SPECULATIVE, 5, 2, 1536),
        Header(Kind.DECODE, 8, 1, 7, Flag.NONE, NO_RUN, 1, 1536),
        Header(Kind.DECODE, 9, 4, 0, Flag.CANCELLED | Flag.SPECULATIVE, 8, 4, 1536),
        Header(Kind.RESULT, 7, 3, 0, Flag.NONE, NO_RUN, 3, 0),
        Header(Kind.KV, NO_RUN, 4), Header(Kind.SAMPLING), Header(Kind.SHUTDOWN),
    ])


@st.composite
def header_buffers(draw):
    """(buffer, whether the receiver is the head): random, or a valid header with one to three fields mutated
    (mostly sent to the rank that takes its kind, so that the size checks, not the kind check, are what
    stands between the buffer and an allocation)."""
    if draw(st.integers(0, 3)) == 0:
        return np.array(draw(st.lists(I32, min_size=HEADER_LEN, max_size=HEADER_LEN)), dtype=np.int32), draw(st.booleans())
    hdr = draw(_valid_headers())
    buf = hdr.pack()
    for _ in range(draw(st.integers(1, 3))):
        buf[draw(st.integers(0, HEADER_LEN - 1))] = draw(I32)
    head = (hdr.kind == Kind.RESULT) != (draw(st.integers(0, 9)) == 0)
    return buf, head


@settings(FUZZ, max_examples=1500)
@given(b=header_buffers(), last=st.sampled_from([NO_RUN, 0, 6, 2**31 - 2]))
def test_any_header_is_accepted_within_bounds_or_refused(b, last):
    buf, head = b
    def decode_and_check(b):
        hdr = Header.unpack(b)
        check_header(hdr, LIM, HEAD_KINDS if head else WORKER_KINDS, last)
        return hdr
    hdr = _bounded(decode_and_check, buf)
    if isinstance(hdr, Header):  # accepted: what it makes the receiver allocate is bounded by the limits
        assert payload_bytes(hdr) <= _max_payload(LIM)
        assert hdr.kind in (HEAD_KINDS if head else WORKER_KINDS)
        if hdr.kind in (Kind.DECODE, Kind.RESULT):
            assert hdr.run_id > last and 1 <= hdr.n_tokens <= LIM.n_batch and 0 <= hdr.n_outputs <= hdr.n_tokens


@FUZZ
@given(arr=st.one_of(
    st.lists(I32, max_size=20).map(lambda v: np.array(v, dtype=np.int32)),
    st.lists(st.integers(-2**63, 2**63 - 1), min_size=8, max_size=8).map(lambda v: np.array(v, dtype=np.int64)),
    st.lists(st.floats(allow_nan=True, width=32), min_size=8, max_size=8).map(lambda v: np.array(v, dtype=np.float32)),
    st.just(np.zeros((2, 4), np.int32)), st.just([1, 2, 3, 4, 5, 6, 7, 8]), st.none()))
def test_header_of_any_shape_or_type(arr):
    out = _bounded(Header.unpack, arr)
    if isinstance(out, Header):
        assert isinstance(arr, np.ndarray) and arr.shape == (HEADER_LEN,) and arr.dtype == np.int32


def test_a_huge_header_is_refused_before_any_payload():
    """The cases the issue names: a header must not make a rank allocate what it announces."""
    for fields, why in [
        (dict(n_tokens=2**30, n_embd=1536, n_meta=2**31 - 1), "n_tokens"),
        (dict(n_tokens=4, n_embd=2**30, n_meta=30), "n_embd"),
        (dict(n_tokens=4, n_embd=1536, n_meta=2**31 - 1), "n_meta"),
        (dict(n_tokens=4, n_embd=1536, n_meta=30, n_outputs=5), "n_outputs"),
    ]:
        hdr = Header(Kind.DECODE, run_id=3, **fields)
        with pytest.raises(ProtocolError, match=why):
            check_header(hdr, LIM, WORKER_KINDS, NO_RUN)
    with pytest.raises(ProtocolError, match="launch order"):
        check_header(Header(Kind.DECODE, 3, 1, 7, n_outputs=1, n_embd=1536), LIM, WORKER_KINDS, 3)
    with pytest.raises(ProtocolError, match="unexpected transaction RESULT"):
        check_header(Header(Kind.RESULT, 4, 1, n_outputs=1), LIM, WORKER_KINDS, 3)
    with pytest.raises(ProtocolError, match="unexpected transaction DECODE"):
        check_header(Header(Kind.DECODE, 4, 1, 7, n_outputs=1, n_embd=1536), LIM, HEAD_KINDS, 3)
    with pytest.raises(ProtocolError, match="ops"):
        check_header(Header(Kind.KV, n_tokens=2**31 - 1), LIM, WORKER_KINDS, NO_RUN)


# ---------------------------------------------------------------- META
def _valid_batches():
    return st.sampled_from([
        Batch(np.array([11, 21, 22, 31, 32], np.int32), np.array([9, 10, 10, 11, 11], np.int32),
              [[0, 5, 6], [5], [6], [5], [6]], np.array([1, 1, 1, 0, 1], np.int32), prefix_ops([5, 6], 9, 3, 9)),
        Batch(np.array([7], np.int32), np.array([0], np.int32), [[0]], np.array([1], np.int32),
              np.zeros((0, 5), np.int32)),
        Batch(np.array([4, 5], np.int32), np.array([20, 21], np.int32), [[9], [9]], np.array([1, 1], np.int32),
              commit_ops(1, 10, 14, [1, 2, 3], {1: 10, 2: 12}, 9)),
    ])


@st.composite
def metas(draw):
    how = draw(st.sampled_from(["random", "mutate", "truncate", "extend"]))
    if how == "random":
        return np.array(draw(st.lists(I32, max_size=64)), dtype=np.int32), None
    batch = draw(_valid_batches())
    meta = batch.pack_meta()
    hdr = Header(Kind.DECODE, 1, batch.n_tokens, len(meta), Flag.NONE, NO_RUN, batch.n_outputs, LIM.n_embd)
    if how == "mutate":
        for _ in range(draw(st.integers(1, 3))):
            meta[draw(st.integers(0, len(meta) - 1))] = draw(I32)
    elif how == "truncate":
        meta = meta[:draw(st.integers(0, len(meta) - 1))]
    else:
        meta = np.concatenate([meta, np.array(draw(st.lists(I32, min_size=1, max_size=8)), np.int32)])
    return meta, (hdr if draw(st.booleans()) else None)


@settings(FUZZ, max_examples=1500)
@given(m=metas(), checked=st.booleans())
def test_any_meta_is_a_valid_batch_or_refused(m, checked):
    meta, hdr = m
    out = _bounded(Batch.unpack_meta, meta, LIM if checked else None, hdr)
    if isinstance(out, Batch) and checked:  # accepted with limits: every value llama.cpp will see is in range
        assert 1 <= out.n_tokens <= LIM.n_batch
        assert ((out.tokens >= 0) & (out.tokens < LIM.n_vocab)).all()
        assert ((out.pos >= 0) & (out.pos < LIM.n_ctx)).all()
        assert set(out.output.tolist()) <= {0, 1}
        assert all(ids and all(0 <= s < LIM.n_seq_max for s in ids) for ids in out.seq_ids)
        if hdr is not None:
            assert out.n_tokens == hdr.n_tokens and out.n_outputs == hdr.n_outputs


# ---------------------------------------------------------------- SAMPLING, KV ops, TOKENS
_SAMPLING_ROW = st.tuples(st.floats(allow_nan=True, allow_infinity=True), st.floats(allow_nan=True, allow_infinity=True),
                          st.integers(-5, 2**40), st.integers(-5, 2**62), st.integers(-3, 25), st.integers(-2, 4)).map(
    lambda t: np.concatenate([np.array(t[:2], np.float64).view(np.int64), np.array(t[2:], np.int64)]))


@FUZZ
@given(st.one_of(
    st.lists(st.lists(st.integers(-2**63, 2**63 - 1), min_size=6, max_size=6), max_size=4).map(
        lambda v: np.array(v, dtype=np.int64).reshape(-1, 6)),
    st.lists(_SAMPLING_ROW, min_size=1, max_size=4).map(np.stack),
    st.lists(st.integers(-9, 9), max_size=6).map(lambda v: np.array(v, dtype=np.int64)),
    st.lists(st.integers(-9, 9), min_size=6, max_size=6).map(lambda v: np.array(v, dtype=np.int32).reshape(1, 6))))
def test_any_sampling_buffer_is_valid_parameters_or_refused(buf):
    out = _bounded(unpack_sampling, buf)
    for d in out if isinstance(out, tuple) else ():
        sp = d.params
        assert np.isfinite(sp.temp) and sp.temp >= 0 and 0 < sp.top_p <= 1 and sp.top_k >= 0 and sp.seed >= 0
        assert d.top_logprobs is None or 0 <= d.top_logprobs <= 20
    if isinstance(out, tuple):
        assert out[-1].n_rows == 0 and all(d.n_rows >= 1 for d in out[:-1])


def test_sampling_round_trips_still():
    sp = SamplingParams(0.7, 40, 0.95, 12345)
    assert unpack_sampling(pack_sampling(one_sampling(sp))) == one_sampling(sp)
    assert unpack_sampling(pack_sampling(one_sampling(sp, 0))) == one_sampling(sp, 0)


@st.composite
def kv_buffers(draw):
    if draw(st.booleans()):
        rows = draw(st.lists(st.lists(I32, min_size=5, max_size=5), max_size=12))
        return np.array(rows, dtype=np.int32).reshape(-1, 5)
    ops = commit_ops(1, 10, 14, [1, 2, 3], {1: 10, 2: 12}, 9).copy()
    ops[draw(st.integers(0, len(ops) - 1)), draw(st.integers(0, 4))] = draw(I32)
    return ops


@FUZZ
@given(ops=kv_buffers())
def test_any_kv_ops_buffer_is_in_range_or_refused(ops):
    out = _bounded(check_kv_ops, ops, LIM)
    if not isinstance(out, ProtocolError):
        for op, src, dst, p0, p1 in ops.tolist():
            assert op in KvOp._value2member_map_ and -1 <= src < LIM.n_seq_max and p0 >= -1 and p1 >= -1


@FUZZ
@given(st.lists(I32, max_size=16))
def test_any_tokens_payload_is_in_the_vocabulary_or_refused(tokens):
    arr = np.array(tokens, dtype=np.int32)
    out = _bounded(check_tokens, arr, LIM)
    if not isinstance(out, ProtocolError):
        assert ((arr >= 0) & (arr < LIM.n_vocab)).all()


def test_what_the_head_sends_passes_every_check():
    """The checks refuse nothing the head really sends (the MPI tests run them on every message, too)."""
    b = Batch(np.array([11, 21, 22], np.int32), np.array([9, 10, 10], np.int32), [[0, 5, 6], [5], [6]],
              np.array([1, 1, 1], np.int32), prefix_ops([5, 6], 9, 3, 9))
    meta = b.pack_meta()
    hdr = Header(Kind.DECODE, 1, 3, len(meta), Flag.SPECULATIVE, NO_RUN, 3, LIM.n_embd)
    check_header(hdr, LIM, WORKER_KINDS, NO_RUN)
    assert Batch.unpack_meta(meta, LIM, hdr).seq_ids == b.seq_ids


# ---------------------------------------------------------------- the real receive path, under mpiexec
@pytest.mark.mpi
@pytest.mark.parametrize("case, match", [
    ("huge", "DECODE header with n_tokens 1073741824, outside 1..64"),
    ("wrong-size", "bytes on tag ACTIV, its header announced 128"),
    ("bad-kind", "unexpected transaction RESULT"),
    ("bad-meta", "META token id outside 0..99"),
])
def test_a_stage_refuses_a_bad_message_before_its_payload(case, match):
    import subprocess
    import sys
    from pathlib import Path

    from helpers import MPIEXEC
    script = Path(__file__).parent / "mpi_badmsg.py"
    p = subprocess.run([MPIEXEC, "-n", "2", sys.executable, "-m", "mpi4py", str(script), case],
                       capture_output=True, text=True, timeout=60)
    assert p.returncode == 0, p.stderr[-2000:]
    line = next(l for l in p.stdout.splitlines() if l.startswith(("REFUSED", "ACCEPTED")))
    assert line.startswith("REFUSED rank 1 refused a message from rank 0 (host") and match in line, line
