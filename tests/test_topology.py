"""Layer splits, per-rank integer options and ring neighbours (pure functions, no MPI)."""
from __future__ import annotations

import pytest

from pipeinfer.core.topology import (LayerRange, SplitError, Topology, balanced_counts, layer_ranges,
                                     parse_per_rank_ints, parse_split, plan_layers, split_from_speeds)


# ---------------------------------------------------------------- parse_split
@pytest.mark.parametrize("text", [None, "", "  ", "even", " even "])
def test_parse_split_even_default(text):
    assert parse_split(text, 3) == [1.0, 1.0, 1.0]


def test_parse_split_fractions():
    assert parse_split("0.2,0.4,0.4", 3) == [0.2, 0.4, 0.4]
    assert parse_split("1/2/1", 3) == [1.0, 2.0, 1.0]       # '/' is accepted as a separator
    assert parse_split(" 3 , 1 ", 2) == [3.0, 1.0]
    assert parse_split("2,0,1", 3) == [2.0, 0.0, 1.0]        # a middle rank may hold nothing


def test_parse_split_count_mismatch_names_both_numbers():
    with pytest.raises(SplitError) as e:
        parse_split("0.5,0.5", 3)
    msg = str(e.value)
    assert "2" in msg and "3" in msg and "--layer-split" in msg
    with pytest.raises(SplitError, match=r"4 fractions .* 2 target ranks"):
        parse_split("1,1,1,1", 2)


@pytest.mark.parametrize("text", ["0.5,-0.1,0.6", "nan,1", "1,nan", "inf,1", "1,-inf"])
def test_parse_split_rejects_negative_and_non_finite(text):
    with pytest.raises(SplitError, match="finite and >= 0"):
        parse_split(text, 2 if text.count(",") == 1 else 3)


@pytest.mark.parametrize("text", ["a,b", "0.5,x", "1;2", "0.5 0.5"])
def test_parse_split_rejects_non_numeric(text):
    with pytest.raises(SplitError, match="comma-separated numbers"):
        parse_split(text, 2)


@pytest.mark.parametrize("text", ["0,1,1", "0.0,2", "-0,1"])
def test_parse_split_head_needs_a_layer(text):
    with pytest.raises(SplitError, match="rank 0"):
        parse_split(text, text.count(",") + 1)


def test_split_error_is_a_value_error():
    assert issubclass(SplitError, ValueError)


# ---------------------------------------------------------------- layer_ranges
def _check_cover(ranges: list[LayerRange], n_layer: int, fractions: list[float]) -> None:
    assert ranges[0].start == 0 and ranges[-1].end == n_layer
    for a, b in zip(ranges, ranges[1:]):
        assert a.end == b.start                      # contiguous, no overlap, no gap
    assert sum(r.n_layers for r in ranges) == n_layer
    for r, f in zip(ranges, fractions):
        assert (r.n_layers >= 1) if f > 0 else (r.n_layers == 0)


@pytest.mark.parametrize("n_layer, fractions, expected", [
    (28, [1, 1], [(0, 14), (14, 28)]),
    (28, [1, 1, 1], [(0, 9), (9, 18), (18, 28)]),          # 27 whole, the leftover to the last rank
    (10, [1, 1, 1], [(0, 3), (3, 6), (6, 10)]),
    (5, [1, 1], [(0, 2), (2, 5)]),                         # 2.5 twice: the leftover to the last
    (10, [0.2, 0.4, 0.4], [(0, 2), (2, 6), (6, 10)]),
    (4, [0.1, 0.45, 0.45], [(0, 1), (1, 2), (2, 4)]),      # a 1-layer rank; equal remainders: the last first
    (10, [1, 1, 1, 1], [(0, 2), (2, 4), (4, 7), (7, 10)]),  # 2.5 each: the last two take the leftovers
    (6, [0.05, 0.05, 0.9], [(0, 1), (1, 2), (2, 6)]),      # two tiny shares' layers trimmed from the largest
    (10, [1, 0.01, 0.01], [(0, 8), (8, 9), (9, 10)]),     # tiny shares still get one layer each
    (4, [1, 0, 1], [(0, 2), (2, 2), (2, 4)]),              # fraction 0: empty range
    (6, [1, 1, 0], [(0, 3), (3, 6), (6, 6)]),              # last rank empty: leftovers to the last *active* rank
    (3, [1, 1, 1], [(0, 1), (1, 2), (2, 3)]),              # exactly one layer per rank
    (1, [1], [(0, 1)]),
])
def test_layer_ranges_exact(n_layer, fractions, expected):
    ranges = layer_ranges(n_layer, fractions)
    assert [(r.start, r.end) for r in ranges] == expected
    _check_cover(ranges, n_layer, fractions)


