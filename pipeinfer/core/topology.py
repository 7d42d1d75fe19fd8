"""Ranks, roles, layer ranges and communicators.

Rank 0 is the head: it holds the first target stage, sampling and verification, and the draft model
unless a rank of its own drafts (--draft-at rank: the world's last rank, outside the pipeline's ranks).
Ranks 1..N-1 hold the following target stages in order; the last stage sends its tokens back to rank 0.
"""
from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from typing import Callable


class SplitError(ValueError):
    """A layer split that cannot be applied (one-line message for the user)."""


@dataclass(frozen=True)
class LayerRange:
    start: int  # first layer, inclusive
    end: int    # last layer, exclusive

    @property
    def n_layers(self) -> int:
        return self.end - self.start

    def __str__(self) -> str:
        return f"[{self.start}, {self.end})"


def parse_split(text: str | None, n_ranks: int) -> list[float]:
    """'0.2,0.4,0.4' -> [0.2, 0.4, 0.4]; None or 'even' -> equal fractions."""
    if text is None or text.strip() in ("", "even"):
        return [1.0] * n_ranks
    try:
        fractions = [float(x) for x in text.replace("/", ",").split(",") if x.strip()]
    except ValueError:
        raise SplitError(f"--layer-split must be comma-separated numbers, got {text!r}") from None
    if len(fractions) != n_ranks:
        raise SplitError(f"--layer-split has {len(fractions)} fractions but there are {n_ranks} target ranks")
    if any(not math.isfinite(f) or f < 0 for f in fractions):
        raise SplitError(f"--layer-split fractions must be finite and >= 0, got {text!r}")
    if fractions[0] == 0:
        raise SplitError("--layer-split: rank 0 (the head) needs at least one layer")
    if sum(fractions) <= 0:
        raise SplitError(f"--layer-split fractions sum to zero: {text!r}")
    return fractions


def layer_ranges(n_layer: int, fractions: list[float]) -> list[LayerRange]:
    """Give rank i its share n_layer * f_i / sum f of the layers, rounded by largest remainder (the last ranks
    first among equal remainders: 80 layers on 32 equal ranks are 16 x 2 + 16 x 3, not 31 x 2 + 18), at least 1
    unless f_i == 0.

    Ranks with fraction 0 get an empty range (they hold no layers and only relay nothing; the CLI refuses
    them as pipeline stages). Raises SplitError when some rank with a positive fraction would get no layer.
    """
    n_ranks_active = sum(1 for f in fractions if f > 0)
    if n_ranks_active > n_layer:
        raise SplitError(f"{n_ranks_active} ranks need layers but the model has only {n_layer} layers")
    total = sum(fractions)
    shares = [n_layer * f / total for f in fractions]
    counts = [max(1, math.floor(x)) if f > 0 else 0 for x, f in zip(shares, fractions)]
    # trim from the largest shares while we overshoot (tiny shares given their one layer)
    while sum(counts) > n_layer:
        i = max(range(len(counts)), key=lambda k: (counts[k], k))
        counts[i] -= 1
    active = [i for i, f in enumerate(fractions) if f > 0]
    by_remainder = sorted(active, key=lambda i: (shares[i] - counts[i], i), reverse=True)
    for k in range(n_layer - sum(counts)):
        counts[by_remainder[k % len(by_remainder)]] += 1
    ranges, start = [], 0
    for c in counts:
        ranges.append(LayerRange(start, start + c))
        start += c
    assert start == n_layer and all(r.n_layers >= 1 for r, f in zip(ranges, fractions) if f > 0)
    return ranges


SPLIT_NAMES = ("balanced", "even", "auto")


def plan_layers(text: str | None, n_layer: int, n_ranks: int, layer_cost: list[float] | None = None,
                tail_cost: float = 0.0, speeds: list[float] | None = None,
                allowed: Callable[[int, int], bool] | None = None) -> list[LayerRange]:
    """--layer-split TEXT as every rank's layer range, rank 0 first.

    balanced (the default, and `auto` once every rank's speed is measured): the split that makes the slowest
    stage as fast as it can be (balanced_counts), counting the last stage's output projection (`tail_cost`) and
    each layer's own cost (`layer_cost`, in the same unit; None: every layer alike), among the splits whose every
    range [start, end) is `allowed` (the architecture's rules: stagefile.RangeCheck) when there is one.
    even: equal layer counts. Numbers: fractions of the layers (parse_split, layer_ranges)."""
    name = (text or "").strip() or "balanced"
    if name in ("balanced", "auto"):
        costs, speeds = layer_cost or [1.0] * n_layer, speeds or [1.0] * n_ranks
        try:
            counts = balanced_counts(costs, tail_cost, speeds, allowed)
        except SplitError:
            if allowed is None:
                raise
            counts = balanced_counts(costs, tail_cost, speeds)  # none allowed: the caller's check says why
        starts = [sum(counts[:r]) for r in range(n_ranks)]
        return [LayerRange(a, a + c) for a, c in zip(starts, counts)]
    return layer_ranges(n_layer, parse_split(text, n_ranks))


