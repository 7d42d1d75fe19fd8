"""The prompt cache: its pure bookkeeping (core/prefixcache.py), and the scheduler using it over the toy pipeline,
whose stages check every cell a token sees and record the batch each cell was computed in (its bits on a real
stage): a request served from the cache must see exactly the cells its cold run would compute."""
from __future__ import annotations

import pytest

from pipeinfer.core.kvplan import CACHE_ENTRIES
from pipeinfer.core.prefixcache import PrefixCache, common_prefix, reusable, whole_chunks
from pipeinfer.core.protocol import KvOp
from pipeinfer.core.sampling import SamplingParams
from pipeinfer.decide.scheduler import Request, generate
from lanes import make
from toy import target_alone

C = 4  # the toy's prompt chunk


# ---------------------------------------------------------------- pure bookkeeping
def test_reusable_is_the_common_prefix_in_whole_chunks_short_of_the_last_token():
    assert whole_chunks(9, 4) == 8 and whole_chunks(3, 4) == 0
    assert common_prefix([1, 2, 3], [1, 2, 4, 5]) == 2 and common_prefix([], [1]) == 0
    assert reusable(list(range(20)), list(range(10)) + [99], 4) == 8
    assert reusable(list(range(8)), list(range(8)), 4) == 4      # the last token's row must be decoded
    assert reusable(list(range(8)), list(range(9)), 4) == 8
    assert reusable([0, 1, 2, 9], list(range(12)), 4) == 0       # a chunk in common only in part gives nothing


def test_entries_extended_or_beyond_the_limit_go_least_recently_used_first():
    cache = PrefixCache(chunk=4, max_entries=2)
    a, _ = cache.add(1, 11, list(range(10)), cells=12)
    assert a.tokens == list(range(8))
    b, gone = cache.add(2, 12, list(range(13)), cells=5)         # extends a: a can give nothing b cannot
    assert gone == [a] and cache.entries == [b]
    assert cache.add(3, 13, [1, 2, 3], cells=3) == (None, [])    # no whole chunk: nothing to keep
    c, _ = cache.add(4, 14, [7] * 9, cells=9)
    assert cache.find(list(range(12)) + [5]).entry is b          # b used after c
    d, gone = cache.add(5, 15, [8] * 8, cells=8)
    assert gone == [c] and {e.lane for e in cache.entries} == {2, 5}
    assert cache.n_tokens == 12 + 8 and cache.n_cells == 5 + 8


def test_a_running_prompt_is_a_source_too_and_compaction_keeps_the_recent_within_budget():
    cache = PrefixCache(chunk=4, max_entries=4)
    start = cache.find(list(range(10)), running=[(3, list(range(10)))])
    assert (start.seq, start.n, start.entry) == (3, 8, None)
    old, _ = cache.add(1, 11, list(range(100, 110)), cells=30)
    new, _ = cache.add(2, 12, list(range(200, 213)), cells=40)
    gone = cache.keep_within(budget=12)
    assert gone == [old] and cache.entries == [new] and new.cells == 12


# ---------------------------------------------------------------- the scheduler with the cache
def run_one(sched, prompt, n, **kw):
    stats = {}
    tokens, st = generate(sched, Request(list(prompt), n, SamplingParams(), **kw))
    stats.update(vars(st))
    return tokens, st


