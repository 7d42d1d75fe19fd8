"""What a generation's Head asks of the pipeline, as values: the scheduler collects them and is the one place
that applies them (Scheduler._apply), so it sees every generation's next launches before any is sent.

A Head never calls the pipeline: its steps (feed, take, cover, speculate_once, cancel_all) return these in the
order they must reach the stages (a run's KV edits before it, a commit before the cancels it causes).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Union

import numpy as np

from ..core.protocol import Batch, RowRules
from ..core.verify import SamplingParams

# how the last stage draws this generation's tokens: its sampling parameters and log-probabilities asked (None: none)
Sampling = tuple[SamplingParams, Union[int, None]]


@dataclass(frozen=True)
class Launch:
    """Decode a run: `batch` at every stage (its prefix KV ops first), drawn by `sampling` at the last."""
    run_id: int
    batch: Batch
    speculative: bool
    parent_id: int
    sampling: Sampling
    rules: RowRules | None = None  # the constraint's masks and biases for the run's output rows


@dataclass(frozen=True)
class Cancel:
    """Runs that can no longer add a token: the signal travels backwards through the stages."""
    run_ids: tuple[int, ...]


@dataclass(frozen=True)
class EditKv:
    """KV cache operations every stage applies in order with the runs (protocol.kv_ops: i32[n, 5])."""
    ops: np.ndarray


Action = Union[Launch, Cancel, EditKv]
