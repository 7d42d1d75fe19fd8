"""The generation loop (head.py through scheduler.py) against the fake pipeline and toy target of tests/toy.py."""
from __future__ import annotations



import numpy as np
import pytest

from pipeinfer.drafters.drafter import NgramDrafter
from pipeinfer.decide.head import Head
from pipeinfer.decide.genconfig import GenConfig, auto_p_recovery
from pipeinfer.decide.scheduler import Request, Scheduler
from pipeinfer.core.kvplan import PartitionPool
from pipeinfer.core.protocol import Batch, cp, kv_ops, rm
from pipeinfer.core.sampling import SamplingParams

from toy import FakePipeline, KvError, PROMPT, ToyDrafter, V, assert_clean_end, logits_flat, run_head, target_alone


# ---------------------------------------------------------------- tests
def test_toy_target_is_not_trivial():
    gen = target_alone(PROMPT, 40)[len(PROMPT):]
    assert len(set(gen)) > 10


def test_iterative_equals_target():
    r = run_head("iterative", n_predict=25)
    assert r.out == r.expected and r.streamed == r.out
    assert (r.stats.n_generated, r.stats.n_runs, r.stats.n_spec_runs) == (25, 25, 0)
    assert r.pipe.max_in_flight == 1 and r.pipe.cancel_calls == []
    assert r.head.seq0_end == len(PROMPT) + 24          # the last token is emitted but never decoded
    assert_clean_end(r)


def test_iterative_prompt_in_chunks():
    r = run_head("iterative", n_predict=5, prompt_chunk=3)
    assert r.out == r.expected
    assert r.stats.n_runs == 4 + 4                   # ceil(10 / 3) prompt chunks + 4 single-token runs
    assert_clean_end(r)


@pytest.mark.parametrize("max_branches", [1, 2])
@pytest.mark.parametrize("error_rate", [0.0, 0.3, 1.0])
def test_speculative_equals_target(error_rate, max_branches):
    r = run_head("speculative", error_rate=error_rate, max_branches=max_branches, seed=3)
    assert r.out == r.expected and r.streamed == r.out
    assert_clean_end(r)
    assert r.pipe.max_in_flight == 1                 # synchronous: one run at a time
    assert r.stats.n_spec_runs > 0
    assert r.stats.n_draft_accepted <= r.stats.n_drafted
    if error_rate == 0.0:
        assert r.stats.n_spec_runs <= 40 // 5 + 2   # 4 drafts + 1 bonus token per run
        assert r.stats.n_draft_accepted >= 32
    if error_rate == 1.0:                            # every main-branch token is wrong; the second branch is right
        assert (r.stats.n_draft_accepted > 0) == (max_branches == 2)


PIPEINFER_CASES = [
    # error_rate, max_branches, abort_mid, cancel_lag, seed, poll_every
    (0.0, 1, False, 0, 0, 3),
    (0.1, 1, False, 0, 1, 3),
    (0.3, 1, False, 0, 2, 3),
    (0.3, 1, True, 0, 3, 2),
    (0.3, 1, False, 2, 9, 3),
    (0.3, 1, True, 4, 10, 2),
    (0.3, 2, False, 0, 4, 3),
    (0.3, 2, True, 1, 5, 5),
    (0.6, 1, True, 3, 6, 4),
    (1.0, 1, False, 0, 7, 3),
    (1.0, 2, True, 2, 8, 3),
]


@pytest.mark.parametrize("error_rate, max_branches, abort_mid, cancel_lag, seed, poll_every", PIPEINFER_CASES)
def test_pipeinfer_equals_target(error_rate, max_branches, abort_mid, cancel_lag, seed, poll_every):
    r = run_head("pipeinfer", error_rate=error_rate, max_branches=max_branches, abort_mid=abort_mid,
                 cancel_lag=cancel_lag, seed=seed, poll_every=poll_every)
    assert r.out == r.expected and r.streamed == r.out
    assert_clean_end(r)
    st = r.stats
    assert st.n_runs == len(r.pipe.speculative) and st.n_spec_runs == sum(r.pipe.speculative.values())
    assert st.n_draft_accepted <= st.n_drafted
    assert sum(len(c) for c in r.pipe.cancel_calls) >= st.n_cancelled
    if error_rate < 1.0:
        assert r.pipe.max_in_flight >= 3             # asynchronous: several runs in flight


