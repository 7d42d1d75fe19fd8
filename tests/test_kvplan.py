"""Sequence partitions and the KV ops of a run's life (invariants 4, 6, 7, 11)."""
from __future__ import annotations

import numpy as np
import pytest

from pipeinfer.core.kvplan import (CANONICAL, PartitionPool, cells_reserve, commit_ops, in_flight_limit, garbage_seq, plan_partitions,
                              prefix_ops, retire_starts)
from pipeinfer.core.protocol import KvOp

RM, CP = int(KvOp.RM), int(KvOp.CP)


# ---------------------------------------------------------------- PartitionPool
def test_pool_fifo_order():
    pool = PartitionPool(3, 4, 256)
    assert [pool.take(), pool.take(), pool.take()] == [0, 1, 2]
    assert pool.take() is None and pool.n_free == 0
    pool.give_back(2)
    pool.give_back(0)
    assert pool.n_free == 2
    assert pool.take() == 2            # oldest freed first: a just-cleared partition is reused last
    pool.give_back(1)
    assert [pool.take(), pool.take(), pool.take()] == [0, 1, None]


def test_pool_exhausted_returns_none_repeatedly():
    pool = PartitionPool(1, 1, 3)
    assert pool.take() == 0
    assert pool.take() is None and pool.take() is None


def test_pool_double_free_asserts():
    pool = PartitionPool(2, 4, 256)
    k = pool.take()
    pool.give_back(k)
    with pytest.raises(AssertionError, match="freed twice"):
        pool.give_back(k)
    with pytest.raises(AssertionError):
        pool.give_back(1)              # never taken: still free


@pytest.mark.parametrize("n_part, size, n_seq_max", [(1, 1, 3), (4, 1, 6), (15, 16, 256), (3, 4, 14), (254, 1, 256)])
def test_pool_seqs_disjoint_and_never_canonical_or_garbage(n_part, size, n_seq_max):
    pool = PartitionPool(n_part, size, n_seq_max)
    assert 0 < pool.garbage_seq < n_seq_max and pool.garbage_seq == 1 + n_part * size
    seen: set[int] = set()
    for k in range(n_part):
        s = pool.seqs(k)
        assert s == list(range(1 + k * size, 1 + (k + 1) * size))
        assert CANONICAL not in s and pool.garbage_seq not in s and all(0 < x < n_seq_max for x in s)
        assert not seen & set(s)
        seen |= set(s)
    assert len(seen) == n_part * size


@pytest.mark.parametrize("n_part, size, n_seq_max", [(16, 16, 256), (0, 4, 256), (2, 0, 256), (4, 1, 5), (1, 1, 2),
                                                   (255, 1, 256)])
def test_pool_rejects_what_does_not_fit(n_part, size, n_seq_max):
    with pytest.raises(ValueError, match="do not fit"):
        PartitionPool(n_part, size, n_seq_max)


# ---------------------------------------------------------------- plan_partitions
@pytest.mark.parametrize("max_branches, max_in_flight, expected", [
    (1, 4, (4, 6)),
    (4, 2, (2, 10)),
    (16, 100, (15, 242)),        # 16 * 16 + 2 > 256: at most 15 partitions
    (16, 8, (8, 130)),
    (1, 1000, (254, 256)),
    (254, 4, (1, 256)),
    (8, 0, (1, 10)),             # at least one partition
])
def test_plan_partitions(max_branches, max_in_flight, expected):
    n_part, n_seq = plan_partitions(max_branches, max_in_flight)
    assert (n_part, n_seq) == expected
    assert n_seq <= 256 and n_seq == 2 + n_part * max_branches  # sequence 0, partitions, garbage
    pool = PartitionPool(n_part, max_branches, n_seq)  # the plan always fits its pool
    assert pool.garbage_seq == garbage_seq(n_seq) == n_seq - 1  # stages find the same garbage id