def balanced_counts(layer_cost: list[float], tail_cost: float, speeds: list[float],
                    allowed: Callable[[int, int], bool] | None = None) -> list[int]:
    """Layers per rank, contiguous from layer 0 and at least one each, that minimise the slowest rank's time per
    token: the cost of its layers, plus `tail_cost` on the last rank (the final norm and the vocabulary projection,
    which on a small model weigh several layers: Qwen2.5-1.5B's is 191 MB against 28 MB a layer), over its speed.
    In a pipeline every token passes every stage, so the slowest stage sets the pace; among splits with the same
    slowest stage, the one with the smaller sum of squared times (the more even) wins. With `allowed`, only splits
    whose every range [a, b) it allows (SplitError when there is none)."""
    n_layer, n_ranks = len(layer_cost), len(speeds)
    ok = functools.cache(allowed) if allowed else (lambda a, b: True)  # each range asked once, not once per rank
    if not 1 <= n_ranks <= n_layer:
        raise SplitError(f"{n_ranks} ranks need layers but the model has only {n_layer} layers")
    prefix = [0.0]
    for c in layer_cost:
        prefix.append(prefix[-1] + c)

    def time(r: int, a: int, b: int) -> float:  # rank r holding layers [a, b)
        return (prefix[b] - prefix[a] + (tail_cost if r == n_ranks - 1 else 0.0)) / max(speeds[r], 1e-12)

    # best[r][i]: (slowest time, sum of squares) of ranks 0..r holding layers [0, i); cut[r][i]: where rank r starts
    inf = (math.inf, math.inf)
    best = [[inf] * (n_layer + 1) for _ in range(n_ranks)]
    cut = [[0] * (n_layer + 1) for _ in range(n_ranks)]
    for i in range(1, n_layer + 1):
        t = time(0, 0, i)
        best[0][i] = (t, t * t) if ok(0, i) else inf
    for r in range(1, n_ranks):
        for i in range(r + 1, n_layer + 1):
            for j in range(r, i):
                prev = best[r - 1][j]
                if prev == inf or not ok(j, i):
                    continue
                t = time(r, j, i)
                cand = (max(prev[0], t), prev[1] + t * t)
                if (round(cand[0], 9), cand[1]) < (round(best[r][i][0], 9), best[r][i][1]):
                    best[r][i], cut[r][i] = cand, j
    if best[n_ranks - 1][n_layer] == inf:
        raise SplitError(f"no split of {n_layer} layers over {n_ranks} ranks has only allowed stages")
    counts, end = [], n_layer
    for r in range(n_ranks - 1, -1, -1):
        start = cut[r][end] if r > 0 else 0
        counts.append(end - start)
        end = start
    return counts[::-1]


def split_from_speeds(ms_per_layer: list[float]) -> list[float]:
    """Each rank's speed (1 / measured ms per layer), for --layer-split auto (plan_layers)."""
    return [1.0 / max(t, 1e-9) for t in ms_per_layer]


def memory_shortfall(slots: list[str], weights_bytes: int, head_bytes: int, available: dict[str, int],
                     fractions: list[float] | None = None) -> str | None:
    """Why the hosts in `slots` (one name per rank, rank 0 first) cannot hold the model, or None: each rank holds
    its share of the target's weights (`fractions` of the layers, as --layer-split gives them; None: even), rank 0
    also `head_bytes` (the draft model), and a host holds its ranks' shares together. Hosts missing from
    `available` (bytes) are not known, so not checked."""
    shares = fractions if fractions and len(fractions) == len(slots) else [1.0] * len(slots)
    need: dict[str, float] = {}
    for rank, host in enumerate(slots):
        need[host] = (need.get(host, 0.0) + weights_bytes * shares[rank] / sum(shares)
                      + (head_bytes if rank == 0 else 0))
    for host, n in need.items():
        if host in available and n > available[host]:
            k = slots.count(host)
            return (f"host {host} would hold {n / 2**30:.2f} GiB of the model on {k} rank(s) and has "
                    f"{available[host] / 2**30:.2f} GiB")
    return None


