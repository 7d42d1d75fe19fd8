"""Several generations at once (decide/scheduler.py) against the fake two-stage pipeline of test_head_logic:
its KV cache checks every cell a token sees, so a generation reading another's cells, a cell out of position
order or a cell freed in the middle of the cache fails the run. Each answer must equal its prompt's target-alone
answer, whatever ran beside it."""
from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest

from lanes import make
from toy import V, logits_flat, logits_greedy, target_alone

from pipeinfer.core.decoding import Constraint, Decoding
from pipeinfer.core.protocol import mask_words
from pipeinfer.core.sampling import SamplingParams
from pipeinfer.decide.actions import Launch
from pipeinfer.decide.rules import RunRules
from pipeinfer.decide.scheduler import Request
from pipeinfer.decide.batching import BatchRules, pipeline_depth

PROMPTS = [[5, 17, 2, 9, 11, 3, 8, 1, 20, 14], [4, 4, 7], [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17],
           [28, 1], [9, 9, 9, 9, 2], [13, 6, 21, 0, 3, 3]]


def submit_all(sched, jobs, logits_fn=logits_greedy):
    """jobs: (prompt, n_predict, sampling, stop_after); returns {i: (tokens, expected)} once answered."""
    got: dict[int, list[int]] = {}
    for i, (prompt, n, sp, stop_after) in enumerate(jobs):
        streamed: list[int] = []

        def done(tokens, stats, i=i, streamed=streamed):
            assert tokens == streamed
            got[i] = tokens
        stop = (lambda s=streamed, k=stop_after: len(s) >= k) if stop_after else None
        sched.submit(Request(list(prompt), n, sp, on_tokens=streamed.extend, should_stop=stop, on_done=done))
    sched.run()
    out = {}
    for i, (prompt, n, sp, stop_after) in enumerate(jobs):
        want = target_alone(prompt, n, logits_fn, sp)[len(prompt):]
        out[i] = (got[i], want, stop_after)
    return out


def assert_exact(results):
    for i, (tokens, want, stop_after) in results.items():
        if stop_after:
            assert len(tokens) >= stop_after and tokens == want[:len(tokens)], i
        else:
            assert tokens == want, i


def assert_all_free(sched, pipe, pool):
    assert not sched.gens and not sched.waiting and not pipe.in_flight and not sched.executor.members
    if pool is not None:
        assert pool.n_free == pool.n_partitions
    pipe.finish() if hasattr(pipe, "finish") else None
    for stage in pipe.stages:  # nothing but retired cells and finished generations' canonical cells
        live = {s for c in stage.cells for s in c.seqs} - {pipe.garbage} - pipe.canon
        assert not live, f"{stage.name}: sequences {sorted(live)} still hold cells"


@pytest.mark.parametrize("mode", ["iterative", "pipeinfer"])
@pytest.mark.parametrize("n_parallel", [1, 2, 4])
def test_concurrent_answers_equal_single(mode, n_parallel):
    sched, pipe, pool = make(mode, n_parallel=n_parallel)
    jobs = [(p, 12 + 3 * i, SamplingParams(), 0) for i, p in enumerate(PROMPTS)]
    assert_exact(submit_all(sched, jobs))
    assert_all_free(sched, pipe, pool)
    assert sched.stats.max_active == min(n_parallel, len(PROMPTS))


def watch_launches(pipe, record) -> list:
    """Wraps pipe.launch: record(batch, speculative) of each run, kept where it is not None."""
    seen: list = []
    launch = pipe.launch

    def watched(run_id, batch, speculative, *a):
        item = record(batch, speculative)
        if item is not None:
            seen.append(item)
        launch(run_id, batch, speculative, *a)
    pipe.launch = watched
    return seen


def n_seqs(batch) -> int:
    return len({s for ids in batch.seq_ids for s in ids})


def decodes_of_several(pipe) -> list[int]:
    """The rows of each run that carries the next tokens of several generations."""
    return watch_launches(pipe, lambda b, spec: b.n_tokens if n_seqs(b) > 1 and not b.prefix_ops.size else None)


