"""Tensor groups (engine/slices.py, engine/group_sums.py, ranks/group.py): how layers are cut, that the slices' partial
sums add up to the whole model, and under mpiexec, groups as pipeline stages in every mode."""
import threading

import numpy as np
import pytest

from helpers import PROMPT, mpirun
from synth import reference_greedy
from pipeinfer.core.topology import Groups, SplitError, group_sizes
from pipeinfer.engine import slices
from pipeinfer.engine.group_sums import add_in_order
from pipeinfer.engine.slices import Slice, SliceError, column_slices, cut, head_slices

FAMILIES = ["llama", "llama-moe", "qwen2"]  # dense, MoE (Mixtral-style), biased QKV with NeoX RoPE (as seed_oss)


# ------------------------------------------------------------------ how a layer is cut
def test_cut_follows_the_shares_and_covers_every_unit():
    assert cut(10, (1, 1)) == [(0, 5), (5, 10)]
    assert cut(35, (1, 1)) == [(0, 18), (18, 35)]  # Qwen2.5-1.5B's ffn_down: 35 blocks of 256
    assert cut(12, (3, 1)) == [(0, 9), (9, 12)]
    assert cut(4, (100, 1, 1)) == [(0, 2), (2, 3), (3, 4)]  # at least one unit each
    with pytest.raises(SliceError):
        cut(2, (1, 1, 1))


def test_heads_go_by_kv_groups_and_are_shared_past_the_kv_heads():
    # Qwen2.5-1.5B: 12 query heads over 2 KV heads
    assert head_slices(12, 2, (1, 1)) == [slices.Heads(0, 6, 0, 1), slices.Heads(6, 12, 1, 2)]
    # a group of 4 holds each KV head twice and splits its 6 query heads 3 and 3
    assert [(h.q0, h.q1, h.kv0) for h in head_slices(12, 2, (1,) * 4)] == [(0, 3, 0), (3, 6, 0), (6, 9, 1), (9, 12, 1)]
    with pytest.raises(SliceError, match="group of 3"):
        head_slices(12, 2, (1, 1, 1))


def test_columns_are_cut_on_block_boundaries():
    assert column_slices(8960, 256, (1, 1)) == [(0, 4608), (4608, 8960)]
    with pytest.raises(SliceError, match="whole blocks"):
        column_slices(100, 32, (1, 1))


def test_partial_sums_add_in_member_order():
    parts = np.array([[1e8, 1.0], [-1e8, 1.0], [1.0, 1.0]], dtype=np.float32)
    assert add_in_order(parts).tolist() == [1.0, 3.0]  # ((p0 + p1) + p2): not p0 + (p1 + p2), which loses the 1


def test_the_best_of_each_slice_is_the_arg_max_of_the_whole_row():
    from pipeinfer.core.verify import pick_best, row_best
    r = np.random.default_rng(0)
    logits = r.standard_normal((6, 20)).astype(np.float32)
    logits[1, [3, 15]] = 9.0  # a tie across slices: the first wins, as np.argmax
    logits[2, [12, 13]] = 9.0  # inside one slice
    cuts = [(0, 7), (7, 14), (14, 20)]
    bests = [row_best(logits[:, a:b]) for a, b in cuts]
    assert pick_best(bests, [a for a, _ in cuts]).tolist() == np.argmax(logits, axis=1).tolist()


def test_only_greedy_rows_without_rules_or_logprobs_take_the_best_only():
    from pipeinfer.core.sampling import SamplingParams, one_sampling
    from pipeinfer.core.verify import greedy_only
    assert greedy_only(one_sampling(SamplingParams()), None, 3)
    assert not greedy_only(one_sampling(SamplingParams(0.7, 0, 1.0, 1)), None, 3)
    assert not greedy_only(one_sampling(SamplingParams()), object(), 3)


