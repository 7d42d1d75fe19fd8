"""Kernel settings and the exact batch limit (pipeinfer/engine/kernels.py)."""
import os

import numpy as np
import pytest

from pipeinfer.engine import kernels
from pipeinfer.core.protocol import KvOp
from pipeinfer.engine.kernels import largest_draft, probe_exact_batch, probe_rows_across_sequences, resolve_draft_max


class FakeEngine:
    """Outputs row i as f(input i), rounded differently when it sits in a batch of more than `exact` rows of one
    sequence, or of more than `across` rows of several (like a gemm that takes over from the one-row kernel)."""

    def __init__(self, exact: int, embd_input: bool = True, n_batch: int = 512, across: int | None = None,
                 n_seq_max: int = 16):
        self.exact, self.embd_input, self.n_batch, self.n_ctx = exact, embd_input, n_batch, 4096
        self.across = exact if across is None else across
        self.n_embd, self.n_vocab, self.capture_hidden, self.n_seq_max = 3, 50, True, n_seq_max
        self.cells: dict[int, list[int]] = {}  # sequence -> its positions
        self.batch_sizes: list[int] = []

    def clear_kv(self):
        self.cells.clear()

    def apply_kv_ops(self, ops):
        for op, src, _dst, p0, p1 in np.asarray(ops).reshape(-1, 5).tolist():
            assert op == KvOp.RM
            self.cells[src] = [p for p in self.cells.get(src, []) if p < p0 or (p1 >= 0 and p >= p1)]

    def decode(self, batch, embd=None):
        n = batch.n_tokens
        for p, (s,) in zip(batch.pos.tolist(), batch.seq_ids):
            assert p == len(self.cells.setdefault(s, [])), "positions follow each sequence's cells"
            self.cells[s].append(p)
        self.batch_sizes.append(n)
        x = embd.sum(axis=1, keepdims=True) if self.embd_input else batch.tokens[:, None].astype(np.float32)
        out = np.repeat(x, self.n_embd, axis=1) * np.float32(1.1)
        n_seqs = len({s for (s,) in batch.seq_ids})
        return out + np.float32(1e-3) if n > (self.exact if n_seqs == 1 else self.across) else out


@pytest.mark.parametrize("exact", [1, 3, 7, 8])
def test_probe_finds_the_largest_exact_batch(exact):
    eng = FakeEngine(exact)
    assert probe_exact_batch(eng) == exact
    assert eng.cells == {}, "the probe leaves the cache empty"
    assert max(eng.batch_sizes) >= min(exact + 1, 8), "tries the first batch size that differs"


@pytest.mark.parametrize("exact, across, limit", [(3, 3, 3), (7, 5, 5), (7, 1, 1), (8, 8, 8)])
def test_the_limit_holds_for_rows_of_several_sequences_too(exact, across, limit):
    """Users batched in one decode: each row the next token of its own sequence must get its bits alone too."""
    eng = FakeEngine(exact, across=across)
    assert probe_exact_batch(eng) == limit
    assert probe_rows_across_sequences(FakeEngine(8, across=across), [2, across, across + 1]) == {
        2: across >= 2, across: True, across + 1: False}


def test_rows_across_sequences_are_probed_only_as_far_as_the_engine_holds_sequences():
    assert probe_exact_batch(FakeEngine(7, across=5, n_seq_max=4)) == 7  # 5 rows untried: not known to differ


def test_probe_stays_within_the_engines_batch_and_uses_tokens_without_embedding_input():
    assert probe_exact_batch(FakeEngine(8, n_batch=4)) == 4
    assert probe_exact_batch(FakeEngine(2, embd_input=False)) == 2


@pytest.mark.parametrize("exact, across, limit", [(64, 64, 32), (20, 64, 16), (64, 10, 8), (1, 64, 1), (64, 2, 2)])
def test_tiled_kernels_probe_their_sizes_up_to_32_rows(exact, across, limit):
    """--kernels tiled: a row costs what 16 do, so the probe tries 2, 3, 4, 5, 8, 16 and 32 rows (one sequence's
    and several's) and takes the last size before the first that differs."""
    eng = FakeEngine(exact, across=across, n_seq_max=32)
    assert probe_exact_batch(eng, kernels="tiled") == limit
    assert max(eng.batch_sizes) <= 32 and eng.cells == {}