def parse_per_rank_ints(text: str | None, n_ranks: int, name: str, default: int | list[int]) -> list[int]:
    """'4,8,8' -> one value per rank; a single value applies to every rank; None -> default (one value, or one
    per rank)."""
    if text is None or str(text).strip() == "":
        return list(default) if isinstance(default, list) else [default] * n_ranks
    try:
        values = [int(x) for x in str(text).replace("/", ",").split(",") if x.strip()]
    except ValueError:
        raise SplitError(f"{name} must be comma-separated integers, got {text!r}") from None
    if len(values) == 1:
        values = values * n_ranks
    if len(values) != n_ranks or any(v < 1 for v in values):
        raise SplitError(f"{name} needs one positive value or {n_ranks} (one per rank), got {text!r}")
    return values


@dataclass(frozen=True)
class Topology:
    """Who is who: rank r holds layers ranges[r] of the target."""
    rank: int
    n_ranks: int
    ranges: tuple[LayerRange, ...]

    @property
    def is_last(self) -> bool:
        return self.rank == self.n_ranks - 1

    @property
    def next_rank(self) -> int:
        """Where this stage's output goes: the next stage, or the head for the last stage's tokens."""
        return (self.rank + 1) % self.n_ranks

    @property
    def prev_rank(self) -> int:
        return (self.rank - 1) % self.n_ranks

    @property
    def my_range(self) -> LayerRange:
        return self.ranges[self.rank]


def group_sizes(groups: str | None, tensor_parallel: int, n_ranks: int) -> list[int]:
    """Each pipeline stage's tensor group size, in rank order, over n_ranks target ranks: --groups '2,1,1' as given
    (they must add up to n_ranks), --tensor-parallel N as stages of N ranks each (N must divide n_ranks), neither
    as one rank per stage. A group's ranks are consecutive; its first is the stage's leader (engine/slices.py)."""
    if groups:
        try:
            sizes = [int(x) for x in str(groups).replace("/", ",").split(",") if x.strip()]
        except ValueError:
            raise SplitError(f"--groups must be comma-separated group sizes, got {groups!r}") from None
        if not sizes or any(s < 1 for s in sizes):
            raise SplitError(f"--groups sizes must be positive, got {groups!r}")
        if sum(sizes) != n_ranks:
            raise SplitError(f"--groups {groups} adds up to {sum(sizes)} ranks but {n_ranks} target ranks started")
        return sizes
    if n_ranks % tensor_parallel:
        raise SplitError(f"--tensor-parallel {tensor_parallel} does not divide the {n_ranks} target ranks into groups")
    return [tensor_parallel] * (n_ranks // tensor_parallel)


def stage_group_sizes(groups: str | None, tensor_parallel: int, n_stages: int) -> list[int]:
    """Each of a run's n_stages pipeline stages' tensor group size, from the options that made it (group_sizes's
    --groups or --tensor-parallel; neither: one rank each)."""
    if groups:
        return group_sizes(groups, 1, sum(int(x) for x in str(groups).replace("/", ",").split(",") if x.strip()))
    return [tensor_parallel] * n_stages


def stage_speeds(speeds: list[float] | None, groups: Groups | None) -> list[float] | None:
    """Each stage's speed for the balanced split: its leader's (measured, else 1) times its tensor group's size (a
    group of G divides each layer's work G ways)."""
    if groups is None or not groups.any:
        return speeds
    return [(speeds[s] if speeds else 1.0) * g for s, g in enumerate(groups.sizes)]


@dataclass(frozen=True)
class Groups:
    """Which target ranks form each stage's tensor group (world ranks, the draft rank left out)."""
    sizes: tuple[int, ...]

    @property
    def leaders(self) -> list[int]:
        return [sum(self.sizes[:s]) for s in range(len(self.sizes))]

    def stage_of(self, rank: int) -> int:
        return max(s for s, first in enumerate(self.leaders) if first <= rank)

    def members(self, stage: int) -> list[int]:
        first = self.leaders[stage]
        return list(range(first, first + self.sizes[stage]))

    @property
    def any(self) -> bool:
        return any(s > 1 for s in self.sizes)

    def describe(self) -> str:
        return " | ".join("{" + ",".join(map(str, self.members(s))) + "}" for s in range(len(self.sizes)))
