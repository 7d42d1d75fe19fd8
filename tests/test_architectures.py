"""Every architecture in stagefile.SPLIT_RULES splits exactly: on a tiny synthetic model of each (synth_arch.py),
the chained stages' logits equal the whole model's bit for bit, and a greedy generation on several ranks equals
one process. The table and the synthetic models must cover each other."""
import dataclasses

import numpy as np
import pytest

from helpers import PROMPT, mpirun
from synth import reference_greedy
from synth_arch import VARIANTS, make_arch_gguf
from pipeinfer.core.protocol import Batch, kv_ops
from pipeinfer.engine import stage as stage_mod
from pipeinfer.engine import stagefile
from pipeinfer.engine.stage import StageEngine, TokenEmbedder
from pipeinfer.engine.stagefile import SPLIT_RULES, SPLITTABLE, ensure_stage_file, read_info, write_stage_file

# Stage boundaries for the 6-layer models: [0,3) [3,6) and [0,1) [1,4) [4,6). Between them they start stages at
# odd and even layers (period-2 windows), right after gemma3's global layer 5's predecessors (period 6) and
# olmo2's global layer 3, and inside and past deepseek2's 2 leading dense layers.
CUTS = {2: (3,), 3: (1, 4)}
N_STEPS = 12


@pytest.fixture(scope="module")
def arch_model(tmp_path_factory):
    d, made = tmp_path_factory.mktemp("arch"), {}

    def get(name, qtype="f32"):
        if (name, qtype) not in made:
            made[name, qtype] = make_arch_gguf(d / f"{name}-{qtype}.gguf", name, qtype=qtype)
        return made[name, qtype]
    return get


def test_the_table_and_the_synthetic_models_cover_each_other():
    """SPLITTABLE is what the matrix below verifies: no architecture admitted without a model, none tested but
    left out."""
    assert SPLITTABLE == set(SPLIT_RULES) == {v.arch for v in VARIANTS.values()}


def _batch(tokens, p0):
    n = len(tokens)
    return Batch(np.asarray(tokens, np.int32), np.arange(p0, p0 + n, dtype=np.int32), [[0]] * n,
                 np.ones(n, np.int32), kv_ops())


def _engine(path, embd_input, capture_hidden):
    return StageEngine(path, n_ctx=64, n_batch=16, n_seq_max=1, n_threads=1, n_threads_batch=1,
                       embd_input=embd_input, capture_hidden=capture_hidden)


def _stage_paths(src, cuts, write=ensure_stage_file):
    n_layer = read_info(src).n_layer
    bounds = [0, *cuts, n_layer]
    return [write(src, a, b, b == n_layer) for a, b in zip(bounds, bounds[1:])]


def _run_whole_and_chained(src, stage_paths):
    """(whole-model logits, chained-stage logits) for the prompt (every row) and N_STEPS greedy steps."""
    whole = _engine(src, embd_input=False, capture_hidden=False)
    stages = [_engine(p, embd_input=True, capture_hidden=i < len(stage_paths) - 1) for i, p in enumerate(stage_paths)]
    embed = TokenEmbedder(src)
    ref, got, tokens, pos = [], [], list(PROMPT), 0
    try:
        for step in range(N_STEPS + 1):
            chunk = tokens if step == 0 else tokens[-1:]
            ref.append(whole.decode(_batch(chunk, pos)))
            h = embed(np.asarray(chunk))
            for st in stages:
                h = st.decode(_batch(chunk, pos), h)
            got.append(h)
            pos += len(chunk)
            tokens.append(int(ref[-1][-1].argmax()))
    finally:
        for e in [whole, *stages]:
            e.close()
    return np.concatenate(ref), np.concatenate(got)


@pytest.mark.parametrize("n_stages", [2, 3])
@pytest.mark.parametrize("name", sorted(VARIANTS))
def test_chained_stages_equal_whole_model_bit_for_bit(arch_model, name, n_stages):
    src = arch_model(name)
    ref, got = _run_whole_and_chained(src, _stage_paths(src, CUTS[n_stages]))
    assert ref.shape == (len(PROMPT) + N_STEPS, 256)
    np.testing.assert_array_equal(got, ref)