def test_no_garbage_and_one_cell_without_partitions():
    assert garbage_seq(1) is None
    assert cells_reserve(0, 4) == 1                       # iterative: one token per round
    assert cells_reserve(3, 4) == 20                      # 3 partitions + 1 run, 4 drafted + 1 lead token each


@pytest.mark.parametrize("max_branches", [1, 2, 3, 7, 16, 31, 64, 100, 128, 200, 254])
def test_plan_partitions_respects_llama_cap(max_branches):
    n_part, n_seq = plan_partitions(max_branches, 10_000)
    assert n_seq <= 256 and n_part == 254 // max_branches


def test_plan_partitions_too_wide():
    with pytest.raises(ValueError, match="--max-branches 255"):
        plan_partitions(255, 4)
    assert plan_partitions(4, 4, n_seq_max=10) == (2, 10)


# ---------------------------------------------------------------- prefix_ops / commit_ops
def test_prefix_ops_without_parent():
    ops = prefix_ops([5, 6], 10, None, 10)
    assert ops.dtype == np.int32 and ops.shape == (4, 5)
    assert ops.tolist() == [[RM, 5, -1, -1, -1], [CP, 0, 5, 0, 10],
                            [RM, 6, -1, -1, -1], [CP, 0, 6, 0, 10]]


def test_prefix_ops_with_parent():
    ops = prefix_ops([5, 6], 10, 3, 13)
    assert ops.tolist() == [[RM, 5, -1, -1, -1], [CP, 0, 5, 0, 10], [CP, 3, 5, 10, 13],
                            [RM, 6, -1, -1, -1], [CP, 0, 6, 0, 10], [CP, 3, 6, 10, 13]]


def test_prefix_ops_parent_without_speculative_cells():
    # the parent's speculation does not reach past sequence 0 any more: nothing to copy from it
    assert prefix_ops([2], 8, 1, 8).tolist() == [[RM, 2, -1, -1, -1], [CP, 0, 2, 0, 8]]


G = 99  # the garbage sequence in these tests


def test_commit_ops_copies_only_accepted_cells_and_retires_the_rest():
    ops = commit_ops(7, 20, 23, [5, 6, 7, 8], {5: 20, 7: 22}, G)
    assert ops.tolist() == [[CP, 7, 0, 20, 23],
                            [CP, 5, G, 20, -1], [RM, 5, -1, -1, -1], [RM, 6, -1, -1, -1],
                            [CP, 7, G, 22, -1], [RM, 7, -1, -1, -1], [RM, 8, -1, -1, -1]]
    assert ops[0, 0] == CP and ops[0, 2] == CANONICAL


def test_commit_ops_nothing_accepted_only_retires():
    assert commit_ops(None, 20, 20, [1, 2], {}, G).tolist() == [[RM, 1, -1, -1, -1], [RM, 2, -1, -1, -1]]
    assert commit_ops(3, 20, 20, [3], {3: 20}, G).tolist() == [[CP, 3, G, 20, -1], [RM, 3, -1, -1, -1]]


@pytest.mark.parametrize("size", [1, 2, 16, 64, 254])
def test_commit_is_o_accepted_not_o_sequences(size):
    seqs = list(range(1, 1 + size))
    ops = commit_ops(seqs[-1], 100, 104, seqs, {seqs[0]: 100}, G)
    cps = ops[(ops[:, 0] == CP) & (ops[:, 2] == CANONICAL)]
    assert len(cps) == 1                                     # one copy into seq 0, whatever the partition size
    assert cps[0].tolist() == [CP, seqs[-1], 0, 100, 104]    # of exactly the accepted range [n_kv0, end)
    assert set(ops[:, 2][ops[:, 0] == CP].tolist()) <= {CANONICAL, G}  # never to other sequences
    assert sorted(ops[ops[:, 0] == RM, 1].tolist()) == seqs  # and the whole partition is cleared
    assert ops[0, 0] == CP                                   # copy before the clear that would drop the cells