def test_tiled_kernels_force_llamas_tiled_multiply_and_keep_weights_as_stored(monkeypatch):
    monkeypatch.setenv(kernels.TILED_FORCE_ENV, "0")  # restored (unset) after the test
    assert kernels.model_params("repack").use_extra_bufts and os.environ[kernels.TILED_FORCE_ENV] == "0"
    params = kernels.model_params("tiled")
    assert not params.use_extra_bufts and os.environ[kernels.TILED_FORCE_ENV] == "1"


def test_a_draft_beside_tiled_stages_keeps_repacked_weights_and_the_process_is_tiled(monkeypatch):
    monkeypatch.setenv(kernels.TILED_FORCE_ENV, "0")  # restored (unset) after the test
    assert kernels.draft_kernels("repack") == "repack" and os.environ[kernels.TILED_FORCE_ENV] == "0"
    assert kernels.draft_kernels("tiled") == "repack" and os.environ[kernels.TILED_FORCE_ENV] == "1"


def test_largest_draft_counts_the_lead_token():
    assert largest_draft(3, lead=False) == 3   # a PipeInfer micro-batch is its draft tokens
    assert largest_draft(3, lead=True) == 2    # synchronous speculation adds the last accepted token


def test_resolve_draft_max():
    assert resolve_draft_max(None, 3, lead=False) == 3
    assert resolve_draft_max(None, 3, lead=True) == 2
    assert resolve_draft_max(None, 7, lead=False) == 4   # auto stays in the useful range on CPUs
    assert resolve_draft_max(2, 3, lead=True) == 2
    with pytest.raises(ValueError, match="--draft-max 3 makes verification batches of 4 tokens.*limit of 3"):
        resolve_draft_max(3, 3, lead=True)
    with pytest.raises(ValueError, match="--draft-max 4 makes verification batches of 4 tokens.*limit of 3"):
        resolve_draft_max(4, 3, lead=False)
    with pytest.raises(ValueError, match="no draft token fits"):
        resolve_draft_max(None, 1, lead=True)


def test_kernel_settings():
    assert kernels.model_params("repack").use_extra_bufts
    assert not kernels.model_params("no-repack").use_extra_bufts
    assert kernels.model_params("fast").use_extra_bufts
    import llama_cpp
    assert kernels.flash_attn_type("repack") == llama_cpp.LLAMA_FLASH_ATTN_TYPE_ENABLED
    assert kernels.flash_attn_type("fast") == llama_cpp.LLAMA_FLASH_ATTN_TYPE_DISABLED
    with pytest.raises(ValueError, match="unknown kernels"):
        kernels.model_params("turbo")


def test_weights_never_go_to_the_amx_buffer():
    """A build for an AMX CPU lists llama.cpp's AMX buffer type first; after model_params the loader's list of
    extra buffer types holds no AMX (its matmul crashed on q8_0 models) and keeps the repacked one."""
    import llama_cpp
    kernels.model_params("repack")
    left = kernels.extra_buffer_types()
    assert "AMX" not in left
    if "REPACK = 1" in llama_cpp.llama_print_system_info().decode():
        assert "CPU_REPACK" in left


def test_limit_is_measured_once_and_cached(models, monkeypatch, tmp_path):
    """A real engine on a synthetic q8_0 model: the probe runs on first load only (keyed by file, kernels,
    threads and build); the cache sits beside the stage files."""
    from pipeinfer.engine.stage import StageEngine
    monkeypatch.setenv("PIPEINFER_STAGE_CACHE", str(tmp_path))
    calls = []
    real_probe = kernels.probe_exact_batch
    monkeypatch.setattr(kernels, "probe_exact_batch", lambda eng, **kw: calls.append(1) or real_probe(eng, **kw))
    path = str(models["q8"])
    with StageEngine(path, n_ctx=64, n_batch=64, n_seq_max=1, n_threads=1, n_threads_batch=1,
                     embd_input=False, capture_hidden=False) as eng:
        first = kernels.exact_batch_limit(eng, path, "repack", 1, 1)
        again = kernels.exact_batch_limit(eng, path, "repack", 1, 1)
        other = kernels.exact_batch_limit(eng, path, "repack", 1, 2)
    assert 1 <= first <= 8 and again == first and other == first
    assert len(calls) == 2, "one probe per (file, kernels, threads)"
    assert len(list(tmp_path.glob("*.exact.*.json"))) == 2


