"""The round's plan (decide/planner.py) and the batching rules (decide/batching.py): pure functions on made-up views."""
from pipeinfer.decide.batching import BatchRules, Held, ride_cost_ms
from pipeinfer.decide.planner import GenView, RoundView, held_after, plan_feeds, plan_round

RULES = BatchRules(batch_rows=8, depth=2, n_stages=2)
ALONE = BatchRules(batch_rows=1, depth=2, n_stages=2)
DEEP = BatchRules(batch_rows=8, depth=3, n_stages=3)


def view(*gens: GenView, n_in_flight=0, held=Held(), row_cap=8, cells_other=0, reserve=10, n_ctx=4096,
         mode="pipeinfer") -> RoundView:
    return RoundView(tuple(gens), n_in_flight, held, row_cap, cells_other, reserve, n_ctx, mode)


def never_rides(gen: int, n_rows: int) -> int:
    raise AssertionError("ride_len asked where the lend does not depend on it")


def test_a_round_that_might_not_fit_compacts_and_does_nothing_else():
    gens = (GenView(cells=3000), GenView(cells=1085))
    assert plan_round(view(*gens), DEEP, never_rides).compact                    # 4085 + 2 + 10 > 4096
    assert not plan_round(view(*gens, n_ctx=4097), DEEP, never_rides).compact   # 4085 + 2 + 10 = 4097 fits
    done = (GenView(cells=4090, done=True),)                                     # done ones only drain
    assert not plan_round(view(*done), RULES, never_rides).compact


def test_prompt_chunks_go_out_while_fewer_than_the_stages_are_in_flight_fewest_left_first():
    long, short = GenView(chunks=((63, 0),) * 3), GenView(chunks=((63, 0), (5, 0)))
    feeds, _ = plan_feeds(view(long, short), ALONE)
    assert feeds == (1, 1)                       # the short prompt first, and no more than the 2 stages in flight
    feeds, _ = plan_feeds(view(long, short.__class__(chunks=((5, 0),), prompt_in_flight=1)), ALONE)
    assert feeds == (1,)                         # one of its runs is already out: one more fills the stages


def test_a_chunk_beyond_the_stages_goes_out_only_where_it_joins_rows_held():
    gen = GenView(chunks=((3, 0), (3, 0), (3, 0)), prompt_in_flight=2)
    feeds, held = plan_feeds(view(gen, held=Held(1, 1)), RULES)
    assert feeds == (0, 0) and held == Held(7, 1)       # 1 + 3 + 3 rows; a third chunk would pass 8 rows
    feeds, held = plan_feeds(view(gen), RULES)
    assert feeds == () and held == Held()                # nothing held: nothing to join
    with_edits = GenView(chunks=((3, 2),), prompt_in_flight=2)  # a cached start's copy goes after the rows held
    assert plan_feeds(view(with_edits, held=Held(1, 1)), RULES)[0] == ()


def test_held_after_follows_the_executors_rules():
    assert held_after(Held(), 3, 0, RULES, 4) == Held(3, 0)
    assert held_after(Held(3, 0), 1, 0, RULES, 4) == Held(4, 1)           # a next token joins
    assert held_after(Held(6, 0), 3, 0, RULES, 4) == Held(3, 0)           # no room: the held rows go first
    assert held_after(Held(2, 0), 2, 1, RULES, 4) == Held(2, 0)           # KV edits: the held rows go first
    assert held_after(Held(2, 0), 9, 0, RULES, 4) == Held()               # too big to share: goes alone, with them
    assert held_after(Held(), 1, 0, ALONE, 1) == Held()                   # no sharing: nothing is ever held


def test_the_drafter_goes_to_the_oldest_decoding_generation_while_a_stage_would_idle():
    newcomer, old = GenView(chunks=((63, 0),) * 4), GenView()
    plan = plan_round(view(newcomer, old), RULES, never_rides)
    assert plan.lend_to == 1 and plan.speculate and not plan.to_ride   # the newcomer is still being fed
    fed_now = GenView(chunks=((63, 0),))
    plan = plan_round(view(fed_now, old), DEEP, never_rides)
    assert plan.feeds == (0,) and plan.lend_to == 0                    # its last chunk went out: it decodes now
    assert plan_round(view(GenView(), GenView(background=True)), RULES, never_rides).lend_to == 0
    assert plan_round(view(old, mode="iterative"), RULES, never_rides).lend_to is None
    sync = plan_round(view(old, mode="speculative"), RULES, never_rides)
    assert sync.lend_to == 0 and not sync.speculate                    # it drafts when it covers its next token


def test_beyond_the_pipeline_depth_the_drafter_is_lent_only_where_its_rows_pay_riding():
    gens = (GenView(), GenView(), GenView())
    asked = []
    plan = plan_round(view(*gens, row_cap=2), RULES, lambda g, n: asked.append((g, n)) or 0)
    assert plan.lend_to is None and asked == [(0, 2)]
    plan = plan_round(view(*gens, row_cap=2), RULES, lambda g, n: 2)
    assert plan.lend_to == 0 and plan.to_ride
    assert plan_round(view(*gens, row_cap=2), ALONE, never_rides).lend_to is None  # no shared decodes: no rides


def test_batch_rules():
    r = RULES
    assert [r.row_cap(n) for n in (1, 2, 3, 8, 40)] == [1, 1, 2, 4, 8]
    assert r.room(Held(6, 2), 2, 4) and not r.room(Held(7, 2), 2, 4) and not r.room(Held(2, 4), 1, 4)
    assert r.holding(Held(2, 1), 2, 2) and not r.holding(Held(2, 2), 2, 2) and not r.holding(Held(2, 1), 2, 1)
    assert r.speculates_alone(1, 5) and r.speculates_alone(3, 1) and not r.speculates_alone(3, 2)
    assert r.rides(Held(2, 2), 6, False, True) and not r.rides(Held(2, 2), 7, False, True)
    assert not r.rides(Held(2, 2), 1, True, True) and not r.rides(Held(2, 2), 1, False, False)
    assert not r.rides(Held(), 1, False, True)
    assert ride_cost_ms([]) is None and ride_cost_ms([(0, 4.0), (1, 2.0), (1, 3.0)]) == 4.5
