"""What a generation's Head asks of the pipeline, as values, and the one place they are carried out.

A Head never calls the pipeline: its steps (feed, take, handle, cover, speculate_once) return these in the order
they must reach the stages (a run's KV edits before it, a commit before the cancels it causes). The scheduler
decides which generation steps when and hands what each returned to the Executor, the only code that drives the
pipeline (as vLLM's scheduler returns a plan and its executor runs it): so the scheduler sees every generation's
next launches before any is sent.
"""
from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Generic, TypeVar, Union

import numpy as np

from ..core.protocol import NO_RUN, Batch, RowRules, kv_ops
from ..core.sampling import RunSampling, SamplingParams, joined_sampling, one_sampling
from .batching import BatchRules, Held
from .port import PipePort


@dataclass(frozen=True)
class Launch:
    """Decode a generation's run: `batch` at every stage (its prefix KV ops first), its output rows drawn by
    `sampling` at the last, with top_logprobs log-probabilities each (None: none)."""
    run_id: int
    batch: Batch
    speculative: bool
    parent_id: int
    sampling: SamplingParams = SamplingParams()
    top_logprobs: int | None = None
    rules: RowRules | None = None  # the constraint's masks and biases for the run's output rows


@dataclass(frozen=True)
class Run:
    """What goes down the pipe: one generation's Launch, or several merged into one decode (merge), each one's output
    rows drawn by its own group of `sampling`."""
    run_id: int
    batch: Batch
    speculative: bool
    parent_id: int
    sampling: RunSampling
    rules: RowRules | None = None

    @classmethod
    def of(cls, a: Launch) -> Run:
        return cls(a.run_id, a.batch, a.speculative, a.parent_id, one_sampling(a.sampling, a.top_logprobs), a.rules)


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


@dataclass(frozen=True)
class Member:
    """One owner's run inside a run in flight: the run id it knows and its output rows in the run's result."""
    owner: object
    run_id: int
    n_outputs: int
    top_logprobs: int | None = None   # the log-probabilities it asked of each row (None: none)

    @classmethod
    def of(cls, owner: object, a: "Launch") -> "Member":
        return cls(owner, a.run_id, a.batch.n_outputs, a.top_logprobs)


def mergeable(a: Action, batch_rows: int) -> bool:
    """A run that may share a decode with other generations' (each generation's rows in its own sequences), at
    most batch_rows rows: a next token, a prompt chunk (its KV edits go before the shared batch: it then opens
    one, Executor.apply), or the drafter holder's micro-batch (it rides the rows held, Executor.apply). Each keeps
    its own sampling, log-probabilities, constraint and biases inside the shared run (its rows' group of
    SAMPLING, its rows of RULES)."""
    return isinstance(a, Launch) and a.batch.n_tokens <= batch_rows


def merge(launches: list[Launch]) -> Run:
    """One run of several generations' runs (mergeable): their rows and their KV edits in order, each one's output
    rows drawn by its own sampling and rules, under the newest run id (every stage takes run ids in launch order,
    and the others were drawn before it)."""
    rows = [x.batch for x in launches]
    batch = Batch(np.concatenate([b.tokens for b in rows]), np.concatenate([b.pos for b in rows]),
                  [ids for b in rows for ids in b.seq_ids], np.concatenate([b.output for b in rows]),
                  kv_ops(*[tuple(op) for b in rows for op in b.prefix_ops.tolist()]))
    sampling = joined_sampling([(one_sampling(x.sampling, x.top_logprobs), x.batch.n_outputs) for x in launches])
    rules = RowRules.joined([(x.rules, x.batch.n_outputs) for x in launches])
    # not speculative and of no parent: a stage never skips nor aborts it (a draft member's parent being cancelled
    # would take the others' certain rows with it); a cancelled member's rows are dropped at the head instead
    return Run(max(x.run_id for x in launches), batch, False, NO_RUN, sampling, rules)


def split(res, members: list[Member]) -> list:
    """A merged run's result as each member's own (its run id, its rows' tokens, and the log-probabilities it asked:
    the run's are as wide as the widest any member asked, verify.run_logprobs)."""
    out, at = [], 0
    for m in members:
        rows = slice(at, at + m.n_outputs)
        at += m.n_outputs
        logprobs = None
        if res.logprobs is not None and m.top_logprobs is not None:
            chosen, ids, top = res.logprobs
            logprobs = (chosen[rows], ids[rows, :m.top_logprobs], top[rows, :m.top_logprobs])
        out.append(replace(res, run_id=m.run_id, tokens=None if res.tokens is None else res.tokens[rows],
                           logprobs=logprobs))
    return out