def test_a_stage_with_the_same_kernel_key_takes_the_limit_measured_before(models, monkeypatch, tmp_path):
    """Stage files of other layer ranges of one model (the same roles, types and shapes) share a kernel key: the
    second takes the first's limit from this host's table without a probe; rank 0's table (`known`) serves a host
    whose own table lacks the key; other settings, another model or other types make another key."""
    import json

    from pipeinfer.engine.stage import StageEngine
    from pipeinfer.engine.stagefile import ensure_stage_file
    from synth import make_llama_gguf
    monkeypatch.setenv("PIPEINFER_STAGE_CACHE", str(tmp_path))
    calls = []
    real_probe = kernels.probe_exact_batch
    monkeypatch.setattr(kernels, "probe_exact_batch", lambda eng, **kw: calls.append(1) or real_probe(eng, **kw))
    model = make_llama_gguf(tmp_path / "m.gguf", n_layer=6, qtype="q8_0")
    a, b = ensure_stage_file(model, 0, 2, False), ensure_stage_file(model, 2, 5, False)
    key = kernels.kernel_key(a, "repack", 1, 1, True, True)
    assert kernels.kernel_key(b, "repack", 1, 1, True, True) == key
    assert kernels.kernel_key(b, "repack", 1, 2, True, True) != key                       # other threads
    assert kernels.kernel_key(ensure_stage_file(model, 4, 6, True), "repack", 1, 1, True, False) != key  # the output
    f32 = make_llama_gguf(tmp_path / "f.gguf", n_layer=6)
    assert kernels.kernel_key(ensure_stage_file(f32, 0, 2, False), "repack", 1, 1, True, True) != key  # other types
    from synth_arch import make_arch_gguf
    assert kernels.kernel_key(make_arch_gguf(tmp_path / "q.gguf", "qwen3moe"), "repack", 1, 1, False, False) is None
    wide = make_llama_gguf(tmp_path / "w.gguf", n_layer=6, qtype="q8_0", n_embd=128)
    assert kernels.kernel_key(ensure_stage_file(wide, 0, 2, False), "repack", 1, 1, True, True) != key  # other shapes

    def limit(path, known=None):
        with StageEngine(str(path), n_ctx=64, n_batch=64, n_seq_max=1, n_threads=1, n_threads_batch=1,
                         embd_input=True, capture_hidden=True) as eng:
            return kernels.exact_batch_limit(eng, path, "repack", 1, 1, known)
    first = limit(a)
    assert len(calls) == 1 and kernels.exact_table() == {key: first}
    assert limit(b) == first and len(calls) == 1                                          # from the host's table
    (record,) = [json.loads(p.read_text()) for p in tmp_path.glob(f"{b.stem}.exact.*.json")]
    assert record["how"] == "taken from a stage with the same kernel key" and record["kernel_key"] == key
    (tmp_path / kernels.EXACT_TABLE).unlink()                                               # another host ...
    c = ensure_stage_file(model, 1, 4, False)
    assert limit(c, known={key: 5}) == 5 and len(calls) == 1                              # ... rank 0's table
    assert limit(ensure_stage_file(model, 1, 3, False)) == 5                              # now in its own table


def test_batch_rows_are_the_stages_exact_limit_unless_fast():
    """--batch-rows auto takes the smallest exact limit of the stages; more is one line naming the rank; --kernels
    fast (no limit measured) takes what it is given, 16 by default."""
    from pipeinfer.core.config import ServingOptions
    from pipeinfer.core.errors import UserError
    from pipeinfer.ranks.startup import FAST_BATCH_ROWS, _batch_rows
    assert _batch_rows(ServingOptions(), [7, 3]) == 3
    assert _batch_rows(ServingOptions(batch_rows=2), [7, 3]) == 2
    with pytest.raises(UserError, match="--batch-rows 4 is more than the exact batch limit of 3 measured on rank 1"):
        _batch_rows(ServingOptions(batch_rows=4), [7, 3])
    assert _batch_rows(ServingOptions(), [None, None]) == FAST_BATCH_ROWS   # --kernels fast: no limit measured
    assert _batch_rows(ServingOptions(batch_rows=32), [None, None]) == 32
