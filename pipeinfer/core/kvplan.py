"""KV sequence planning: partitions of sequence ids for in-flight runs, and the KV ops runs need.

Sequence 0 is canonical: exactly the accepted tokens at positions 0..n_kv0-1 on every stage.
Each in-flight speculative run owns a partition: `max_branches` consecutive sequence ids, one per
tree branch (for a model with recurrent layers one per drafted token: core/recurrent.py), taken from a FIFO free
list (multibuffering). Before decoding, a stage makes the run's
sequences see the canonical prefix (seq_cp 0 -> s) and the cells of the run it builds on (seq_cp
parent -> s over the parent's speculative positions). On acceptance the accepted cells join sequence
0 with one seq_cp over the accepted positions (O(accepted tokens), never a copy to every sequence),
then the partition is cleared and returned to the free list. The clear travels in order with
everything else, so a later run given the same partition cannot see old cells on any stage.

Cells are never freed in the middle of the cache. Freeing a cell makes llama.cpp's slot search start
there, so a later token would land *below* canonical cells of lower positions, and CPU flash
attention (which accumulates V in f16, in cell order) would then add the canonical prefix up in
another order than a plain run does: logits move by up to 0.6 (measured on Qwen2.5-Coder-1.5B) and a
near-tie flips. So a partition's cells are *retired* instead: tagged with the garbage sequence (never
decoded, never seen) before the partition's own tag goes. Every cell is then allocated above every
cell allocated before it, and any sequence's cells lie in position order, exactly as in a plain run
(masked cells are skipped, not summed). Garbage is reclaimed by COMPACT (the head issues it when the
cache is about to fill, with nothing in flight): each stage repacks sequence 0 into cells 0..n-1.
"""
from __future__ import annotations

from collections import deque

from dataclasses import dataclass

import numpy as np

from .protocol import cp, kv_ops, rm

CANONICAL = 0


class PartitionPool:
    """FIFO free list of sequence-id ranges [1 + k*size, 1 + (k+1)*size); the garbage sequence is the
    context's last id (after the partitions and the other generations' canonical sequences, lane_seq_max)."""

    def __init__(self, n_partitions: int, size: int, n_seq_max: int, n_lanes: int = 1):
        if n_partitions < 1 or size < 1 or lane_seq_max(n_partitions, size, n_lanes) > n_seq_max:
            raise ValueError(f"{n_partitions} partitions of {size} sequences do not fit in {n_seq_max} sequence ids")
        self.size = size
        self.n_partitions = n_partitions
        self.garbage_seq = garbage_seq(lane_seq_max(n_partitions, size, n_lanes))
        self._free = deque(range(n_partitions))

    def take(self) -> int | None:
        """A partition index, or None when every partition is in flight."""
        return self._free.popleft() if self._free else None

    def give_back(self, k: int) -> None:
        assert k not in self._free, f"partition {k} freed twice"
        self._free.append(k)

    def seqs(self, k: int) -> list[int]:
        return list(range(1 + k * self.size, 1 + (k + 1) * self.size))

    @property
    def n_free(self) -> int:
        return len(self._free)


def in_flight_limit(max_in_flight: int | None, n_stages: int) -> int:
    """Speculative runs in flight at most: --max-in-flight, or by default as many as keep a pipeline of n_stages
    full (a run's result comes back after every stage has decoded it) and two more, at least 8: a fixed limit
    caps a deep pipeline below what its stages could overlap (docs/speculation.md)."""
    return max_in_flight if max_in_flight is not None else max(8, n_stages + 2)


