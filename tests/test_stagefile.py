"""Stage files and the stage engine on synthetic GGUFs: chained stages reproduce the whole model."""
import numpy as np
import pytest

from helpers import PROMPT
from pipeinfer.core.protocol import Batch, kv_ops
from pipeinfer.engine.stage import StageEngine, TokenEmbedder
from pipeinfer.engine.stagefile import StageFileError, check_splittable, ensure_stage_file, read_info, ModelInfo


def _batch(tokens, p0, out_last=True):
    n = len(tokens)
    out = np.zeros(n, np.int32)
    out[-1] = 1
    return Batch(np.asarray(tokens, np.int32), np.arange(p0, p0 + n, dtype=np.int32), [[0]] * n, out, kv_ops())


def _engine(path, **kw):
    args = dict(n_ctx=256, n_batch=64, n_seq_max=2, n_threads=1, n_threads_batch=1)
    args.update(kw)
    return StageEngine(path, **args)


def test_stage_file_layout(models):
    src = models["f32"]
    s0 = ensure_stage_file(src, 0, 1, with_vocab=False)
    s1 = ensure_stage_file(src, 1, 4, with_vocab=True)
    i0, i1 = read_info(s0), read_info(s1)
    assert (i0.n_layer, i0.n_vocab) == (1, 4)         # dummy vocabulary on a middle stage
    assert (i1.n_layer, i1.n_vocab) == (3, read_info(src).n_vocab)
    assert ensure_stage_file(src, 0, 1, with_vocab=False) == s0  # cached


@pytest.mark.parametrize("kind", ["f32", "q8"])
@pytest.mark.parametrize("cuts", [(2,), (1,), (1, 3), (1, 2, 3)])
def test_chained_stages_equal_whole_model(models, kind, cuts):
    src = models[kind]
    n_layer = read_info(src).n_layer
    bounds = [0, *cuts, n_layer]
    whole = _engine(src, embd_input=False, capture_hidden=False)
    stages = [_engine(ensure_stage_file(src, a, b, with_vocab=(b == n_layer)), embd_input=True,
                      capture_hidden=(b != n_layer)) for a, b in zip(bounds, bounds[1:])]
    emb = TokenEmbedder(src)
    tokens, pos = list(PROMPT), 0
    for step in range(12):
        chunk = tokens if step == 0 else tokens[-1:]
        ref = whole.decode(_batch(chunk, pos))
        h = emb(np.asarray(chunk))
        for st in stages:
            h = st.decode(_batch(chunk, pos), h)
        assert h.shape == ref.shape
        np.testing.assert_allclose(h, ref, atol=2e-2)
        assert int(h[-1].argmax()) == int(ref[-1].argmax())
        pos += len(chunk)
        tokens.append(int(ref[-1].argmax()))


def test_middle_stage_has_no_vocabulary_work(models):
    s = ensure_stage_file(models["f32"], 1, 3, with_vocab=False)
    eng = _engine(s, embd_input=True, capture_hidden=True)
    assert eng.n_vocab == 4
    h = eng.decode(_batch([0, 0, 0], 0), np.ones((3, eng.n_embd), np.float32))
    assert h.shape == (3, eng.n_embd) and np.isfinite(h).all()


def test_kv_ops_and_tree_batch(models):
    """Tree tokens sharing a prefix cell give the same logits as each branch decoded alone."""
    eng = _engine(models["f32"], embd_input=False, capture_hidden=False, n_seq_max=3)
    n = len(PROMPT)
    eng.decode(_batch(PROMPT, 0))
    eng.apply_kv_ops(kv_ops((2, 0, 1, -1, -1), (2, 0, 2, -1, -1)))  # seq_cp 0->1, 0->2
    t1, a, b = 7, 11, 12
    tree = Batch(np.array([t1, a, b], np.int32), np.array([n, n + 1, n + 1], np.int32), [[1, 2], [1], [2]],
                 np.ones(3, np.int32), kv_ops())
    lt = eng.decode(tree)
    assert eng.seq_pos_range(1) == (0, n + 1) and eng.seq_pos_range(2) == (0, n + 1)
    eng.apply_kv_ops(kv_ops((1, 1, -1, -1, -1), (1, 2, -1, -1, -1)))
    assert eng.kv_summary() == [[0, 0, n - 1]]
    for branch_tok, row in ((a, 1), (b, 2)):
        eng.apply_kv_ops(kv_ops((2, 0, 1, -1, -1)))
        lin = Batch(np.array([t1, branch_tok], np.int32), np.array([n, n + 1], np.int32), [[1], [1]],
                    np.ones(2, np.int32), kv_ops())
        ll = eng.decode(lin)
        np.testing.assert_allclose(ll[1], lt[row], atol=1e-2)
        eng.apply_kv_ops(kv_ops((1, 1, -1, -1, -1)))


def test_refuses_unverified_architecture():
    check_splittable(ModelInfo("mamba", 8, 64, 10), 1)  # whole model: fine
    with pytest.raises(StageFileError, match="not verified for layer splitting"):
        check_splittable(ModelInfo("mamba", 8, 64, 10), 2)


def test_not_a_gguf(tmp_path):
    p = tmp_path / "x.gguf"
    p.write_bytes(b"hello world, not a model" * 10)
    with pytest.raises(StageFileError, match="not a GGUF"):
        read_info(p)


