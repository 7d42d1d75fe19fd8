"""The drafter lent to one generation (the scheduler lends it to the generation that may speculate): what the
head drafts with, how it is steered when it drafts ahead beside the pipeline, and what it did for that generation,
read from its counters when it is given back."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from ..core.metrics import Stats
from ..core.kvplan import PartitionPool
from ..drafters.drafter import AheadDrafter, Cutoffs, Drafter, DraftNode
from .draftsize import DraftSizer


@dataclass(frozen=True)
class DrafterCounts:
    """A drafter beside the pipeline's running counters, read when it is lent and given back: the difference is
    one generation's share."""
    n_stale: int = 0
    n_calls: int = 0
    bytes_out: int = 0
    bytes_in: int = 0

    @classmethod
    def of(cls, drafter: Drafter) -> DrafterCounts:
        if not drafter.asynchronous:
            return cls()
        return cls(drafter.n_stale, drafter.n_calls, drafter.bytes_out, drafter.bytes_in)


class DraftLease:
    """The drafter and the speculative partitions while one generation holds them."""

    def __init__(self, drafter: Drafter, pool: PartitionPool, stats: Stats, prompt: list[int],
                 clock: Callable[[], float]):
        self.drafter, self.pool, self.stats, self.clock = drafter, pool, stats, clock
        self.lent_at = DrafterCounts.of(drafter)
        stats.exact_batch_draft = drafter.exact_batch
        drafter.prefill(prompt)

    @property
    def asynchronous(self) -> bool:
        """The drafter drafts ahead beside the pipeline: the head only reads what it has drafted."""
        return self.drafter.asynchronous

    @property
    def ahead(self) -> AheadDrafter:
        return self.drafter  # type: ignore[return-value]  (asynchronous: an AheadDrafter)

    def steer(self, target: list[int], horizon: int, p_min: float, n_chunk: int) -> None:
        """Point the drafter beside the pipeline at `target`, to draft up to `horizon` in chunks of n_chunk tokens,
        down to confidence p_min."""
        self.ahead.steer(target, horizon, p_min, n_chunk)

    def propose(self, context: list[int], cutoffs: Cutoffs, sizer: DraftSizer) -> tuple[list[DraftNode], bool]:
        """(a draft micro-batch after `context` within the cutoffs, whether the drafter was unconfident): what the
        drafter beside the pipeline has ready on this chain, or a call of the drafter in series (its cost is what
        the sizer prices micro-batches by)."""
        if self.asynchronous:
            return self.ahead.ready(context, cutoffs.p_accept, cutoffs.n_max)
        t0 = self.clock()
        tree = self.drafter.draft(context, cutoffs)
        self.stats.n_draft_calls += 1
        if tree:
            sizer.drafted(len(tree), (self.clock() - t0) * 1e3)
        return tree, not tree

    def quiet(self, n_generated: int, done: bool) -> bool:
        """While the first token after the prompt is computed, a drafter that shares the head's cores (a thread of
        rank 0) is left idle and nothing speculative is launched: drafting then slows that token's decodes, and it
        is the token the time to first token waits for (docs/speculation.md). It costs the overlap of one token."""
        return self.asynchronous and not self.drafter.remote and n_generated == 1 and not done

    def end(self) -> Drafter:
        """What the drafter did for this generation goes into its statistics; the drafter goes back."""
        if self.asynchronous:
            now = DrafterCounts.of(self.drafter)
            self.stats.n_draft_stale += now.n_stale - self.lent_at.n_stale
            self.stats.n_draft_calls += now.n_calls - self.lent_at.n_calls
            if self.drafter.remote:
                self.stats.draft_link_bytes = [now.bytes_out - self.lent_at.bytes_out,
                                               now.bytes_in - self.lent_at.bytes_in]
        self.stats.draft_levels = [level.as_dict() for level in self.drafter.levels()]  # drafts of drafts (stack.py)
        return self.drafter