@pytest.mark.parametrize("n_layer", [2, 3, 5, 7, 12, 18, 28, 32, 80])
@pytest.mark.parametrize("fractions", [[1], [1, 1], [0.2, 0.4, 0.4], [5, 1, 1, 1], [0.01, 1, 0.01],
                                       [1, 0, 3], [1, 2, 3, 4, 5], [0.3, 0.3, 0.3, 0.05, 0.05]])
def test_layer_ranges_cover_all_layers(n_layer, fractions):
    if sum(f > 0 for f in fractions) > n_layer:
        with pytest.raises(SplitError):
            layer_ranges(n_layer, fractions)
        return
    ranges = layer_ranges(n_layer, fractions)
    assert len(ranges) == len(fractions)
    _check_cover(ranges, n_layer, fractions)


def test_layer_ranges_more_ranks_than_layers():
    with pytest.raises(SplitError, match=r"3 ranks need layers but the model has only 2 layers"):
        layer_ranges(2, [1, 1, 1])
    assert [r.n_layers for r in layer_ranges(2, [1, 0, 1])] == [1, 0, 1]  # inactive ranks do not count


def test_layer_range_str_and_size():
    r = LayerRange(3, 7)
    assert r.n_layers == 4 and str(r) == "[3, 7)"


def test_split_from_speeds_is_inverse_time():
    f = split_from_speeds([10.0, 5.0, 0.0])
    assert f[0] == pytest.approx(0.1) and f[1] == pytest.approx(0.2) and f[2] > 1e6  # 0 ms: clamped, no div by 0
    assert [r.n_layers for r in layer_ranges(9, split_from_speeds([2.0, 1.0]))] == [3, 6]


# ---------------------------------------------------------------- parse_per_rank_ints
def test_parse_per_rank_ints():
    assert parse_per_rank_ints("4,8,8", 3, "--threads", 2) == [4, 8, 8]
    assert parse_per_rank_ints("4/8/8", 3, "--threads", 2) == [4, 8, 8]
    assert parse_per_rank_ints("5", 3, "--threads", 2) == [5, 5, 5]   # one value for every rank
    assert parse_per_rank_ints(6, 2, "--threads", 2) == [6, 6]        # a click int passes through
    assert parse_per_rank_ints(None, 3, "--threads", 2) == [2, 2, 2]
    assert parse_per_rank_ints("", 2, "--threads", 7) == [7, 7]


@pytest.mark.parametrize("text, what", [
    ("4,8", "one positive value or 3"),
    ("4,8,8,8", "one positive value or 3"),
    ("0", "one positive value or 3"),
    ("4,-1,2", "one positive value or 3"),
    ("a,b,c", "comma-separated integers"),
    ("1.5", "comma-separated integers"),
])
def test_parse_per_rank_ints_rejects(text, what):
    with pytest.raises(SplitError, match=what) as e:
        parse_per_rank_ints(text, 3, "--threads-batch", 1)
    assert "--threads-batch" in str(e.value)


# ---------------------------------------------------------------- Topology
def test_topology_ring():
    ranges = tuple(layer_ranges(12, [1, 1, 1]))
    head, mid, last = (Topology(r, 3, ranges) for r in range(3))
    assert (head.is_last, head.next_rank, head.prev_rank) == (False, 1, 2)
    assert (mid.is_last, mid.next_rank, mid.prev_rank) == (False, 2, 0)
    assert (last.is_last, last.next_rank, last.prev_rank) == (True, 0, 1)  # tokens go to the head
    assert [t.my_range for t in (head, mid, last)] == [LayerRange(0, 4), LayerRange(4, 8), LayerRange(8, 12)]


