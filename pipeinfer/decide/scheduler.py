"""Rank 0's one generation loop: every generation, in every mode, one at a time or several at once
(`generate`, `serve --parallel N`, `generate --prompts FILE`, the attached rank 0 of a supervised server).

With one generation an N-stage pipeline holds one token's work unless the draft is right; with N generations
every stage is busy on work that is certain to be used, and no speculation beats that. Each round (step):

    admit waiting requests, first come first served, while a slot is free and their cells fit (slots.py)
    if the runs of one more round might not fit the context: collect every run, repack the canonical
        sequences (COMPACT), and go on
    feed: the newcomers' prompt chunks go out between the others' next tokens, as many in flight as the pipeline
        has stages, or more where they join rows held (BatchRules.feeds), the newcomer with the fewest chunks left
        first; its chunks are the ones it would take alone (other chunks change the numerics)
    lend: the oldest decoding generation holds the drafter while fewer decode than the pipeline is deep, alone,
        or where its draft rows pay riding the others' decodes (BatchRules.lends; in synchronous speculative mode
        the one generation holds it and drafts a tree whenever its next token needs covering, Head.cover_next)
    speculate: while no result is waiting, the holder's micro-batches go out one by one (PipeInfer, with its
        reactive cutoffs), alone while a stage would idle (BatchRules.speculates_alone), else riding the rows held
    take the oldest result (launch order) and route it to the generations whose rows it carried (update): each
        verifies and commits, its emitted tokens are delivered to its request, and its next token goes out with
        the others' as one shared decode (actions.Executor: up to the stages' exact batch limit), or waits for the
        next result's to join it while the runs in flight keep every stage busy (BatchRules.holding)
    a finished generation (length, end of generation, stop string, disconnect) cancels its runs; once the last of
        them is collected its answer is delivered and its slot holds its prompt for the cache, or waits for the
        next COMPACT

Admission reserves the worst case of every admitted generation (prompt + max tokens) plus one round of speculative
runs (kvplan.ContextBudget): the cells never run out; a request that does not fit waits in the queue. With nothing
to generate, idle_work re-decodes the last answer in whole chunks for the prompt cache.
"""
from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field, replace
from typing import Callable

from ..core.decoding import Decoding, TokenLogprob
from ..core.kvplan import ContextBudget, PartitionPool, cells_reserve
from ..core.metrics import Stats
from ..core.prefixcache import whole_chunks
from ..core.protocol import compact, kv_ops, rm
from ..core.sampling import SamplingParams
from .actions import EditKv, Executor
from .batching import BatchRules, pipeline_depth, ride_cost_ms
from .genconfig import GenConfig, check_gen_config
from .head import Head, Taken
from .planner import GenView, RoundPlan, RoundView, cells_short, plan_round
from .port import PipePort, Result
from .slots import Slots


@dataclass
class Request:
    """One generation asked of the scheduler; the callbacks run on the scheduler's thread, from update alone."""
    prompt: list[int]
    n_predict: int
    sampling: SamplingParams = SamplingParams()
    prompt_text: str | None = None
    chat: bool = False
    on_tokens: Callable[[list[int]], None] | None = None
    should_stop: Callable[[], bool] | None = None
    on_done: Callable[[list[int], Stats], None] | None = None  # the answer's tokens and statistics
    on_progress: Callable[[Stats, int], None] | None = None    # (statistics, runs in flight) after every emission
    t_queued_s: float = 0.0
    replay: list[int] = field(default_factory=list)  # tokens the answer already has (a resumed request, Head.start):
                                                     # n_predict, on_tokens and on_done count only those after them
    decoding: Decoding = Decoding()                  # constraint, biases, penalties, log-probabilities (core/decoding)
    on_logprobs: Callable[[list[TokenLogprob]], None] | None = None  # called just before on_tokens, one per token
    cache_prompt: bool = True                        # start from the prompt cache, and leave this prompt in it
    background: bool = False                         # the scheduler's own (idle_work): never lent the drafter

    @property
    def need(self) -> int:
        """Canonical cells it may hold at most: prompt, replayed tokens, max new tokens."""
        return len(self.prompt) + len(self.replay) + self.n_predict


