"""The generation slots of one pipeline and the cells their sequences hold (kvplan.py): which slots are clean,
which wait for a COMPACT, and the prompt cache's entries (core/prefixcache.py), which are slots too.

Each slot has a canonical sequence of its own (lane_canonical); the partitions and the garbage sequence are shared.
A finished generation's cells are not freed (a hole would be refilled out of position order, kvplan.py): its slot
is dirty until the next COMPACT, which keeps every live canonical sequence and drops the rest. There are twice as
many slots as generations at once (lane_count), so a request rarely waits for a compaction. A finished
generation's slot becomes a cache entry (its prompt's whole chunks) instead of dirty when it may; entries are
evictable, and a compaction keeps only those that fit beside what the running and the next request may need.
"""
from __future__ import annotations

from collections import deque

from ..core.kvplan import CACHE_ENTRIES, lane_canonical, lane_count
from ..core.prefixcache import Entry, PrefixCache, Start, cache_load


class Slots:
    """The slots, their canonical sequences and the prompt cache."""

    def __init__(self, n_parallel: int, cache_prompt: bool, prompt_chunk: int, n_partitions: int, partition_size: int):
        self.n_lanes = lane_count(n_parallel, cache_prompt)
        self.cache = PrefixCache(prompt_chunk, CACHE_ENTRIES) if cache_prompt else None
        self.canon = [lane_canonical(k, n_partitions, partition_size) for k in range(self.n_lanes)]
        self.clean = deque(range(self.n_lanes))
        self.dirty: list[int] = []
        self.n_cells_dead = 0                 # cells of finished generations, until the next COMPACT

    @property
    def n_cells_cached(self) -> int:
        return self.cache.n_cells if self.cache is not None else 0

    def take(self) -> int:
        """A clean slot for a new generation."""
        return self.clean.popleft()

    def start(self, prompt: list[int], running: list[tuple[int, list[int]]]) -> Start | None:
        """Where a new prompt starts from: the longest prefix it shares with a cache entry or a running prompt
        (running: (canonical sequence, its prompt's planned tokens)), or None."""
        return self.cache.find(prompt, running) if self.cache is not None else None

    def finished(self, lane: int, prompt: list[int], cells: int, tokens: list[int], cache_prompt: bool) -> None:
        """A generation's runs are all back: its slot holds its prompt (the chunks launched: tokens) as a cache
        entry, or waits for a COMPACT with its cells."""
        entry = None
        if self.cache is not None and cache_prompt:
            entry, gone = self.cache.add(lane, self.canon[lane], prompt, cells, tokens)
            for e in gone:
                self.drop(e)
        if entry is None:
            self.dirty.append(lane)
            self.n_cells_dead += cells

    def drop(self, e: Entry) -> None:
        """A cache entry goes: its slot and cells wait for the next COMPACT (freeing cells now would leave holes)."""
        self.dirty.append(e.lane)
        self.n_cells_dead += e.cells

    def keep_cached(self, budget: int, next_need: int = 0, next_prompt: list[int] | None = None) -> list[Entry]:
        """At a COMPACT: the cache entries that fit within `budget` cells beside the next request's next_need (the
        cells it shares with the entry its prompt starts from not counted twice; next_prompt None: it does not use
        the cache). Returns the entries kept; the slots of the others are clean after the COMPACT."""
        if self.cache is None:
            return []
        start = self.cache.peek(next_prompt) if next_prompt is not None else None
        budget -= next_need - (start.n if start else 0)
        self.clean.extend(e.lane for e in self.cache.keep_within(budget, start.entry if start else None))
        return self.cache.entries

    def compacted(self) -> None:
        """Every stage repacked the live sequences: the dirty slots are clean, their cells gone."""
        self.clean.extend(sorted(self.dirty))
        self.dirty.clear()
        self.n_cells_dead = 0

    def load(self, cells_used: int, n_ctx: int) -> dict:
        """The prompt cache and the cells, for /health (a snapshot read from another thread)."""
        return {**cache_load(self.cache), "cells_used": min(cells_used, n_ctx), "cells": n_ctx}