def test_pipeinfer_perfect_drafts_cancel_nothing():
    r = run_head("pipeinfer", error_rate=0.0, n_predict=60)
    assert r.out == r.expected
    assert r.stats.n_cancelled == 0
    assert r.stats.n_spec_runs <= 60 // 4 + 3
    assert r.pipe.max_in_flight >= 3
    assert_clean_end(r)


def test_pipeinfer_cancels_with_draft_errors():
    r = run_head("pipeinfer", error_rate=0.3, seed=11, n_predict=60)
    assert r.out == r.expected
    assert r.stats.n_cancelled > 0
    assert r.pipe.cancel_calls, "no cancellation signal was sent"
    assert r.pipe.n_skipped > 0                      # some reached the last stage before it ran them
    assert_clean_end(r)


def test_pipeinfer_no_cancel_sends_no_signal():
    r = run_head("pipeinfer", error_rate=0.3, seed=12, cancel=False)
    assert r.out == r.expected
    assert r.pipe.cancel_calls == [] and r.pipe.n_skipped == 0
    assert r.stats.n_cancelled > 0                   # the head still ignores the useless runs
    assert_clean_end(r)


def test_pipeinfer_not_continuous_keeps_one_speculative_run():
    r = run_head("pipeinfer", error_rate=0.2, seed=13, continuous=False)
    assert r.out == r.expected
    assert r.pipe.max_in_flight <= 3
    assert_clean_end(r)


def test_pipeinfer_recovery_raises_the_cutoff():
    # p_accept 0.5 rises by 0.25 per micro-batch launched since the last acceptance: 0.5, 0.75, then 1.0 stops
    r = run_head("pipeinfer", error_rate=0.3, seed=17, p_recovery=0.25)
    assert r.out == r.expected
    assert set(r.drafter.p_accepts) == {0.5, 0.75}
    assert_clean_end(r)


@pytest.mark.parametrize("n_ranks, expected, runs_ahead_at_0_9", [(1, 0.5, 1), (2, 0.5, 1), (3, 0.25, 2),
                                                                   (5, 0.125, 4), (9, 0.0625, 7)])
def test_auto_recovery_fills_the_stages_after_the_head(n_ranks, expected, runs_ahead_at_0_9):
    pr = auto_p_recovery(n_ranks)
    assert pr == expected
    # micro-batches a 0.9-confident draft launches over -pa 0.5 before the cutoff passes 0.9
    assert sum(1 for k in range(20) if 0.5 + k * pr <= 0.9 + 1e-9) == runs_ahead_at_0_9


def test_head_needs_a_resolved_recovery_factor():
    with pytest.raises(ValueError, match="p_recovery is unresolved"):
        Head(GenConfig(p_recovery=None), lambda: 1)


def test_pipeinfer_decay_lowers_the_cutoff():
    # the drafter is 0.4 confident: never enough for p_accept 0.5, enough after one decay step
    r = run_head("pipeinfer", error_rate=0.3, seed=18, drafter_prob=0.4, p_decay=0.1)
    assert r.out == r.expected
    assert r.stats.n_spec_runs > 0 and set(r.drafter.p_accepts) >= {0.5, 0.4}
    assert_clean_end(r)
    r = run_head("pipeinfer", error_rate=0.3, seed=18, drafter_prob=0.4)
    assert r.out == r.expected and r.stats.n_spec_runs == 0   # no decay: wait for results instead
    assert_clean_end(r)