@pytest.mark.parametrize("mode", ["iterative", "pipeinfer"])
@pytest.mark.parametrize("batch_rows", [2, 3])
def test_generations_share_decodes_and_each_answer_equals_its_own(mode, batch_rows):
    """Batching users: the next tokens of several generations go out as one run of up to batch_rows rows, each in
    its own sequence (the toy stages check every cell a row sees); every answer equals its prompt's alone, stops
    and all."""
    sched, pipe, pool = make(mode, n_parallel=6, batch_rows=batch_rows)
    rows = decodes_of_several(pipe)
    jobs = [(p, 14 + 3 * i, SamplingParams(), 5 if i == 2 else 0) for i, p in enumerate(PROMPTS)]
    assert_exact(submit_all(sched, jobs))
    assert_all_free(sched, pipe, pool)
    assert rows and max(rows) == batch_rows and sched.executor.n_merged_runs == len(rows)
    assert sum(rows) == sched.executor.n_merged_rows


FLAT_MS = ((10.0,) * 12, (10.0,) * 12)              # rows nearly free (tiled kernels): draft rows ride
LINEAR_MS = tuple(tuple(10.0 * k for k in range(1, 13)) for _ in range(2))  # a row costs a decode: they do not


@pytest.mark.parametrize("error_rate", [0.0, 0.3])
def test_draft_rows_ride_the_users_decodes_and_a_cancelled_rider_takes_none_of_them_with_it(error_rate):
    """Many generations, rows nearly free: the oldest holds the drafter and its micro-batches ride the others'
    next tokens in one decode (each in its own sequences). A rider the verification proves wrong is cancelled at
    the head while its shared run is in flight: the Cancel never names the shared run (the toy pipeline asserts
    that only speculative runs are cancelled), its rows are dropped, its partition retired; every answer equals
    its prompt's alone, stops and all, and the toy stages check every cell each row sees."""
    sched, pipe, pool = make("pipeinfer", n_parallel=6, batch_rows=6, stage_ms=FLAT_MS, error_rate=error_rate)
    mixed = watch_launches(pipe, lambda b, spec: (b.n_tokens, n_seqs(b)) if not spec and n_seqs(b) > 2 else None)
    jobs = [(p, 20 + 3 * i, SamplingParams(), 7 if i == 4 else 0) for i, p in enumerate(PROMPTS)]
    assert_exact(submit_all(sched, jobs))
    assert_all_free(sched, pipe, pool)
    ex = sched.executor
    assert ex.n_rides > 0 and mixed
    assert any(rows > seqs for rows, seqs in mixed), "a draft micro-batch (rows of one partition) shared a decode"
    assert ex.n_riders_dropped > 0 or not error_rate  # (a finished generation also drops its riders)
    assert all(pipe.speculative[r] for ids in pipe.cancel_calls for r in ids)


def test_draft_rows_do_not_ride_where_each_row_costs_a_decode():
    """The same load where a row costs what it costs alone: a draft row (right with probability < 1) buys less
    than a user's certain one, so none rides, and the drafter is lent only while fewer generate than the stages."""
    sched, pipe, pool = make("pipeinfer", n_parallel=6, batch_rows=6, stage_ms=LINEAR_MS)
    jobs = [(p, 20 + 3 * i, SamplingParams(), 0) for i, p in enumerate(PROMPTS)]
    assert_exact(submit_all(sched, jobs))
    assert_all_free(sched, pipe, pool)
    assert sched.executor.n_rides == 0 and sched.executor.n_merged_runs > 0


def runs_of_several(pipe) -> list[tuple[int, int]]:
    """(rows, sequences) of each non-speculative run that carries several generations' rows."""
    return watch_launches(pipe, lambda b, spec: (b.n_tokens, n_seqs(b)) if n_seqs(b) > 1 and not spec else None)