def plan_partitions(max_branches: int, max_in_flight: int, n_seq_max: int = 256, n_lanes: int = 1) -> tuple[int, int]:
    """(n_partitions, n_seq_max for the context) for the given tree width, in-flight runs and generations
    at once (sequence 0, the partitions, the other generations' canonical sequences, the garbage sequence)."""
    room = n_seq_max - 2 - (n_lanes - 1)
    n_part = max(1, min(max_in_flight, room // max_branches))
    if n_part * max_branches > room:
        raise ValueError(f"--max-branches {max_branches} with --parallel {n_lanes} leaves no room within "
                         f"{n_seq_max} sequences")
    return n_part, lane_seq_max(n_part, max_branches, n_lanes)


CACHE_ENTRIES = 32  # finished prompts kept at most (prefixcache.py; the cells bound them too); each holds a slot


def lane_count(n_parallel: int, cache_prompt: bool = False) -> int:
    """Generation slots for --parallel N: twice N (a finished generation's slot stays dirty until the next
    COMPACT, scheduler.py), one for one generation at a time; with the prompt cache, twice CACHE_ENTRIES more (an
    entry holds its slot, and an entry that goes leaves it dirty until the next COMPACT)."""
    return (2 * n_parallel if n_parallel > 1 else 1) + (2 * CACHE_ENTRIES if cache_prompt else 0)


def lane_seq_max(n_part: int, size: int, n_lanes: int) -> int:
    """Sequence ids a context needs: sequence 0, the partitions, the other lanes' canonical sequences and the
    garbage sequence (the last id); one alone, without partitions or other lanes."""
    return 1 if n_part == 0 and n_lanes == 1 else 2 + n_part * size + n_lanes - 1


def lane_canonical(lane: int, n_part: int, size: int) -> int:
    """The canonical sequence of generation slot `lane` (several generations at once, scheduler.py): slot 0
    keeps sequence 0, so one generation at a time lays its cache out as before; slot k >= 1 takes the id after
    the partitions' (1 .. n_part*size) and before the garbage sequence (always the last id)."""
    return 0 if lane == 0 else n_part * size + lane


def garbage_seq(n_seq_max: int) -> int | None:
    """The garbage sequence of a context planned by plan_partitions: its last id (None without partitions)."""
    return n_seq_max - 1 if n_seq_max > 1 else None


def cells_reserve(n_partitions: int, n_max: int) -> int:
    """KV cells one round of the head's loop may allocate: a micro-batch of n_max tokens (plus a lead
    token) for every partition, and one more run; one token without partitions (iterative). The head
    compacts before fewer are left."""
    return (n_partitions + 1) * (n_max + 1) if n_partitions else 1


@dataclass(frozen=True)
class ContextBudget:
    """The one context check: a request holds at most its prompt (with any replayed tokens) and its max tokens of
    canonical cells, and the runs in flight may take `reserve` more (cells_reserve)."""
    n_ctx: int
    reserve: int

    def fits(self, n_prompt: int, n_predict: int, n_held: int = 0) -> bool:
        """Whether such a request fits beside n_held cells that others may hold."""
        return n_held + n_prompt + n_predict + self.reserve <= self.n_ctx

    def refusal(self, n_prompt: int, n_predict: int) -> str:
        return (f"prompt ({n_prompt} tokens) + max tokens ({n_predict}) does not fit the context ({self.n_ctx} cells, "
                f"{self.reserve} kept for speculative runs)")


def prefix_ops(seqs: list[int], n_kv0: int, parent_seq: int | None, first_pos: int,
               canon: int = CANONICAL) -> np.ndarray:
    """Ops a stage applies before decoding a run whose first node sits at first_pos in `seqs`.

    The canonical prefix [0, n_kv0) comes from the generation's canonical sequence `canon`; speculative
    cells [n_kv0, first_pos) come from the parent run's main branch, which the stage decoded earlier (runs
    are handled in order).
    """
    ops = []
    for s in seqs:
        ops.append(rm(s))  # defensive: partitions are cleared when freed, so this removes nothing
        ops.append(cp(canon, s, 0, n_kv0))
        if parent_seq is not None and first_pos > n_kv0:
            ops.append(cp(parent_seq, s, n_kv0, first_pos))
    return kv_ops(*ops)


def retire_starts(nodes: list[tuple[int, list[int]]], canon: int = CANONICAL) -> dict[int, int]:
    """For a run's nodes (pos, seq_ids): each sequence -> first position of the cells it *owns*.

    A tree cell carries every branch through it; the lowest of those ids owns it. Branch ids grow as
    branches split off, so a branch owns one contiguous stretch of positions, from where it split to
    its end, and copying [start, inf) of each branch to the garbage sequence tags every cell of the
    run exactly once (llama.cpp asserts a cell never gets a sequence twice). Cells that were canonical
    at launch (the synchronous mode's lead token) are not the run's to retire.
    """
    starts: dict[int, int] = {}
    for pos, seq_ids in nodes:
        if canon in seq_ids:
            continue
        owner = min(seq_ids)
        starts[owner] = min(starts.get(owner, pos), pos)
    return starts


def commit_ops(branch_seq: int | None, n_kv0: int, end: int, seqs: list[int], starts: dict[int, int],
               garbage_seq: int, canon: int = CANONICAL) -> np.ndarray:
    """Accept cells [n_kv0, end) of `branch_seq` into the canonical sequence `canon`, then retire the run's
    partition: its own cells (`starts`, from retire_starts) join the garbage sequence before the partition's tags
    go, so no cell is freed; the canonical and parent cells it saw keep their other tags."""
    ops = []
    if branch_seq is not None and end > n_kv0:
        ops.append(cp(branch_seq, canon, n_kv0, end))
    for s in seqs:
        if s in starts:
            ops.append(cp(s, garbage_seq, starts[s]))
        ops.append(rm(s))
    return kv_ops(*ops)