@pytest.mark.parametrize("mode", ["speculative", "pipeinfer"])
def test_with_ngram_drafter(mode):
    # prompt lookup on this target proposes mostly wrong tokens: a stress test with a real drafter
    r = run_head(mode, drafter=NgramDrafter(), n_predict=60)
    assert r.out == r.expected
    assert r.stats.n_spec_runs > 0
    assert_clean_end(r)


def test_pipeinfer_results_always_ready():
    # the last stage answers on the first poll: no room to speculate, PipeInfer degrades to iterative
    r = run_head("pipeinfer", error_rate=0.3, seed=16, poll_every=1)
    assert r.out == r.expected
    assert r.stats.n_spec_runs == 0 and r.stats.n_runs == 40
    assert_clean_end(r)


def test_pipeinfer_single_rank():
    r = run_head("pipeinfer", error_rate=0.3, seed=14, distributed=False)
    assert r.out == r.expected
    assert r.stats.n_spec_runs > 0
    assert_clean_end(r)


def test_pipeinfer_prompt_in_chunks_and_small_pool():
    r = run_head("pipeinfer", error_rate=0.2, seed=15, prompt_chunk=4, max_in_flight=2)
    assert r.out == r.expected
    assert r.n_part == 2
    assert_clean_end(r)


@pytest.mark.parametrize("mode", ["iterative", "speculative", "pipeinfer"])
def test_sampled_equals_target_alone(mode):
    """Per-position seeded sampling: every mode gives the very sample the target alone gives (inv. 9)."""
    sp = SamplingParams(temp=1.0, seed=21)
    r = run_head(mode, sampling=sp, logits_fn=logits_flat, error_rate=0.1, seed=22,
                 max_branches=1 if mode == "iterative" else 2)
    assert r.out == r.expected
    assert r.out != target_alone(PROMPT, 40)[len(PROMPT):]   # sampling really happened
    assert_clean_end(r)


@pytest.mark.parametrize("mode", ["iterative", "speculative", "pipeinfer"])
def test_stops_before_eos(mode):
    gen = target_alone(PROMPT, 40)[len(PROMPT):]
    k = next(i for i in range(5, 40) if gen[i] not in gen[:i])   # a token first produced at index k
    r = run_head(mode, eos=frozenset({gen[k]}), error_rate=0.2, seed=4)
    assert r.out == gen[:k] and r.streamed == r.out
    assert r.stats.n_generated == k
    assert_clean_end(r)


@pytest.mark.parametrize("n_predict", [1, 2, 5])
@pytest.mark.parametrize("mode", ["iterative", "speculative", "pipeinfer"])
def test_short_generations(mode, n_predict):
    r = run_head(mode, n_predict=n_predict, error_rate=0.2, seed=5)
    assert r.out == r.expected
    assert r.stats.n_generated == n_predict
    assert_clean_end(r)


@pytest.mark.parametrize("mode", ["speculative", "pipeinfer"])
def test_drafter_takes_the_prompt_while_the_pipeline_does(mode, monkeypatch):
    """The draft model's prompt processing overlaps the target's: prefill comes before the first result."""
    log = []
    next_result = FakePipeline.next_result
    monkeypatch.setattr(FakePipeline, "next_result", lambda self: log.append("result") or next_result(self))

    class Probe(ToyDrafter):
        def prefill(self, prompt):
            log.append("prefill")
            super().prefill(prompt)

    drafter = Probe(0.2, 3)
    r = run_head(mode, drafter=drafter)
    assert drafter.prefilled == list(PROMPT)
    assert log[:2] == ["prefill", "result"] and log.count("prefill") == 1
    assert r.out == r.expected


