"""Rank 0's one generation loop: every generation, in every mode, one at a time or several at once
(`generate`, `serve --parallel N`, `generate --prompts FILE`, the attached rank 0 of a supervised server).

With one generation an N-stage pipeline holds one token's work unless the draft is right; with N generations
every stage is busy on work that is certain to be used, and no speculation beats that. So the scheduler runs:

    until every request is answered:
        admit waiting requests, first come first served, while a slot is free and their cells fit
        if the runs of one more round might not fit the context: collect every run, repack the canonical
            sequences (COMPACT), and go on
        certain work first: every generation keeps its next token covered (Head.take launches it when a result
            leaves it uncovered); the newcomers' prompt chunks go out between those tokens, as many in flight as
            the pipeline has stages (enough to keep every stage busy on them, few enough that the others' next
            tokens wait behind at most that many chunks), the newcomer with the fewest chunks left first (a
            short or mostly cached prompt is not queued behind a long one); its chunks are the ones it would take
            alone: other chunks change the numerics, and the answer would differ
        speculation only where a stage would otherwise idle: while fewer generations decode than the pipeline
            is deep (pipeline_depth), the oldest one holds the drafter (PipeInfer, with its reactive cutoffs;
            alone, exactly PipeInfer; beside others, only while fewer runs are in flight than that depth); in
            synchronous speculative mode the one generation holds it and drafts a tree whenever its next token
            needs covering (Head.cover); with many, the holder's draft rows ride the others' shared decodes
            where the measured costs and its running acceptance say they buy more than they cost (shape.ride_len:
            rows nearly free, as on tiled kernels; never where a row costs a decode), and the drafter is lent
            for that too
        take the oldest result and hand it to the generations whose rows it carried (results come in launch
            order); their next tokens go out together as one run, each row in its own sequence (users batched,
            up to the stages' exact batch limit: actions.Executor), or wait for the next result's to join them
            while the runs in flight keep every stage busy
        a finished generation (length, end of generation, stop string, disconnect) cancels its runs; once
            the last of them is collected its answer is delivered and its slot waits for the next COMPACT

KV cache (kvplan.py): each generation slot has a canonical sequence of its own (lane_canonical); the partitions
and the garbage sequence are shared, and only the drafter's holder takes partitions. A finished generation's
cells are not freed (a hole would be refilled out of position order, kvplan.py): its slot is dirty until the
next COMPACT, which keeps every live canonical sequence and drops the rest. There are twice as many slots as
--parallel, so a request rarely waits for a compaction. Admission reserves the worst case of every admitted
generation (prompt + max tokens) plus one round of speculative runs: the cells never run out; a request that
does not fit waits in the queue.

Prompt cache (core/prefixcache.py): a finished generation's slot becomes a cache entry (its prompt's whole chunks)
instead of dirty; a newcomer copies the longest prefix it shares with an entry or a running prompt into its own
canonical sequence and decodes only the rest, in the chunks a cold run would. Entries are evictable: admission
does not count them, and a compaction keeps only those that fit beside what the running and the next waiting
request may need. With nothing to generate, idle_work re-decodes the last answer in whole chunks.
"""
from __future__ import annotations

import math
import time
from collections import deque
from dataclasses import dataclass, field, replace
from typing import Callable

from ..core.decoding import Decoding, TokenLogprob
from ..core.kvplan import CACHE_ENTRIES, PartitionPool, cells_reserve, lane_canonical, lane_count
from ..core.metrics import Stats
from ..core.prefixcache import Entry, PrefixCache, cache_load, whole_chunks
from ..core.protocol import compact, kv_ops, rm
from ..core.verify import SamplingParams
from .actions import EditKv, Executor
from .head import GenConfig, Head, check_gen_config

# generations at once by default, per stage (`serve`/`generate --prompts` --parallel): one per stage would keep
# every stage busy if every run cost the same, but a newcomer's prompt holds a stage for many token-times, and
# the other generations' next tokens queued at the other stages are what keeps those busy meanwhile; each one
# more queues in front of every token, so latency grows with it. Measured (launch/serve_load.py --config; 2 ranks, 8
# clients, 64 requests, the one-at-a-time server's tokens/s and p50 latency in the same run): with the stages
# balanced (--layer-split balanced), 4 at once 1.67x / 0.62x, 6 1.71x / 0.72x (medians of 2 rounds), 8 1.63x /
# 0.84x; with 14 + 14 layers, 2 at once 1.25x / 0.85x, 4 1.47x / 0.71x, 6 1.63x / 0.74x, 8 1.71x / 0.81x
PARALLEL_PER_STAGE = 2
MAX_PARALLEL = 64


