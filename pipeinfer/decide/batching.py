"""The batching rules, in one place and pure: how many generations share the pipeline, how deep it is, when rows
wait to share a decode, when a prompt chunk joins them, when the drafter's holder speculates alone and when its
draft rows ride the others' decode. The scheduler (scheduler.py) decides each round by them and the executor
(actions.py) holds rows by them; the twin runs the same rules.

Why these numbers: docs/benchmarks.md (many users at once) has the measurements behind PARALLEL_PER_STAGE and
PARALLEL_PER_STAGE_BATCHED.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable

# generations at once by default, per stage (`serve`/`generate --prompts` --parallel): one per stage would keep every
# stage busy if every run cost the same, but a newcomer's prompt holds a stage for many token-times, and the other
# generations' next tokens queued at the other stages keep those busy meanwhile; each one more queues in front of
# every token, so latency grows with it
PARALLEL_PER_STAGE = 2
# ... when several generations' next tokens share a decode (--batch-rows): each stage then carries a batch, and as
# many generations must decode as the batches in flight hold
PARALLEL_PER_STAGE_BATCHED = 4
MAX_PARALLEL = 64


def default_parallel(n_stages: int, batching: bool = False) -> int:
    per_stage = PARALLEL_PER_STAGE_BATCHED if batching else PARALLEL_PER_STAGE
    return max(1, min(MAX_PARALLEL, per_stage * n_stages))


def default_parallel_text() -> str:
    """default_parallel in words, as every help text and docs/serving.md say it (tests/test_defaults_docs.py)."""
    return f"{PARALLEL_PER_STAGE_BATCHED} per pipeline stage ({PARALLEL_PER_STAGE} with --batch-rows 1)"


def pipeline_depth(n_stages: int, stage_ms: tuple[tuple[float, ...], ...] | None) -> int:
    """Runs in flight that keep the slowest stage busy: the pass time over the slowest stage's time,
    ceil(sum of stages' single-token ms / max), never more than the stages. On a balanced pipeline that is
    the number of stages; on one whose last stage carries the output projection of a large vocabulary it is
    fewer, and runs beyond it only queue at that stage (so speculating there takes time from certain work)."""
    if not stage_ms or any(not ms for ms in stage_ms):
        return n_stages
    one = [ms[0] for ms in stage_ms]
    if max(one) <= 0:
        return n_stages
    return max(1, min(n_stages, math.ceil(sum(one) / max(one) - 1e-9)))


def cost_sizes(draft_max: int, batch_rows: int, n_parallel: int, n_stages: int) -> int:
    """Decode sizes (1..this) whose cost start-up measures on every stage: a micro-batch's (draft_max), and one
    that rides a shared decode of as many next tokens as the rows are paced to (BatchRules.row_cap: the generations
    over the stages), within the exact batch limit (DraftSizer.ride_len needs both)."""
    return max(draft_max, min(batch_rows, draft_max + math.ceil(n_parallel / n_stages)))


@dataclass(frozen=True)
class Held:
    """The rows held to share the next decode, as the rules see them."""
    n_rows: int = 0      # every row held (next tokens, prompt chunks, riding drafts)
    n_next: int = 0      # next tokens among them (one-row runs that are not drafts): what the row cap paces


@dataclass(frozen=True)
class BatchRules:
    """The rules of one pipeline: batch_rows (the most rows one decode carries: the stages' exact batch limit),
    depth (runs in flight that keep the slowest stage busy: pipeline_depth) and n_stages."""
    batch_rows: int
    depth: int
    n_stages: int

    @property
    def batching(self) -> bool:
        """Whether several generations' rows may share a decode at all."""
        return self.batch_rows > 1

    def row_cap(self, n_decoding: int) -> int:
        """Next tokens per shared decode: batch_rows, but no more than the decoding generations spread over the
        pipeline's depth (one batch of every generation would leave all stages but one idle)."""
        return max(1, min(self.batch_rows, math.ceil(n_decoding / self.depth)))

    def room(self, held: Held, n_rows: int, row_cap: int) -> bool:
        """Whether a run of n_rows may join the rows held: every row within batch_rows (the exact limit), next tokens
        within the row cap (a prompt chunk rides along: on the tiled kernel its rows cost next to nothing there)."""
        return held.n_rows + n_rows <= self.batch_rows and (n_rows > 1 or held.n_next < row_cap)

    def joins(self, held: Held, n_rows: int, n_kv_ops: int, row_cap: int) -> bool:
        """Whether a prompt chunk of n_rows (after n_kv_ops KV edits) would join rows already held, not go alone (KV
        edits, a cached prompt's copy, go after every run held before them)."""
        return self.batching and held.n_rows > 0 and not n_kv_ops and self.room(held, n_rows, row_cap)

    def rides(self, held: Held, n_rows: int, owner_held: bool, parent_shared: bool) -> bool:
        """Whether a draft micro-batch of n_rows rides the rows held: they leave room, none is its owner's (its KV
        edits run before the shared decode and must read only its own sequences), and its parent is none or a
        member of a shared run (parent_shared: a lone speculative parent may be skipped or aborted at a stage,
        leaving cells the rider decodes on missing, and a shared run cannot be skipped with it)."""
        return held.n_rows > 0 and held.n_rows + n_rows <= self.batch_rows and not owner_held and parent_shared

    def holding(self, held: Held, row_cap: int, n_in_flight: int) -> bool:
        """Whether the next tokens held wait for the next result's to join them: while they do not fill a decode and
        enough runs are in flight to keep every stage busy without them."""
        return 0 < held.n_rows and held.n_next < row_cap and n_in_flight >= self.depth

    def feeds(self, n_prompt_runs_in_flight: int, joins: bool) -> bool:
        """Whether one more prompt chunk goes out this round: while fewer than the stages are in flight (enough to
        keep every stage busy on them, few enough that the others' next tokens wait behind at most that many), or
        when it joins rows already held."""
        return n_prompt_runs_in_flight < self.n_stages or joins

    def speculates_alone(self, n_gens: int, n_in_flight: int) -> bool:
        """Whether the drafter's holder may launch a speculative run of its own: alone, always (exactly PipeInfer);
        beside others, only while fewer runs are in flight than the pipeline's depth (a stage would idle). Beyond
        that its draft rows only ride the others' (rides_pay)."""
        return n_gens == 1 or n_in_flight < self.depth

    def rides_pay(self, n_rows: int, ride_len: Callable[[], int]) -> bool:
        """Whether draft rows buy more than they cost riding a decode of n_rows others' rows (ride_len: the draft
        tokens DraftSizer.ride_len finds worth it, 0 where none is; asked only where rows may be shared at all)."""
        return self.batching and n_rows > 0 and ride_len() > 0

    def lends(self, n_decoding: int, n_gens: int) -> bool:
        """Whether the oldest of n_decoding generations holds the drafter to speculate on its own: while fewer decode
        than the pipeline's depth (a stage would otherwise idle), or alone (exactly PipeInfer). Beyond that it is
        lent only where its draft rows pay riding the others' decodes (rides_pay)."""
        return n_decoding > 0 and (n_decoding < self.depth or n_gens == 1)


def ride_cost_ms(tries: list[tuple[int, float]]) -> float | None:
    """What a ride launched has cost the head lately (ms), from (rides launched, head ms) per try or lend: every
    drafting try for a ride, launched or not (an unconfident draft launches nothing), and the drafter's prefill at
    each lend made for riding, over the rides launched; None before any try."""
    if not tries:
        return None
    return sum(ms for _, ms in tries) / max(1, sum(n for n, _ in tries))