def test_head_rejects_bad_configuration():
    pipe = FakePipeline(target_alone(PROMPT, 8))
    with pytest.raises(ValueError, match="unknown mode"):
        Scheduler(pipe, GenConfig(mode="turbo"), n_stages=2)
    with pytest.raises(ValueError, match="needs a drafter"):
        Scheduler(pipe, GenConfig(mode="pipeinfer"), n_stages=2, pool=PartitionPool(2, 1, 4))
    with pytest.raises(ValueError, match="needs a drafter"):
        Scheduler(pipe, GenConfig(mode="speculative"), n_stages=2, drafter_for=lambda *_: ToyDrafter())
    with pytest.raises(ValueError, match="one generation at a time"):
        Scheduler(pipe, GenConfig(mode="speculative"), n_stages=2, n_parallel=2, pool=PartitionPool(2, 1, 4),
                  drafter_for=lambda *_: ToyDrafter())
    with pytest.raises(ValueError, match="empty prompt"):
        Scheduler(pipe, GenConfig(mode="iterative"), n_stages=2).submit(Request([], 8))


# ---------------------------------------------------------------- the fake itself
def _prompted_pipe() -> tuple[FakePipeline, list[int]]:
    ref = target_alone(PROMPT, 8)
    pipe = FakePipeline(ref)
    out = np.zeros(len(PROMPT), np.int32)
    out[-1] = 1
    pipe.launch(1, Batch(np.array(PROMPT, np.int32), np.arange(len(PROMPT), dtype=np.int32), [[0]] * len(PROMPT),
                         out, kv_ops()), False)
    return pipe, ref


def _one(tok: int, pos: int, seqs: list[int], ops=()) -> Batch:
    return Batch(np.array([tok], np.int32), np.array([pos], np.int32), [seqs], np.array([1], np.int32), kv_ops(*ops))


def test_fake_pipeline_computes_the_target():
    pipe, ref = _prompted_pipe()
    pipe.launch(2, _one(ref[10], 10, [0]), False)
    assert [int(pipe.next_result().tokens[0]), int(pipe.next_result().tokens[0])] == \
        [ref[10], ref[11]]


@pytest.mark.parametrize("batch, what", [
    (_one(0, 11, [0]), "inconsistent sequence positions"),                    # skips position 10
    (_one(0, 10, [0, 4]), "inconsistent sequence positions"),                 # seq 4 is empty
    (_one(0, 10, [0, 4], [cp(0, 4, 5, 10)]), "misses position"),              # seq 4 lacks 0..4
    (_one(1, 10, [0]), "sequence 0 holds tokens"),                           # a wrong token in sequence 0
])
def test_fake_pipeline_enforces_llama_rules(batch, what):
    """The fake must reject what llama.cpp rejects (or what breaks invariants), or the tests above prove nothing."""
    pipe, ref = _prompted_pipe()
    if what == "sequence 0 holds tokens":
        batch.tokens[0] = (ref[10] + 1) % V
    with pytest.raises(KvError, match=what):
        pipe.launch(2, batch, True)


def test_fake_pipeline_rejects_reused_partition():
    pipe, ref = _prompted_pipe()
    pipe.launch(2, _one(ref[10], 10, [3], [cp(0, 3, 0, 10)]), True)
    with pytest.raises(KvError, match="still holds"):
        pipe.launch(3, _one(ref[10], 10, [3], [rm(3), cp(0, 3, 0, 10)]), True)  # seq 3 never cleared


def test_fake_pipeline_rejects_two_cells_at_one_position():
    pipe, ref = _prompted_pipe()
    pipe.launch(2, _one(ref[10], 10, [3], [cp(0, 3, 0, 10)]), True)
    pipe.launch(3, _one(ref[10], 10, [0]), False)
    with pytest.raises(AssertionError, match="commit copy"):
        pipe.kv(kv_ops(cp(3, 0, 10, 11)))                      # a commit of a position seq 0 already holds
    with pytest.raises(KvError, match="two cells at position 10"):
        pipe.stages[0].apply(kv_ops(cp(3, 0, 10, 11)))        # and what the stage would then hold


