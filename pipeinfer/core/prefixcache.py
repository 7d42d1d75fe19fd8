"""The prompt cache's bookkeeping on rank 0 (the stages only follow the KV ops it leads to): which finished
prompts stay on every stage, which one a new prompt starts from, which go when sequence ids or cells run short.

Why only whole chunks are reused: every stage decodes a prompt in chunks at positions 0, C, 2C, ...
(C = --prompt-chunk), and a row's bits depend on the batch it was decoded in (llama.cpp's matrix kernels take
rows in blocks, engine/kernels.py), not on where its cells sit (up to 63 rows, config.PROMPT_CHUNK). So the cells
of a prompt's whole chunks hold exactly the bits any later prompt with the same tokens there computes cold; a
last, partial chunk does not (a longer prompt decodes those positions in a fuller batch), nor do the answer's
tokens (decoded one to a few at a time). A request therefore starts from the longest common prefix of its prompt
with an entry (or with a prompt being decoded now: `n` > 1's choices, a batch of prompts with a common head), cut
to whole chunks and short of its last token, whose row gives the answer's first token; it decodes the rest in the
chunks a cold run would, from the same aligned positions.

An entry is a generation slot's canonical sequence (kvplan.lane_canonical) left on the stages when its generation
ended; a request that starts from it copies its first n positions into its own sequence (seq_cp: the cells are
shared, not copied). Entries go least recently used first: when there are more than `max_entries`, when a newer
entry extends one (its prefix is then the newer one's too), and at a compaction, beyond the cells the generations
running and waiting may need.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np


def whole_chunks(n: int, chunk: int) -> int:
    """Positions [0, n) cut to whole chunks of a prompt decoded from position 0."""
    return n // chunk * chunk


def common_prefix(a, b) -> int:
    n = min(len(a), len(b))
    if n == 0:
        return 0
    diff = np.flatnonzero(np.asarray(a[:n], dtype=np.int64) != np.asarray(b[:n], dtype=np.int64))
    return int(diff[0]) if len(diff) else n


def reusable(cached, prompt, chunk: int) -> int:
    """Positions of `prompt` a sequence holding the cold bits of `cached` can give it: their common prefix, short
    of the prompt's last token, cut to whole chunks."""
    return whole_chunks(min(common_prefix(cached, prompt), len(prompt) - 1), chunk)


@dataclass
class Entry:
    lane: int            # the generation slot whose sequence it is (scheduler.py)
    seq: int             # that sequence's id on every stage
    tokens: list[int]    # the positions it can give: a prompt's whole chunks
    cells: int           # cells counted against the context for it (kept entries after a compaction: len(tokens))
    used: int = 0        # when it was last made or reused (a counter: larger is more recent)
    held: list[int] = field(default_factory=list)  # the tokens its cells hold: `tokens`, then the rest of its
                                                   # prompt and its answer, decoded in other batches than a cold run


@dataclass(frozen=True)
class Start:
    """Where a new prompt starts: copy positions [0, n) of sequence `seq`; `entry` is None for a running prompt."""
    seq: int
    n: int
    entry: Entry | None = None


class PrefixCache:
    def __init__(self, chunk: int, max_entries: int):
        if chunk < 1 or max_entries < 1:
            raise ValueError("a prompt cache needs a chunk and room for an entry")
        self.chunk, self.max_entries = chunk, max_entries
        self.entries: list[Entry] = []
        self._clock = 0
        self.n_hits = 0
        self.n_tokens_reused = 0

    def _tick(self) -> int:
        self._clock += 1
        return self._clock

    def find(self, prompt: list[int], running: list[tuple[int, list[int]]] = ()) -> Start | None:
        """The longest start for `prompt` among the entries and the prompts being decoded now ((seq, prompt)),
        or None when nothing gives a whole chunk. An entry found counts as used."""
        best = self.peek(prompt, running)
        if best is not None:
            if best.entry is not None:
                best.entry.used = self._tick()
            self.n_hits += 1
            self.n_tokens_reused += best.n
        return best

    def peek(self, prompt: list[int], running: list[tuple[int, list[int]]] = ()) -> Start | None:
        """What `find` would give, changing nothing."""
        best: Start | None = None
        for e in self.entries:
            n = reusable(e.tokens, prompt, self.chunk)
            if n > (best.n if best else 0):
                best = Start(e.seq, n, e)
        for seq, tokens in running:
            n = reusable(tokens[:whole_chunks(len(tokens), self.chunk)], prompt, self.chunk)
            if n > (best.n if best else 0):
                best = Start(seq, n)
        return best

    def add(self, lane: int, seq: int, prompt: list[int], cells: int,
            held: list[int] | None = None) -> tuple[Entry | None, list[Entry]]:
        """A finished generation's sequence as an entry (None when its prompt has no whole chunk), and the entries
        that go for it: those it extends, then the least recently used beyond max_entries. held: the tokens its
        cells hold (the prompt, then the answer's decoded tokens)."""
        n = whole_chunks(len(prompt), self.chunk)
        if n == 0:
            return None, []
        new = Entry(lane, seq, list(prompt[:n]), cells, self._tick(), list(held if held is not None else prompt))
        gone = [e for e in self.entries if len(e.tokens) <= n and common_prefix(e.tokens, new.tokens) == len(e.tokens)]
        self.entries = [e for e in self.entries if e not in gone] + [new]
        while len(self.entries) > self.max_entries:
            gone.append(self.pop_lru())
        return new, gone

    def to_extend(self) -> Entry | None:
        """The most recently used entry whose cells hold at least one whole chunk more than it can give (an
        answer, the last part of a prompt): decoding those chunks again, as a cold run would, lets a next turn start
        after them (scheduler.idle_work)."""
        more = [e for e in self.entries if whole_chunks(len(e.held), self.chunk) > len(e.tokens)]
        return max(more, key=lambda e: e.used) if more else None

    def pop_lru(self) -> Entry | None:
        """The least recently used entry, taken out; None when there is none."""
        if not self.entries:
            return None
        e = min(self.entries, key=lambda e: e.used)
        self.entries.remove(e)
        return e

    def keep_within(self, budget: int, first: Entry | None = None) -> list[Entry]:
        """Before a compaction: keep `first` (the entry the next request starts from), then the most recently used
        entries, while their positions fit in `budget` cells together (each keeps only its tokens' positions); the
        rest are taken out and returned."""
        kept, gone, used = [], [], 0
        for e in sorted(self.entries, key=lambda e: (e is not first, -e.used)):
            if used + len(e.tokens) <= budget:
                kept.append(e)
                used += len(e.tokens)
                e.cells = len(e.tokens)
            else:
                gone.append(e)
        self.entries = [e for e in self.entries if e in kept]
        return gone

    @property
    def n_tokens(self) -> int:
        """Positions the entries can give."""
        return sum(len(e.tokens) for e in self.entries)

    @property
    def n_cells(self) -> int:
        """Cells counted against the context for the entries."""
        return sum(e.cells for e in self.entries)


def cache_load(cache: PrefixCache | None) -> dict:
    """A prompt cache's counters, as /health has them (`enabled` False and zeros without one)."""
    if cache is None:
        return {"enabled": False, "entries": 0, "tokens": 0, "hits": 0, "tokens_reused": 0}
    return {"enabled": True, "entries": len(cache.entries), "tokens": cache.n_tokens, "hits": cache.n_hits,
            "tokens_reused": cache.n_tokens_reused}