def test_retire_starts_owner_is_the_lowest_branch_through_a_cell():
    # tree over positions 10..: root (branches 5,6,7) -> a (5,6) -> b (5) ; a -> c (6) ; root -> d (7) -> e (7)
    nodes = [(10, [5, 6, 7]), (11, [5, 6]), (12, [5]), (12, [6]), (11, [7]), (12, [7])]
    assert retire_starts(nodes) == {5: 10, 6: 12, 7: 11}
    assert retire_starts([(9, [0, 3, 4]), (10, [3]), (10, [4])]) == {3: 10, 4: 10}  # a lead cell is canonical


# ---------------------------------------------------------------- the ops against a toy unified KV cache
class ToyKV:
    """seq -> {pos: cell id}; cp tags cells, rm untags, like llama.cpp's unified cache."""

    def __init__(self):
        self.seqs: dict[int, dict[int, int]] = {}
        self.next_cell = 0

    def decode(self, seq_ids: list[int], pos: int) -> None:
        for s in seq_ids:
            assert max(self.seqs.get(s, {}), default=-1) == pos - 1
        cell = self.next_cell
        self.next_cell += 1
        for s in seq_ids:
            self.seqs.setdefault(s, {})[pos] = cell

    def apply(self, ops: np.ndarray) -> None:
        for op, src, dst, p0, p1 in ops.tolist():
            lo, hi = (p0 if p0 >= 0 else 0), (p1 if p1 >= 0 else 1 << 30)
            cells = {p: c for p, c in self.seqs.get(src, {}).items() if lo <= p < hi}
            if op == RM:
                self.seqs[src] = {p: c for p, c in self.seqs.get(src, {}).items() if p not in cells}
            else:
                d = self.seqs.setdefault(dst, {})
                assert not set(d) & set(cells), "two cells at one position in a sequence"
                d.update(cells)

    def held(self, s: int) -> list[int]:
        return sorted(self.seqs.get(s, {}))


def test_prefix_then_commit_against_toy_cache():
    kv = ToyKV()
    for p in range(4):
        kv.decode([0], p)                                     # the prompt in sequence 0
    parent, child = [1, 2], [3, 4]
    kv.apply(prefix_ops(parent, 4, None, 4))
    for p in range(4, 7):
        kv.decode([parent[0]], p)                             # the parent's main chain at 4, 5, 6
    kv.apply(prefix_ops(child, 4, parent[0], 7))              # the child sees 0..3 from seq 0 and 4..6 from the parent
    assert kv.held(3) == kv.held(4) == list(range(7))
    kv.decode([3], 7)                                         # consecutive positions: the decode is legal
    kv.apply(commit_ops(parent[0], 4, 6, parent, {1: 4}, G))  # positions 4, 5 of the parent accepted
    assert kv.held(0) == list(range(6))
    assert kv.held(1) == kv.held(2) == []
    assert kv.held(3) == list(range(8))                       # the child keeps its cells
    assert kv.seqs[0][5] == kv.seqs[3][5]                     # the very same cell: copied, not recomputed
    assert kv.held(G) == [4, 5, 6]                            # the parent's own cells, retired not freed
    kv.apply(commit_ops(None, 6, 6, child, {3: 7}, G))
    assert kv.held(3) == kv.held(4) == [] and kv.held(0) == list(range(6))
    assert kv.held(G) == [4, 5, 6, 7]


def test_the_in_flight_limit_follows_the_stage_count():
    """Enough runs in flight to keep every stage of a deep pipeline busy (a fixed 8 capped 16 and 32 stages)."""
    assert [in_flight_limit(None, n) for n in (1, 2, 6, 8, 16, 32)] == [8, 8, 8, 10, 18, 34]
    assert in_flight_limit(5, 32) == 5                      # --max-in-flight N is taken as given