@pytest.mark.parametrize("mode, error_rate", [("speculative", 0.3), ("pipeinfer", 0.3), ("pipeinfer", 0.0)])
def test_compacts_when_retired_cells_fill_the_cache(mode, error_rate):
    """Retired cells are never freed in the middle (the fake rejects that); when they would fill the
    context, the head collects what is in flight and every stage compacts, and generation goes on."""
    n_predict, n_ctx = 150, len(PROMPT) + 150 + 60
    r = run_head(mode, n_predict=n_predict, error_rate=error_rate, seed=5, n_ctx=n_ctx, max_in_flight=4)
    assert r.out == r.expected
    assert (r.stats.n_compactions >= 1) == (error_rate > 0), r.stats  # perfect drafts leave no garbage to speak of
    assert all(st.n_compactions == r.stats.n_compactions for st in r.pipe.stages)
    assert max(len(st.cells) for st in r.pipe.stages) <= n_ctx
    assert_clean_end(r)


def test_fake_pipeline_rejects_freeing_a_cell():
    pipe, ref = _prompted_pipe()
    pipe.launch(2, _one(ref[10], 10, [3], [cp(0, 3, 0, 10)]), True)
    with pytest.raises(KvError, match="freed a cell"):
        pipe.kv(kv_ops(rm(3)))                                 # the run's own cell would become a hole


# ---- micro-batch size from measured costs (choose_draft_len) and the acceptance it runs on (draft_checks)
def test_draft_len_is_one_where_batching_costs_as_much_as_separate_decodes():
    from pipeinfer.decide.shape import choose_draft_len
    costly = [[38.0, 73.0, 104.0], [52.0, 100.0, 129.0]]   # this project's AVX2 host, 2 ranks x 1 thread
    assert choose_draft_len(0.7, costly, (0.0, 20.0), 3) == 1
    assert choose_draft_len(0.9, costly, (0.0, 20.0), 3) == 1
    assert choose_draft_len(0.95, costly, (30.0, 10.0), 3) == 3  # a costly call, cheap tokens: fill it
    cheap = [[38.0, 40.0, 42.0], [52.0, 54.0, 56.0]]        # batching nearly free (memory-bound kernels)
    assert choose_draft_len(0.7, cheap, (0.0, 1.0), 3) == 3
    assert choose_draft_len(0.7, cheap, (0.0, 1.0), 2) == 2  # --draft-max is the cap
    assert choose_draft_len(0.05, [[38.0, 60.0], [52.0, 70.0]], (0.0, 1.0), 2) == 1  # rarely right: not worth a row
    # the rate it maximises: sum a^i / (bottleneck + P(chain breaks) x one pass), the head paying for drafts
    a, ms = 0.8, [[10.0, 12.0], [30.0, 31.0]]
    rates = [a / (max(15.0, 30.0) + (1 - a) * (15.0 + 30.0)),
             (a + a * a) / (max(22.0, 31.0) + (1 - a * a) * (22.0 + 31.0))]
    assert choose_draft_len(a, ms, (0.0, 5.0), 2) == 1 + rates.index(max(rates))
    assert choose_draft_len(0.5, ms, (0.0, 25.0), 2) == 1    # drafting on the head makes it the bottleneck
    # a deep pipeline: a wrong draft in a big micro-batch costs a long refill, so smaller batches win
    deep = [[40.0, 55.0, 70.0]] * 8
    assert choose_draft_len(0.9, deep, (0.0, 0.0), 3) == 1
    assert choose_draft_len(0.9, deep[:2], (0.0, 0.0), 3) == 3


def test_draft_cost_fit_separates_per_call_and_per_token_costs():
    from pipeinfer.decide.shape import draft_cost_fit
    assert draft_cost_fit([]) == (0.0, 0.0)
    assert draft_cost_fit([(1, 60.0), (1, 60.0)]) == (30.0, 30.0)  # one size seen: half each
    c0, c1 = draft_cost_fit([(1, 50.0), (3, 90.0), (2, 70.0)])
    assert c0 == pytest.approx(30.0) and c1 == pytest.approx(20.0)