@pytest.mark.parametrize("mode", ["iterative", "pipeinfer"])
@pytest.mark.parametrize("prompt_chunk", [2, 3])
def test_prompt_chunks_share_decodes_with_next_tokens(mode, prompt_chunk):
    """Newcomers' prompt chunks within the row cap join the running generations' next tokens in one decode (each
    chunk in its own sequence), a cached start among them; runs with more rows than the cap go alone; every answer
    equals its prompt's alone, a stopped one included, and the toy stages check every cell a row sees. (That a
    cached start's copy goes after the runs held before it: test_kv_edits_go_after_every_run_held_before_them.)"""
    sched, pipe, pool = make(mode, n_parallel=7, batch_rows=6, prompt_chunk=prompt_chunk)
    runs = runs_of_several(pipe)
    jobs = [(p, 14 + 3 * i, SamplingParams(), 4 if i == 3 else 0) for i, p in enumerate(PROMPTS)]
    jobs.append((PROMPTS[2][:9] + [1, 1], 12, SamplingParams(), 0))  # a cached start: 9 positions copied
    assert_exact(submit_all(sched, jobs))
    assert_all_free(sched, pipe, pool)
    assert max(rows for rows, _ in runs) <= 6
    if prompt_chunk == 2:
        assert any(rows > seqs for rows, seqs in runs), "a prompt chunk (rows of one sequence) shared a decode"


def test_kv_edits_go_after_every_run_held_before_them():
    """A cached start copies another generation's cells (its KV edits run before its batch at every stage): held
    rows of the copied sequence go out first, and the copy opens a new shared decode."""
    from pipeinfer.core.protocol import Batch, cp, kv_ops
    from pipeinfer.decide.actions import Executor

    class Recorder:
        def __init__(self):
            self.runs, self.in_flight = [], []

        def set_sampling(self, sampling):
            pass

        def launch(self, run_id, batch, *a):
            self.runs.append((run_id, batch.tokens.tolist(), batch.prefix_ops.tolist()))

    def chunk(run_id, seq, tokens, pre=kv_ops()):
        n = len(tokens)
        return Launch(run_id, Batch(np.array(tokens, np.int32), np.arange(n, dtype=np.int32), [[seq]] * n,
                                    np.zeros(n, np.int32), pre), False, -1, SamplingParams())
    pipe = Recorder()
    ex = Executor(pipe, BatchRules(batch_rows=8, depth=2, n_stages=2))
    ex.pace(16)
    ex.apply("a", [chunk(1, 1, [5, 6, 7])])
    ex.apply("c", [chunk(2, 3, [9])])
    ex.apply("b", [chunk(3, 2, [8, 8], kv_ops(cp(1, 2, 0, 3)))])
    assert pipe.runs == [(2, [5, 6, 7, 9], [])]  # a's chunk and c's row went before b's copy of a's cells
    ex.flush()
    assert pipe.runs[1] == (3, [8, 8], [list(cp(1, 2, 0, 3))])


