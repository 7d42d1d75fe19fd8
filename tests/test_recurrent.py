"""Models with recurrent layers (core/recurrent.py): each drafted token keeps its recurrent state in a sequence of its
own, so a partly accepted run leaves the canonical sequence as if only the accepted tokens had been decoded.

From the pure decisions up: the layout and refusals; the head's loop against toy stages that keep a recurrent state
per sequence with llama.cpp's semantics (and fail the way llama.cpp would compute another model); llama.cpp's own
recurrent memory on the synthetic hybrids (lfm2, granitehybrid); stage ranges; and greedy generation on 2 and 3
ranks in every mode, bit for bit the iterative pipeline's log-probabilities."""
from __future__ import annotations

import dataclasses
import json

import numpy as np
import pytest

from helpers import PROMPT, mpirun
from synth import reference_greedy
from synth_arch import make_arch_gguf
from toy import INF, FakePipeline, KvError, PROMPT as TOY_PROMPT, ToyDrafter, ToyStage, target_alone
from pipeinfer.core.kvplan import PartitionPool, plan_partitions
from pipeinfer.core.protocol import Batch, KvOp, compact, cp, kv_ops, rm
from pipeinfer.core.recurrent import (
    ATTN,
    RECR,
    RecurrentError,
    chain_seq_ids,
    check_recurrent_config,
    check_stage,
    has_recurrent_state,
    layer_kinds,
    main_seq,
    seqs_per_run,
    stage_ok,
    state_seq,
)
from pipeinfer.decide.genconfig import GenConfig
from pipeinfer.decide.scheduler import Request, Scheduler, generate

HYBRIDS = ["lfm2", "granitehybrid", "qwen3next", "qwen35", "qwen35moe"]


# ---------------------------------------------------------------- the pure decisions
def test_nested_chain_layout():
    """Token d of a chain carries seqs[d:]: seqs[d] ends at token d; the last sequence holds the whole chain."""
    seqs = [5, 6, 7, 8]
    assert chain_seq_ids(seqs, 3) == [[5, 6, 7], [6, 7], [7]]
    assert [state_seq(ids, 0) for ids in chain_seq_ids(seqs, 3)] == [5, 6, 7]
    assert state_seq([0, 5, 6, 7], 0) == 5                      # the synchronous mode's lead token: canonical too
    assert main_seq(seqs, 3, nested=True) == 7 and main_seq(seqs, 3, nested=False) == 5
    assert seqs_per_run(True, 1, 4) == 4 and seqs_per_run(False, 2, 4) == 2
    with pytest.raises(ValueError, match="needs 5 sequences"):
        chain_seq_ids(seqs, 5)


def test_what_a_recurrent_target_refuses():
    assert has_recurrent_state("lfm2") and has_recurrent_state("mamba") and not has_recurrent_state("llama")
    check_recurrent_config("lfm2", "pipeinfer", 1, "llama")
    check_recurrent_config("mamba", "iterative", 4, "mamba")    # iterative: anything goes
    check_recurrent_config("llama", "pipeinfer", 4, "qwen2")
    with pytest.raises(RecurrentError, match="--max-branches 2.*chains"):
        check_recurrent_config("granitehybrid", "speculative", 2)
    for target in ("lfm2", "llama"):  # a draft model rolls its own sequence back, whatever the target
        with pytest.raises(RecurrentError, match="draft model.*recurrent"):
            check_recurrent_config(target, "pipeinfer", 1, "granitehybrid")
    with pytest.raises(RecurrentError, match="only recurrent layers.*--mode iterative"):
        check_recurrent_config("mamba2", "speculative", 1)


