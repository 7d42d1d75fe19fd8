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
# Where an architecture lets a stage hold only some ranges (stagefile refuses the others), its own cuts: llama4's
# 12 layers in stages of 4 or more that start at multiples of 4 (no RoPE where (il + 1) % 4 == 0, no key for it).
ARCH_CUTS = {"llama4": {2: (8,), 3: (4, 8)},
             "smollm3": {2: (8,), 3: (4, 8)}, "afmoe": {2: (8,), 3: (4, 8)}}  # the same rule, 12 layers each
# hybrids: every stage holds an attention layer and a recurrent one (core/recurrent.py), so no 1-layer stage
ARCH_CUTS |= {"lfm2": {2: (3,), 3: (2, 4)}, "granitehybrid": {2: (3,), 3: (2, 4)},
              "qwen3next": {2: (3,), 3: (2, 4)}, "qwen35": {2: (3,), 3: (2, 4)},  # 3: a stage starting at an
              "qwen35moe": {2: (3,), 3: (2, 4)}}                                   # attention layer

# ... and where a rule is needed only off those cuts: llama4 split at 6 (starts a stage at a multiple of the expert
# step but not of 4) moves layer 7's and 11's NoPE
RULE_CUTS = {"llama4": (6,)}


def _cuts(name, n_stages):
    return ARCH_CUTS.get(name, CUTS)[n_stages]
N_STEPS = 12


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
    ref, got = _run_whole_and_chained(src, _stage_paths(src, _cuts(name, n_stages)))
    assert ref.shape == (len(PROMPT) + N_STEPS, 256)
    np.testing.assert_array_equal(got, ref)


def test_quantized_experts_split_exactly(arch_model):
    """q8_0 expert tensors ([n_expert, n_ff, n_embd] blocks) are copied raw into the stages."""
    src = arch_model("qwen3moe", "q8_0")
    ref, got = _run_whole_and_chained(src, _stage_paths(src, CUTS[3]))
    np.testing.assert_array_equal(got, ref)


def _plain(name):
    return dataclasses.replace(SPLIT_RULES[VARIANTS[name].arch], swa_period=0, dense_lead=False,
                               first_stage_keys=(), metadata=None, per_layer_keys=())


@pytest.mark.parametrize("name", ["gemma2", "gemma3", "olmo2", "gpt-oss", "granite", "deepseek2",
                                  "cohere2", "granitemoe", "grok", "dots1", "bailingmoe2", "ernie4_5-moe", "apertus",
                                  "glm4moe", "llama4", "deepseek32", "mistral4", "smollm3", "afmoe",
                                  "granitehybrid", "qwen3next", "qwen35", "qwen35moe"])
def test_each_rule_is_needed(arch_model, name, tmp_path, monkeypatch):
    """The synthetic models exercise their rules: stages renumbered without the rule compute another model (or
    do not load), so the matrix above would catch a rule that went missing."""
    src = arch_model(name)
    monkeypatch.setitem(SPLIT_RULES, VARIANTS[name].arch, _plain(name))
    _assert_stages_differ(src, RULE_CUTS.get(name, CUTS[2]), tmp_path)


