"""The target's own multi-token-prediction head as the drafter (--drafter mtp): the last stage runs it after each run
(engine/mtp.py) and its proposal comes back with the run's result; the head keeps it until a micro-batch asks."""
from __future__ import annotations

from .drafter import Cutoffs, DraftNode, InSeries
from .stack import LevelCounts

KEEP_POSITIONS = 16  # proposals kept behind the newest (the older ones can no longer continue the chain)


class MtpDrafter(InSeries):
    """Proposals by position: one for position p is made after a run whose last row is at p - 2, for the context
    whose last two tokens are that row's token and the target's token after it (`tail`); it continues a context
    only where those match."""

    def __init__(self):
        self.proposals: dict[int, tuple[tuple[int, int], int, float]] = {}  # pos -> (tail, token, probability)
        self.counts = LevelCounts("mtp")

    def prefill(self, prompt: list[int]) -> None:
        self.proposals.clear()
        self.counts = LevelCounts("mtp")

    def offer(self, tail: tuple[int, int], pos: int, token: int, prob: float) -> None:
        self.proposals[pos] = (tail, token, prob)
        self.counts.n_proposed += 1
        for old in [p for p in self.proposals if p < pos - KEEP_POSITIONS]:
            del self.proposals[old]

    def draft(self, context: list[int], cut: Cutoffs) -> list[DraftNode]:
        self.counts.n_calls += 1
        got = self.proposals.get(len(context))
        if got is None or len(context) < 2 or tuple(context[-2:]) != got[0] or got[2] < cut.p_accept:
            return []
        return [DraftNode(got[1], -1, 0, {0}, got[2])]

    def levels(self) -> list:
        return [self.counts]