def test_the_tables_are_llama_cpps():
    """RECURRENT_ARCHS and HYBRID_ARCHS are llama-arch.cpp's llm_arch_is_recurrent and llm_arch_is_hybrid (start-up
    checks each loaded model against them: a stage of a missing hybrid would be planned as attention only), read from
    the vendored source when it is here (launch/bench/bench_peers.py fetches it)."""
    import os
    import re
    from importlib import metadata
    from pathlib import Path
    from pipeinfer.core.recurrent import HYBRID_ARCHS, RECURRENT_ARCHS
    home = Path(os.environ.get("PIPEINFER_CACHE", Path.home() / ".cache" / "pipeinfer")) / "peers"
    path = (home / f"llama_cpp_python-{metadata.version('llama_cpp_python')}" / "vendor" / "llama.cpp" / "src"
            / "llama-arch.cpp")
    if not path.exists():
        pytest.skip(f"no vendored llama.cpp source at {path}")
    src = path.read_text()
    names = dict(re.findall(r'\{\s*(LLM_ARCH_[A-Z0-9_]+),\s*"([^"]+)"\s*\}', src))

    def cases(fn):
        body = src[src.index(f"bool {fn}(const llm_arch & arch)"):]
        return {names[a] for a in re.findall(r"case (LLM_ARCH_[A-Z0-9_]+):", body[:body.index("default:")])}
    assert cases("llm_arch_is_recurrent") == RECURRENT_ARCHS
    assert cases("llm_arch_is_hybrid") == HYBRID_ARCHS


def test_layer_kinds_and_stage_ranges():
    fields = {"lfm2.block_count": 6, "lfm2.attention.head_count_kv": [0, 2, 0, 0, 0, 2]}
    kinds = layer_kinds("lfm2", fields, 6)
    assert kinds == [RECR, ATTN, RECR, RECR, RECR, ATTN]
    assert stage_ok(kinds, 0, 2) and not stage_ok(kinds, 2, 5) and not stage_ok(kinds, 5, 6)
    assert check_stage("lfm2", fields, 0, 6) is None            # the whole model
    assert "no attention layer" in check_stage("lfm2", fields, 2, 5)
    assert "no recurrent layer" in check_stage("lfm2", fields, 5, 6)
    assert "llama-graph.cpp" in check_stage("lfm2", fields, 5, 6)
    assert layer_kinds("llama", fields, 6) is None


def test_qwen3next_layer_kinds_follow_llama_cpps_reading():
    """models/qwen3next.cpp: the per-layer `attention.recurrent_layers` first, else a gated delta net unless
    (il + 1) % full_attention_interval == 0 (4 without the key), the prediction blocks after the trunk attention."""
    fields = {"qwen3next.block_count": 9, "qwen3next.nextn_predict_layers": 1}
    assert layer_kinds("qwen3next", fields, 9) == [RECR, RECR, RECR, ATTN] * 2 + [ATTN]
    fields["qwen3next.full_attention_interval"] = 2
    assert layer_kinds("qwen3next", fields, 8) == [RECR, ATTN] * 4
    fields["qwen3next.attention.recurrent_layers"] = [True, False, False, True, True, True, False, True, False]
    assert layer_kinds("qwen3next", fields, 8) == [RECR, ATTN, ATTN, RECR, RECR, RECR, ATTN, RECR]
    assert "no attention layer" in check_stage("qwen3next", fields, 3, 6)
    assert check_stage("qwen3next", fields, 2, 4) is None


def test_qwen3next_stages_carry_their_layer_kinds(hybrid, tmp_path):
    """A qwen3next stage that starts at an attention layer: the whole model's kinds as its per-layer
    `attention.recurrent_layers` (llama.cpp would take layer 3 for a delta net by the interval)."""
    import gguf
    from pipeinfer.engine.stagefile import write_stage_file
    write_stage_file(hybrid("qwen3next"), tmp_path / "s.gguf", 3, 6, True)
    r = gguf.GGUFReader(str(tmp_path / "s.gguf"))
    assert r.fields["qwen3next.attention.recurrent_layers"].contents() == [False, True, False]
    assert int(r.fields["qwen3next.block_count"].contents()) == 3 and "qwen3next.nextn_predict_layers" not in r.fields