def test_topology_single_rank():
    t = Topology(0, 1, (LayerRange(0, 4),))
    assert t.is_last and t.next_rank == 0 and t.prev_rank == 0


def test_memory_shortfall_counts_each_hosts_share_of_the_model():
    from pipeinfer.core.topology import memory_shortfall
    gib = 2**30
    # 3 hosts hold 12 GiB of weights as 4 GiB each, the head's host the 1 GiB draft too
    assert memory_shortfall(["a", "b", "c"], 12 * gib, gib, {"a": 5 * gib, "b": 4 * gib, "c": 4 * gib}) is None
    # after c is lost: 6 GiB each, a (7 with the draft) has 5: named, with both numbers
    assert memory_shortfall(["a", "b"], 12 * gib, gib, {"a": 5 * gib, "b": 8 * gib}) == (
        "host a would hold 7.00 GiB of the model on 1 rank(s) and has 5.00 GiB")
    # a host's ranks add up; a host of unknown memory is not checked
    assert memory_shortfall(["a", "a", "b"], 12 * gib, 0, {"a": 7 * gib}) == (
        "host a would hold 8.00 GiB of the model on 2 rank(s) and has 7.00 GiB")
    assert memory_shortfall(["a", "b"], 12 * gib, gib, {}) is None
    # an uneven --layer-split weighs the shares: a quarter of the layers on a (3 + 1 GiB), three quarters on b
    assert memory_shortfall(["a", "b"], 12 * gib, gib, {"a": 5 * gib, "b": 8 * gib}, [0.25, 0.75]) == (
        "host b would hold 9.00 GiB of the model on 1 rank(s) and has 8.00 GiB")
    assert memory_shortfall(["a", "b"], 12 * gib, gib, {"a": 4 * gib, "b": 9 * gib}, [1, 3]) is None


def test_a_supervisors_memory_check_takes_what_the_ranks_measured():
    """Hosts without mem= are checked against what their ranks found available when the last job started; where
    both are known the lesser counts."""
    from pipeinfer.supervisor.placement import Footprint
    gib = 2**30
    fp = Footprint(12 * gib, 0, {"b": 7.0})
    assert fp.shortfall(["a", "b"]) is None  # a unknown (not checked), b declares 7 for its 6
    assert fp.shortfall(["a", "b"], None, {"a": 5 * gib, "b": 9 * gib}) == (
        "host a would hold 6.00 GiB of the model on 1 rank(s) and has 5.00 GiB")
    assert fp.shortfall(["a", "b"], [1, 2], {"a": 5 * gib, "b": 9 * gib}) == (
        "host b would hold 8.00 GiB of the model on 1 rank(s) and has 7.00 GiB")  # mem=7 below the measured 9
    assert fp.shortfall(["a", "b"], [3, 1], {"a": 10 * gib, "b": 9 * gib}) is None


def test_split_fractions_read_from_the_jobs_configuration():
    from pipeinfer.core.config import StageOptions
    from pipeinfer.supervisor.placement import split_fractions
    assert split_fractions(StageOptions(layer_split="0.25,0.75"), 2) == [0.25, 0.75]
    assert split_fractions(StageOptions(layer_split="1,3"), 2) == [1.0, 3.0]
    assert split_fractions(StageOptions(layer_split="auto"), 2) is None      # measured by the job: not known yet
    assert split_fractions(StageOptions(layer_split="1,2,3"), 2) is None     # the job itself refuses it, in one line
    assert split_fractions(StageOptions(), 2) is None