def test_chain_checks_count_drafts_up_to_the_first_wrong_one():
    from pipeinfer.core.verify import chain_checks
    chain = [(5, 50), (6, 60), (7, 70)]
    base = [0, 1, 2, 3, 4]
    assert chain_checks(chain, base + [50, 60, 71], 5) == (3, 2)   # 5, 6 right; 7 checked and wrong
    assert chain_checks(chain, base + [51, 60, 70], 5) == (1, 0)   # 5 wrong: 6 and 7 never reached
    assert chain_checks(chain, base + [50], 5) == (1, 1)           # 6 and 7 not decided yet
    assert chain_checks(chain, base + [50, 60], 6) == (1, 1)       # 5 was counted by an earlier verification
    assert chain_checks([], base + [50], 5) == (0, 0)              # nothing drafted for it (a cover run)


def test_twin_sizes_micro_batches_by_its_costs():
    from pipeinfer.twin.cluster import Cluster, Link, StageCost
    from pipeinfer.twin.sim import simulate
    costly = Cluster([StageCost([38.0, 73.0, 104.0], 20.0), StageCost([52.0, 100.0, 129.0], 25.0)], [Link()] * 2, 64,
                     20.0)
    res = simulate(costly, GenConfig(mode="pipeinfer", n_predict=96, draft_max=3, p_recovery=None,
                                     stop_at_eos=False), agreement=0.6)
    assert set(res.stats.draft_len_hist) == {1}  # (a streak of right drafts, near 0.95, would make it 3)
    fixed = simulate(costly, GenConfig(mode="pipeinfer", n_predict=96, draft_max=3, p_recovery=None,
                                       stop_at_eos=False, adaptive_draft=False), agreement=0.6)
    assert not fixed.stats.draft_len_hist and fixed.stats.n_drafted > res.stats.n_drafted


# ---- the draft's runner-ups as siblings of its chain (decide/shape.py)
@pytest.mark.parametrize("error_rate, seed, poll_every", [(0.2, 1, 3), (0.5, 2, 2), (0.9, 3, 4)])
def test_runner_up_siblings_keep_the_output_the_targets(error_rate, seed, poll_every):
    """A chain drafter with runner-ups, --max-branches 3: siblings join the micro-batches (no stage costs:
    every runner-up over -ps, within the cap), some are taken at a miss, and the output is the target's."""
    drafter = ToyDrafter(error_rate, seed, runner_ups=True)
    r = run_head("pipeinfer", drafter=drafter, error_rate=error_rate, seed=seed, max_branches=3, n_max=4,
                 poll_every=poll_every, n_predict=60)
    assert r.out == r.expected and r.streamed == r.out
    assert_clean_end(r)
    assert r.stats.n_siblings > 0 and r.stats.n_siblings_right > 0
    assert r.stats.n_siblings_right <= r.stats.n_siblings


def test_a_taken_sibling_saves_the_trip_a_miss_costs():
    """Every draft wrong, every runner-up right: without siblings every speculative run is cancelled and each token
    waits for a non-speculative run; with them a run whose sibling is right gives the token after the sibling, and
    half the tokens need no non-speculative run."""
    chain = run_head("pipeinfer", drafter=ToyDrafter(1.0, 4), error_rate=1.0, seed=4, n_max=2, n_predict=30)
    tree = run_head("pipeinfer", drafter=ToyDrafter(1.0, 4, runner_ups=True), error_rate=1.0, seed=4, n_max=2,
                    max_branches=2, n_predict=30)
    assert chain.out == chain.expected and tree.out == tree.expected
    assert chain.stats.n_cancelled == chain.stats.n_spec_runs and chain.stats.n_siblings == 0
    assert tree.stats.n_siblings_right >= 10
    assert tree.stats.n_runs - tree.stats.n_spec_runs <= (chain.stats.n_runs - chain.stats.n_spec_runs) * 0.6