def test_a_draft_rides_only_rows_of_others_and_never_on_a_parent_a_stage_may_skip():
    """Executor.rides: a micro-batch joins the rows held when they leave room and none is its owner's (its KV edits,
    applied before the shared decode, read its owner's cells), and when it builds on no run or on a member of a
    shared run (never skipped); a lone speculative parent may be skipped at a stage, and the shared decode could
    not be skipped with it. It then goes out with them; else alone, at once. A Cancel naming it is not sent (the
    shared run carries others' rows), the rest of that Cancel is."""
    from pipeinfer.core.protocol import NO_RUN, Batch, kv_ops
    from pipeinfer.decide.actions import Cancel, Executor

    class Recorder:
        def __init__(self):
            self.runs, self.cancels = [], []

        def set_sampling(self, sampling):
            pass

        def launch(self, run_id, batch, speculative, parent_id, rules):
            self.runs.append((run_id, batch.n_tokens, speculative, parent_id))

        def cancel(self, ids):
            self.cancels.append(ids)

    def run(run_id, seq, n, spec=False, parent=NO_RUN):
        return Launch(run_id, Batch(np.arange(n, dtype=np.int32), np.arange(n, dtype=np.int32), [[seq]] * n,
                                    np.ones(n, np.int32), kv_ops()), spec, parent, SamplingParams())
    pipe = Recorder()
    ex = Executor(pipe, BatchRules(batch_rows=6, depth=2, n_stages=2))
    ex.pace(8)
    assert not ex.rides("h", 2, NO_RUN)                     # nothing held: it goes alone
    ex.apply("a", [run(1, 1, 1)])
    ex.apply("h", [run(2, 2, 1)])
    assert not ex.rides("h", 2, NO_RUN)                     # its owner's next token is held
    ex.flush()
    ex.apply("a", [run(3, 1, 1)])
    assert ex.rides("h", 5, NO_RUN) and not ex.rides("h", 6, NO_RUN)
    ex.apply("h", [run(4, 2, 3, spec=True)])                # rides a's row, held with it
    ex.flush()
    assert pipe.runs[-1] == (4, 4, False, NO_RUN)          # one shared run, not speculative, of no parent
    ex.apply("b", [run(5, 3, 1)])
    assert ex.rides("h", 2, 4)                              # its parent is a shared run's member
    ex.apply("h", [run(6, 2, 2, spec=True, parent=4)])
    ex.apply("c", [run(7, 4, 1)])                           # joins them
    assert ex.held.n_rows == 4 and not ex.rides("h", 1, 4)       # one of its runs is held
    ex.flush()
    ex.apply("h", [run(8, 2, 2, spec=True, parent=6)])      # nothing held beside: alone, speculative, at once
    assert pipe.runs[-1] == (8, 2, True, 6)
    ex.apply("c", [run(9, 4, 1)])
    assert not ex.rides("h", 2, 8)                          # a lone parent a stage may skip
    ex.apply("h", [Cancel((4, 6, 8))])
    assert pipe.cancels == [[8]] and ex.n_rides == 2 and ex.n_riders_dropped == 2


@pytest.mark.parametrize("mode", ["iterative", "pipeinfer"])
def test_a_lone_one_token_run_is_never_held_back(mode):
    """A prompt's last chunk of one token (and any next token) may share a decode; alone, with nothing in flight to
    share it with, it goes out at once: the generation ends, exact."""
    for prompt in ([5, 17, 2, 9, 11], [7], [3, 1, 4, 1, 5, 9, 2, 6, 5]):
        sched, pipe, pool = make(mode, n_parallel=4, batch_rows=3, prompt_chunk=4)
        got: list = []
        sched.submit(Request(list(prompt), 9, on_done=lambda tokens, stats: got.append(tokens)))
        for _ in range(500):  # a held run would leave the scheduler stepping for ever
            if not sched.busy:
                break
            sched.step()
        assert got == [target_alone(prompt, 9)[len(prompt):]]
        assert_all_free(sched, pipe, pool)