def test_quantized_experts_split_exactly(arch_model):
    """q8_0 expert tensors ([n_expert, n_ff, n_embd] blocks) are copied raw into the stages."""
    src = arch_model("qwen3moe", "q8_0")
    ref, got = _run_whole_and_chained(src, _stage_paths(src, CUTS[3]))
    np.testing.assert_array_equal(got, ref)


def _plain(name):
    return dataclasses.replace(SPLIT_RULES[VARIANTS[name].arch], swa_period=0, dense_lead=False,
                               first_stage_keys=(), metadata=None)


@pytest.mark.parametrize("name", ["gemma2", "gemma3", "olmo2", "gpt-oss", "granite", "deepseek2"])
def test_each_rule_is_needed(arch_model, name, tmp_path, monkeypatch):
    """The synthetic models exercise their rules: stages renumbered without the rule compute another model (or
    do not load), so the matrix above would catch a rule that went missing."""
    src = arch_model(name)
    monkeypatch.setitem(SPLIT_RULES, VARIANTS[name].arch, _plain(name))
    paths = _stage_paths(src, CUTS[2], lambda s, a, b, v: write_stage_file(s, tmp_path / f"{a}-{b}.gguf", a, b, v)
                         or tmp_path / f"{a}-{b}.gguf")
    try:
        ref, got = _run_whole_and_chained(src, paths)
    except RuntimeError as e:
        assert "could not load" in str(e)
        return
    assert np.abs(got - ref).max() > 1e-3


def test_a_scalar_window_period_in_the_file_is_honoured(tmp_path):
    """A file may give the window period as a scalar `sliding_window_pattern` (here 3 instead of gemma3's 6):
    llama.cpp then derives the pattern from it, and so must the stage files."""
    src = make_arch_gguf(tmp_path / "g3-p3.gguf", "gemma3", keys={"attention.sliding_window_pattern": 3})
    for cuts in CUTS.values():
        ref, got = _run_whole_and_chained(src, _stage_paths(src, cuts))
        np.testing.assert_array_equal(got, ref)


def test_gemma2_hidden_state_input_is_not_rescaled(arch_model, monkeypatch):
    """gemma2's graph multiplies every input by sqrt(n_embd); without the engine's fix a middle stage would
    scale the hidden states a second time."""
    src = arch_model("gemma2")
    monkeypatch.setattr(stage_mod, "SCALES_EVERY_INPUT", {})
    ref, got = _run_whole_and_chained(src, _stage_paths(src, CUTS[2]))
    assert np.abs(got - ref).max() > 1e-3


def test_stage_files_drop_the_prediction_blocks(arch_model):
    """The synthetic deepseek2's multi-token-prediction block (blk.6) is not a layer to split: read_info counts
    the trunk only and the last stage holds layers 3..5 alone."""
    import gguf
    src = arch_model("deepseek2")
    assert read_info(src).n_layer == 6
    r = gguf.GGUFReader(str(ensure_stage_file(src, 3, 6, with_vocab=True)))
    assert {int(t.name.split(".")[1]) for t in r.tensors if t.name.startswith("blk.")} == {0, 1, 2}
    assert "deepseek2.nextn_predict_layers" not in r.fields


@pytest.mark.parametrize("arch,rule", [("glm4", "M-RoPE"), ("glm4moe", "M-RoPE"), ("llama4", "NoPE")])
def test_refused_architectures_name_the_rule(arch, rule):
    stagefile.check_splittable(stagefile.ModelInfo(arch, 40, 64, 10), 1)  # whole model: fine
    with pytest.raises(stagefile.StageFileError, match=f"cannot be split.*{rule}"):
        stagefile.check_splittable(stagefile.ModelInfo(arch, 40, 64, 10), 2)