def check_cold_bits(pipe):
    """Every cell a cached start copies was computed in a whole, aligned prompt chunk: the batch a cold run of any
    prompt that holds those tokens decodes it in."""
    for stage in pipe.stages:
        apply = stage.apply

        def checked(ops, stage=stage, apply=apply):
            for op, src, dst, p0, p1 in ops.reshape(-1, 5).tolist():
                if op == KvOp.CP and dst in pipe.canon and src in pipe.canon:
                    assert p0 == 0 and p1 % C == 0 and p1 > 0, (p0, p1)
                    for c in stage.cells:
                        if src in c.seqs and c.pos < p1:
                            assert c.batch == (c.pos // C * C, C), (c.pos, c.batch)
            apply(ops)
        stage.apply = checked


PROMPT = [(5 * i + 3) % 29 for i in range(10)]


@pytest.mark.parametrize("mode", ["iterative", "pipeinfer"])
def test_a_second_turn_starts_from_the_first_ones_whole_chunks_and_equals_cold(mode):
    sched, pipe, _ = make(mode, n_parallel=1, prompt_chunk=C)
    check_cold_bits(pipe)
    first, st1 = run_one(sched, PROMPT, 6)
    assert first == target_alone(PROMPT, 6)[len(PROMPT):] and st1.n_cached == 0
    turn2 = PROMPT + first + [4, 9, 1]
    second, st2 = run_one(sched, turn2, 8)
    assert second == target_alone(turn2, 8)[len(turn2):]
    assert st2.n_cached == 8                                        # PROMPT's whole chunks; its tail and answer again
    turn3 = turn2 + second + [2]
    third, st3 = run_one(sched, turn3, 5)
    assert third == target_alone(turn3, 5)[len(turn3):] and st3.n_cached == whole_chunks(len(turn2), C)
    assert len(sched.cache.entries) == 1                            # each turn's entry extends the last
    cold_sched, _, _ = make(mode, n_parallel=1, prompt_chunk=C, cache_prompt=False)
    assert run_one(cold_sched, turn3, 5)[0] == third


def test_cache_prompt_false_neither_starts_from_nor_leaves_an_entry():
    sched, pipe, _ = make("pipeinfer", n_parallel=1, prompt_chunk=C)
    run_one(sched, PROMPT, 4, cache_prompt=False)
    assert not sched.cache.entries
    run_one(sched, PROMPT, 4)
    assert len(sched.cache.entries) == 1
    _, st = run_one(sched, PROMPT + [1, 2], 4, cache_prompt=False)
    assert st.n_cached == 0 and len(sched.cache.entries) == 1


def test_n_choices_submitted_at_once_share_the_running_prompt():
    sched, pipe, _ = make("pipeinfer", n_parallel=3, prompt_chunk=C)
    check_cold_bits(pipe)
    prompt = [(3 * i + 1) % 29 for i in range(23)]
    got = {}
    for j in range(3):
        sp = SamplingParams(0.8, 0, 1.0, seed=j)
        sched.submit(Request(list(prompt), 6, sp, on_done=lambda t, s, j=j, sp=sp: got.update({j: (t, s, sp)})))
    sched.run()
    assert sorted(s.n_cached for _, s, _ in got.values()) == [0, 20, 20]
    for tokens, _, sp in got.values():
        assert tokens == target_alone(prompt, 6, sp=sp)[len(prompt):]


def stage_cells(pipe) -> int:
    return max(len(stage.cells) for stage in pipe.stages)


def test_a_full_cache_evicts_for_a_new_request_and_cells_stay_within_the_context():
    n_ctx = 120
    sched, pipe, _ = make("pipeinfer", n_parallel=1, prompt_chunk=C, n_ctx=n_ctx)
    most = 0
    launch = pipe.launch

    def watched(*a, **kw):
        nonlocal most
        launch(*a, **kw)
        most = max(most, stage_cells(pipe))
    pipe.launch = watched
    prompts = [[(k * 7 + i) % 29 for i in range(17)] for k in range(CACHE_ENTRIES + 3)]
    for p in prompts:
        assert run_one(sched, p, 4)[0] == target_alone(p, 4)[len(p):]
    assert len(sched.cache.entries) <= CACHE_ENTRIES
    big = [(11 * i) % 29 for i in range(80)]                        # needs nearly every cell: the entries go
    assert run_one(sched, big, 10)[0] == target_alone(big, 10)[len(big):]
    assert most <= n_ctx and sched.stats.n_compactions >= 1
    assert sched.cache.n_tokens <= n_ctx


def test_a_burst_with_disconnects_leaves_every_cell_cached_or_dead_and_counted():
    sched, pipe, pool = make("pipeinfer", n_parallel=4, prompt_chunk=C, n_ctx=400)
    check_cold_bits(pipe)
    system = [(13 * i + 2) % 29 for i in range(9)]
    answers = {}
    for k in range(12):
        prompt = system + [(k * 5 + i) % 29 for i in range(3 + k % 5)]
        streamed = []
        req = Request(list(prompt), 8, SamplingParams(), on_tokens=streamed.extend,
                      should_stop=(lambda s=streamed: len(s) >= 2) if k % 3 == 0 else None,
                      on_done=lambda t, s, k=k, p=prompt: answers.update({k: (p, t, s)}))
        sched.submit(req)
    sched.run()
    for k, (p, tokens, st) in answers.items():
        assert tokens == target_alone(p, 8)[len(p):len(p) + len(tokens)], k
    assert any(st.n_cached == 8 for _, _, st in answers.values())
    pipe.finish()
    entries = {e.seq for e in sched.cache.entries}
    for stage in pipe.stages:  # a cell is cached, or dead (garbage, a finished slot) until the next COMPACT
        held = {s for c in stage.cells for s in c.seqs}
        assert held <= entries | pipe.canon | {pipe.garbage}
        assert len(stage.cells) <= sched.cache_load()["cells_used"]
    assert pool.n_free == pool.n_partitions and not sched.gens


@pytest.mark.parametrize("mode", ["iterative", "pipeinfer"])
def test_idle_work_decodes_the_last_answer_in_whole_chunks_for_the_next_turn(mode):
    """Between turns the pipeline is idle: the entry's answer is decoded again as a cold run's chunks would decode
    it, so the next turn starts after the answer (every copied cell checked: computed in a whole, aligned chunk)."""
    sched, pipe, pool = make(mode, n_parallel=1, prompt_chunk=C)
    check_cold_bits(pipe)
    first, _ = run_one(sched, PROMPT, 9)
    (entry,) = sched.cache.entries
    held = entry.held   # the prompt, the answer but its last token (emitted, never decoded), and in pipeinfer mode
    assert held[:len(PROMPT) + len(first) - 1] == PROMPT + first[:-1]    # any tokens verified beyond it
    assert held == target_alone(PROMPT, len(held) - len(PROMPT))
    assert sched.has_idle_work() and sched.idle_work()
    sched.run()
    assert not sched.has_idle_work() and not sched.idle_work()
    assert [e.tokens for e in sched.cache.entries] == [held[:whole_chunks(len(held), C)]]
    turn2 = PROMPT + first + [4, 9, 1]
    second, st = run_one(sched, turn2, 6)
    assert second == target_alone(turn2, 6)[len(turn2):]
    assert st.n_cached == whole_chunks(common_prefix(held, turn2), C) > whole_chunks(len(PROMPT), C)
    if pool is not None:
        assert pool.n_free == pool.n_partitions


@pytest.mark.parametrize("mode", ["iterative", "pipeinfer"])
@pytest.mark.parametrize("n_ctx", [64, 80, 110])
def test_entries_make_room_for_newcomers_whose_chunks_are_not_fed_yet(mode, n_ctx):
    """Admitted prompts are fed a chunk at a time: the cells their unfed chunks will take count when the next
    newcomer's room is checked, so the cache's entries go before any stage runs out of cells."""
    sched, pipe, _ = make(mode, n_parallel=2, n_ctx=n_ctx, prompt_chunk=C)
    prompts = [[(k * 7 + i * 3) % 31 for i in range(22)] for k in range(8)]
    answers = {}
    for k, p in enumerate(prompts):
        sched.submit(Request(p, 4, on_done=lambda t, s, k=k: answers.update({k: t})))
        if k % 2:
            sched.run()   # pairs: the entries of the earlier pairs fill the cells
    sched.run()
    assert answers == {k: target_alone(p, 4)[22:] for k, p in enumerate(prompts)}
