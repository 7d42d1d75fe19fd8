"""The stage engine's own costs, cut without changing a bit: the node filter in front of the hidden-state capture,
tokens read from llama.cpp's logits in place, and the weights in huge pages (synthetic GGUFs, real llama.cpp)."""
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from helpers import PROMPT
from synth import make_llama_gguf
from synth_arch import make_arch_gguf
from pipeinfer.core.protocol import Batch, cp, kv_ops, rm
from pipeinfer.core.verify import row_tokens
from pipeinfer.core.sampling import SamplingParams, one_sampling
from pipeinfer.engine.stage import DecodeAborted, StageEngine, TokenEmbedder, anonymous_regions, name_key
from pipeinfer.engine.stagefile import ensure_stage_file, read_info


def _engine(path, cls=StageEngine, **kw):
    args = dict(n_ctx=256, n_batch=64, n_seq_max=1, n_threads=1, n_threads_batch=1)
    return cls(path, **(args | kw))


def _batch(n, p0, all_out=False):
    out = np.ones(n, np.int32) if all_out else np.eye(1, n, n - 1, dtype=np.int32)[0]
    return Batch(np.zeros(n, np.int32), np.arange(p0, p0 + n, dtype=np.int32), [[0]] * n, out, kv_ops())


class EveryNode(StageEngine):
    """The capture as it was: every graph node goes to the full name check (_on_tensor)."""

    def _node_filter(self):
        return self._on_tensor


def test_name_key():
    full = 2**64 - 1
    assert name_key(b"l_out-13") == (int.from_bytes(b"l_out-13", "little"), full)
    assert name_key(b"l_out-5") == (int.from_bytes(b"l_out-5\0", "little"), full)  # 7 characters: the NUL is the 8th byte
    assert name_key(b"inp_scaled") == (int.from_bytes(b"inp_scal", "little"), full)
    key, mask = name_key(b"embd")  # short: the name and its NUL decide, not the field's undefined bytes after it
    assert int.from_bytes(b"embd\0xyz", "little") & mask == key
    assert int.from_bytes(b"embd-0\0z", "little") & mask != key and int.from_bytes(b"emb\0", "little") & mask != key


@pytest.mark.parametrize("arch", ["llama", "gemma2"])  # gemma2: the capture and the input hook (inp_scaled) both
def test_node_filter_captures_what_every_node_check_captures(tmp_path, models, arch):
    src = models["f32"] if arch == "llama" else make_arch_gguf(tmp_path / "g2.gguf", "gemma2")
    n_layer = read_info(src).n_layer
    stage = ensure_stage_file(src, 1, n_layer - 1, with_vocab=False)  # a middle stage: hidden states in and out
    fast, slow = (_engine(stage, cls, embd_input=True, capture_hidden=True) for cls in (StageEngine, EveryNode))
    rng = np.random.default_rng(0)
    pos = 0
    for n in (len(PROMPT), 1, 3, 1):
        h = rng.standard_normal((n, fast.n_embd), dtype=np.float32)
        got, want = fast.decode(_batch(n, pos), h), slow.decode(_batch(n, pos), h)
        assert got.shape == (n, fast.n_embd)
        assert np.array_equal(got, want)
        pos += n


def test_abort_is_polled_only_while_a_decode_may_be_cancelled(models):
    eng = _engine(models["f32"], embd_input=False, capture_hidden=False)
    polls = []
    whole = Batch(np.asarray(PROMPT, np.int32), np.arange(len(PROMPT), dtype=np.int32), [[0]] * len(PROMPT),
                  np.ones(len(PROMPT), np.int32), kv_ops())
    want = eng.decode(whole)
    eng.clear_kv()
    eng.should_abort = lambda: polls.append(1) or True
    with pytest.raises(DecodeAborted):
        eng.decode(whole)
    assert polls and eng.seq_pos_range(0) == (-1, -1)  # the aborted batch left no cell behind
    eng.should_abort, n_polls = None, len(polls)
    assert np.array_equal(eng.decode(whole), want)
    assert len(polls) == n_polls


