"""The micro-batch's shape (decide/shape.py): which runner-ups pay as siblings, and the tree they make."""
from pipeinfer.drafters.drafter import DraftNode, main_chain
from pipeinfer.decide.shape import add_siblings, choose_siblings, fixed_siblings, ride_len, run_time_ms

CHEAP = [[100.0, 105.0, 110.0, 115.0], [100.0, 105.0, 110.0, 115.0]]   # a row costs 5% (memory-bound hosts)
LINEAR = [[24.0, 45.0, 67.0, 83.0], [35.0, 70.0, 105.0, 140.0]]      # this machine's one-thread decodes


def chain(*alts: tuple[int, float]) -> list[DraftNode]:
    """A chain of tokens 10, 11, ... with the given (runner-up, probability) at each depth."""
    return [DraftNode(10 + d, d - 1, d, {0}, 0.8, a, p) for d, (a, p) in enumerate(alts)]


def test_a_likely_runner_up_joins_when_rows_are_cheap_and_not_when_they_cost_a_decode():
    c = chain((50, 0.4), (51, 0.3))
    assert choose_siblings(c, 0.8, 1.0, CHEAP, (0.0, 0.0), 4, 3, 0.35) == [0]       # 0.3 < -ps 0.35
    assert choose_siblings(c, 0.8, 1.0, CHEAP, (0.0, 0.0), 4, 3, 0.0) == [0, 1]
    assert choose_siblings(chain((50, 0.4), (51, 0.05)), 0.8, 1.0, CHEAP, (0.0, 0.0), 4, 3, 0.0) == [0]  # 4% for 5%
    assert choose_siblings(c, 0.8, 1.0, LINEAR, (0.0, 0.0), 4, 3, 0.0) == []
    assert choose_siblings(c, 0.8, 0.0, CHEAP, (0.0, 0.0), 4, 3, 0.0) == []         # siblings never right so far


def test_siblings_stay_within_the_cap_and_the_branches():
    c = chain((50, 0.5), (51, 0.5), (52, 0.5))
    assert choose_siblings(c, 0.9, 1.0, CHEAP, (0.0, 0.0), 4, 3, 0.0) == [0]         # 3 + 1 rows: the cap
    assert choose_siblings(c[:1], 0.9, 1.0, CHEAP, (0.0, 0.0), 4, 1, 0.0) == [0]
    assert choose_siblings(c[:2], 0.9, 1.0, CHEAP, (0.0, 0.0), 4, 1, 0.0) == [0]     # --max-branches 2: one
    assert choose_siblings(c[:2], 0.9, 1.0, CHEAP, (0.0, 0.0), 4, 0, 0.0) == []
    same = [DraftNode(10, -1, 0, {0}, 0.8, 10, 0.5), DraftNode(11, 0, 1, {0}, 0.8, -1, 0.0)]
    assert choose_siblings(same, 0.9, 1.0, CHEAP, (0.0, 0.0), 4, 3, 0.0) == []      # no runner-up, or the token itself


def test_the_rate_counts_a_refill_when_the_chain_breaks():
    assert run_time_ms(1, 1, 1.0, CHEAP, (0.0, 0.0)) == 100.0
    assert run_time_ms(2, 1, 0.5, CHEAP, (0.0, 0.0)) == 105.0 + 0.5 * 210.0


def test_add_siblings_makes_one_branch_per_sibling_sharing_the_chain_before_it():
    c = chain((50, 0.4), (51, 0.3), (52, 0.2))
    tree = add_siblings(c, [2, 0])
    assert [n.token for n in tree] == [10, 11, 12, 50, 52]
    assert [sorted(n.branches) for n in tree] == [[0, 2], [0, 2], [0], [1], [2]]
    assert [(n.parent, n.depth) for n in tree[3:]] == [(-1, 0), (1, 2)]
    assert main_chain(tree) == [0, 1, 2]
    assert [sorted(n.branches) for n in c] == [[0], [0], [0]]                      # the chain is left as it was


def test_without_costs_runner_ups_take_rows_from_the_chains_tail():
    c = chain((50, 0.4), (51, 0.3), (-1, 0.0), (53, 0.3))
    assert fixed_siblings(c, 4, 3, 0.1) == (2, [0, 1])     # 2 chain tokens + 2 siblings: the cap
    assert fixed_siblings(c, 4, 1, 0.1) == (3, [0])
    assert fixed_siblings(c, 4, 3, 0.35) == (3, [0])
    assert fixed_siblings(c, 2, 3, 0.1) == (1, [0])
    assert fixed_siblings(c[2:], 4, 3, 0.1) == (2, [1])     # no runner-up at depth 0; depth 1's fits a third row
    assert fixed_siblings(c[2:], 2, 3, 0.1) == (2, [])      # ... and not within 2


TILED = [[130.0] * 8 + [140.0] * 8, [130.0] * 8 + [140.0] * 8]    # tiled GEMM: 16 rows cost 1.08x one
REPACKED = [[20.0, 37.0, 54.0, 71.0, 88.0, 105.0], [20.0, 37.0, 54.0, 71.0, 88.0, 105.0]]  # a row costs what it costs alone


def test_draft_rows_ride_where_rows_are_nearly_free_and_not_where_each_costs_a_decode():
    assert ride_len(4, 0.6, TILED, (0.0, 0.0), 4) == 4          # every draft token adds a^i for nothing
    assert ride_len(4, 0.6, REPACKED, (0.0, 0.0), 4) == 0       # a certain row beats a draft row
    assert ride_len(1, 0.8, REPACKED, (0.0, 0.0), 2) == 0       # 1.8 tokens in 37 ms against 1 in 20
    assert ride_len(1, 0.99, REPACKED, (0.0, 0.0), 2) == 2      # a nearly sure draft: 2.97 in 54 ms
    assert ride_len(2, 0.99, [[20.0, 21.0, 30.0, 40.0]], (0.0, 0.0), 2) == 1   # the cheap 3rd row only
    assert ride_len(12, 0.6, TILED, (0.0, 0.0), 4) == 4         # up to 16 rows measured
    assert ride_len(14, 0.6, TILED, (0.0, 0.0), 4) == 2         # not beyond the measured sizes
    assert ride_len(16, 0.6, TILED, (0.0, 0.0), 4) == 0


def test_drafting_on_the_head_and_a_poor_acceptance_take_the_ride_away():
    assert ride_len(4, 0.6, TILED, (5.0, 10.0), 4) == 2         # 130 + 5 + 10k: the third token's 0.22 costs 10 ms
    assert ride_len(4, 0.6, TILED, (40.0, 40.0), 4) == 0        # a draft call as dear as a third of the decode
    assert ride_len(4, 0.02, TILED, (5.0, 10.0), 4) == 0
    assert ride_len(0, 0.9, TILED, (0.0, 0.0), 4) == 0          # nothing to ride


def test_start_up_times_a_micro_batch_s_sizes_and_every_4th_beyond_and_fills_the_rest_in():
    from pipeinfer.ranks.startup import cost_curve, cost_probe_sizes
    assert cost_probe_sizes(3, 3) == [1, 2, 3]
    assert cost_probe_sizes(4, 20) == [1, 2, 3, 4, 8, 12, 16, 20]
    assert cost_probe_sizes(3, 13) == [1, 2, 3, 7, 11, 13]
    assert cost_probe_sizes(8, 3) == [1, 2, 3]
    assert cost_curve([1, 2, 3, 7], [10.0, 12.0, 14.0, 22.0], 7) == (10.0, 12.0, 14.0, 16.0, 18.0, 20.0, 22.0)