@pytest.mark.mpi
def test_generate_on_two_ranks_refuses_glm4_in_one_line(tmp_path):
    """A glm4 file on 2 ranks: one line naming the rule, non-zero exit, before llama.cpp sees the file."""
    import gguf
    from helpers import cli
    path = tmp_path / "glm4.gguf"
    w = gguf.GGUFWriter(str(path), "glm4")
    w.add_block_count(4)
    w.add_embedding_length(8)
    w.add_tensor("token_embd.weight", np.zeros((4, 8), np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    p = cli(["generate", "-m", str(path), "-p", "hi", "-n", "4"], n=2, timeout=60)
    assert p.returncode != 0
    assert "cannot be split into stages" in p.stderr and "M-RoPE" in p.stderr
    assert "Traceback" not in p.stderr


def test_deepseek2_refuses_a_stage_llama_cpp_would_read_as_lite(tmp_path):
    fields = {"deepseek2.block_count": 61, "deepseek2.attention.q_lora_rank": 1536, "deepseek2.vocab_size": 129280}
    with pytest.raises(stagefile.StageFileError, match="DeepSeek-V2-Lite"):
        stagefile._deepseek2_metadata(fields, 0, 27, False)
    out = stagefile._deepseek2_metadata(fields, 0, 30, False)
    assert out["deepseek2.attention.q_lora_rank"][0] == 1536 and out["deepseek2.expert_gating_func"][0] == 1


# ------------------------------------------------------------------ the real pipeline on several ranks
@pytest.mark.mpi
@pytest.mark.parametrize("name", sorted(VARIANTS))
def test_greedy_generation_on_two_ranks_equals_one_process(arch_model, name):
    """Every architecture through the head's token embedder and two stage ranks: the MoE forms, and those
    whose first stage needs care (gemma2's input scaling inside the graph, granite's embedding_scale)."""
    src = arch_model(name)
    out = mpirun(2, {"model": str(src), "prompt": PROMPT, "n": 24})
    assert out["tokens"] == reference_greedy(src, PROMPT, 24)
    assert out["ranges"] == [[0, 3], [3, 6]]


@pytest.mark.mpi
def test_quantized_moe_pipeinfer_on_three_ranks_is_exact(arch_model):
    """PipeInfer through a 3-stage q8_0 qwen3moe, drafted by its f32 twin: speculative runs of several tokens,
    accepted and rejected, each stage's exact batch limit probed on its own experts."""
    src = arch_model("qwen3moe", "q8_0")
    out = mpirun(3, {"model": str(src), "prompt": PROMPT, "n": 48, "mode": "pipeinfer",
                     "draft": str(arch_model("qwen3moe"))})
    assert out["tokens"] == reference_greedy(src, PROMPT, 48)
    s = out["stats"]
    assert s["n_spec_runs"] > 0 and s["n_draft_accepted"] > 0 and len(s["exact_batch"]) == 3
    for st in s["stage_stats"]:  # sequence 0 holds exactly the committed tokens on every stage
        assert st["kv"] == [[0, 0, s["n_kv0"] - 1]], st


# ------------------------------------------------------------------ MoE in the twin: a layer costs its active experts
def test_a_moe_layer_costs_its_active_experts(arch_model):
    """weight_bytes counts k of n experts of each routed-expert tensor, every other block tensor whole."""
    import gguf
    from pipeinfer.twin.profile import weight_bytes
    src = arch_model("qwen3moe")
    r = gguf.GGUFReader(str(src))
    experts = sum(int(t.n_bytes) for t in r.tensors if t.name.endswith("_exps.weight"))
    rest = sum(int(t.n_bytes) for t in r.tensors if t.name.startswith("blk.") and not t.name.endswith("_exps.weight"))
    per_layer, out = weight_bytes(src)
    assert per_layer == pytest.approx((rest + experts * 2 / 4) / 6)
    assert out == next(int(t.n_bytes) for t in r.tensors if t.name == "output.weight")
    dense_per_layer, _ = weight_bytes(arch_model("qwen3"))
    assert per_layer < (rest + experts) / 6 and dense_per_layer > 0


def test_qwen3_30b_a3b_shape_has_its_published_sizes():
    """48 layers of 623M parameters (57M active) plus 2 x 151936 x 2048 embeddings: 30.5B, 3.3B active (29.9B
    without the embeddings), as Qwen's model card gives them."""
    from pipeinfer.twin.cluster import moe_params_per_layer
    total, active = moe_params_per_layer(2048, 32, 4, 128, 128, 8, 768)
    embeddings = 2 * 151936 * 2048
    assert round((48 * total + embeddings) / 1e9, 1) == 30.5 and round(48 * total / 1e9, 1) == 29.9
    assert 3.3 <= (48 * active + embeddings) / 1e9 < 3.4
