"""What the decisions ask of a pipeline, declared once: the port that ranks/pipeline.Pipeline (MPI ranks and their
llama.cpp stages) and twin/sim.SimPipeline (a simulated cluster on a virtual clock) both implement, and the result
value they hand back. The scheduler and its executor (decide/) drive a pipeline only through it."""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

import numpy as np

from ..core.protocol import Batch, RowRules
from ..core.sampling import RunSampling


@dataclass
class Result:
    """The last stage's answer to one run, in launch order."""
    run_id: int
    cancelled: bool
    tokens: np.ndarray | None  # i32[n_outputs]: the target's token after each output row (verify.row_tokens)
    logprobs: tuple | None = None  # with top_logprobs k: (chosen f32[n], top ids i32[n, k], top f32[n, k])
    mtp: tuple[int, int, float] | None = None  # the target's MTP head: (position, token, probability) after the
                                               # run's last row and the target's token after it (engine/mtp.py)


@runtime_checkable
class PipePort(Protocol):
    """A pipeline of stages that takes runs in order and answers them in the same order."""

    in_flight: deque[int]   # run ids launched and not yet answered, oldest first

    @property
    def distributed(self) -> bool:
        """Whether results take time to come back (more than one stage); on one, a run's result is ready at once."""

    def launch(self, run_id: int, batch: Batch, speculative: bool, parent_id: int,
               rules: RowRules | None = None) -> None:
        """A run into the pipeline (its prefix KV ops first, at every stage)."""

    def set_sampling(self, sampling: RunSampling) -> None:
        """How the last stage draws the output rows of the runs after this, group by group of rows."""

    def kv(self, ops: np.ndarray) -> None:
        """KV cache operations (protocol.kv_ops) every stage applies in order with the runs around them."""

    def cancel(self, run_ids: list[int]) -> None:
        """Runs that can no longer add a token (out of band, backwards through the stages)."""

    def result_ready(self) -> bool:
        """Whether the oldest run's result has arrived."""

    def next_result(self) -> Result:
        """The oldest run's result, waiting for it."""
