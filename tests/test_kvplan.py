"""Sequence partitions and the KV ops of a run's life (invariants 4, 6, 7, 11)."""
from __future__ import annotations

import numpy as np
import pytest

from pipeinfer.kvplan import CANONICAL, PartitionPool, commit_ops, plan_partitions, prefix_ops
from pipeinfer.protocol import KvOp

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
    pool = PartitionPool(1, 1, 2)
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


@pytest.mark.parametrize("n_part, size, n_seq_max", [(1, 1, 2), (4, 1, 5), (15, 16, 256), (3, 4, 13), (255, 1, 256)])
def test_pool_seqs_disjoint_and_never_canonical(n_part, size, n_seq_max):
    pool = PartitionPool(n_part, size, n_seq_max)
    seen: set[int] = set()
    for k in range(n_part):
        s = pool.seqs(k)
        assert s == list(range(1 + k * size, 1 + (k + 1) * size))
        assert CANONICAL not in s and all(0 < x < n_seq_max for x in s)
        assert not seen & set(s)
        seen |= set(s)
    assert len(seen) == n_part * size


@pytest.mark.parametrize("n_part, size, n_seq_max", [(16, 16, 256), (0, 4, 256), (2, 0, 256), (4, 1, 4), (1, 1, 1)])
def test_pool_rejects_what_does_not_fit(n_part, size, n_seq_max):
    with pytest.raises(ValueError, match="do not fit"):
        PartitionPool(n_part, size, n_seq_max)


# ---------------------------------------------------------------- plan_partitions
@pytest.mark.parametrize("max_branches, max_in_flight, expected", [
    (1, 4, (4, 5)),
    (4, 2, (2, 9)),
    (16, 100, (15, 241)),        # 16 * 16 + 1 > 256: at most 15 partitions
    (16, 8, (8, 129)),
    (1, 1000, (255, 256)),
    (255, 4, (1, 256)),
    (8, 0, (1, 9)),              # at least one partition
])
def test_plan_partitions(max_branches, max_in_flight, expected):
    n_part, n_seq = plan_partitions(max_branches, max_in_flight)
    assert (n_part, n_seq) == expected
    assert n_seq <= 256 and n_seq == 1 + n_part * max_branches
    PartitionPool(n_part, max_branches, n_seq)  # the plan always fits its pool


@pytest.mark.parametrize("max_branches", [1, 2, 3, 7, 16, 31, 64, 100, 128, 200, 255])
def test_plan_partitions_respects_llama_cap(max_branches):
    n_part, n_seq = plan_partitions(max_branches, 10_000)
    assert n_seq <= 256 and n_part == 255 // max_branches


def test_plan_partitions_too_wide():
    with pytest.raises(ValueError, match="--max-branches 256"):
        plan_partitions(256, 4)
    assert plan_partitions(4, 4, n_seq_max=9) == (2, 9)


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


def test_commit_ops_copies_only_accepted_cells():
    ops = commit_ops(7, 20, 23, [5, 6, 7, 8])
    assert ops.tolist() == [[CP, 7, 0, 20, 23],
                            [RM, 5, -1, -1, -1], [RM, 6, -1, -1, -1], [RM, 7, -1, -1, -1], [RM, 8, -1, -1, -1]]
    assert ops[0, 0] == CP and ops[0, 2] == CANONICAL


def test_commit_ops_nothing_accepted_only_clears():
    assert commit_ops(None, 20, 20, [1, 2]).tolist() == [[RM, 1, -1, -1, -1], [RM, 2, -1, -1, -1]]
    assert commit_ops(3, 20, 20, [3]).tolist() == [[RM, 3, -1, -1, -1]]   # end == n_kv0: no empty copy


@pytest.mark.parametrize("size", [1, 2, 16, 64, 255])
def test_commit_is_o_accepted_not_o_sequences(size):
    seqs = list(range(1, 1 + size))
    ops = commit_ops(seqs[-1], 100, 104, seqs)
    cps = ops[ops[:, 0] == CP]
    assert len(cps) == 1                                     # one copy, whatever the partition size
    assert cps[0].tolist() == [CP, seqs[-1], 0, 100, 104]    # of exactly the accepted range [n_kv0, end)
    assert (ops[:, 2][ops[:, 0] == CP] == CANONICAL).all()   # only into sequence 0, never to other sequences
    assert sorted(ops[ops[:, 0] == RM, 1].tolist()) == seqs  # and the whole partition is cleared
    assert ops[0, 0] == CP                                   # copy before the clear that would drop the cells


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
    kv.apply(commit_ops(parent[0], 4, 6, parent))             # positions 4, 5 of the parent accepted
    assert kv.held(0) == list(range(6))
    assert kv.held(1) == kv.held(2) == []
    assert kv.held(3) == list(range(8))                       # the child keeps its cells
    assert kv.seqs[0][5] == kv.seqs[3][5]                     # the very same cell: copied, not recomputed
    kv.apply(commit_ops(None, 6, 6, child))
    assert kv.held(3) == kv.held(4) == [] and kv.held(0) == list(range(6))