def test_group_sizes_and_leaders():
    from pipeinfer.core.topology import stage_group_sizes
    assert stage_group_sizes("2,2", 1, 2) == [2, 2]  # the report's and the banner's: 2 stages of 2 ranks, 4 in all
    assert stage_group_sizes(None, 2, 1) == [2] and stage_group_sizes(None, 1, 3) == [1, 1, 1]
    assert group_sizes(None, 2, 4) == [2, 2]
    assert group_sizes("2,1,1", 1, 4) == [2, 1, 1]
    assert group_sizes(None, 1, 3) == [1, 1, 1]
    g = Groups((2, 1, 1))
    assert g.leaders == [0, 2, 3] and g.members(0) == [0, 1] and g.stage_of(1) == 0 and g.stage_of(3) == 2
    assert g.describe() == "{0,1} | {2} | {3}"
    for text, tp, n, why in [("2,2", 1, 3, "adds up to 4"), (None, 3, 4, "does not divide"), ("2,x", 1, 3, "sizes")]:
        with pytest.raises(SplitError, match=why):
            group_sizes(text, tp, n)


def test_a_re_formed_job_keeps_each_groups_members_left():
    from pipeinfer.core.config import Config, StageOptions
    tp = Config(model="m.gguf", stage=StageOptions(tensor_parallel=2))
    assert tp.for_places([0, 1, 2, 3], 4).stage.groups == "2,2"
    assert tp.for_places([0, 2, 3], 4).stage.groups == "1,2"  # rank 1 lost: its group's leader goes on alone
    assert Config(model="m.gguf", stage=StageOptions(groups="2,1,1")).for_places([0, 1, 3], 4).stage.groups == "2,1"


def test_hostfile_groups_become_the_groups_option():
    from pipeinfer.wire.launcher import host_settings, parse_hostfile_text
    hosts = parse_hostfile_text("a # pipeinfer: group=x\nb # pipeinfer: group=x\nc\nd # pipeinfer: group=x\n")
    assert host_settings(hosts, 4)["groups"] == "2,1,1"  # one name on hosts apart: groups apart
    assert "groups" not in host_settings(hosts, 4, given={"tensor_parallel"})
    assert "groups" not in host_settings(parse_hostfile_text("a\nb\n"), 2)


def test_a_recurrent_family_is_refused_in_one_line(arch_model, tmp_path):
    for name in ("qwen3next", "lfm2"):
        with pytest.raises(SliceError) as e:
            slices.write_slice_file(arch_model(name), tmp_path / "s.gguf", 0, 6, True, Slice(0, (1, 1)))
        assert "\n" not in str(e.value) and "state" in str(e.value), e.value