class Executor(Generic[Owner]):
    """Drives the pipeline (ranks/pipeline.Pipeline, or the twin's SimPipeline): each owner's actions applied in
    the order it decided them; the owners of every run in flight remembered (results come back in launch order and
    go to them); a run's sampling parameters sent down the pipeline, in order with the runs, only when they change.

    Batching users: next-token runs and prompt chunks of different owners (mergeable) are held, up to `batch_rows`
    rows, and go out as one run when the scheduler says so (flush), or before any other action (so the stages still
    see every owner's actions in its order); each owner's rows are drawn by its own sampling and rules. A row's bits
    do not depend on the other rows of its decode up to the stages' exact batch limit (engine/kernels.py), which is
    what batch_rows defaults to: every answer stays what it is alone.

    Draft rows ride: a speculative micro-batch joins the rows held, and goes out with them, when it may (rides:
    its KV edits, applied before the shared decode, read only its owner's sequences, which no other member writes),
    else it goes out at once, alone (so one generation alone is exactly PipeInfer). A shared run is never skipped
    nor aborted: a Cancel naming a member of one is not sent (the head drops the member's rows; its cells are its
    partition's, which the head retires as for any cancelled run), the other ids of the Cancel are."""

    def __init__(self, pipe: PipePort, rules: BatchRules):
        self.pipe, self.rules = pipe, rules
        self.row_cap = rules.batch_rows                # next tokens per shared decode now (pace lowers it)
        self.members: dict[int, list[Member]] = {}   # run id in flight -> whose rows it carries, in row order
        self._held: list[tuple[Owner, Launch]] = []
        self._sampling_sent: RunSampling | None = None
        self.n_merged_runs = 0                         # runs that carried more than one owner's row
        self.n_merged_rows = 0                         # rows those runs carried
        self.n_rides = 0                               # draft micro-batches that rode others' rows
        self.n_riders_dropped = 0                      # ... cancelled while their shared run was in flight

    @property
    def held(self) -> Held:
        """The rows held to share a decode (batching.Held)."""
        return Held(sum(a.batch.n_tokens for _, a in self._held),
                    sum(a.batch.n_tokens == 1 and not a.speculative for _, a in self._held))

    def joins(self, n_rows: int, n_kv_ops: int) -> bool:
        """Whether a prompt chunk of n_rows (after n_kv_ops KV edits) would join rows already held (BatchRules)."""
        return self.rules.joins(self.held, n_rows, n_kv_ops, self.row_cap)

    def rides(self, owner: Owner, n_rows: int, parent_id: int) -> bool:
        """Whether owner's draft micro-batch of n_rows, building on run parent_id's cells, would ride the rows held
        (BatchRules.rides)."""
        return self.rules.rides(self.held, n_rows, any(o is owner for o, _ in self._held),
                                parent_id == NO_RUN or parent_id in self._shared_ids())

    def _shared_ids(self) -> set[int]:
        """Run ids of the members of shared runs in flight (a Cancel must not name these on the wire)."""
        return {m.run_id for ms in self.members.values() if len(ms) > 1 for m in ms}

    def pace(self, n_decoding: int) -> None:
        """Next tokens per shared decode, for n_decoding generations (BatchRules.row_cap)."""
        self.row_cap = self.rules.row_cap(n_decoding)

    @property
    def holding(self) -> bool:
        """Whether the next tokens held wait for the next result's to join them (BatchRules.holding)."""
        return self.rules.holding(self.held, self.row_cap, len(self.pipe.in_flight))

    def apply(self, owner: Owner, actions: list[Action]) -> None:
        for a in actions:
            if self.rules.batching and mergeable(a, self.rules.batch_rows):
                if a.speculative and self.rides(owner, a.batch.n_tokens, a.parent_id):
                    self._held.append((owner, a))
                    self.n_rides += 1
                    continue
                if not a.speculative:
                    if self._held and (not self.rules.room(self.held, a.batch.n_tokens, self.row_cap)
                                       or len(a.batch.prefix_ops)):
                        self.flush()  # KV edits (a cached prompt's copy) go after every run held before them
                    self._held.append((owner, a))
                    continue
            self.flush()
            if isinstance(a, Launch):
                self._launch(Run.of(a), [Member.of(owner, a)])
            elif isinstance(a, Cancel):
                shared = self._shared_ids()
                ids = [r for r in a.run_ids if r not in shared]
                self.n_riders_dropped += len(a.run_ids) - len(ids)
                if ids:
                    self.pipe.cancel(ids)
            elif isinstance(a, EditKv):
                self.pipe.kv(a.ops)
            else:
                raise TypeError(f"internal: unknown action {a!r}")

    def flush(self) -> None:
        """Send the held next-token runs, as one run."""
        if not self._held:
            return
        held, self._held = self._held, []
        launches = [a for _, a in held]
        members = [Member.of(o, a) for o, a in held]
        if len(held) > 1:
            self.n_merged_runs += 1
            self.n_merged_rows += sum(a.batch.n_tokens for a in launches)
        self._launch(merge(launches) if len(held) > 1 else Run.of(launches[0]), members)

    def _launch(self, a: Run, members: list[Member]) -> None:
        if a.sampling != self._sampling_sent:  # the last stage draws this run's tokens by these
            self.pipe.set_sampling(a.sampling)
            self._sampling_sent = a.sampling
        self.members[a.run_id] = members
        self.pipe.launch(a.run_id, a.batch, a.speculative, a.parent_id, a.rules)

    def row_owners(self, run_id: int) -> list:
        """The owner of each output row of a run in flight (the twin answers each row from its owner's reference)."""
        return [m.owner for m in self.members[run_id] for _ in range(m.n_outputs)]

    def next_result(self, flush: bool = True) -> list[tuple[Owner, object]]:
        """The oldest run's result (waiting for it), as (owner, its own port.Result) for each owner it carried
        (several when it was merged), in row order. Held runs go out first (a result may be what they wait for),
        unless the caller holds them on purpose while other runs are in flight (flush=False: to merge them with
        the rows this result frees)."""
        if flush or not self.pipe.in_flight:
            self.flush()
        res = self.pipe.next_result()
        members = self.members.pop(res.run_id)
        if len(members) == 1:  # a run of one owner: the result is its own as it came
            return [(members[0].owner, res)]
        return [(m.owner, r) for m, r in zip(members, split(res, members))]