def _assert_stages_differ(src, cuts, tmp_path):
    """The stages of src cut at `cuts`, written as they are (the rule under test taken out by the caller), compute
    another model than the whole file, or do not load."""
    paths = _stage_paths(src, cuts, lambda s, a, b, v: write_stage_file(s, tmp_path / f"{a}-{b}.gguf", a, b, v)
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


@pytest.mark.parametrize("name", ["gemma2", "gemma", "afmoe"])
def test_gemma2_hidden_state_input_is_not_rescaled(arch_model, monkeypatch, name):
    """gemma2's (and gemma's, afmoe's) graph multiplies every input by sqrt(n_embd); without the engine's fix a
    middle stage would scale the hidden states a second time."""
    src = arch_model(name)
    monkeypatch.setattr(stage_mod, "SCALES_EVERY_INPUT", {})
    ref, got = _run_whole_and_chained(src, _stage_paths(src, _cuts(name, 2)))
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


@pytest.mark.parametrize("arch,rule", [("gemma3n", "n_altup streams")])
def test_refused_architectures_name_the_rule(arch, rule):
    stagefile.check_splittable(stagefile.ModelInfo(arch, 40, 64, 10), 1)  # whole model: fine
    with pytest.raises(stagefile.StageFileError, match=f"cannot be split.*{rule}"):
        stagefile.check_splittable(stagefile.ModelInfo(arch, 40, 64, 10), 2)


@pytest.mark.mpi
def test_generate_on_two_ranks_refuses_an_architecture_in_one_line(tmp_path):
    """A refused architecture's file on 2 ranks: one line naming the rule, non-zero exit, before llama.cpp sees the
    file."""
    import gguf
    from helpers import cli
    arch = sorted(stagefile.NOT_SPLITTABLE)[0]
    path = tmp_path / f"{arch}.gguf"
    w = gguf.GGUFWriter(str(path), arch)
    w.add_block_count(4)
    w.add_embedding_length(8)
    w.add_tensor("token_embd.weight", np.zeros((4, 8), np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    p = cli(["generate", "-m", str(path), "-p", "hi", "-n", "4"], n=2, timeout=60)
    assert p.returncode != 0
    assert "cannot be split into stages" in p.stderr and stagefile.NOT_SPLITTABLE[arch][:40] in p.stderr
    assert "Traceback" not in p.stderr


def test_deepseek2_refuses_a_stage_llama_cpp_would_read_as_lite(tmp_path):
    fields = {"deepseek2.block_count": 61, "deepseek2.attention.q_lora_rank": 1536, "deepseek2.vocab_size": 129280}
    with pytest.raises(stagefile.StageFileError, match="DeepSeek-V2-Lite"):
        stagefile._deepseek2_metadata(fields, 0, 27, False)
    out = stagefile._deepseek2_metadata(fields, 0, 30, False)
    assert out["deepseek2.attention.q_lora_rank"][0] == 1536 and out["deepseek2.expert_gating_func"][0] == 1


# ---- dense and MoE families (issue 55)
def _with_layers(monkeypatch, name, n_layer, layer=None, **keys):
    """VARIANTS[name] with n_layer layers (and another layer builder, more keys) for this test."""
    v = VARIANTS[name]
    monkeypatch.setitem(VARIANTS, name, dataclasses.replace(v, n_layer=n_layer, layer=layer or v.layer,
                                                            keys=v.keys | keys))


def _command_r_plus(r, il, n):
    from synth_arch import HD, KV, H, _cohere
    return _cohere(r, il, n) | {"attn_q_norm.weight": np.ones((H, HD)), "attn_k_norm.weight": np.ones((KV, HD))}


@pytest.mark.parametrize("name", ["exaone4", "command-r"])
def test_a_64_layer_model_is_refused_where_llama_cpp_reads_the_layer_count(tmp_path, monkeypatch, name):
    """llama.cpp turns EXAONE 4.0's windows on (models/exaone4.cpp:4) and reads Command R+'s q/k norms
    (models/command-r.cpp:28) only in a file of 64 layers (or more): the stages of such a model, written without
    the refusal, compute another model or do not load; with it, writing them fails in one line naming the rule."""
    from synth_arch import SWA
    if name == "exaone4":
        _with_layers(monkeypatch, name, 64, **{"attention.sliding_window": SWA})
    else:
        _with_layers(monkeypatch, name, 64, layer=_command_r_plus)
    src = make_arch_gguf(tmp_path / "m.gguf", name)
    with pytest.raises(stagefile.StageFileError, match=f"{name}.*64 layers.*models/{name}.cpp"):
        write_stage_file(src, tmp_path / "s.gguf", 0, 32, False)
    monkeypatch.setitem(SPLIT_RULES, name, _plain(name))
    _assert_stages_differ(src, (32,), tmp_path)


def test_the_other_layer_count_rules_refuse_only_what_llama_cpp_would_misread():
    ok = {"exaone4.block_count": 30}
    assert stagefile._exaone4_metadata(ok, 0, 15, False) == {}
    with pytest.raises(stagefile.StageFileError, match="exaone4"):  # a 64-layer stage of a larger model
        stagefile._exaone4_metadata({"exaone4.block_count": 128}, 0, 64, False)
    assert stagefile._exaone4_metadata({"exaone4.block_count": 64}, 0, 64, True) == {}  # the whole model
    assert stagefile._command_r_metadata({"command-r.block_count": 40}, 20, 40, True) == {}
    # ERNIE 4.5 MoE with experts every 2nd layer: a stage keeps (il + 1) % 2 only from an even start
    fields = {"ernie4_5-moe.block_count": 28, "ernie4_5-moe.interleave_moe_layer_step": 2}
    with pytest.raises(stagefile.StageFileError, match=r"\(il \+ 1\) % 2.*ernie4-5-moe.cpp:64"):
        stagefile._ernie4_5_moe_metadata(fields, 3, 28, True)
    assert stagefile._ernie4_5_moe_metadata(fields, 4, 28, True) == {}


def test_grok_without_an_embedding_scale_key_splits_exactly(tmp_path, monkeypatch):
    """A Grok file without `embedding_scale` gets llama.cpp's default of 78.38 (models/grok.cpp:7), which
    dropping the key from a later stage would not undo: the stage is written 0."""
    v = VARIANTS["grok"]
    monkeypatch.setitem(VARIANTS, "grok", dataclasses.replace(
        v, keys={k: x for k, x in v.keys.items() if k != "embedding_scale"}))
    src = make_arch_gguf(tmp_path / "grok.gguf", "grok")
    for cuts in CUTS.values():
        ref, got = _run_whole_and_chained(src, _stage_paths(src, cuts))
        np.testing.assert_array_equal(got, ref)


# ---- glm4, llama4, deepseek32, mistral4 (issue 55)
GLM_STAGE = """
import sys
import numpy as np
from pipeinfer.core.protocol import Batch, kv_ops
from pipeinfer.engine import stage
from pipeinfer.engine.stage import StageEngine
stage.TOKEN_INPUT_ONLY = {}
with StageEngine(sys.argv[1], n_ctx=64, n_batch=8, n_seq_max=1, n_threads=1, n_threads_batch=1,
                 embd_input=True, capture_hidden=True) as eng:
    eng.decode(Batch(np.zeros(2, np.int32), np.arange(2, dtype=np.int32), [[0]] * 2, np.ones(2, np.int32), kv_ops()),
               np.ones((2, eng.n_embd), np.float32))
print("decoded")
"""


@pytest.mark.parametrize("name", ["glm4", "glm4moe"])
def test_glm4_takes_hidden_states_only_over_token_rows(arch_model, name):
    """Without the engine's token-row input (stage.TOKEN_INPUT_ONLY) a glm4/glm4moe stage fed hidden states aborts
    in llama.cpp (models/glm4.cpp:84, glm4-moe.cpp:307): the chained stages above decode only through it."""
    import subprocess
    import sys
    path = ensure_stage_file(arch_model(name), 3, 6, with_vocab=True)
    p = subprocess.run([sys.executable, "-c", GLM_STAGE, str(path)], capture_output=True, text=True, timeout=120)
    assert p.returncode != 0 and "decoded" not in p.stdout
    assert "This GGUF does not support multimodal" in p.stderr


QWEN35_CHAIN = """
import sys
import numpy as np
sys.path.insert(0, sys.argv[2])
from pipeinfer.engine import stage
stage.TOKEN_INPUT_ONLY = {}
import test_architectures as t
try:
    ref, got = t._run_whole_and_chained(sys.argv[1], t._stage_paths(sys.argv[1], (3,)))
except RuntimeError as e:
    print("failed:", e)
else:
    print("max difference:", float(np.abs(got - ref).max()))
"""


@pytest.mark.parametrize("name", ["qwen35", "qwen35moe"])
def test_qwen35_takes_hidden_states_only_over_token_rows(arch_model, name):
    """Qwen3.5's M-RoPE takes 4 positions a token of hidden-state input (llama-batch.cpp:98) where token input
    gives 1: without the engine's token-row input (stage.TOKEN_INPUT_ONLY) the chained stages compute another model
    or fail (in a process of its own: llama.cpp reads positions the batch does not have)."""
    import subprocess
    import sys
    from helpers import ROOT
    p = subprocess.run([sys.executable, "-c", QWEN35_CHAIN, str(arch_model(name)), str(ROOT / "tests")],
                       capture_output=True, text=True, timeout=120)
    diff = [float(x.split(":")[1]) for x in p.stdout.splitlines() if x.startswith("max difference:")]
    assert p.returncode != 0 or "failed:" in p.stdout or (diff and diff[0] > 1e-3), (p.stdout, p.stderr[-2000:])


def test_llama4_stages_start_at_multiples_of_4_and_of_the_expert_step():
    """Llama 4 Maverick's shape (48 layers, experts every 2nd): a stage must hold a layer without RoPE
    ((il + 1) % 4 == 0) where the whole model has it, and start where the expert step does; the refusal names the
    line of llama.cpp."""
    fields = {"llama4.block_count": 48, "llama4.interleave_moe_layer_step": 2}
    check = stagefile.RangeCheck("llama4", 48, fields)
    assert all(check.refusal(a, b) is None for a, b in [(0, 48), (0, 24), (24, 48), (0, 4), (44, 48), (8, 20)])
    for a, b in [(2, 24), (22, 48), (46, 48), (40, 43)]:
        assert "models/llama4.cpp:143" in check.refusal(a, b)
    step8 = stagefile.RangeCheck("llama4", 48, fields | {"llama4.interleave_moe_layer_step": 8})
    assert "models/llama4.cpp:62" in step8.refusal(4, 48) and step8.refusal(8, 48) is None
    no_chunks = stagefile.RangeCheck("llama4", 48, fields | {"llama4.attention.sliding_window": 0})
    assert "models/llama4.cpp:11" in no_chunks.refusal(0, 24) and no_chunks.refusal(0, 48) is None


def test_the_balanced_split_keeps_to_llama4s_rule(arch_model):
    """--layer-split balanced picks the most even split among those llama.cpp reads right: the synthetic llama4's
    12 layers go [0, 8) [8, 12) on 2 ranks (unconstrained: [0, 6) [6, 12), refused)."""
    from pipeinfer.core.topology import plan_layers
    src = arch_model("llama4")
    check = stagefile.range_check(src)
    costs = stagefile.layer_costs(src)
    for n_ranks, cuts in [(2, (8,)), (3, (4, 8))]:
        ranges = plan_layers(None, 12, n_ranks, *costs, allowed=lambda a, b: check.refusal(a, b) is None)
        assert [r.start for r in ranges[1:]] == list(cuts) == list(_cuts("llama4", n_ranks))
    assert [r.start for r in plan_layers(None, 12, 2, *costs)] == [0, 6] and check.refusal(6, 12)


def test_mistral4_reads_the_lite_rule_under_its_own_keys():
    fields = {"mistral4.block_count": 36, "mistral4.attention.q_lora_rank": 1024, "mistral4.vocab_size": 131072}
    with pytest.raises(stagefile.StageFileError, match="mistral4: .*DeepSeek-V2-Lite"):
        SPLIT_RULES["mistral4"].metadata(fields, 0, 27, False)
    out = SPLIT_RULES["mistral4"].metadata(fields, 0, 18, False)
    assert out["mistral4.attention.q_lora_rank"][0] == 1024 and out["mistral4.expert_gating_func"][0] == 1


@pytest.mark.mpi
def test_a_llama4_split_off_its_rule_is_refused_in_one_line(tmp_path, monkeypatch):
    """--layer-split 0.5,0.5 puts llama4's layers 6-11 in a stage: refused on every rank before any stage file is
    written, in one line naming llama.cpp's line, non-zero exit; the same command on 1 rank generates."""
    import synth_arch
    from helpers import PROMPT_TEXT, cli
    monkeypatch.setattr(synth_arch, "V", 512)  # a vocabulary with byte fallback: the CLI tokenizes any text
    monkeypatch.setitem(VARIANTS, "llama4", dataclasses.replace(VARIANTS["llama4"], tied=True))  # no codebook
    src = make_arch_gguf(tmp_path / "llama4.gguf", "llama4")
    args = ["generate", "-m", str(src), "-p", PROMPT_TEXT, "--no-chat", "-n", "4"]
    p = cli(args + ["--layer-split", "0.5,0.5"], n=2, timeout=120)
    assert p.returncode != 0 and "Traceback" not in p.stderr
    lines = [line for line in p.stderr.splitlines() if "models/llama4.cpp:143" in line]
    assert len(lines) == 1 and "layers 6-11 do not" in lines[0], p.stderr
    one = cli(args, timeout=120)
    assert one.returncode == 0 and one.stdout.strip(), one.stderr[-2000:]


@pytest.mark.mpi
@pytest.mark.parametrize("name", ["glm4moe", "llama4", "deepseek32"])
def test_pipeinfer_on_three_ranks_is_exact_through_the_rules(arch_model, name):
    """PipeInfer on 3 ranks, q8_0 target drafted by its f32 copy: glm4moe's stages take hidden states over token
    rows, llama4's balanced split keeps to its rule ([0, 4) [4, 8) [8, 12)), deepseek32's indexer cache follows the
    runs' sequence copies and removals; the target's tokens exactly, nothing but sequence 0 left in any cache."""
    src = arch_model(name, "q8_0")
    out = mpirun(3, {"model": str(src), "prompt": PROMPT, "n": 48, "mode": "pipeinfer", "draft": str(arch_model(name))})
    assert out["tokens"] == reference_greedy(src, PROMPT, 48)
    s = out["stats"]
    assert s["n_spec_runs"] > 0 and s["n_draft_accepted"] > 0
    assert all(st["kv"] == [[0, 0, s["n_kv0"] - 1]] for st in s["stage_stats"])
    if name == "llama4":
        assert [start for start, _ in out["ranges"]] == [0, *_cuts(name, 3)]


# ------------------------------------------------------------------ the real pipeline on several ranks
@pytest.mark.mpi
@pytest.mark.parametrize("name", sorted(VARIANTS))
def test_greedy_generation_on_two_ranks_equals_one_process(arch_model, name):
    """Every architecture through the head's token embedder and two stage ranks: the MoE forms, and those
    whose first stage needs care (gemma2's input scaling inside the graph, granite's embedding_scale)."""
    src = arch_model(name)
    out = mpirun(2, {"model": str(src), "prompt": PROMPT, "n": 24})
    assert out["tokens"] == reference_greedy(src, PROMPT, 24)
    cut, n_layer = _cuts(name, 2)[0], VARIANTS[name].n_layer  # the balanced split keeps to llama4's rule too
    assert out["ranges"] == [[0, cut], [cut, n_layer]]


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