# ---------------------------------------------------------------- the head's loop against recurrent toy stages
class HybridToyStage(ToyStage):
    """A toy stage whose sequences also keep a recurrent state with llama.cpp's semantics
    (llama-memory-recurrent.cpp): one state per sequence, the tokens it has absorbed; seq_cp copies the whole state
    whatever the positions; seq_rm of a part that holds the state's last token fails; a token of several sequences
    advances all of them (they must hold the same state: llama.cpp checks they are coupled). A token whose state is
    not its context is a decode of another model: KvError."""

    def __init__(self, *a, **kw):
        super().__init__(*a, **kw)
        self.state: dict[int, list[int]] = {}

    def apply(self, ops: np.ndarray) -> None:
        rows = np.asarray(ops).reshape(-1, 5).tolist()
        for i, (op, src, dst, p0, p1) in enumerate(rows):
            lo, hi = (p0 if p0 >= 0 else 0), (p1 if p1 >= 0 else INF)
            if op == KvOp.RM:
                if src < 0:
                    self.state.clear()
                elif src in self.state:
                    last = len(self.state[src]) - 1
                    if lo <= last < hi:
                        if lo > 0:
                            raise KvError(f"{self.name}: seq_rm({src}, {p0}, {p1}) of a recurrent state ending at "
                                          f"{last} (llama.cpp refuses it)")
                        del self.state[src]
            elif op == KvOp.CP:
                if src in self.state:
                    self.state[dst] = list(self.state[src])
                else:
                    self.state.pop(dst, None)
            elif op == KvOp.KEEP:
                self.state = {s: v for s, v in self.state.items() if s == src}
            elif op == KvOp.COMPACT:
                keep = {r[1] for r in rows[i:] if r[0] == KvOp.COMPACT}
                self.state = {s: v for s, v in self.state.items() if s in keep}
        super().apply(ops)

    def decode(self, batch: Batch) -> np.ndarray:
        out = super().decode(batch)  # the attention cells (and their checks) first
        for pos, tok, ids in zip(batch.pos.tolist(), batch.tokens.tolist(), batch.seq_ids):
            states = {tuple(self.state.get(s, [])) for s in ids}
            if len(states) != 1:
                raise KvError(f"{self.name}: token at {pos} in sequences {ids} whose states differ")
            before = list(states.pop())
            for s in ids:
                held = self.seq_cells(s)
                context = [held[q].token for q in range(pos)]
                if before != context:
                    raise KvError(f"{self.name}: sequence {s}'s recurrent state holds {before}, its context at {pos} "
                                  f"is {context}")
                self.state[s] = before + [tok]
        return out


def run_hybrid_head(mode: str, *, state_per_token: bool = True, n_predict: int = 40, error_rate: float = 0.3,
                    seed: int = 0, n_max: int = 4, max_in_flight: int = 6, poll_every: int = 3,
                    abort_mid: bool = False, cancel_lag: int = 0):
    """toy.run_head on hybrid toy stages, with partitions of n_max sequences (one per drafted token)."""
    reference = target_alone(TOY_PROMPT, n_predict + 64)
    size = seqs_per_run(state_per_token, 1, n_max)
    n_part, n_seq = plan_partitions(size, max_in_flight)
    pipe = FakePipeline(reference, poll_every=poll_every, abort_mid=abort_mid, cancel_lag=cancel_lag,
                        garbage=n_seq - 1)
    pipe.stages = [HybridToyStage(s.name, s.logits_fn, reference, n_seq - 1) for s in pipe.stages]
    pool = PartitionPool(n_part, size, n_seq)
    cfg = GenConfig(mode=mode, n_predict=n_predict, draft_max=n_max, state_per_token=state_per_token)
    sched = Scheduler(pipe, cfg, n_stages=2, pool=pool, drafter_for=lambda *_: ToyDrafter(error_rate, seed))
    out, stats = generate(sched, Request(list(TOY_PROMPT), n_predict))
    pipe.finish()
    return out, stats, pipe, reference[len(TOY_PROMPT):len(TOY_PROMPT) + n_predict]


@pytest.mark.parametrize("mode, error_rate, abort_mid, cancel_lag, seed", [
    ("speculative", 0.3, False, 0, 1), ("speculative", 0.6, False, 0, 2),
    ("pipeinfer", 0.3, False, 0, 3), ("pipeinfer", 0.3, True, 2, 4), ("pipeinfer", 0.6, True, 0, 5),
    ("pipeinfer", 0.0, False, 0, 6)])