def test_pruned_head_keeps_specials_then_frequent_tokens():
    """head_tokens: every special a model can emit (not <unused..> placeholders), a 1/16 share of single
    characters by id, then merged tokens by id (merge order = frequency), sorted, never more than asked."""
    from pipeinfer.engine.stagefile import head_tokens
    N, U, C, B = 1, 2, 3, 6   # gguf token types NORMAL, UNKNOWN, CONTROL, BYTE
    toks = [b"<pad>", b"<eos>", b"<unused0>", b"<0x00>", b"ing", b" the", b"a", b"b", b" of",
            "\u4e00".encode(), b"er", b"c", b"<unk>"]
    types = [C, C, C, B, N, N, N, N, N, N, N, N, U]
    assert head_tokens(toks, types, 64).tolist() == [0, 1, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12]  # all but <unused0>
    assert head_tokens(toks, types, 6).tolist() == [0, 1, 3, 4, 5, 12]                  # no room for characters
    assert head_tokens(toks, types, 16).tolist() == [0, 1, 3, 4, 5, 6, 8, 10, 12]  # one character (16 // 16)
    assert len(head_tokens(toks, types, 2)) == 2


def test_pruned_head_file(models, tmp_path):
    """The pruned file's vocabulary and output rows are the kept ones, byte for byte; no tokenizer text."""
    import gguf
    from pipeinfer.engine.stagefile import ensure_pruned_head
    path, keep = ensure_pruned_head(models["f32"], 384)
    assert read_info(path).n_vocab == len(keep) == 384 and read_info(models["f32"]).n_vocab == 512
    src, dst = gguf.GGUFReader(str(models["f32"])), gguf.GGUFReader(str(path))
    t_src = {t.name: t for t in src.tensors}
    for t in dst.tensors:
        want = t_src[t.name].data[keep] if t.name in ("token_embd.weight", "output.weight") else t_src[t.name].data
        np.testing.assert_array_equal(t.data, want)
    assert ensure_pruned_head(models["f32"], 384)[0] == path   # cached


def test_layer_costs_count_what_a_token_reads(tmp_path):
    """MB of weights per token: every trunk layer, and the output projection (token_embd where tied); an expert
    tensor counts the share of experts a token uses."""
    from synth import make_llama_gguf
    from synth_arch import E, V, X, XU, make_arch_gguf
    from pipeinfer.engine.ggufheader import read_header
    from pipeinfer.engine.stagefile import layer_costs
    m = make_llama_gguf(tmp_path / "m.gguf", n_layer=3, n_embd=64, n_ff=128, n_vocab=512)
    per_layer, tail = layer_costs(m)
    assert len(per_layer) == 3 and len(set(per_layer)) == 1
    assert tail == pytest.approx((512 * 64 + 64) * 4 / 1e6)                 # output.weight + output_norm, f32
    tensors = read_header(m).tensors
    assert per_layer[0] == pytest.approx(sum(t.nbytes for n, t in tensors.items() if n.startswith("blk.0.")) / 1e6)

    tied = make_arch_gguf(tmp_path / "g.gguf", "gemma2")
    assert layer_costs(tied)[1] == pytest.approx((V * E + E) * 4 / 1e6)     # token_embd stands in for output
    moe = make_arch_gguf(tmp_path / "q.gguf", "qwen3moe")
    tensors = read_header(moe).tensors
    dense = sum(t.nbytes for n, t in tensors.items() if n.startswith("blk.0.") and "_exps" not in n)
    experts = sum(t.nbytes for n, t in tensors.items() if n.startswith("blk.0.") and "_exps" in n)
    assert experts > 0
    assert layer_costs(moe)[0][0] == pytest.approx((dense + experts * XU / X) / 1e6)


def test_header_reader_skips_long_arrays_as_gguf_reads_them(tmp_path):
    """Arrays the reader is not asked to keep are skipped (a string array crossing its 1 MiB reads many times):
    the same tensor offsets and key spans as keeping them, the same as gguf.GGUFReader; a file cut inside the array
    is a truncated header, not a wrong answer."""
    import gguf
    from pipeinfer.engine.ggufheader import NotGGUF, _read_header, read_header
    p = tmp_path / "long.gguf"
    w = gguf.GGUFWriter(str(p), "llama")
    words = [("w" * (i % 37)) + str(i) for i in range(60_000)]  # about 1.6 MB of strings
    w.add_array("tokenizer.ggml.tokens", words)
    w.add_array("tokenizer.ggml.scores", [float(i) for i in range(5000)])
    w.add_uint32("after.arrays", 7)
    w.add_tensor("t", np.arange(64, dtype=np.float32).reshape(8, 8))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    skipped, kept = read_header(p), read_header(p, keep_arrays=("tokenizer.ggml.tokens",))
    assert skipped.fields["tokenizer.ggml.tokens"] == 60_000 and skipped.fields["after.arrays"] == 7
    assert [s.decode() for s in kept.fields["tokenizer.ggml.tokens"]] == words
    assert skipped.spans == kept.spans and skipped.tensors == kept.tensors
    assert skipped.tensors["t"].offset == gguf.GGUFReader(str(p)).tensors[0].data_offset
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(p.read_bytes()[:1_200_000])  # inside the strings
    _read_header.cache_clear()
    with pytest.raises(NotGGUF, match="truncated GGUF header"):
        read_header(cut)
