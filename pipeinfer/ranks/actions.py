"""What a generation's Head asks of the pipeline, as values, and the one place they are carried out.

A Head never calls the pipeline: its steps (feed, take, handle, cover, speculate_once) return these in the order
they must reach the stages (a run's KV edits before it, a commit before the cancels it causes). The scheduler
decides which generation steps when and hands what each returned to the Executor, the only code that drives the
pipeline (as vLLM's scheduler returns a plan and its executor runs it): so the scheduler sees every generation's
next launches before any is sent.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Generic, TypeVar, Union

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


Owner = TypeVar("Owner")


class Executor(Generic[Owner]):
    """Drives the pipeline (ranks/pipeline.Pipeline, or the twin's SimPipeline): each owner's actions applied in
    the order it decided them; the owner of every run in flight remembered (results come back in launch order and
    go to it); a run's sampling parameters sent down the pipeline, in order with the runs, only when they change."""

    def __init__(self, pipe):
        self.pipe = pipe
        self.owner: dict[int, Owner] = {}   # run id -> who launched it
        self._sampling_sent: Sampling | None = None

    def apply(self, owner: Owner, actions: list[Action]) -> None:
        for a in actions:
            if isinstance(a, Launch):
                if a.sampling != self._sampling_sent:  # the last stage draws this generation's tokens by these
                    self.pipe.set_sampling(*a.sampling)
                    self._sampling_sent = a.sampling
                self.owner[a.run_id] = owner
                self.pipe.launch(a.run_id, a.batch, a.speculative, a.parent_id, a.rules)
            elif isinstance(a, Cancel):
                self.pipe.cancel(list(a.run_ids))
            elif isinstance(a, EditKv):
                self.pipe.kv(a.ops)
            else:
                raise TypeError(f"internal: unknown action {a!r}")

    def next_result(self):
        """The oldest run's result (waiting for it) and who launched it: (owner, pipeline.Result)."""
        res = self.pipe.next_result()
        return self.owner.pop(res.run_id), res