@dataclass
class Running:
    """A generation admitted: its request, its state machine and its slot."""
    req: Request
    head: Head
    lane: int

    @property
    def decoding(self) -> bool:
        """Its prompt is all fed and its answer not finished."""
        return not self.head.done and not self.head.pending


@dataclass
class SchedulerStats:
    n_admitted: int = 0
    n_finished: int = 0
    n_compactions: int = 0
    n_lends: int = 0                     # times the drafter went to another generation
    max_active: int = 0
    waits_for_cells: int = 0             # rounds a request waited because its cells did not fit
    admitted_order: list[int] = field(default_factory=list)  # request numbers in admission order


class Scheduler:
    """Rank 0's scheduler for many generations over one pipeline (any port.PipePort): the round of the module
    docstring, with the per-generation algorithm in Head, the batching rules in batching.py, the slots and cells in
    slots.py, and the executor (actions.py) the only code that drives the pipe."""

    def __init__(self, pipe: PipePort, cfg: GenConfig, *, n_stages: int, n_parallel: int = 1,
                 pool: PartitionPool | None = None, drafter_for=None, eos: set[int] = frozenset(),
                 first_run_id: int = 0, clock: Callable[[], float] = time.perf_counter, rules_for=None):
        check_gen_config(cfg)
        if cfg.mode == "speculative" and n_parallel != 1:
            raise ValueError("synchronous speculative mode runs one generation at a time (--parallel 1)")
        if cfg.mode != "iterative" and (pool is None or drafter_for is None):
            raise ValueError(f"mode {cfg.mode} needs a drafter and a partition pool")
        self.pipe, self.cfg, self.pool, self.drafter_for = pipe, cfg, pool, drafter_for
        self.rules_for = rules_for  # callable(decoding, answer_at) -> rules.RunRules (a request that shapes logits)
        self.n_stages, self.n_parallel, self.eos, self.clock = n_stages, n_parallel, set(eos), clock
        self.rules = BatchRules(cfg.batch_rows, pipeline_depth(n_stages, cfg.stage_ms), n_stages)
        self.slots = Slots(n_parallel, cfg.cache_prompt, cfg.prompt_chunk, pool.n_partitions if pool else 0,
                           pool.size if pool else 1)
        self.budget = ContextBudget(cfg.n_ctx, cells_reserve(pool.n_partitions, cfg.draft_max) if pool else 0)
        self.waiting: deque[tuple[int, Request, object]] = deque()  # (number, request, its RunRules or None)
        self.gens: list[Running] = []         # admission order
        self.executor: Executor[Running] = Executor(pipe, self.rules)  # the one place the pipeline is driven
        self.holder: Running | None = None    # the generation the drafter is lent to
        self.draft_obs: deque = deque(maxlen=32)  # the drafter's recent (tokens, ms) calls, whoever held it
        self._ride_tries: deque[tuple[int, float]] = deque(maxlen=32)  # (rides launched, head ms) per try or lend
        self._run_id = first_run_id
        self._n_requests = 0
        self.stats = SchedulerStats()

    @property
    def cache(self):
        """The prompt cache (core/prefixcache.PrefixCache), or None."""
        return self.slots.cache

    def submit(self, req: Request) -> None:
        if not req.prompt:
            raise ValueError("empty prompt")
        if not self.budget.fits(len(req.prompt) + len(req.replay), req.n_predict):
            raise ValueError(self.budget.refusal(len(req.prompt) + len(req.replay), req.n_predict))
        rules = None
        if req.decoding.shapes_logits:  # built here: a constraint that cannot compile is this request's ValueError
            if self.rules_for is None:
                raise ValueError("this pipeline takes no constraints or biases")
            rules = self.rules_for(req.decoding, len(req.prompt))
        if not req.t_queued_s:
            req.t_queued_s = self.clock()
        self.waiting.append((self._n_requests, req, rules))
        self._n_requests += 1

    @property
    def busy(self) -> bool:
        return bool(self.waiting or self.gens)

    def run(self) -> None:
        """Until every submitted request is answered."""
        while self.busy:
            self.step()

    def step(self) -> None:
        """One round (module docstring); then the next tokens held to share a decode go out, unless the runs in
        flight keep every stage busy without them."""
        self._round()
        if not self.executor.holding:
            self.executor.flush()

    def _round(self) -> None:
        if not (self.gens and self.pipe.result_ready()):
            self._admit()
        if self.gens:
            self._execute(plan_round(self._view(), self.rules, lambda i, n_rows: self._ride_len(self.gens[i], n_rows)))

    def _view(self) -> RoundView:
        """What the planner sees (planner.RoundView)."""
        return RoundView(
            tuple(GenView(tuple((len(nodes), len(ops)) for nodes, ops in g.head.pending), len(g.head.prompt_in_flight),
                          g.head.done, g.req.background, g.head.n_cells_held)
                  for g in self.gens),
            len(self.pipe.in_flight), self.executor.held, self.executor.row_cap,
            self.slots.n_cells_dead + self.slots.n_cells_cached,
            self.budget.reserve, self.cfg.n_ctx, self.cfg.mode)

    def _execute(self, plan: RoundPlan) -> None:
        """Carry out a round's plan: compact, or feed, lend, speculate while no result is waiting, then take the
        oldest result (_update) and deliver the answers of the generations whose runs are all back."""
        if plan.compact:
            self._compact()
            return
        gens = list(self.gens)
        for i in plan.feeds:
            self.executor.apply(gens[i], gens[i].head.feed_prompt())
        if self.executor.held != plan.held:
            raise RuntimeError(f"internal: the plan held {plan.held}, the executor holds {self.executor.held}")
        holder = self._lend(gens[plan.lend_to] if plan.lend_to is not None else None, plan.to_ride)
        if plan.speculate:
            self._speculate(holder)
            if holder.head.asynchronous and not self.pipe.result_ready():
                holder.head.lease.ahead.wait(self.pipe.result_ready)  # a draft or a result, whichever comes first
                if not self.pipe.result_ready():
                    return
        if self.pipe.in_flight:
            self._update(self.executor.next_result(flush=not self.executor.holding))
        for g in [g for g in self.gens if g.head.done and not g.head.flights]:
            self._finish(g)

    # ---------------------------------------------------------------- admission and the cell budget
    def _admit(self) -> None:
        if self.waiting and not self.gens and self.slots.dirty:
            self._compact()  # nothing in flight: every cell goes, and the newcomer starts from cell 0, as alone
        while self.waiting and len(self.gens) < self.n_parallel:
            if not self.slots.clean:
                self._compact()  # every free slot is dirty: repack to clean them
                continue
            num, req, rules = self.waiting[0]
            if not self.budget.fits(req.need, 0, sum(g.req.need for g in self.gens)):
                self.stats.waits_for_cells += 1
                return  # first come first served: the next request waits for cells, no one overtakes it
            if self._cells_short(req.need):
                self._compact()  # the cache entries beyond what this request may need go
            self.waiting.popleft()
            self._start(num, req, rules)

    def _start(self, num: int, req: Request, rules) -> None:
        lane = self.slots.take()
        cfg = replace(self.cfg, n_predict=req.n_predict, sampling=req.sampling)
        head = Head(cfg, self._new_run_id, eos=self.eos, clock=self.clock, canon=self.slots.canon[lane], rules=rules,
                    top_logprobs=req.decoding.top_logprobs, draft_obs=self.draft_obs)
        g = Running(req, head, lane)
        self.gens.append(g)
        self.stats.n_admitted += 1
        self.stats.max_active = max(self.stats.max_active, len(self.gens))
        self.stats.admitted_order.append(num)
        start = None
        if req.cache_prompt:
            running = {self.slots.canon[h.lane]: h for h in self.gens if h is not g and h.req.cache_prompt}
            start = self.slots.start(req.prompt, [(seq, h.req.prompt[:h.head.n_planned]) for seq, h in running.items()])
            if start is not None and start.seq in running:  # the copy must follow the chunks it copies at every stage
                while running[start.seq].head.seq0_end < start.n:
                    self.executor.apply(running[start.seq], running[start.seq].head.feed_prompt())
        # in the chunks it takes alone (prompt_chunk, from position 0): other chunks change the numerics
        head.start(req.prompt, req.replay, cached=(start.seq, start.n) if start else None)
        head.stats.t_queue_s = max(0.0, head.stats.t_start_s - req.t_queued_s)

    def _cells_short(self, newcomer: int = 0) -> bool:
        """Whether one more round's runs might not fit: a token per generation and the speculation, and the cells a
        newcomer may need."""
        return cells_short(self._cells_bound() + newcomer, len(self.gens), self.budget.reserve, self.cfg.n_ctx)

    def _cells_bound(self) -> int:
        """Cells any stage may hold now: the running generations' (and their unfed chunks'), the finished ones' until
        a COMPACT, the cache's."""
        return sum(g.head.n_cells_held for g in list(self.gens)) + self.slots.n_cells_dead + self.slots.n_cells_cached

    def _compact(self) -> None:
        """Collect every run in flight, then have every stage keep only the canonical sequences of the generations
        still here, repacked (one that ended while its runs were collected keeps its cells: it is finished after)."""
        self.executor.flush()
        while self.pipe.in_flight:
            for g, res in self.executor.next_result():
                self._route(g, res, follow=False)
        live = [self.slots.canon[g.lane] for g in self.gens]
        # the cache entries that fit beside what the generations here and the next request may need
        nxt = self.waiting[0][1] if self.waiting else None
        kept = self.slots.keep_cached(self.cfg.n_ctx - self.budget.reserve - sum(g.req.need + 1 for g in self.gens),
                                      nxt.need if nxt else 0, nxt.prompt if nxt and nxt.cache_prompt else None)
        trim = [rm(e.seq, len(e.tokens), -1) for e in kept]  # an entry keeps only the positions it can give
        keep = live + [e.seq for e in kept]
        self.executor.apply(None, [EditKv(kv_ops(*trim, *[compact(s) for s in keep]) if keep else kv_ops(rm(-1)))])
        for g in self.gens:
            g.head.compacted()
        self.slots.compacted()
        self.stats.n_compactions += 1
        for g in [g for g in self.gens if g.head.done]:
            self._finish(g)
        for g in self.gens:
            self.executor.apply(g, g.head.cover_next())

    def idle_work(self) -> bool:
        """With nothing to generate: have the most recent cache entry's answer (and the rest of its prompt) decoded
        again in whole chunks, as a later turn's cold run decodes them, so that the next turn of a conversation
        starts after its last answer instead of before it. It runs as a request of one token that nobody receives
        (its entry then extends the old one). Whether there was such work (then submitted: step until not busy)."""
        if self.busy or self.cache is None or (e := self.cache.to_extend()) is None:
            return False
        self.submit(Request(e.held[:whole_chunks(len(e.held), self.cache.chunk)], 1, background=True))
        return True

    def has_idle_work(self) -> bool:
        return self.cache is not None and self.cache.to_extend() is not None

    def cache_load(self) -> dict:
        """The prompt cache and the cells, for /health (a snapshot read from another thread)."""
        return self.slots.load(self._cells_bound(), self.cfg.n_ctx)

    # ---------------------------------------------------------------- the drafter's lease and speculation
    def _lend(self, want: Running | None, to_ride: bool) -> Running | None:
        """The drafter goes to `want` (planner: the oldest decoding generation, or no one); a lend made only for its
        draft rows to ride counts as a ride's cost."""
        if want is not self.holder:
            if self.holder is not None:
                self.holder.head.release_drafter()
            if want is not None:
                t0 = self.clock()
                drafter = self.drafter_for(want.req.prompt, want.req.prompt_text, want.req.chat)
                want.head.hold_drafter(drafter, self.pool)
                if to_ride:
                    self._ride_tries.append((0, (self.clock() - t0) * 1e3))
                self.stats.n_lends += 1
            self.holder = want
        return want

    def _speculate(self, g: Running) -> None:
        """Keep the pipeline full while no result is waiting (continuous, asynchronous speculation): the holder's
        micro-batches, one by one, each sent as soon as it is drafted, or riding the others' rows held."""
        head = g.head
        # one rank: results are ready at once, so it speculates one micro-batch per round instead of never
        while head.may_speculate and (not self.pipe.result_ready() or
                                      (not self.pipe.distributed and not head.speculating)):
            if not self.rules.speculates_alone(len(self.gens), len(self.pipe.in_flight)):
                self._ride(g)
                return
            actions = head.speculate_once()
            if actions is None:
                return
            self.executor.apply(g, actions)

    def _ride(self, g: Running) -> None:
        """g's next micro-batch joins the rows held for a shared decode, where it may (Executor.rides) and pays
        (_rides_pay), sized for that decode."""
        head, n_held = g.head, self.executor.held.n_rows
        if head.may_speculate and self._rides_pay(g, n_held) and self.executor.rides(g, 1, head.spec_parent):
            t0 = self.clock()
            actions = head.speculate_once(ride_rows=n_held)
            self._ride_tries.append((int(bool(actions)), (self.clock() - t0) * 1e3))
            if actions:
                self.executor.apply(g, actions)

    def _rides_pay(self, g: Running, n_rows: int) -> bool:
        """Whether g's draft rows buy more than they cost riding a shared decode of n_rows others' rows."""
        return self.rules.rides_pay(n_rows, lambda: self._ride_len(g, n_rows))

    def _ride_len(self, g: Running, n_rows: int) -> int:
        """Draft tokens g would ride on n_rows others' rows (its sizer's ride_len on the measured stage costs, its
        running acceptance and what rides have cost the head)."""
        return g.head.sizer.ride_len(n_rows, ride_cost_ms(self._ride_tries))

    # ---------------------------------------------------------------- runs and results
    def _new_run_id(self) -> int:
        self._run_id += 1
        return self._run_id

    @property
    def last_run_id(self) -> int:
        return self._run_id

    def _update(self, results: list[tuple[Running, Result]]) -> None:
        """A result, routed to each generation whose rows it carried: their next tokens go out together (held in the
        executor), now, or with the next result's while the stages are busy anyway (BatchRules.holding)."""
        self.executor.pace(sum(1 for g in self.gens if g.decoding))
        for g, res in results:
            self._route(g, res, follow=not g.head.done)
        if self.holder is not None and not self.holder.head.done and self.cfg.mode == "pipeinfer":
            self._ride(self.holder)
        if not self.executor.holding:
            self.executor.flush()

    def _route(self, g: Running, res: Result, follow: bool) -> None:
        """One generation's result: what it decided goes to the executor, what it emitted to its request; then,
        unless it only collects its runs (follow False: no after_result), it covers its next token or, told to stop,
        ends."""
        taken: Taken = g.head.take_result(res)
        self.executor.apply(g, taken.actions)
        for out in taken.emitted:
            if g.req.on_logprobs and out.logprobs is not None:
                g.req.on_logprobs(out.logprobs)
            if g.req.on_tokens:
                g.req.on_tokens(out.tokens)
            if g.req.on_progress:
                g.req.on_progress(g.head.stats, len(g.head.flights))
        if follow:
            self.executor.apply(g, g.head.after_result(stop=g.req.should_stop is not None and g.req.should_stop()))

    def _finish(self, g: Running) -> None:
        """Every run of a finished generation is back: deliver its answer; its slot holds its prompt as a cache
        entry, or waits for a COMPACT (a generation that ended before its prompt's last chunk went out holds only
        the chunks launched)."""
        if self.holder is g:
            g.head.release_drafter()
            self.holder = None
        self.gens.remove(g)
        head = g.head
        self.slots.finished(g.lane, g.req.prompt[:head.seq0_end], head.n_cells_bound, head.accepted[:head.seq0_end],
                            g.req.cache_prompt)
        self.stats.n_finished += 1
        head.stats.n_kv0 = head.seq0_end
        if g.req.on_done is not None:
            g.req.on_done(head.result(), head.stats)


def generate(sched: Scheduler, req: Request) -> tuple[list[int], Stats]:
    """One request to its end on `sched` (with whatever else was submitted): its tokens and statistics."""
    answer: list = []
    on_done = req.on_done

    def done(tokens: list[int], stats: Stats) -> None:
        answer.append((tokens, stats))
        if on_done is not None:
            on_done(tokens, stats)
    sched.submit(replace(req, on_done=done))
    while not answer:
        sched.step()
    return answer[0]