# per stage when several generations' next tokens share a decode (--batch-rows): each stage then carries a batch,
# and the scheduler needs as many generations decoding as the batches in flight hold
PARALLEL_PER_STAGE_BATCHED = 4


def default_parallel(n_stages: int, batching: bool = False) -> int:
    per_stage = PARALLEL_PER_STAGE_BATCHED if batching else PARALLEL_PER_STAGE
    return max(1, min(MAX_PARALLEL, per_stage * n_stages))


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
    that rides a shared decode of as many next tokens as the executor paces in (Executor.pace: the generations
    over the stages), within the exact batch limit (Head.ride_len needs both)."""
    return max(draft_max, min(batch_rows, draft_max + math.ceil(n_parallel / n_stages)))


@dataclass
class Request:
    """One generation asked of the scheduler; the callbacks run on the scheduler's thread."""
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
class _Gen:
    req: Request
    head: Head
    lane: int


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
    """Rank 0's scheduler for many generations over one Pipeline (or the twin's SimPipeline).

    Why one class: admission, the cell budget, the drafter's lease and the routing of results all read and
    change the same state together (the generations in flight, their slots, the runs each launched); the
    per-generation algorithm stays in Head, the KV arithmetic in kvplan.py.
    """

    def __init__(self, pipe, cfg: GenConfig, *, n_stages: int, n_parallel: int = 1, pool: PartitionPool | None = None,
                 drafter_for=None, eos: set[int] = frozenset(), first_run_id: int = 0,
                 clock: Callable[[], float] = time.perf_counter, rules_for=None):
        check_gen_config(cfg)
        if cfg.mode == "speculative" and n_parallel != 1:
            raise ValueError("synchronous speculative mode runs one generation at a time (--parallel 1)")
        if cfg.mode != "iterative" and (pool is None or drafter_for is None):
            raise ValueError(f"mode {cfg.mode} needs a drafter and a partition pool")
        self.pipe, self.cfg, self.pool, self.drafter_for = pipe, cfg, pool, drafter_for
        self.rules_for = rules_for  # callable(decoding, answer_at) -> rules.RunRules (a request that shapes logits)
        n_part = pool.n_partitions if pool is not None else 0
        self.n_stages, self.n_parallel, self.eos, self.clock = n_stages, n_parallel, set(eos), clock
        self.depth = pipeline_depth(n_stages, cfg.stage_ms)  # runs in flight that fill the slowest stage
        size = pool.size if pool is not None else 1  # a partition's sequence ids (the other slots' ids follow)
        self.n_lanes = lane_count(n_parallel, cfg.cache_prompt)
        self.cache = PrefixCache(cfg.prompt_chunk, CACHE_ENTRIES) if cfg.cache_prompt else None
        self._canon = [lane_canonical(k, n_part, size) for k in range(self.n_lanes)]
        self._clean = deque(range(self.n_lanes))
        self._dirty: list[int] = []
        self.n_cells_dead = 0                 # cells of finished generations, until the next COMPACT
        self.reserve = cells_reserve(pool.n_partitions, cfg.draft_max) if pool is not None else 0
        self.waiting: deque[tuple[int, Request, object]] = deque()  # (number, request, its RunRules or None)
        self.gens: list[_Gen] = []            # admission order
        self.executor: Executor[_Gen] = Executor(pipe, cfg.batch_rows)  # the one place the pipeline is driven
        self.holder: _Gen | None = None       # the generation the drafter is lent to
        self.draft_obs: deque = deque(maxlen=32)  # the drafter's recent (tokens, ms) calls, whoever held it
        self._ride_obs: deque[tuple[int, float]] = deque(maxlen=32)  # (rides launched, head ms) per try or lend
        self._run_id = first_run_id
        self._n_requests = 0
        self.stats = SchedulerStats()

    # ================================================================ the loop
    def submit(self, req: Request) -> None:
        if not req.prompt:
            raise ValueError("empty prompt")
        if req.need + self.reserve > self.cfg.n_ctx:
            raise ValueError(f"prompt ({len(req.prompt) + len(req.replay)} tokens) + max tokens ({req.n_predict}) does not fit the "
                             f"context ({self.cfg.n_ctx} cells, {self.reserve} kept for speculative runs)")
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
        """One round (_round); then the next tokens held to share a decode go out, unless the runs in flight keep
        every stage busy without them (_holding)."""
        self._round()
        if not self._holding():
            self.executor.flush()

    def _round(self) -> None:
        """Admit (while no result waits), compact if needed, feed prompt chunks, speculate where there is room,
        take a result."""
        ready = bool(self.gens) and self.pipe.result_ready()
        if not ready:
            self._admit()
        if not self.gens:
            return
        if self._cells_short() and not all(g.head.done for g in self.gens):  # done ones only drain: no new cells
            self._compact()
            return
        self._feed()
        holder = self._lease()
        if holder is not None and not holder.head.done and self.cfg.mode == "pipeinfer":
            self._speculate(holder)
            if holder.head.asynchronous and not self.pipe.result_ready():
                holder.head.drafter.wait(self.pipe.result_ready)  # a draft or a result, whichever comes first
                if not self.pipe.result_ready():
                    return
        if self.pipe.in_flight:
            self._take(self.executor.next_result(flush=not self._holding()))
        for g in [g for g in self.gens if g.head.done and not g.head.flights]:
            self._finish(g)

    # ================================================================ admission and the cell budget
    def _admit(self) -> None:
        if self.waiting and not self.gens and self._dirty:
            self._compact()  # nothing in flight: every cell goes, and the newcomer starts from cell 0, as alone
        while self.waiting and len(self.gens) < self.n_parallel:
            if not self._clean:
                self._compact()  # every free slot is dirty: repack to clean them
                continue
            num, req, rules = self.waiting[0]
            if sum(g.req.need for g in self.gens) + req.need + self.reserve > self.cfg.n_ctx:
                self.stats.waits_for_cells += 1
                return  # first come first served: the next request waits for cells, no one overtakes it
            if self._cells_short(req.need):
                self._compact()  # the cache entries beyond what this request may need go
            self.waiting.popleft()
            self._start(num, req, rules)

    def _start(self, num: int, req: Request, rules) -> None:
        lane = self._clean.popleft()
        cfg = replace(self.cfg, n_predict=req.n_predict, sampling=req.sampling)
        head = Head(cfg, self._new_run_id, eos=self.eos, on_tokens=req.on_tokens,
                    on_progress=req.on_progress, should_stop=req.should_stop, clock=self.clock,
                    canon=self._canon[lane], rules=rules, top_logprobs=req.decoding.top_logprobs,
                    on_logprobs=req.on_logprobs, draft_obs=self.draft_obs)
        g = _Gen(req, head, lane)
        self.gens.append(g)
        self.stats.n_admitted += 1
        self.stats.max_active = max(self.stats.max_active, len(self.gens))
        self.stats.admitted_order.append(num)
        start = None
        if self.cache is not None and req.cache_prompt:
            running = {self._canon[h.lane]: h for h in self.gens if h is not g and h.req.cache_prompt}
            start = self.cache.find(req.prompt, [(seq, h.req.prompt[:h.head.n_planned]) for seq, h in running.items()])
            if start is not None and start.seq in running:  # the copy must follow the chunks it copies at every stage
                while running[start.seq].head.n_kv0 < start.n:
                    self.executor.apply(running[start.seq], running[start.seq].head.feed())
        # in the chunks it takes alone (prompt_chunk, from position 0): other chunks change the numerics
        head.start(req.prompt, req.replay, cached=(start.seq, start.n) if start else None)
        head.stats.t_queue_s = max(0.0, head.stats.t_start_s - req.t_queued_s)

    def _feed(self) -> None:
        """Launch newcomers' prompt chunks while fewer than the stages are in flight, or while the next one joins
        rows already held to share a decode (Executor.joins), fewest chunks left first (then the first admitted)."""
        while True:
            pending = [g for g in self.gens if g.head.pending]
            if not pending:
                return
            g = min(pending, key=lambda g: len(g.head.pending))
            nodes, pre_ops = g.head.pending[0]
            if (sum(len(h.head.prompt_in_flight) for h in self.gens) >= self.n_stages
                    and not self.executor.joins(len(nodes), len(pre_ops))):
                return
            self.executor.apply(g, g.head.feed())

    def _cells_short(self, newcomer: int = 0) -> bool:
        """Whether one more round's runs might not fit: a token per generation and the speculation, and the cells a
        newcomer may need."""
        return self._cells_bound() + len(self.gens) + self.reserve + newcomer > self.cfg.n_ctx

    def _cells_bound(self) -> int:
        """Cells any stage may hold now: the running generations', the finished ones' until a COMPACT, the cache's."""
        return (sum(g.head.n_cells_bound + g.head.n_planned - g.head.n_kv0 for g in list(self.gens))  # + unfed chunks
                + self.n_cells_dead + self.n_cells_cached)

    def _compact(self) -> None:
        """Collect every run in flight, then have every stage keep only the canonical sequences of the generations
        still here, repacked (one that ended while its runs were collected keeps its cells: it is finished after)."""
        self.executor.flush()
        while self.pipe.in_flight:
            for g, res in self.executor.next_result():
                self.executor.apply(g, g.head.handle(res))
        live = [self._canon[g.lane] for g in self.gens]
        kept: list[Entry] = []
        if self.cache is not None:  # the entries that fit beside what the generations here and the next may need
            budget = self.cfg.n_ctx - self.reserve - sum(g.req.need + 1 for g in self.gens)
            start = None
            if self.waiting:  # the next request: its cells, but not those it will share with the entry it starts from
                nxt = self.waiting[0][1]
                start = self.cache.peek(nxt.prompt) if nxt.cache_prompt else None
                budget -= nxt.need - (start.n if start else 0)
            self._clean.extend(e.lane for e in self.cache.keep_within(budget, start.entry if start else None))
            kept = self.cache.entries
        trim = [rm(e.seq, len(e.tokens), -1) for e in kept]  # an entry keeps only the positions it can give
        keep = live + [e.seq for e in kept]
        self.executor.apply(None, [EditKv(kv_ops(*trim, *[compact(s) for s in keep]) if keep else kv_ops(rm(-1)))])
        for g in self.gens:
            g.head.compacted()
        self._clean.extend(sorted(self._dirty))
        self._dirty.clear()
        self.n_cells_dead = 0
        self.stats.n_compactions += 1
        for g in [g for g in self.gens if g.head.done]:
            self._finish(g)
        for g in self.gens:
            self.executor.apply(g, g.head.cover())

    # ================================================================ the prompt cache
    def _drop(self, e: Entry) -> None:
        """A cache entry goes: its slot and cells wait for the next COMPACT (freeing cells now would leave holes,
        kvplan.py)."""
        self._dirty.append(e.lane)
        self.n_cells_dead += e.cells

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

    @property
    def n_cells_cached(self) -> int:
        return self.cache.n_cells if self.cache is not None else 0

    def cache_load(self) -> dict:
        """The prompt cache and the cells, for /health (a snapshot read from another thread)."""
        return {**cache_load(self.cache), "cells_used": min(self._cells_bound(), self.cfg.n_ctx), "cells": self.cfg.n_ctx}

    # ================================================================ the drafter's lease
    def _lease(self) -> _Gen | None:
        """The generation that may speculate: the oldest decoding one, while fewer decode than the pipeline's
        depth (pipeline_depth: the stages, or fewer where one stage is slower than the rest)."""
        if self.cfg.mode == "iterative":
            return None
        # a newcomer is lent it once its prompt is fed (a drafter's prefill would hold the head from feeding it)
        decoding = [g for g in self.gens if not g.head.done and not g.req.background and not g.head.pending]
        want = None
        if decoding and (len(decoding) < self.depth or len(self.gens) == 1  # alone: always (exactly PipeInfer)
                         or self._rides_pay(decoding[0], self.executor.row_cap)):
            want = decoding[0]
        if want is not self.holder:
            if self.holder is not None:
                self.holder.head.give_back()
            if want is not None:
                t0 = self.clock()
                want.head.lend(self.drafter_for(want.req.prompt, want.req.prompt_text, want.req.chat), self.pool)
                if len(decoding) >= self.depth and len(self.gens) > 1:  # lent to ride: the lend is a ride's cost
                    self._ride_obs.append((0, (self.clock() - t0) * 1e3))
                self.stats.n_lends += 1
            self.holder = want
        return want

    def _speculate(self, g: _Gen) -> None:
        """Keep the pipeline full while no result is waiting (continuous, asynchronous speculation): the holder's
        micro-batches, one by one, each sent as soon as it is drafted, or riding the others' rows held."""
        head = g.head
        while head.may_speculate and (not self.pipe.result_ready() or self._single_rank_turn(head)):
            if not self._room():
                self._ride(g)
                return
            actions = head.speculate_once()
            if actions is None:
                return
            self.executor.apply(g, actions)

    def _ride(self, g: _Gen) -> None:
        """g's next micro-batch joins the rows held for a shared decode, where it may (Executor.rides) and pays
        (_rides_pay), sized for that decode."""
        head = g.head
        if (head.may_speculate and self._rides_pay(g, self.executor.n_held)
                and self.executor.rides(g, 1, head.spec_parent)):
            t0 = self.clock()
            actions = head.speculate_once(ride_rows=self.executor.n_held)
            self._ride_obs.append((int(bool(actions)), (self.clock() - t0) * 1e3))
            if actions:
                self.executor.apply(g, actions)

    def _ride_cost_ms(self) -> float | None:
        """What a ride launched has cost the head lately (ms): every drafting try for a ride, launched or not
        (an unconfident draft launches nothing), and the drafter's prefill at each lend made for riding, over
        the rides launched; None before any try. A drafter beside the pipeline costs the head next to nothing."""
        if not self._ride_obs:
            return None
        return sum(ms for _, ms in self._ride_obs) / max(1, sum(n for n, _ in self._ride_obs))

    def _room(self) -> bool:
        """Whether the holder may launch one more speculative run of its own now: alone, while the drafter keeps
        up; beside others, only while fewer runs are in flight than the pipeline's depth (the stages would idle).
        Beyond that its draft rows only ride the others' (_rides_pay)."""
        return len(self.gens) == 1 or len(self.pipe.in_flight) < self.depth

    def _rides_pay(self, g: _Gen, n_rows: int) -> bool:
        """Whether g's draft rows buy more than they cost riding a shared decode of n_rows others' rows (Head.ride_len
        on the measured stage costs, g's running acceptance and what rides have cost the head in drafting): the
        rule that decides between draft rows and users' rows when many generate."""
        return self.executor.batch_rows > 1 and n_rows > 0 and g.head.ride_len(n_rows, self._ride_cost_ms()) > 0

    def _single_rank_turn(self, head: Head) -> bool:
        # one rank: results are ready at once, so speculate one micro-batch per round instead of never
        return not self.pipe.distributed and not head.speculating

    # ================================================================ runs and results
    def _new_run_id(self) -> int:
        self._run_id += 1
        return self._run_id

    @property
    def last_run_id(self) -> int:
        return self._run_id

    def _take(self, results: list) -> None:
        """A result, for each generation whose rows it carried: their next tokens go out together (held in the
        executor), now, or with the next result's while the stages are busy anyway (_holding)."""
        self.executor.pace(sum(1 for g in self.gens if not g.head.done and not g.head.pending), self.depth)
        for g, res in results:
            self.executor.apply(g, g.head.handle(res) if g.head.done else g.head.take(res))
        if self.holder is not None and not self.holder.head.done and self.cfg.mode == "pipeinfer":
            self._ride(self.holder)
        if not self._holding():
            self.executor.flush()

    def _holding(self) -> bool:
        return self.executor.holding(len(self.pipe.in_flight), self.depth)  # (Executor.holding says when)

    def _finish(self, g: _Gen) -> None:
        """Every run of a finished generation is back: deliver its answer; its slot holds its prompt as a cache
        entry, or waits for a COMPACT."""
        if self.holder is g:
            g.head.give_back()
            self.holder = None
        self.gens.remove(g)
        entry = None
        if self.cache is not None and g.req.cache_prompt:
            # a generation that ended before its prompt's last chunk went out holds only the chunks launched
            entry, gone = self.cache.add(g.lane, self._canon[g.lane], g.req.prompt[:g.head.n_kv0], g.head.n_cells_bound,
                                         g.head.accepted[:g.head.n_kv0])
            for e in gone:
                self._drop(e)
        if entry is None:
            self._dirty.append(g.lane)
            self.n_cells_dead += g.head.n_cells_bound
        self.stats.n_finished += 1
        tokens = g.head.result()
        g.head.stats.n_kv0 = g.head.n_kv0
        if g.req.on_done is not None:
            g.req.on_done(tokens, g.head.stats)


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