def test_partly_accepted_runs_leave_the_state_of_the_accepted_tokens(mode, error_rate, abort_mid, cancel_lag, seed):
    out, stats, pipe, expected = run_hybrid_head(mode, error_rate=error_rate, abort_mid=abort_mid,
                                                 cancel_lag=cancel_lag, seed=seed)
    assert out == expected
    if error_rate:
        assert 1 in stats.accept_hist and any(1 < n < 5 for n in stats.accept_hist)  # partial acceptances
    for st in pipe.stages:  # sequence 0's state is its cells' tokens; nothing else holds a state but garbage
        n0 = len(st.seq_cells(0))
        assert st.state[0] == [st.seq_cells(0)[p].token for p in range(n0)], st.name
        assert set(st.state) <= {0, pipe.garbage}, st.name


@pytest.mark.parametrize("mode", ["speculative", "pipeinfer"])
def test_a_plain_commit_leaves_the_last_drafted_tokens_state(mode):
    """The negative control: runs in one sequence each (the attention layout) commit the state after their last
    drafted token, and the next decode of the canonical sequence is another model's."""
    with pytest.raises(KvError, match="recurrent state holds"):
        run_hybrid_head(mode, state_per_token=False, error_rate=0.3, seed=3)


# ---------------------------------------------------------------- llama.cpp's recurrent memory, on the synthetic hybrids
@pytest.fixture(scope="module")
def hybrid(tmp_path_factory):
    d, made = tmp_path_factory.mktemp("hybrid"), {}

    def get(name):
        if name not in made:
            made[name] = make_arch_gguf(d / f"{name}.gguf", name)
        return made[name]
    return get


def _engine(path, n_seq_max=8, capture_hidden=False):
    from pipeinfer.engine.stage import StageEngine
    return StageEngine(path, n_ctx=64, n_batch=16, n_seq_max=n_seq_max, n_threads=1, n_threads_batch=1,
                       embd_input=False, capture_hidden=capture_hidden)


DRAFT = [10, 20, 30, 40]


@pytest.mark.parametrize("capture", [False, True])
@pytest.mark.parametrize("name", HYBRIDS)
def test_nested_sequences_hold_each_drafted_tokens_state(hybrid, name, capture):
    """A chain decoded in nested sequences gives every row the bits it gets alone, and committing sequence d gives
    the canonical sequence exactly the state after token d: the next token's output is the one-at-a-time run's. A
    commit of the last sequence instead (what one sequence per run would commit) computes another model."""
    path, n = hybrid(name), len(PROMPT)
    with _engine(path, capture_hidden=capture) as e:
        assert e.recurrent
        alone = [e.decode(Batch.chain(np.array(PROMPT, np.int32), 0))[-1]]
        for k, t in enumerate(DRAFT):
            alone.append(e.decode(Batch.chain(np.array([t], np.int32), n + k))[-1])
    for d in range(len(DRAFT) - 1):
        with _engine(path, capture_hidden=capture) as e:
            e.decode(Batch.chain(np.array(PROMPT, np.int32), 0))
            seqs = [1, 2, 3]
            e.apply_kv_ops(kv_ops(*[cp(0, s, 0, n) for s in seqs]))
            rows = e.decode(Batch(np.array(DRAFT[:3], np.int32), np.arange(n, n + 3, dtype=np.int32),
                                  chain_seq_ids(seqs, 3), np.ones(3, np.int32), kv_ops()))
            np.testing.assert_array_equal(rows, np.stack(alone[1:4]))
            e.apply_kv_ops(kv_ops(cp(seqs[d], 0, n, n + d + 1), *[rm(s) for s in seqs]))
            nxt = e.decode(Batch.chain(np.array([DRAFT[d + 1]], np.int32), n + d + 1))[-1]
            np.testing.assert_array_equal(nxt, alone[d + 2])
    with _engine(path, capture_hidden=capture) as e:  # the negative control: the state after 3 tokens, as after 1
        e.decode(Batch.chain(np.array(PROMPT, np.int32), 0))
        e.apply_kv_ops(kv_ops(cp(0, 1, 0, n)))
        e.decode(Batch(np.array(DRAFT[:3], np.int32), np.arange(n, n + 3, dtype=np.int32), [[1]] * 3,
                       np.ones(3, np.int32), kv_ops()))
        e.apply_kv_ops(kv_ops(cp(1, 0, n, n + 1), rm(1)))
        wrong = e.decode(Batch.chain(np.array([DRAFT[1]], np.int32), n + 1))[-1]
        assert np.abs(wrong - alone[2]).max() > 1e-2


