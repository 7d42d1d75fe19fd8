"""A round as a value: what the scheduler does next, decided by one pure function over what it sees.

plan_round takes a RoundView (each generation's state as the round starts, the pipe's room, the rows held, the
cells) and the pipeline's BatchRules, and returns a RoundPlan: compact first, or which generations' prompt chunks go
out and in what order, who holds the drafter, and whether it speculates. The scheduler carries the plan out
(Scheduler._execute) and routes the result it takes to the generations (Scheduler._update). Speculation itself stays
reactive, as PipeInfer's is: the holder's micro-batches go out one by one while no result is waiting, each alone or
riding the rows held by BatchRules.speculates_alone.

The planner predicts the rows the executor will hold after each chunk (held_after) with the executor's own rules,
so that a chunk joins rows held exactly where the executor would hold it with them.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

from .batching import BatchRules, Held


@dataclass(frozen=True)
class GenView:
    """One generation as the planner sees it."""
    chunks: tuple[tuple[int, int], ...] = ()  # its prompt's runs not fed yet: (rows, KV edits before them)
    prompt_in_flight: int = 0                 # its prompt's runs fed and not yet answered
    done: bool = False
    background: bool = False                  # the scheduler's own work (idle_work): never lent the drafter
    cells: int = 0                            # cells any stage may hold for it (its unfed chunks included)


@dataclass(frozen=True)
class RoundView:
    """What the scheduler sees as a round starts."""
    gens: tuple[GenView, ...]                 # admission order
    n_in_flight: int                          # runs in the pipe
    held: Held                                # rows held to share the next decode
    row_cap: int                              # next tokens per shared decode now
    cells_other: int                          # cells of finished generations and of the prompt cache
    cells_reserve: int                        # cells one round of speculative runs may take
    n_ctx: int
    mode: str                                 # iterative | speculative | pipeinfer


@dataclass(frozen=True)
class RoundPlan:
    """What one round does, in this order: COMPACT (and nothing else), or feed these generations' next prompt runs
    (indices, in launch order; one may appear several times), lend the drafter (to `lend_to`, None: to no one) and let
    it speculate."""
    compact: bool = False
    feeds: tuple[int, ...] = ()
    lend_to: int | None = None
    speculate: bool = False
    to_ride: bool = False                     # lent only for its draft rows to ride the others' decodes
    held: Held = field(default_factory=Held)  # the rows the executor holds once the feeds went out (predicted)


def held_after(held: Held, n_rows: int, n_kv_ops: int, rules: BatchRules, row_cap: int) -> Held:
    """The rows held once a prompt run of n_rows (after n_kv_ops KV edits) is applied (actions.Executor.apply): held
    with them when it may share a decode, after the rows held go out where it has no room beside them or edits the
    cache first; gone at once, and the rows held with it, where it is too big to share one."""
    if not (rules.batching and n_rows <= rules.batch_rows):
        return Held()
    if held.n_rows and (not rules.room(held, n_rows, row_cap) or n_kv_ops):
        held = Held()
    return Held(held.n_rows + n_rows, held.n_next + (n_rows == 1))


def cells_short(n_cells: int, n_gens: int, reserve: int, n_ctx: int) -> bool:
    """Whether one more round's runs might not fit the context beside the n_cells any stage may hold: a token for each
    of n_gens generations and a round of speculative runs (reserve)."""
    return n_cells + n_gens + reserve > n_ctx


def plan_feeds(view: RoundView, rules: BatchRules) -> tuple[tuple[int, ...], Held]:
    """The prompt runs that go out this round (BatchRules.feeds), the generation with the fewest left first (then the
    first admitted: a short or mostly cached prompt is not queued behind a long one), and the rows held after them."""
    left = [list(g.chunks) for g in view.gens]
    in_flight = sum(g.prompt_in_flight for g in view.gens)
    held, feeds = view.held, []
    while pending := [i for i, c in enumerate(left) if c]:
        i = min(pending, key=lambda i: len(left[i]))
        n_rows, n_kv_ops = left[i][0]
        if not rules.feeds(in_flight, rules.joins(held, n_rows, n_kv_ops, view.row_cap)):
            break
        held = held_after(held, n_rows, n_kv_ops, rules, view.row_cap)
        left[i].pop(0)
        in_flight += 1
        feeds.append(i)
    return tuple(feeds), held


def plan_round(view: RoundView, rules: BatchRules, ride_len: Callable[[int, int], int]) -> RoundPlan:
    """The round's plan. ride_len(gen, n_rows): the draft tokens generation `gen` would ride on a decode of n_rows
    others' rows (DraftSizer.ride_len), asked only where the lend depends on it."""
    n_cells = sum(g.cells for g in view.gens) + view.cells_other
    short = cells_short(n_cells, len(view.gens), view.cells_reserve, view.n_ctx)
    if short and not all(g.done for g in view.gens):  # done ones only drain: they take no new cells
        return RoundPlan(compact=True)
    feeds, held = plan_feeds(view, rules)
    if view.mode == "iterative":
        return RoundPlan(feeds=feeds, held=held)
    n_fed = [feeds.count(i) for i in range(len(view.gens))]
    # a newcomer is lent the drafter once its prompt is fed (a drafter's prefill would hold the head from feeding it)
    decoding = [i for i, g in enumerate(view.gens)
                if not g.done and not g.background and len(g.chunks) == n_fed[i]]
    alone = rules.lends(len(decoding), len(view.gens))
    lend_to = None
    if decoding and (alone or rules.rides_pay(view.row_cap, lambda: ride_len(decoding[0], view.row_cap))):
        lend_to = decoding[0]
    return RoundPlan(feeds=feeds, lend_to=lend_to, speculate=lend_to is not None and view.mode == "pipeinfer",
                     to_ride=lend_to is not None and not alone, held=held)