# ---------------------------------------------------------------- plan_layers / balanced_counts
def test_balanced_counts_gives_the_output_projection_its_weight():
    # Qwen2.5-Coder-1.5B Q4_K_M: 28 layers of ~28 MB, an output projection of 191 MB on the last rank
    assert balanced_counts([28.0] * 28, 191.0, [1.0, 1.0]) == [17, 11]
    assert balanced_counts([28.0] * 28, 0.0, [1.0, 1.0]) == [14, 14]
    assert balanced_counts([1.0] * 5, 0.0, [1.0, 1.0]) == [2, 3]


def test_balanced_counts_minimises_the_slowest_rank():
    import itertools
    costs, tail, speeds = [3.0, 1.0, 4.0, 1.0, 5.0, 9.0, 2.0, 6.0], 7.0, [1.0, 2.0, 1.5]

    def slowest(counts):
        out, a = [], 0
        for r, c in enumerate(counts):
            out.append((sum(costs[a:a + c]) + (tail if r == len(counts) - 1 else 0)) / speeds[r])
            a += c
        return max(out)
    every = [c for c in itertools.product(range(1, 7), repeat=3) if sum(c) == len(costs)]
    got = balanced_counts(costs, tail, speeds)
    assert sum(got) == len(costs) and min(got) >= 1
    assert slowest(got) == pytest.approx(min(slowest(c) for c in every))


def test_balanced_counts_follows_speed():
    assert balanced_counts([1.0] * 12, 0.0, [2.0, 1.0]) == [8, 4]
    assert balanced_counts([1.0] * 12, 0.0, [1.0, 1.0, 1.0]) == [4, 4, 4]


@pytest.mark.parametrize("n_ranks", [0, 4])
def test_balanced_counts_needs_a_layer_per_rank(n_ranks):
    with pytest.raises(SplitError):
        balanced_counts([1.0] * 3, 0.0, [1.0] * n_ranks)


def test_balanced_counts_keeps_to_the_allowed_ranges():
    """An architecture's rule (stagefile.RangeCheck: llama4's stages start at multiples of 4) limits the balanced
    split to the ranges it allows; with none allowed, plan_layers gives the unconstrained split (the caller's check
    then says why it is refused); fractions stay as given."""
    at4 = lambda a, b: a % 4 == 0 and b - a >= 4  # noqa: E731
    assert balanced_counts([1.0] * 28, 0.0, [1.0, 1.0]) == [14, 14]
    assert balanced_counts([1.0] * 28, 0.0, [1.0, 1.0], at4) == [12, 16]
    assert balanced_counts([1.0] * 12, 0.0, [1.0] * 3, at4) == [4, 4, 4]
    with pytest.raises(SplitError, match="allowed"):
        balanced_counts([1.0] * 12, 0.0, [1.0] * 4, at4)
    spans = lambda rs: [(r.start, r.end) for r in rs]  # noqa: E731
    assert spans(plan_layers(None, 12, 4, allowed=at4)) == [(0, 3), (3, 6), (6, 9), (9, 12)]
    assert spans(plan_layers("0.5,0.5", 28, 2, allowed=at4)) == [(0, 14), (14, 28)]


def test_plan_layers_names_and_fractions():
    cost, tail = [28.0] * 28, 191.0
    spans = lambda rs: [(r.start, r.end) for r in rs]  # noqa: E731
    assert spans(plan_layers(None, 28, 2, cost, tail)) == [(0, 17), (17, 28)]          # default: balanced
    assert spans(plan_layers(" balanced ", 28, 2, cost, tail)) == [(0, 17), (17, 28)]
    assert spans(plan_layers("even", 28, 2, cost, tail)) == [(0, 14), (14, 28)]
    assert spans(plan_layers("0.25,0.75", 28, 2, cost, tail)) == [(0, 7), (7, 28)]     # fractions: as given
    assert spans(plan_layers("auto", 28, 2, cost, tail, speeds=[1.0, 1.0])) == [(0, 17), (17, 28)]
    assert spans(plan_layers(None, 4, 2)) == [(0, 2), (2, 4)]                          # no costs: layers alike
    with pytest.raises(SplitError, match="only 2 layers"):
        plan_layers(None, 2, 3)
    with pytest.raises(SplitError, match="comma-separated"):
        plan_layers("fastest", 28, 2, cost, tail)