@pytest.mark.parametrize("name", HYBRIDS)
def test_a_run_aborted_mid_decode_is_retired_without_touching_the_canonical_state(hybrid, name):
    """A cancelled run stopped by the abort callback in its second token's ubatch: llama.cpp cannot remove that
    ubatch's positions from a recurrent state (the engine's removal fails and changes nothing), the retire
    (kvplan.commit_ops: cells to the garbage sequence, the partition's tags removed) takes them all, and the
    canonical sequence decodes on as if the run had never been."""
    from pipeinfer.core.kvplan import commit_ops, retire_starts
    from pipeinfer.engine.stage import DecodeAborted
    path, n = hybrid(name), len(PROMPT)
    with _engine(path) as e:
        e.decode(Batch.chain(np.array(PROMPT, np.int32), 0))
        polls = []
        e.should_abort = lambda: polls.append(1) and False
        ref = e.decode(Batch.chain(np.array([DRAFT[0]], np.int32), n))[-1]
        per_ubatch = len(polls)  # the abort callback's polls in a one-token decode
    with _engine(path) as e:
        e.decode(Batch.chain(np.array(PROMPT, np.int32), 0))
        seqs, garbage = [1, 2, 3], 7
        e.apply_kv_ops(kv_ops(*[cp(0, s, 0, n) for s in seqs]))
        polls = []
        e.should_abort = lambda: polls.append(1) or len(polls) > per_ubatch * 3 // 2  # inside the second ubatch
        ids = chain_seq_ids(seqs, 3)
        with pytest.raises(DecodeAborted):
            e.decode(Batch(np.array(DRAFT[:3], np.int32), np.arange(n, n + 3, dtype=np.int32), ids,
                           np.ones(3, np.int32), kv_ops()))
        e.should_abort = None
        starts = retire_starts([(n + d, x) for d, x in enumerate(ids)])
        e.apply_kv_ops(commit_ops(None, n, n, seqs, starts, garbage))
        assert [s for s, _, _ in e.kv_summary()] == [0, garbage]
        np.testing.assert_array_equal(e.decode(Batch.chain(np.array([DRAFT[0]], np.int32), n))[-1], ref)


@pytest.mark.parametrize("name", HYBRIDS)
def test_compaction_keeps_a_hybrids_canonical_state(hybrid, name):
    """COMPACT (kvplan.py) saves and restores the canonical sequence: its attention cells and its recurrent state."""
    path, n = hybrid(name), len(PROMPT)
    with _engine(path) as e:
        e.decode(Batch.chain(np.array(PROMPT, np.int32), 0))
        ref = e.decode(Batch.chain(np.array([DRAFT[0]], np.int32), n))[-1]
    with _engine(path) as e:
        e.decode(Batch.chain(np.array(PROMPT, np.int32), 0))
        e.apply_kv_ops(kv_ops(cp(0, 1, 0, n)))
        e.decode(Batch(np.array([7, 8], np.int32), np.arange(n, n + 2, dtype=np.int32), [[1], [1]],
                       np.ones(2, np.int32), kv_ops()))
        e.apply_kv_ops(kv_ops(cp(1, 7, n), rm(1)))   # the run's cells to the garbage sequence, as a retire does
        e.apply_kv_ops(kv_ops(compact(0)))
        assert e.seq_pos_range(0)[1] == n - 1 and e.seq_pos_range(7) == (-1, -1)
        np.testing.assert_array_equal(e.decode(Batch.chain(np.array([DRAFT[0]], np.int32), n))[-1], ref)
        e.apply_kv_ops(kv_ops(rm(-1)))               # every sequence: llama.cpp's recurrent memory refuses id -1
        assert e.seq_pos_range(0) == (-1, -1)


def test_start_up_measurements_run_on_a_hybrid(hybrid):
    """The exact batch probe (rows of several sequences) and the micro-batch timings (nested, as runs decode) never
    remove part of a recurrent state."""
    from pipeinfer.engine.kernels import probe_exact_batch, time_decodes
    with _engine(hybrid("lfm2")) as e:
        assert probe_exact_batch(e, 4) >= 1
        ms = time_decodes(e, [1, 2, 3], n_fill=8, n_repeat=1)
        assert len(ms) == 3 and all(t > 0 for t in ms)
        assert e.kv_summary() == []