def test_decode_tokens_reads_the_logits_in_place(models):
    src = models["q8"]
    a, b = (_engine(src, embd_input=False, capture_hidden=False) for _ in range(2))
    toks = np.asarray(PROMPT, np.int32)
    for sp in (SamplingParams(), SamplingParams(temp=0.8, top_k=20, seed=7)):
        for eng in (a, b):
            eng.clear_kv()
        for p0, n in ((0, len(toks)), (len(toks), 1), (len(toks) + 1, 3)):
            batch = Batch(toks[:n], np.arange(p0, p0 + n, dtype=np.int32), [[0]] * n, np.ones(n, np.int32), kv_ops())
            got, logprobs = a.decode_tokens(batch, None, one_sampling(sp))
            want = row_tokens(b.decode(batch), batch.output_pos, sp)
            assert got.dtype == np.int32 and np.array_equal(got, want) and logprobs is None


def _thp_available() -> bool:
    p = Path("/sys/kernel/mm/transparent_hugepage/enabled")
    return p.exists() and "[never]" not in p.read_text()


# a fresh process, as a rank is: in a long-lived one (pytest after many tests) glibc may serve the weights from memory
# it already holds, which then is no new mapping to advise
HUGE_PAGE_PROBE = """import sys
from pipeinfer.engine.stage import StageEngine
eng = StageEngine(sys.argv[1], n_ctx=256, n_batch=64, n_seq_max=1, n_threads=1, n_threads_batch=1, embd_input=False,
                  capture_hidden=False)
print(eng.huge_page_bytes)
eng.close()
"""


def test_weights_in_huge_pages_give_the_same_bits(tmp_path, monkeypatch):
    """Logits and captured hidden states are bit for bit those of llama.cpp's file mapping (PIPEINFER_HUGE_PAGES=0),
    and where the kernel has THP the weights are in huge pages. The model is 46 MB: glibc serves smaller blocks
    from its heap, which stays in small pages, while a real model's weights get mappings of their own."""
    src = make_llama_gguf(tmp_path / "big.gguf", n_layer=2, n_embd=512, n_head=4, n_head_kv=2, n_ff=2048, n_vocab=4096)
    first = ensure_stage_file(src, 0, 1, with_vocab=False)
    emb = TokenEmbedder(src)(np.asarray(PROMPT))
    outputs, huge = {}, {}
    for setting in ("0", "1"):
        monkeypatch.setenv("PIPEINFER_HUGE_PAGES", setting)
        whole = _engine(src, embd_input=False, capture_hidden=False)
        mid = _engine(first, embd_input=True, capture_hidden=True)
        batch = Batch(np.asarray(PROMPT, np.int32), np.arange(len(PROMPT), dtype=np.int32), [[0]] * len(PROMPT),
                      np.ones(len(PROMPT), np.int32), kv_ops())
        outputs[setting] = (whole.decode(batch), mid.decode(batch, emb))
        huge[setting] = whole.huge_page_bytes
        whole.close()
        mid.close()
    for a, b in zip(outputs["0"], outputs["1"]):
        assert np.array_equal(a, b)
    assert huge["0"] == 0
    if _thp_available() and anonymous_regions():
        p = subprocess.run([sys.executable, "-c", HUGE_PAGE_PROBE, str(src)], capture_output=True, text=True,
                           timeout=120, env=dict(os.environ, PIPEINFER_HUGE_PAGES="1"))
        assert p.returncode == 0, p.stderr[-2000:]
        assert int(p.stdout.split()[-1]) >= 2 << 20, p.stdout