class ToyMasker:
    """A grammar for the toy vocabulary: the answer's token at index i must be congruent to i modulo 3."""
    eos_ids = frozenset()
    done = False

    def __init__(self):
        self.n_committed = 0

    def commit(self, tokens: list[int]) -> None:
        self.n_committed += len(tokens)

    def masks(self, tails: list[list[int]]) -> np.ndarray:
        out = np.zeros((len(tails), mask_words(V)), np.int32)
        for r, tail in enumerate(tails):
            for tok in range(V):
                if tok % 3 == (self.n_committed + len(tail)) % 3:
                    out[r, tok // 32] |= 1 << (tok % 32)
        return out


def toy_rules(decoding: Decoding, answer_at: int) -> RunRules:
    return RunRules(decoding, answer_at, V, ToyMasker() if decoding.constraint else None)


MIXED = [  # (sampling, decoding): what users of one server ask at once
    (SamplingParams(), Decoding()),
    (SamplingParams(), Decoding(top_logprobs=2)),
    (SamplingParams(temp=0.9, seed=1), Decoding()),
    (SamplingParams(temp=0.7, top_k=5, seed=2), Decoding(top_logprobs=3)),
    (SamplingParams(), Decoding(logit_bias=((4, 3.0), (7, -2.0)), frequency_penalty=0.5)),
    (SamplingParams(temp=1.1, seed=3), Decoding(constraint=Constraint("regex", "toy"), top_logprobs=1)),
]


def answer_mixed(mode: str, jobs: list, n_parallel: int, batch_rows: int):
    """Each job's (tokens, log-probabilities) on a fresh toy scheduler, and the runs that carried several
    generations' rows: (rows, groups of SAMPLING in force, whether it had rules)."""
    sched, pipe, pool = make(mode, n_parallel=n_parallel, batch_rows=batch_rows, logits_fn=logits_flat)
    sched.rules_for = toy_rules
    shared = watch_launches(pipe, lambda b, spec: b.n_tokens if n_seqs(b) > 1 and not spec else None)
    got: dict[int, tuple] = {}
    for i, (prompt, (sp, decoding)) in enumerate(jobs):
        lp: list = []
        sched.submit(Request(list(prompt), 14, sp, decoding=decoding, on_logprobs=lp.extend,
                             on_done=lambda tokens, stats, i=i, lp=lp: got.__setitem__(i, (tokens, lp))))
    sched.run()
    assert_all_free(sched, pipe, pool)
    return got, shared, pipe.sampling_sent


@pytest.mark.parametrize("mode", ["iterative", "pipeinfer"])
def test_generations_sampled_and_shaped_differently_share_decodes_each_its_own(mode):
    """Batching users whatever they ask: generations with their own temperatures and seeds, log-probabilities,
    biases, penalties and a grammar share decodes (each one's rows drawn by its own SAMPLING group and shaped by
    its own rows of RULES), and every answer, log-probabilities included, is what the request gets alone."""
    jobs = list(zip(PROMPTS[:len(MIXED)], MIXED))
    together, shared, sampling_sent = answer_mixed(mode, jobs, n_parallel=6, batch_rows=3)
    assert shared and max(shared) == 3
    assert any(len(s) > 1 for s in sampling_sent)  # a shared run drew its rows by several generations' parameters
    for i, job in enumerate(jobs):
        alone, alone_shared, _ = answer_mixed(mode, [job], n_parallel=1, batch_rows=1)
        assert not alone_shared
        assert together[i] == alone[0], i
        assert len(together[i][0]) == 14 and (job[1][1].top_logprobs is None) == (not together[i][1])
    masked = together[5][0]
    assert all(t % 3 == k % 3 for k, t in enumerate(masked))  # the grammar held inside shared runs


def test_seeded_sampling_per_generation():
    """Each generation's tokens are drawn with its own seed and temperature, whatever shares the pipeline."""
    sched, pipe, pool = make("pipeinfer", n_parallel=3, logits_fn=logits_flat)
    jobs = [(p, 15, SamplingParams(temp=0.8 + 0.1 * i, seed=i), 0) for i, p in enumerate(PROMPTS[:4])]
    assert_exact(submit_all(sched, jobs, logits_flat))
    assert len(pipe.sampling_sent) > 4  # the parameters switch as the generations take turns


def test_stop_cancels_only_that_generation():
    sched, pipe, pool = make("pipeinfer", n_parallel=3)
    jobs = [(p, 30, SamplingParams(), 4 if i % 2 else 0) for i, p in enumerate(PROMPTS)]
    assert_exact(submit_all(sched, jobs))
    assert_all_free(sched, pipe, pool)


def test_interleaved_when_full_speculative_only_with_room():
    """With as many generations as stages nothing speculative is launched; alone, the drafter is lent."""
    sched, pipe, pool = make("pipeinfer", n_parallel=2, error_rate=0.0)
    jobs = [(p, 20, SamplingParams(), 0) for p in PROMPTS[:2]]
    assert_exact(submit_all(sched, jobs))
    assert sched.stats.n_lends >= 1
    sched2, pipe2, _ = make("pipeinfer", n_parallel=1, error_rate=0.0)
    assert_exact(submit_all(sched2, [(PROMPTS[0], 20, SamplingParams(), 0)]))
    assert sum(pipe2.speculative.values()) > 0


def test_admission_waits_for_cells_and_compacts():
    """A context too small for every request at once: requests wait (first come first served), the scheduler
    compacts, and every answer is still exact; none is lost."""
    sched, pipe, pool = make("pipeinfer", n_parallel=4, n_ctx=120)
    jobs = [(p, 25, SamplingParams(), 0) for p in PROMPTS]
    assert_exact(submit_all(sched, jobs))
    assert sched.stats.waits_for_cells > 0 and sched.stats.n_compactions > 0
    assert sched.stats.admitted_order == sorted(sched.stats.admitted_order)
    assert_all_free(sched, pipe, pool)


def test_request_that_never_fits_is_refused():
    sched, _, _ = make("iterative", n_parallel=2, n_ctx=40)
    with pytest.raises(ValueError, match="does not fit the context"):
        sched.submit(Request(list(range(30)), 20))


def test_a_prompt_beside_others_goes_in_the_chunks_it_takes_alone():
    """Smaller chunks would change the prompt's numerics on real stages (the answer would differ from the
    single-request one): a newcomer's prompt is launched in prompt_chunk chunks whatever runs beside it."""
    long_prompt = [(7 * i) % 29 for i in range(40)]
    sizes = {}
    for n_parallel in (1, 2):
        sched, pipe, _ = make("iterative", n_parallel=n_parallel)
        sched.cfg = replace(sched.cfg, prompt_chunk=16)
        launched = []
        launch = pipe.launch
        pipe.launch = lambda run_id, batch, *a: (launched.append(batch.n_tokens), launch(run_id, batch, *a))
        jobs = [(PROMPTS[1], 30, SamplingParams(), 0), (long_prompt, 5, SamplingParams(), 0)]
        assert_exact(submit_all(sched, jobs))
        sizes[n_parallel] = sorted(n for n in launched if n > 1)
    assert sizes[1] == sizes[2] == [3, 8, 16, 16]


def test_no_admitted_generation_starves():
    """Between two launches of one generation's runs (once its prompt is in), the others launch at most one run
    each plus what speculation may add while a stage would idle (fewer than the stages): its inter-token delay is
    bounded by the load, not by how long the others' answers are."""
    # 3 at once on 4 stages: the oldest speculates; nothing but the room rule keeps it from 8 runs ahead
    sched, pipe, _ = make("pipeinfer", n_parallel=3, n_stages=4, max_in_flight=8, p_recovery=0.0, error_rate=0.0)
    order: list[int] = []
    apply = sched.executor.apply

    def record(g, actions):
        order.extend(id(g) for a in actions if isinstance(a, Launch))
        apply(g, actions)
    sched.executor.apply = record
    jobs = [(PROMPTS[0], 60, SamplingParams(), 0), (PROMPTS[1], 8, SamplingParams(), 0),
            (PROMPTS[3], 40, SamplingParams(), 0), (PROMPTS[4], 30, SamplingParams(), 0)]
    assert_exact(submit_all(sched, jobs))
    for g in set(order):
        at = [i for i, x in enumerate(order) if x == g]
        gaps = [b - a - 1 for a, b in zip(at[1:], at[2:])]  # after its prompt
        assert max(gaps, default=0) <= (sched.n_parallel - 1) + sched.n_stages, gaps
    assert sched.stats.n_lends >= 1 and sum(pipe.speculative.values()) > 0


def test_pipeline_depth():
    assert pipeline_depth(4, None) == 4
    assert pipeline_depth(4, ((10.0, 19.0),) * 4) == 4                  # balanced: every stage
    assert pipeline_depth(32, ((62.0,),) * 31 + ((599.0,),)) == 5       # a slow last stage fills at 5 in flight
    assert pipeline_depth(2, ((25.0,), (31.0,))) == 2
    assert pipeline_depth(3, ((1.0,), (1.0,), (100.0,))) == 2


@pytest.mark.parametrize("mode", ["iterative", "pipeinfer"])
def test_a_resumed_request_continues_the_uninterrupted_answer(mode):
    """A request resumed after a lost pipeline (its prompt, then the tokens it had streamed, replayed one per run)
    goes on exactly as the uninterrupted answer, whatever point it was cut at and whatever runs beside it."""
    full = target_alone(PROMPTS[0], 30)[len(PROMPTS[0]):]
    sched, pipe, pool = make(mode, n_parallel=3)
    got: dict[int, list[int]] = {}
    cuts = (0, 1, 2, 7, 29)
    for cut in cuts:
        streamed: list[int] = []
        sched.submit(Request(list(PROMPTS[0]), 30 - cut, on_tokens=streamed.extend, replay=full[:cut],
                             on_done=lambda tokens, stats, cut=cut, s=streamed: got.update({cut: (tokens, list(s))})))
    sched.submit(Request(list(PROMPTS[2]), 12))  # beside them, another request
    sched.run()
    for cut in cuts:
        tokens, streamed = got[cut]
        assert tokens == streamed == full[cut:], cut
    assert_all_free(sched, pipe, pool)


@pytest.mark.parametrize("mode", ["iterative", "pipeinfer"])
def test_a_long_prompt_goes_out_between_the_running_generations_tokens_shortest_newcomer_first(mode):
    """A newcomer's prompt chunks are fed a few at a time (never more in flight than the stages), so a running
    generation's tokens are launched between them instead of after all of them; of two newcomers the one with
    fewer chunks left goes first; every answer is the target's alone."""
    sched, pipe, _ = make(mode, n_parallel=3, prompt_chunk=4, n_stages=2, cache_prompt=False)
    a_prompt, b_prompt, c_prompt = [3, 1, 4], [(7 * i) % 29 for i in range(40)], [2, 7, 1, 8, 2, 8]
    name = {tuple(a_prompt): "a", tuple(b_prompt): "b", tuple(c_prompt): "c"}
    log, chunk_runs, most = [], set(), [0]   # log: (request, chunk or not) per launch, in launch order
    launch = pipe.launch

    def logged(run_id, batch, speculative, parent_id=-1, rules=None):
        launch(run_id, batch, speculative, parent_id, rules)
        chunk = not speculative and len(batch.tokens) > 1
        log.append((name[tuple(sched.executor.members[run_id][0].owner.req.prompt)], chunk))
        if chunk:
            chunk_runs.add(run_id)
        most[0] = max(most[0], sum(r in chunk_runs for r in pipe.in_flight))
    pipe.launch = logged
    got, streamed_a = {}, []
    sched.submit(Request(a_prompt, 40, on_tokens=streamed_a.extend, on_done=lambda t, s: got.update(a=t)))
    while len(streamed_a) < 3:
        sched.step()
    sched.submit(Request(b_prompt, 3, on_done=lambda t, s: got.update(b=t)))
    sched.submit(Request(c_prompt, 3, on_done=lambda t, s: got.update(c=t)))
    sched.run()
    assert got == {"a": target_alone(a_prompt, 40)[3:], "b": target_alone(b_prompt, 3)[40:],
                   "c": target_alone(c_prompt, 3)[6:]}
    assert most[0] <= 2                                          # never more chunks in flight than stages
    b_chunks = [i for i, e in enumerate(log) if e == ("b", True)]
    assert len(b_chunks) == 10
    a_between = [i for i, (r, _) in enumerate(log) if r == "a" and b_chunks[0] < i < b_chunks[-1]]
    assert len(a_between) >= 4, log                              # A kept generating during B's prompt
    c_chunks = [i for i, e in enumerate(log) if e == ("c", True)]
    assert len(c_chunks) == 2 and c_chunks[-1] < b_chunks[1], log  # C's 2 chunks went before B's second
