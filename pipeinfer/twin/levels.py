"""Drafts of drafts in the twin: what a hierarchy of drafters costs per token of its first level, by the rule the
real hierarchy follows (drafters/stack.py: verify_len), so that the simulator can run the real scheduler with it as
one draft (sim.py: a draft of that cost and the first level's agreement with the target).

A level's decode of b rows costs its one-row decode times row_factor[b - 1]. On CPUs a batch costs about its rows
(CPU_ROWS, measured here), and a level below pays only where it nearly always agrees; where a batch costs one row
(FLAT_ROWS: PipeSpec's GPUs), any agreement above zero pays, which is PipeSpec's claim.
"""
from __future__ import annotations

from dataclasses import dataclass

from ..drafters.stack import MAX_VERIFY, level_ms_per_token

# a decode of 1..8 rows in one-row decodes: Qwen2.5-Coder-0.5B Q4_K_M, 1 thread, repacked weights, 2-core AMD EPYC
# (26.3 ms for one row; docs/speculation.md, Drafts of drafts)
CPU_ROWS = (1.0, 2.12, 2.67, 3.02, 3.65, 4.30, 4.79, 5.29)
FLAT_ROWS = (1.0,) * 8


@dataclass(frozen=True)
class Level:
    """One drafter of a hierarchy: its one-row decode on the host it runs on (0: the n-gram drafter, free) and its
    agreement with the level above it (the first level: with the target)."""
    name: str
    ms_per_token: float
    agreement: float


@dataclass(frozen=True)
class Priced:
    """A hierarchy's price: ms per token its first level proposes, and the proposals each level hands up per
    decode of the level above (verify_len's L; [] for one level)."""
    ms_per_token: float
    verify: tuple[int, ...]


def price(levels: list[Level], row_factor: tuple[float, ...] = CPU_ROWS) -> Priced:
    """What levels[0] costs per token when levels[1] drafts for it, levels[2] for levels[1], ..: from the bottom up,
    each level's price is level_ms_per_token on its own row costs and the price of the level below."""
    below = levels[-1].ms_per_token
    verify: list[int] = []
    for upper, lower in zip(reversed(levels[:-1]), reversed(levels[1:])):
        rows = [upper.ms_per_token * f for f in row_factor[:MAX_VERIFY + 1]]
        below, n = level_ms_per_token(lower.agreement, rows, MAX_VERIFY, below)
        verify.insert(0, n)
    return Priced(below, tuple(verify))