# ------------------------------------------------------------------ the slices add up to the whole model
def _group_logits(paths: list, embd: np.ndarray, n_threads: int = 1) -> np.ndarray:
    """Every slice decoded in a thread of its own (llama_decode lets go of the GIL), their partial sums added through a
    barrier as MPI's all-gather would; the whole vocabulary's logits (the slices' rows side by side)."""
    from pipeinfer.core.protocol import Batch
    from pipeinfer.engine.group_sums import PartialSums
    from pipeinfer.engine.stage import StageEngine
    g = len(paths)
    board, done = [None] * g, threading.Barrier(g)

    def exchange_for(i):
        def exchange(mine):
            board[i] = mine.copy()
            done.wait()
            every = np.stack(board)
            done.wait()
            return every
        return exchange
    engines = [StageEngine(p, n_ctx=64, n_batch=16, n_seq_max=2, n_threads=n_threads, n_threads_batch=n_threads,
                           embd_input=True, capture_hidden=False, sums=PartialSums(exchange_for(i)))
               for i, p in enumerate(paths)]
    out = [None] * g
    batch = Batch.chain(np.arange(len(embd), dtype=np.int32), 0)

    def run(i):
        engines[i].sums.begin()
        out[i] = engines[i].decode(batch, embd)
    threads = [threading.Thread(target=run, args=(i,)) for i in range(g)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for e in engines:
        e.close()
    return np.concatenate(out, axis=1)


@pytest.mark.parametrize("name", FAMILIES)
@pytest.mark.parametrize("shares", [(1.0, 1.0), (3.0, 1.0)])
def test_slices_add_up_to_the_whole_model(arch_model, tmp_path, name, shares):
    from pipeinfer.engine.stage import StageEngine, TokenEmbedder
    from pipeinfer.core.protocol import Batch
    src = arch_model(name)
    tokens = np.array(PROMPT, dtype=np.int32)
    embd = TokenEmbedder(src)(tokens)
    with StageEngine(src, n_ctx=64, n_batch=16, n_seq_max=2, n_threads=1, n_threads_batch=1, embd_input=True,
                     capture_hidden=False) as whole:
        want = whole.decode(Batch.chain(tokens, 0), embd)
    paths = [slices.ensure_slice_file(src, 0, 6, True, Slice(i, shares)) for i in range(len(shares))]
    got = _group_logits(paths, embd)
    assert got.shape == want.shape
    assert np.abs(got - want).max() < 1e-3 * np.abs(want).max(), np.abs(got - want).max()
    assert (got.argmax(1) == want.argmax(1)).all()


def test_a_qwen2_group_of_one_is_the_model_bit_for_bit(arch_model):
    """A qwen2 slice is written as seed_oss, whose graph is qwen2's operation for operation: the whole model in one
    slice gives the model's own logits, bit for bit (written as llama, with its q/k rows reordered for llama's RoPE
    pairs, one process agreed on 98.2% of the real story prompt's tokens: slices.py)."""
    from pipeinfer.core.protocol import Batch
    from pipeinfer.engine.stage import StageEngine, TokenEmbedder
    src = arch_model("qwen2")
    tokens = np.array(PROMPT, dtype=np.int32)
    embd = TokenEmbedder(src)(tokens)
    with StageEngine(src, n_ctx=64, n_batch=16, n_seq_max=2, n_threads=1, n_threads_batch=1, embd_input=True,
                     capture_hidden=False) as whole:
        want = whole.decode(Batch.chain(tokens, 0), embd)
    got = _group_logits([slices.ensure_slice_file(src, 0, 6, True, Slice(0, (1.0,)))], embd)
    assert np.array_equal(got, want)


def test_a_slice_holds_its_share_of_each_layer(arch_model):
    from pipeinfer.engine.ggufheader import read_header
    src = arch_model("qwen2")
    whole = read_header(src).tensors
    parts = [read_header(slices.ensure_slice_file(src, 2, 5, False, Slice(i, (1, 1)))) for i in range(2)]
    for p in parts:
        f = p.fields
        assert f["general.architecture"] == "seed_oss" and "blk.0.post_attention_norm.weight" in p.tensors
        assert f["seed_oss.block_count"] == 3 and f["seed_oss.attention.head_count"] == 2
        assert f["seed_oss.attention.head_count_kv"] == 1 and f["seed_oss.feed_forward_length"] == 64
    for suffix in ("attn_q.weight", "attn_k.bias", "ffn_up.weight", "ffn_down.weight", "attn_output.weight"):
        shapes = [p.tensors[f"blk.0.{suffix}"].shape for p in parts]
        full = whole[f"blk.2.{suffix}"].shape
        axis = 0 if suffix.startswith(("ffn_down", "attn_output")) else len(full) - 1
        assert sum(s[axis] for s in shapes) == full[axis], (suffix, shapes, full)


# ------------------------------------------------------------------ groups as pipeline stages, under mpiexec
@pytest.mark.mpi
@pytest.mark.parametrize("name", FAMILIES)
def test_two_groups_of_two_are_exact_in_every_mode(arch_model, name):
    """4 ranks: two stages, each a group of 2, of the q8_0 model (q8_0 blocks of 32 values: whole heads, whole blocks of
    the feed-forward and of each expert). Iterative equals one process (clear margins); speculative and PipeInfer,
    drafted by the f32 copy (PipeInfer also with token trees), equal the group's iterative token for token, every
    cache left holding the answer."""
    src, draft = arch_model(name, "q8_0"), arch_model(name)
    base = {"model": str(src), "prompt": PROMPT, "n": 40, "groups": "2,2"}
    it = mpirun(4, base, timeout=300)
    assert it["tokens"] == reference_greedy(src, PROMPT, 40)
    assert len(it["stats"]["stage_stats"]) == 2  # the pipeline sees two stages: the groups' leaders
    for mode, more in (("speculative", {}), ("pipeinfer", {}), ("pipeinfer", {"max_branches": 2})):  # trees last
        out = mpirun(4, base | {"mode": mode, "draft": str(draft)} | more, timeout=300)
        assert out["tokens"] == it["tokens"], (mode, more)
        s = out["stats"]
        assert s["n_spec_runs"] > 0
        assert all(st["kv"] == [[0, 0, s["n_kv0"] - 1]] for st in s["stage_stats"]), s["stage_stats"]


@pytest.mark.mpi
def test_one_group_of_two_is_one_stage_on_two_ranks(arch_model):
    src = arch_model("qwen2")
    out = mpirun(2, {"model": str(src), "prompt": PROMPT, "n": 24, "tp": 2})
    assert out["tokens"] == reference_greedy(src, PROMPT, 24)
    assert out["ranges"] == [[0, 6]]


@pytest.mark.mpi
def test_a_sampled_group_gathers_the_whole_vocabulary(arch_model):
    """At temperature 0.8 (and with log-probabilities asked) the last group's leader gathers every member's logits:
    PipeInfer draws what iterative draws, and the log-probabilities are the whole vocabulary's."""
    src, draft = arch_model("llama", "q8_0"), arch_model("llama")
    base = {"model": str(src), "prompt": PROMPT, "n": 24, "tp": 2, "temp": 0.8, "seed": 3, "logprobs": 2}
    it = mpirun(2, base)
    pi = mpirun(2, base | {"mode": "pipeinfer", "draft": str(draft)})
    assert pi["tokens"] == it["tokens"] and len(it["logprobs"]) == 24
    assert np.allclose(pi["logprobs"], it["logprobs"]) and all(lp <= 0 for lp in it["logprobs"])


@pytest.mark.mpi
def test_a_group_beside_a_draft_rank(arch_model):
    """3 ranks: a group of 2 and the draft's own rank (--draft-at rank, the world's last): PipeInfer exact."""
    src, draft = arch_model("qwen2", "q8_0"), arch_model("qwen2")
    out = mpirun(3, {"model": str(src), "prompt": PROMPT, "n": 32, "tp": 2, "mode": "pipeinfer", "draft": str(draft),
                     "draft_at": "rank"})
    assert out["tokens"] == reference_greedy(src, PROMPT, 32)
    assert out["ranges"] == [[0, 6]] and out["stats"]["n_spec_runs"] > 0


@pytest.mark.mpi
def test_pipeinfer_on_one_stage_runs_as_iterative_without_a_draft(arch_model):
    """One stage (here one group) returns each run's tokens as it launches it: one stream has no run in flight to
    speculate beside, so PipeInfer runs as iterative and loads no draft (it measured 0.75-0.91x iterative drafting
    in a thread beside the group, with no speculative run ever launched); speculative mode still verifies drafts."""
    src, draft = arch_model("llama", "q8_0"), arch_model("llama")
    base = {"model": str(src), "prompt": PROMPT, "n": 24, "tp": 2, "draft": str(draft)}
    pi = mpirun(2, base | {"mode": "pipeinfer", "draft_at": "thread"})
    assert pi["tokens"] == reference_greedy(src, PROMPT, 24)
    assert pi["stats"]["n_draft_calls"] == 0 and pi["stats"]["n_spec_runs"] == 0
    spec = mpirun(2, base | {"mode": "speculative"})
    assert spec["tokens"] == pi["tokens"] and spec["stats"]["n_spec_runs"] > 0


def test_a_split_gguf_is_sliced_as_its_whole(arch_model, tmp_path):
    """Models past 50 GB ship as split GGUFs (llama.cpp's gguf-split): each member's slice of the set is the slice
    of the same model in one file, logits bit for bit."""
    from gguf_split import ToolUnavailable, split_gguf
    from pipeinfer.engine.stage import TokenEmbedder
    src = arch_model("qwen2", "q8_0")
    try:
        parts = split_gguf(src, tmp_path / "parts" / "q", max_tensors=20)
    except ToolUnavailable as e:
        pytest.skip(str(e))
    assert len(parts) > 1
    embd = TokenEmbedder(src)(np.array(PROMPT, dtype=np.int32))
    whole = _group_logits([slices.ensure_slice_file(src, 0, 6, True, Slice(i, (1, 1))) for i in range(2)], embd)
    split = _group_logits([slices.ensure_slice_file(parts[0], 0, 6, True, Slice(i, (1, 1))) for i in range(2)], embd)
    assert np.array_equal(whole, split)