@pytest.mark.real
def test_where_a_sequence_s_cells_sit_changes_large_batches_only(monkeypatch):
    """What exactness under load rests on, measured on the real Qwen2.5-Coder-1.5B (--kernels repack: flash
    attention): a batch of up to 63 rows gives the same logits bit for bit wherever the sequence's cells sit (other
    sequences' cells before them, or between its own), and so do the 1-4 row decodes after it. With f16 keys and
    values a batch of 64 rows or more goes through llama.cpp's tiled flash attention, whose result depends on the
    cells' offset mod 64 (up to ~1 in a logit): so prompts are decoded in chunks of at most 63 tokens. The exact
    settings' bf16 values (engine/kernels.kv_cache_types) keep 64 rows on the one-row kernel too, wherever they sit."""
    from helpers import real_model
    from pipeinfer.engine import stage
    from pipeinfer.engine.tokenizer import Tokenizer
    path = real_model("qwen2.5-coder-1.5b")
    tok = Tokenizer(path)
    prompt = tok.encode("Write a Python function that parses a CSV file into a list of dictionaries, with a docstring "
                        "and type hints, and explain each step of it in a short comment. " * 2)
    tok.close()
    assert len(prompt) >= 64

    def last_logits(eng, n: int, fill: int) -> np.ndarray:
        eng.clear_kv()
        if fill:  # another sequence's cells first
            g = np.arange(100, 100 + fill, dtype=np.int32)
            eng.decode_tokens(Batch(g, np.arange(fill, dtype=np.int32), [[1]] * fill, np.eye(1, fill, fill - 1,
                                    dtype=np.int32)[0], kv_ops()), None, one_sampling(SamplingParams()))
        toks = np.array(prompt[:n], np.int32)
        eng.decode_tokens(Batch(toks, np.arange(n, dtype=np.int32), [[0]] * n, np.eye(1, n, n - 1, dtype=np.int32)[0],
                                kv_ops()), None, one_sampling(SamplingParams()))
        return eng._logits(n)[0].copy()

    def engine():
        return StageEngine(path, n_ctx=512, n_batch=128, n_seq_max=2, n_threads=1, n_threads_batch=1,
                           embd_input=False, capture_hidden=False)
    eng = engine()
    try:
        for n, fill in ((63, 1), (63, 20), (40, 30), (64, 64), (64, 1)):
            assert np.array_equal(last_logits(eng, n, 0), last_logits(eng, n, fill)), (n, fill)
    finally:
        eng.close()
    monkeypatch.setattr(stage, "kv_cache_types", lambda kernels, one_type: (1, 1))  # f16 and f16
    eng = engine()
    try:
        assert np.array_equal(last_logits(eng, 63, 0), last_logits(eng, 63, 1))
        assert np.array_equal(last_logits(eng, 64, 0), last_logits(eng, 64, 64))      # the same offset mod 64
        assert not np.array_equal(last_logits(eng, 64, 0), last_logits(eng, 64, 1))  # another offset: other bits
    finally:
        eng.close()


def _row_alone_and_in_a_batch(path, n_threads: int, n_cells: int) -> tuple[np.ndarray, np.ndarray]:
    """Logits of sequence 0's next row decoded alone and beside sequence 1's (which shares its n_cells cells)."""
    eng = _engine(path, n_ctx=n_cells + 64, n_batch=n_cells, n_seq_max=2, n_threads=n_threads,
                  n_threads_batch=n_threads, embd_input=False, capture_hidden=False)
    rng = np.random.default_rng(3)
    toks = rng.integers(100, 20000, n_cells + 2).astype(np.int32)
    try:
        eng.decode(Batch(toks[:n_cells], np.arange(n_cells, dtype=np.int32), [[0]] * n_cells,
                         np.eye(1, n_cells, n_cells - 1, dtype=np.int32)[0], kv_ops(cp(0, 1))))

        def next_rows(seqs):
            out = eng.decode(Batch(toks[[n_cells + s for s in seqs]], np.full(len(seqs), n_cells, np.int32),
                                   [[s] for s in seqs], np.ones(len(seqs), np.int32), kv_ops()))
            eng.apply_kv_ops(kv_ops(*[rm(s, n_cells, -1) for s in seqs]))
            return out
        return next_rows([0]), next_rows([0, 1])[:1]
    finally:
        eng.close()


@pytest.mark.real
def test_a_row_alone_is_the_row_in_a_batch_on_two_threads_past_512_cells(monkeypatch):
    """On 2+ threads ggml's CPU flash attention splits one query row over 512+ cells across the threads when K and V
    are both f16 (a row alone then gets other bits than the same row in a batch: a verified draft or a batched user
    against the target one token at a time); the exact settings' bf16 values keep every row on the one-row kernel
    (engine/kernels.kv_cache_types). Pinned both ways on the real Qwen2.5-Coder-1.5B (its K-quant matrix multiplies
    are row by row: the synthetic models' f32/q8_0 ones are not)."""
    from helpers import real_model
    from pipeinfer.engine import stage
    path = real_model("qwen2.5-coder-1.5b")
    alone, in_batch = _row_alone_and_in_a_batch(path, n_threads=2, n_cells=300)  # 300 used cells: a 512-cell view
    assert np.array_equal(alone, in_batch)
    monkeypatch.setattr(stage, "kv_cache_types", lambda kernels, one_type: (1, 1))  # f16 and f16
    alone, in_batch = _row_alone_and_in_a_batch(path, n_threads=2, n_cells=300)
    assert not np.array_equal(alone, in_batch)
    alone, in_batch = _row_alone_and_in_a_batch(path, n_threads=1, n_cells=300)  # one thread: one part, same bits
    assert np.array_equal(alone, in_batch)