# ---------------------------------------------------------------- stage ranges
@pytest.mark.parametrize("name", HYBRIDS)
def test_a_stage_without_a_layer_of_each_kind_is_refused(hybrid, name, tmp_path):
    """llama.cpp aborts the process decoding a hybrid file without an attention layer or without a recurrent one:
    such a stage file is refused in one line, and the balanced split keeps to stages that hold both."""
    from pipeinfer.core.topology import plan_layers
    from pipeinfer.engine.stagefile import StageFileError, range_check, write_stage_file
    path = hybrid(name)
    with pytest.raises(StageFileError, match=f"{name}: layers \\[0, 1\\) hold no .* llama-graph.cpp"):
        write_stage_file(path, tmp_path / "s.gguf", 0, 1, False)
    check = range_check(path)
    for n_ranks in (2, 3):
        ranges = plan_layers("balanced", 6, n_ranks, allowed=lambda a, b: check.refusal(a, b) is None)
        assert all(check.refusal(r.start, r.end) is None for r in ranges), ranges
    assert check.refusal(0, 3) is None and check.refusal(0, 1) is not None


# ---------------------------------------------------------------- every mode on 2 and 3 ranks, under mpiexec
N_GEN = 40


@pytest.fixture(scope="module")
def references(hybrid, tmp_path_factory):
    """(model, greedy reference, replay reference file) per family: the replay instrument proposes the reference's
    tokens, right with probability 0.7, so runs are accepted whole, in part, or not at all."""
    d, out = tmp_path_factory.mktemp("replay"), {}
    for name in HYBRIDS:
        path = hybrid(name)
        ref = reference_greedy(path, PROMPT, N_GEN + 8)
        (d / f"{name}.json").write_text(json.dumps({"prompt_tokens": PROMPT, "tokens": ref}))
        out[name] = (path, ref[:N_GEN], d / f"{name}.json")
    return out


@pytest.mark.mpi
@pytest.mark.parametrize("n_ranks", [2, 3])
@pytest.mark.parametrize("name", HYBRIDS)
def test_every_mode_on_several_ranks_equals_one_process(references, name, n_ranks):
    """Iterative, speculative and PipeInfer generation of a hybrid split over n_ranks: the greedy tokens of one
    process, and every token's log-probability bit for bit the iterative pipeline's (a recurrent state one token
    off moves them: test_a_plain_commit_leaves...); micro-batches of 3 tokens (fixed), partly accepted and
    cancelled; sequence 0 alone holds cells at the end, the accepted tokens'."""
    path, ref, replay = references[name]
    base = {"model": str(path), "prompt": PROMPT, "n": N_GEN, "logprobs": 1, "drafter": "replay",
            "replay_ref": str(replay), "replay_accuracy": 0.7, "draft_max": 3, "micro_batch": "fixed"}
    runs = {mode: mpirun(n_ranks, base | {"mode": mode}) for mode in ("iterative", "speculative", "pipeinfer")}
    for mode, out in runs.items():
        assert out["tokens"] == ref, mode
        assert out["logprobs"] == runs["iterative"]["logprobs"] and len(out["logprobs"]) == N_GEN, mode
        s = out["stats"]
        assert len(out["ranges"]) == n_ranks
        for st in s["stage_stats"]:  # a hybrid's sequence reports its state's position as its first (llama.cpp)
            assert st["kv"] == [[0, s["n_kv0"] - 1, s["n_kv0"] - 1]], (mode, st)
        if mode != "iterative":
            assert s["n_spec_runs"] > 0 and s["n_draft_accepted"] > 0, mode
            partial = [int(k) for k in s["accept_hist"] if 1 < int(k) < 4]
            assert partial, (mode, s["accept_hist"])  # accepted in part: 1 or 2 of 3 drafted tokens
    assert runs["pipeinfer"]["stats"]["n_cancelled"] > 0


@pytest.mark.mpi
def test_trees_on_a_hybrid_are_refused_in_one_line(references):
    from helpers import cli
    path = references["lfm2"][0]
    p = cli(["generate", "-m", str(path), "-p", "hi", "-n", "4", "--mode", "speculative", "--drafter", "ngram",
             "--max-branches", "2"], n=2, timeout=120)
    assert p.returncode != 0
    assert "--max-branches 2" in p.stderr and "chains" in p.stderr and "Traceback" not in p.stderr


@pytest.mark.mpi
@pytest.mark.parametrize("mode, parallel", [("iterative", 3), ("pipeinfer", 2)])
def test_several_generations_at_once_on_a_hybrid_equal_each_alone(references, mode, parallel):
    """Token prompts through one 2-rank pipeline of a hybrid at once (tests/mpi_parallel.py): each generation in a
    canonical sequence of its own beside the nested partitions (their ids follow the partitions' sequence count),
    compacted together, the prompt cache off even when asked for (recurrent states), every answer one process's."""
    import subprocess
    import sys
    from helpers import MPIEXEC, ROOT
    path, _, replay = references["lfm2"]
    prompts, ns = [PROMPT, [1, 40, 41, 42], [1, 7, 7, 7, 100, 200]], [16, 9, 12]
    cfg = {"model": str(path), "prompts": prompts, "n": ns, "mode": mode, "parallel": parallel,
           "drafter": "replay", "replay_ref": str(replay), "draft_max": 3, "micro_batch": "fixed",
           "cache_prompt": True, "set_by_user": ["cache_prompt"]}
    p = subprocess.run([MPIEXEC, "-n", "2", sys.executable, "-m", "mpi4py", str(ROOT / "tests" / "mpi_parallel.py"),
                        json.dumps(cfg)], capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr[-3000:]
    out = json.loads(next(x for x in p.stdout.splitlines() if x.startswith("RESULT "))[len("RESULT "):])
    assert out["answers"] == [reference_greedy(path, pr, n) for pr, n in zip(prompts, ns)]
    assert out["max_active"] == parallel
    assert "--cache-prompt off" in p.stderr


@pytest.mark.parametrize("name", ["lfm2", "granitehybrid", "qwen3next"])
def test_plan_counts_a_hybrids_state_as_llama_cpp_keeps_it(hybrid, name):
    """twin/machines.target_from_gguf: a sequence's recurrent states (every recurrent layer's) and its KV cells (the
    attention layers' only) are what llama.cpp serializes of that sequence (llama_state_seq_get_size), to a small
    header; and a plan's fit counts the states once per sequence id of the context (context_seqs)."""
    import llama_cpp

    from pipeinfer.twin.machines import RankPlan, context_seqs, fit, machines_from_hosts, target_from_gguf
    from pipeinfer.wire.launcher import parse_hostfile_text
    t = target_from_gguf(hybrid(name))
    assert t.state_bytes_per_seq_layer > 0
    eng = _engine(hybrid(name))
    try:
        eng.decode(Batch.chain(np.array([1, 5, 7], np.int32), 0))
        size = llama_cpp.llama_state_seq_get_size(eng.ctx, 0)
    finally:
        eng.close()
    want = t.n_layer * (t.state_bytes_per_seq_layer + 3 * t.kv_bytes_per_pos_layer)
    assert 0 <= size - want < 512, (size, want)

    n_seq = context_seqs(t, 2)
    assert n_seq == plan_partitions(4, 8)[1] > 8        # nested per-token states: 2 + partitions x draft_max
    hosts = machines_from_hosts(parse_hostfile_text("a # pipeinfer: cores=1 mem=1\nb # pipeinfer: cores=1 mem=1\n"))
    ranks = [RankPlan(0, hosts[0], 1), RankPlan(1, hosts[1], 1)]
    ranks[0].layers, ranks[1].layers = (0, 3), (3, 6)
    ranks[0].first, ranks[1].last = True, True
    with_states = sum(h.ram_gib for h in fit(ranks, t, 64))
    without = sum(h.ram_gib for h in fit(ranks, dataclasses.replace(t, state_bytes_per_seq_layer=0.0), 64))
    assert with_states - without == pytest.approx(t.n_layer * t.state_bytes_per_seq_layer * n_seq / 2**30)
