"""The digital twin: the real generation loop (decide/scheduler.py, head.py) against a simulated pipeline in
virtual time.

Nothing here touches MPI or llama.cpp. `SimPipeline` has the interface of pipeline.Pipeline and plays
the cluster (cluster.py describes it) as a discrete-event simulation:

    head (rank 0)   decodes stage 0 synchronously at launch (its own clock advances), sends the run on
    rank r >= 1     one FIFO server: a transaction waits for the stage to be free, decodes for
                    stage_ms(batch size), then travels the link to r+1 (the last rank: back to the head)
    link r          FIFO, bandwidth-limited: departs when the link is free, arrives after bytes /
                    bandwidth + latency; message sizes are the real protocol's (protocol.py)
    cancellation    head -> last rank -> ... -> rank 1, each hop after its link's latency; a stage
                    skips a cancelled run it has not started and aborts a speculative decode in
                    progress `abort_check_ms` after the signal arrives (llama.cpp's abort callback)
    drafting        a replay drafter (drafter.ReplayDrafter, the real code) whose proposals cost
                    `draft_ms_per_token` on the head's clock, or on a draft host of its own that drafts
                    ahead along the chain and re-roots when the head's context leaves it
    the head        pays `head_overhead_ms` per launch and per result (its Python scheduling)
    prompts         the real Head launches a prompt in runs of GenConfig.prompt_chunk tokens; each costs a stage
                    StageCost.ms(rows, outputs) (cluster.py: what the profile measured for that many rows), and
                    as each rank passes a chunk on and takes the next, chunks flow through the stages one behind
                    the other: P tokens on S equal stages take about (ceil(P / C) + S - 1) chunk-times. A KV
                    transaction costs KV_OP_MS, a run's prefix ops (the prompt cache's seq_cp) nothing; cells
                    themselves are not modelled

The target's token after every output row comes from a reference sequence, so verification, the
cutoffs, multibuffering, cancellation and compaction all run the real code. The Head reads the
virtual clock (Scheduler(clock=...)), so Stats, --results rows and `pipeinfer plot` work unchanged.
"""
from __future__ import annotations

import heapq
import itertools
from collections import deque
from dataclasses import dataclass, field, replace
from typing import Callable

import numpy as np

from ..core.kvplan import PartitionPool, cells_reserve, in_flight_limit, lane_count, plan_partitions
from ..core.metrics import Stats
from ..core.protocol import HEADER_LEN, NO_RUN, Batch, Kind, kv_ops
from ..decide.genconfig import GenConfig, auto_p_recovery
from ..decide.port import Result
from ..decide.scheduler import Request, Scheduler, SchedulerStats, generate
from ..decide.batching import cost_sizes
from ..drafters.drafter import Cutoffs, DraftNode, ReplayDrafter
from .cluster import Cluster, StageCost

KV_OP_MS = 0.05      # a stage applying one KV transaction (seq_rm/cp: bookkeeping, no compute)


# ==================================================================== virtual time
class VirtualClock:
    def __init__(self) -> None:
        self.now_s = 0.0

    def __call__(self) -> float:
        return self.now_s

    def advance(self, dt_s: float) -> None:
        self.now_s += max(0.0, dt_s)

    def advance_to(self, t_s: float) -> None:
        self.now_s = max(self.now_s, t_s)


@dataclass
class Txn:
    kind: Kind
    run_id: int = NO_RUN
    parent_id: int = NO_RUN
    speculative: bool = False
    n_tokens: int = 0
    n_outputs: int = 0
    output_pos: np.ndarray | None = None
    n_meta: int = 0
    cancelled: bool = False
    references: list[list[int]] | None = None  # each output row's generation's tokens (None: the one reference)

    def wire_bytes(self, n_embd: int, to_head: bool) -> int:
        """Bytes of this transaction on the wire, as protocol.py lays it out."""
        n = 4 * HEADER_LEN
        if self.kind == Kind.DECODE and not self.cancelled:
            n += 4 * self.n_outputs if to_head else 4 * self.n_meta + 4 * self.n_tokens * n_embd
        elif self.kind == Kind.KV:
            n += 20 * self.n_tokens
        elif self.kind == Kind.SAMPLING:
            n += 32
        return n


@dataclass
class StageTrace:
    rank: int
    t_busy_s: float = 0.0
    n_decoded: int = 0
    n_tokens: int = 0
    n_cancelled_before: int = 0
    n_cancelled_mid: int = 0
    bytes_sent: int = 0


class _Stage:
    def __init__(self, rank: int):
        self.rank = rank
        self.queue: deque[Txn] = deque()
        self.current: Txn | None = None
        self.t_start_s = 0.0
        self.version = 0           # invalidates a scheduled end when the decode is aborted
        self.cancelled: set[int] = set()
        self.trace = StageTrace(rank)


class SimPipeline:
    """decide/port.PipePort over a simulated cluster (module docstring)."""

    distributed = True

    def __init__(self, cluster: Cluster, reference: list[int], clock: VirtualClock):
        if cluster.n_ranks < 2:
            raise ValueError("the twin simulates 2 or more ranks")
        if len(cluster.links) != cluster.n_ranks:
            raise ValueError(f"{cluster.n_ranks} ranks need {cluster.n_ranks} links (the last one back to the head)")
        self.c, self.ref, self.clock = cluster, reference, clock
        self.last = cluster.n_ranks - 1
        self.stages = [_Stage(r) for r in range(cluster.n_ranks)]  # [0] holds the head's trace only
        self.in_flight: deque[int] = deque()
        self._events: list = []
        self._seq = itertools.count()
        self._link_free_s = [0.0] * cluster.n_ranks
        self._arrived: deque[Result] = deque()
        self.t_head_wait_s = 0.0
        self._machine = cluster.machine_of or [f"host{r}" for r in range(cluster.n_ranks)]
        # compute in progress, by rank (0: the head's thread): [work left in seconds alone, slowdown, since]
        self._active: dict[int, list[float]] = {}
        # several generations at once (simulate_clients): run id -> the reference of the generation of each of its
        # output rows (a run may carry several generations' next tokens), asked at launch (the scheduler knows the
        # run's owners then); None: every run answers from `reference`
        self.reference_of: Callable[[int], list[list[int]]] | None = None

    # ---- the event queue
    def _post(self, t_s: float, fn, *args) -> None:
        heapq.heappush(self._events, (t_s, next(self._seq), fn, args))

    def _run_until(self, t_s: float) -> None:
        while self._events and self._events[0][0] <= t_s:
            t, _, fn, args = heapq.heappop(self._events)
            fn(t, *args)

    def _send(self, t_s: float, link: int, n_bytes: int, fn, *args) -> None:
        """A message over link `link` (FIFO, bandwidth-limited), then fn(arrival time, *args)."""
        lk = self.c.links[link]
        depart = max(t_s, self._link_free_s[link])
        self._link_free_s[link] = depart + lk.transfer_s(n_bytes)
        self._post(self._link_free_s[link] + lk.latency_s, fn, *args)

    # ---- a stage rank
    def _arrive(self, t_s: float, rank: int, txn: Txn) -> None:
        st = self.stages[rank]
        st.queue.append(txn)
        if st.current is None:
            self._start_next(t_s, st)

    def _start_next(self, t_s: float, st: _Stage) -> None:
        while st.current is None and st.queue:
            txn = st.queue.popleft()
            if txn.kind == Kind.DECODE:
                if not txn.cancelled and (txn.run_id in st.cancelled or txn.parent_id in st.cancelled):
                    txn.cancelled = True
                    st.trace.n_cancelled_before += 1
                if txn.cancelled:
                    st.cancelled.add(txn.run_id)
                    self._forward(t_s, st, txn)
                    continue
                st.current, st.t_start_s = txn, t_s
                self._compute_starts(st.rank, self.c.stages[st.rank].ms(txn.n_tokens, txn.n_outputs) / 1e3, t_s)
            else:
                st.current, st.t_start_s = txn, t_s
                st.version += 1
                self._post(t_s + KV_OP_MS / 1e3, self._end, st.rank, st.version)

    def _end(self, t_s: float, rank: int, version: int) -> None:
        st = self.stages[rank]
        if version != st.version or st.current is None:
            return  # aborted: a later end was scheduled
        txn, st.current = st.current, None
        if txn.kind == Kind.DECODE:
            self._compute_ends(rank, t_s)
            st.trace.t_busy_s += t_s - st.t_start_s
            if txn.cancelled:
                st.trace.n_cancelled_mid += 1
                st.cancelled.add(txn.run_id)
            else:
                st.trace.n_decoded += 1
                st.trace.n_tokens += txn.n_tokens
        self._forward(t_s, st, txn)
        self._start_next(t_s, st)

    def _forward(self, t_s: float, st: _Stage, txn: Txn) -> None:
        to_head = st.rank == self.last
        n_bytes = txn.wire_bytes(self.c.n_embd, to_head)
        st.trace.bytes_sent += n_bytes
        if to_head:
            if txn.kind == Kind.DECODE:
                self._send(t_s, st.rank, n_bytes, self._result, txn)
        else:
            self._send(t_s, st.rank, n_bytes, self._arrive, st.rank + 1, txn)

    def _cancel_arrives(self, t_s: float, rank: int, run_ids: list[int]) -> None:
        st = self.stages[rank]
        st.cancelled.update(run_ids)
        cur = st.current
        if (cur is not None and cur.kind == Kind.DECODE and cur.speculative and not cur.cancelled
                and (cur.run_id in st.cancelled or cur.parent_id in st.cancelled)):
            cur.cancelled = True
            self._settle(rank, t_s)
            self._active[rank][0] = self.c.abort_check_ms / 1e3  # stops at the abort callback's next check
            self._reschedule(rank, t_s)
        if rank > 1:  # relayed backwards, never to the head
            lk = self.c.links[rank - 1]
            self._post(t_s + lk.latency_s + lk.transfer_s(4 * len(run_ids)), self._cancel_arrives, rank - 1, run_ids)

    def _result(self, t_s: float, txn: Txn) -> None:
        tokens = None
        if not txn.cancelled:  # the target's token after each output row: the reference's next token
            refs = txn.references or [self.ref] * len(txn.output_pos)
            tokens = np.array([ref[p + 1] if p + 1 < len(ref) else 0 for ref, p in zip(refs, txn.output_pos)],
                              dtype=np.int32)
        self._arrived.append(Result(txn.run_id, txn.cancelled, tokens))

    # ---- compute that shares a machine (processor sharing: every rank of a machine that computes slows down)
    def _slowdown(self, k: int, rank: int) -> float:
        """The slowdown of each of k computations running at once on rank's machine."""
        if k <= 1:
            return 1.0
        cores = self.c.cores_of[rank] if self.c.cores_of else k
        return self.c.shared_slowdown * max(1.0, k / cores)

    def _peers(self, rank: int) -> list[int]:
        return [q for q in self._active if self._machine[q] == self._machine[rank]]

    def _settle(self, rank: int, t_s: float) -> None:
        """Charge the work done until t_s to every computation on rank's machine."""
        for q in self._peers(rank):
            a = self._active[q]
            a[0] = max(0.0, a[0] - (t_s - a[2]) / a[1])
            a[2] = t_s

    def _reschedule(self, rank: int, t_s: float) -> None:
        """New slowdowns on rank's machine; the stage ranks' ends move accordingly (the head's loop reads its own)."""
        peers = self._peers(rank)
        for q in peers:
            a = self._active[q]
            a[1] = self._slowdown(len(peers), q)
            if q > 0:
                st = self.stages[q]
                st.version += 1
                self._post(t_s + a[0] * a[1], self._end, q, st.version)

    def _compute_starts(self, rank: int, work_s: float, t_s: float) -> None:
        self._settle(rank, t_s)
        self._active[rank] = [work_s, 1.0, t_s]
        self._reschedule(rank, t_s)

    def _compute_ends(self, rank: int, t_s: float) -> None:
        self._settle(rank, t_s)
        del self._active[rank]
        self._reschedule(rank, t_s)

    # ---- Pipeline's interface (the head's side)
    def _head_work(self, ms: float, compute: bool = False) -> None:
        """The head's thread works ms (compute: a decode, slowed while other ranks of its machine compute)."""
        t0 = self.clock()
        if not compute:
            self.clock.advance(ms / 1e3)
        else:
            self._run_until(t0)
            self._compute_starts(0, ms / 1e3, t0)
            while True:
                work, slow, since = self._active[0]
                t_end = since + work * slow
                if self._events and self._events[0][0] < t_end:  # something changes before it finishes
                    t_next = self._events[0][0]
                    self.clock.advance_to(t_next)
                    self._run_until(t_next)
                    continue
                self.clock.advance_to(t_end)
                self._compute_ends(0, t_end)
                break
        self.stages[0].trace.t_busy_s += self.clock() - t0

    def launch(self, run_id: int, batch: Batch, speculative: bool, parent_id: int = NO_RUN, rules=None) -> None:
        self._head_work(self.c.head_overhead_ms)
        self._head_work(self.c.stages[0].ms(batch.n_tokens, batch.n_outputs), compute=True)
        self.stages[0].trace.n_decoded += 1
        self.stages[0].trace.n_tokens += batch.n_tokens
        txn = Txn(Kind.DECODE, run_id, parent_id, speculative, batch.n_tokens, batch.n_outputs, batch.output_pos,
                  len(batch.pack_meta()), references=self.reference_of(run_id) if self.reference_of else None)
        self._sent_from_head(txn)
        self.in_flight.append(run_id)

    def _sent_from_head(self, txn: Txn) -> None:
        n_bytes = txn.wire_bytes(self.c.n_embd, False)
        self.stages[0].trace.bytes_sent += n_bytes
        self._send(self.clock(), 0, n_bytes, self._arrive, 1, txn)

    def set_sampling(self, sampling) -> None:
        self._sent_from_head(Txn(Kind.SAMPLING))

    def kv(self, ops: np.ndarray) -> None:
        if len(ops):
            self._sent_from_head(Txn(Kind.KV, n_tokens=len(ops)))

    def cancel(self, run_ids: list[int]) -> None:
        if run_ids:
            lk = self.c.links[self.last]
            self._post(self.clock() + lk.latency_s + lk.transfer_s(4 * len(run_ids)), self._cancel_arrives,
                       self.last, list(run_ids))

    def result_ready(self) -> bool:
        self._run_until(self.clock())
        return bool(self._arrived)

    def next_result(self) -> Result:
        if not self.in_flight:
            raise RuntimeError("no run in flight")
        expected = self.in_flight.popleft()
        self._run_until(self.clock())
        while not self._arrived:
            if not self._events:
                raise RuntimeError(f"internal: the twin lost run {expected}")
            t_next = self._events[0][0]
            self.t_head_wait_s += max(0.0, t_next - self.clock())
            self.clock.advance_to(t_next)
            self._run_until(t_next)
        res = self._arrived.popleft()
        if res.run_id != expected:
            raise RuntimeError(f"results out of order: expected run {expected}, got {res.run_id}")
        self._head_work(self.c.head_overhead_ms)
        return res

    def shutdown(self) -> None:
        pass

    def stage_stats(self) -> list[dict]:
        """Per rank, like worker.StageStats: busy and idle time, decodes, cancellations, bytes sent."""
        t_end = self.clock()
        out = []
        for st in self.stages:
            d = vars(st.trace).copy()
            d["t_idle_s"] = max(0.0, t_end - d["t_busy_s"]) if st.rank else self.t_head_wait_s
            out.append(d)
        return out


# ==================================================================== the draft's compute
class SimDraftCost:
    """Stands in for ReplayDrafter's `burner`: charges a draft model's compute to virtual time.

    On the head (draft_on="head") every drafted token costs draft_ms_per_token of the head's clock, plus
    one decode when the context is not a continuation of the last draft (the drafter re-syncs its KV).
    On a host of its own (draft_on="own") the drafter drafts ahead along its last chain while the head
    works: a continuation is ready draft-time after the previous draft was; a re-rooted context can
    start only once the head's verification reached it (one draft-link latency). The head waits only
    for what is not ready yet, plus the draft's trip back.
    """

    n_vocab = 2**31 - 1
    exact_batch = None

    def __init__(self, cluster: Cluster, clock: VirtualClock, pipe: SimPipeline):
        self.c, self.clock, self.pipe = cluster, clock, pipe
        self._last: list[int] = []
        self._ready_s = 0.0      # when the draft host finished its last draft

    def prefill(self, prompt: list[int]) -> None:
        ms = len(prompt) * self.c.draft_prefill_ms_per_token
        if self.c.draft_on == "head":
            self.pipe._head_work(ms, compute=True)
        else:
            self._ready_s = self.clock() + self.c.draft_link.latency_s + ms / 1e3
        self._last = list(prompt)

    def draft(self, context: list[int], cut: Cutoffs) -> list:
        n = cut.n_max
        continues = len(context) >= len(self._last) and context[:len(self._last)] == self._last
        ms = (n + (0 if continues else 1)) * self.c.draft_ms_per_token
        if self.c.draft_on == "head":
            self.pipe._head_work(ms, compute=True)
        else:
            start = self._ready_s if continues else max(self._ready_s, self.clock() + self.c.draft_link.latency_s)
            self._ready_s = start + ms / 1e3
            self.clock.advance_to(self._ready_s + self.c.draft_link.latency_s)
        return []

    def follow(self, context: list[int], tokens: list[int]) -> None:
        """The replay instrument's compute for proposing `tokens` (ModelDrafter.follow's cost)."""
        self.draft(context, Cutoffs(0.0, 1.0, len(tokens), 1))
        self._last = list(context) + list(tokens)


class _ChainAwareReplay(ReplayDrafter):
    """ReplayDrafter whose burner sees the real context and proposals (so continuation is detected), and
    which proposes at a call only with probability `propose` (a draft model is not always confident: the
    Gemma draft proposed at about half of its calls); an unconfident call costs one draft token."""

    propose = 1.0

    def draft(self, context, cut):
        if self.propose < 1.0 and np.random.default_rng([self.seed, len(context), 1]).random() >= self.propose:
            if self.burner is not None:
                self.burner.draft(context, Cutoffs(0.0, 1.0, 1, 1))
            return []
        return super().draft(context, cut)


class _ConfidenceReplay(ReplayDrafter):
    """A draft drawn from measured (confidence, right) pairs (profile.py's measure_confidence), in the order
    they were measured: each block of BLOCK positions takes BLOCK consecutive pairs from an offset drawn by
    (seed, block), because a draft is right and sure in streaks (a chain of k tokens is all right far more
    often than the k-th power of the agreement). The chain proposes while the confidence clears the cutoff,
    the reference token where the pair was right and a wrong one where not. So -pa and the reactive cutoff
    decide what is proposed and how much of it is accepted, as with a real draft model. A call that
    proposes nothing costs one draft token."""

    BLOCK = 8

    def __init__(self, reference: list[int], pairs: list, seed: int, burner):
        super().__init__(reference, 1.0, n_vocab=30000, seed=seed, burner=burner)
        # (confidence, right) or, measured with the runner-up, (confidence, right, runner-up's, runner-up right)
        self.pairs = [tuple(float(x) if k % 2 == 0 else bool(x) for k, x in enumerate(p)) for p in pairs]

    def pair(self, pos: int) -> tuple:
        offset = int(np.random.default_rng([self.seed, pos // self.BLOCK, 2]).integers(len(self.pairs)))
        return self.pairs[(offset + pos % self.BLOCK) % len(self.pairs)]

    def draft(self, context, cut):
        pos0 = len(context)
        nodes: list[DraftNode] = []
        for pos in range(pos0, min(pos0 + cut.n_max, len(self.ref))):
            p, right, *runner_up = self.pair(pos)
            if p < cut.p_accept or p <= 0.0:
                break
            token = self.ref[pos] if right else (self.ref[pos] + 1 + pos % 7) % self.n_vocab
            alt = (-1, 0.0)
            if runner_up and runner_up[0] > 0.0:
                alt = (self.runner_up_token(pos, runner_up[1]), runner_up[0])
            nodes.append(DraftNode(token, len(nodes) - 1, len(nodes), {0}, p, *alt))
        if self.burner is not None:
            if nodes:
                self.burner.follow(context, [n.token for n in nodes])
            else:
                self.burner.draft(context, Cutoffs(0.0, 1.0, 1, 1))
        return nodes


# ==================================================================== one simulated generation
@dataclass
class SimResult:
    tokens: list[int]
    stats: Stats
    stages: list[dict]
    p_recovery: float


def reference_tokens(n_prompt: int, n_predict: int, seed: int = 0) -> list[int]:
    """A stand-in token sequence: prompt then the target's output (the twin needs no real text)."""
    rng = np.random.default_rng(seed)
    return rng.integers(10, 30000, n_prompt + n_predict + 64).tolist()


def _resolved(cluster: Cluster, gen: GenConfig, n_parallel: int = 1) -> GenConfig:
    """What start-up resolves on a real cluster: -pr auto, and each stage's measured decode times (PipeInfer sizes
    its micro-batches, and the draft rows that ride others' decodes, by them)."""
    if gen.p_recovery is None:
        gen = replace(gen, p_recovery=auto_p_recovery(cluster.n_ranks))
    if gen.mode == "pipeinfer" and gen.adaptive_draft and gen.stage_ms is None and gen.draft_max > 1:
        # what startup.stage_costs measures: each stage's decode time for 1..cost_sizes tokens
        sizes = cost_sizes(gen.draft_max, gen.batch_rows, n_parallel, cluster.n_ranks)
        gen = replace(gen, stage_ms=tuple(tuple(st.ms(b) for b in range(1, sizes + 1)) for st in cluster.stages))
    return gen


def _replay_drafter(ref: list[int], seed: int, cost: SimDraftCost, agreement: float, propose: float,
                    confidence: list | None, runner_up: float = 0.0) -> ReplayDrafter:
    """The twin's draft for one reference: right with probability `agreement` and proposing at `propose` of its
    calls, or, given measured (confidence, right) pairs, as they and the cutoff decide."""
    if confidence:
        return _ConfidenceReplay(ref, confidence, seed, cost)
    drafter = _ChainAwareReplay(ref, agreement, n_vocab=30000, seed=seed, burner=cost)
    drafter.propose, drafter.runner_up = propose, runner_up
    return drafter


def simulate(cluster: Cluster, gen: GenConfig, *, agreement: float = 0.9, n_prompt: int = 64,
             reference: list[int] | None = None, max_in_flight: int | None = None, seed: int = 0,
             propose: float = 1.0, confidence: list | None = None, runner_up: float = 0.0) -> SimResult:
    """Run the real loop on the twin: one generation of gen.n_predict tokens in virtual time. The draft
    agrees with probability `agreement` and proposes at `propose` of its calls, or, given `confidence`
    (measured (confidence, right) pairs), as those pairs and the cutoff decide."""
    clock = VirtualClock()
    ref = reference or reference_tokens(n_prompt, gen.n_predict, seed)
    n_prompt = min(n_prompt, len(ref) - 1)
    gen = _resolved(cluster, gen)
    pipe = SimPipeline(cluster, ref, clock)
    pool = drafter = None
    if gen.mode != "iterative":
        n_lanes = lane_count(1, gen.cache_prompt)   # the Scheduler's slots (sequence ids as startup.py plans them)
        limit = in_flight_limit(max_in_flight, cluster.n_ranks)
        n_part, n_seq_max = plan_partitions(gen.max_branches, limit, n_lanes=n_lanes)
        pool = PartitionPool(n_part, gen.max_branches, n_seq_max, n_lanes=n_lanes)
        drafter = _replay_drafter(ref, seed, SimDraftCost(cluster, clock, pipe), agreement, propose, confidence,
                                  runner_up)
    sched = Scheduler(pipe, gen, n_stages=cluster.n_ranks, pool=pool, drafter_for=lambda *_: drafter, clock=clock)
    tokens, stats = generate(sched, Request(ref[:n_prompt], gen.n_predict, gen.sampling))
    expect = ref[n_prompt:n_prompt + len(tokens)]
    if tokens != expect:
        raise RuntimeError("internal: the twin's output differs from its reference")
    stages = pipe.stage_stats()
    stats.stage_stats = stages
    return SimResult(tokens, stats, stages, gen.p_recovery)


# ==================================================================== several clients at once (decide/scheduler.py)
def throughput_limit(cluster: Cluster) -> float:
    """Tokens/s of the stages when every one is busy with one single-token decode at a time (interleaved
    generations, nothing speculative, no prompt): one token per the slowest server's time per token,

        limit = 1 / max( head (rank 0):  stage_ms[0](1) + 2 x head_overhead_ms   (its decode, a launch and a
                                         result on its thread)
                         rank r >= 1:    stage_ms[r](1)
                         link r:         bytes of one token's message / bandwidth   (activations; the last link
                                         the result) )

    each rank's time multiplied by the slowdown of every rank of its machine computing at once (SimPipeline's
    processor sharing). A link's latency lengthens every token's round trip but not the rate: messages of other
    tokens are on their way meanwhile, so with enough generations in flight it is hidden. Prompt chunks, drafting
    and speculative runs are work this limit does not count, which is why a server below it can still be busy."""
    one = Batch(np.zeros(1, np.int32), np.zeros(1, np.int32), [[0]], np.ones(1, np.int32), kv_ops())
    msg = Txn(Kind.DECODE, n_tokens=1, n_outputs=1, n_meta=len(one.pack_meta()))
    machine = cluster.machine_of or [f"host{r}" for r in range(cluster.n_ranks)]
    per_token_s = []
    for r, st in enumerate(cluster.stages):
        k = machine.count(machine[r])
        cores = cluster.cores_of[r] if cluster.cores_of else k
        slowdown = cluster.shared_slowdown * max(1.0, k / cores) if k > 1 else 1.0
        own_ms = st.ms(1) + (2 * cluster.head_overhead_ms if r == 0 else 0.0)
        per_token_s.append(own_ms * slowdown / 1e3)
        per_token_s.append(cluster.links[r].transfer_s(msg.wire_bytes(cluster.n_embd, r == cluster.n_ranks - 1)))
    return 1.0 / max(per_token_s)


@dataclass
class RequestResult:
    """One request's life in virtual seconds."""
    t_arrival_s: float   # sent by its client
    t_first_s: float     # its first token
    t_done_s: float      # its last token
    t_queue_s: float     # waited for admission (a slot, or cells)
    n_tokens: int
    n_prompt: int = 0    # its prompt's tokens ...
    n_cached: int = 0    # ... of them taken from the prompt cache

    @property
    def latency_s(self) -> float:
        return self.t_done_s - self.t_arrival_s

    @property
    def ttft_s(self) -> float:
        return self.t_first_s - self.t_arrival_s


@dataclass
class ClientsResult:
    """A server's run under load: every request, the stages' limit, and the server's throughput."""
    requests: list[RequestResult]            # in the order they were sent
    limit_tokens_per_s: float                # throughput_limit(cluster)
    stages: list[dict] = field(default_factory=list)
    sched: SchedulerStats | None = None
    n_turns: int = 1                         # conversations (simulate_conversations): turns of each, in order

    @property
    def later_turns(self) -> list[RequestResult]:
        """The requests after each conversation's first turn (all but the first of every n_turns)."""
        return [r for i, r in enumerate(self.requests) if i % self.n_turns]

    def later_ttft_pct_s(self, q: float) -> float:
        """A percentile of the time to first token of turns 2+ (nan with one turn each)."""
        later = self.later_turns
        return float(np.percentile([r.ttft_s for r in later], q)) if later else float("nan")

    @property
    def later_ttft_mean_s(self) -> float:
        later = self.later_turns
        return float(np.mean([r.ttft_s for r in later])) if later else float("nan")

    @property
    def cached_share(self) -> float:
        """Prompt tokens taken from the prompt cache over all prompt tokens."""
        total = sum(r.n_prompt for r in self.requests)
        return sum(r.n_cached for r in self.requests) / total if total else 0.0

    @property
    def makespan_s(self) -> float:
        """From the first request sent to the last token of the last answer."""
        return max(r.t_done_s for r in self.requests) - min(r.t_arrival_s for r in self.requests)

    @property
    def tokens_per_s(self) -> float:
        return sum(r.n_tokens for r in self.requests) / self.makespan_s if self.makespan_s > 0 else 0.0

    @property
    def fraction_of_limit(self) -> float:
        return self.tokens_per_s / self.limit_tokens_per_s

    def latency_pct_s(self, q: float) -> float:
        return float(np.percentile([r.latency_s for r in self.requests], q))

    def ttft_pct_s(self, q: float) -> float:
        return float(np.percentile([r.ttft_s for r in self.requests], q))

    @property
    def p50_latency_s(self) -> float:
        return self.latency_pct_s(50)

    @property
    def p95_latency_s(self) -> float:
        return self.latency_pct_s(95)


class _Clients:
    """The clients' side of the server: the requests (each its own reference sequence), when each is sent, the
    answers checked against their references. The scheduler hands a request's prompt to drafter_for and the
    SimPipeline asks for a run's reference by run id; both find the request by its prompt (the very list object
    it was sent with), so no reference is confused with another however the runs interleave. Request i's prompt
    is refs[i][:n_prompts[i]] and its answer the n_predict tokens after it. Several requests may share a
    reference (the turns of one conversation: each turn's prompt extends the one before)."""

    def __init__(self, refs: list[list[int]], n_prompts: list[int], n_predict: int, clock: VirtualClock):
        self.refs, self.n_prompts = refs, n_prompts
        self.prompts = [ref[:n] for ref, n in zip(refs, n_prompts)]
        self.num_of = {id(p): i for i, p in enumerate(self.prompts)}
        self.n_predict, self.clock = n_predict, clock
        self.pending: list[tuple[float, int]] = []   # (when sent, request number), a heap
        self.n_sent = 0
        # closed loop: the request a client sends once request i's answer is complete (None: it stops), after
        # think_s; None: open loop (every request is sent up front)
        self.after: Callable[[int], int | None] | None = None
        self.think_s = 0.0
        self.results: dict[int, RequestResult] = {}

    def send(self, t_s: float, i: int) -> None:
        heapq.heappush(self.pending, (t_s, i))
        self.n_sent += 1

    def request(self, i: int, t_s: float) -> Request:
        n0 = self.n_prompts[i]

        def done(tokens: list[int], stats: Stats) -> None:
            if tokens != self.refs[i][n0:n0 + self.n_predict]:
                raise RuntimeError(f"internal: the twin's answer to request {i} differs from its reference")
            self.results[i] = RequestResult(t_s, stats.t_prompt_done_s, stats.t_last_s, stats.t_queue_s, len(tokens),
                                            n0, stats.n_cached)
            nxt = self.after(i) if self.after is not None else None
            if nxt is not None:
                self.send(self.clock() + self.think_s, nxt)
        return Request(self.prompts[i], self.n_predict, on_done=done, t_queued_s=t_s)

    def reference_of_prompt(self, prompt: list[int]) -> list[int]:
        return self.refs[self.num_of[id(prompt)]]

    def drive(self, sched: Scheduler) -> None:
        """Send what is due, run a round; idle with the next request in the future: jump the clock to it."""
        while self.pending or sched.busy:
            while self.pending and self.pending[0][0] <= self.clock():
                t_s, i = heapq.heappop(self.pending)
                sched.submit(self.request(i, t_s))
            if sched.busy:
                sched.step()
            elif self.pending:
                self.clock.advance_to(self.pending[0][0])


def _roomy_ctx(gen: GenConfig, n_parallel: int, longest_prompt: int, n_part: int, n_lanes: int) -> int:
    """A context with room for every slot's longest request at once and a round of speculation per slot."""
    longest = longest_prompt + gen.n_predict
    need = 2 * n_parallel * longest if n_parallel > 1 else longest
    return max(gen.n_ctx, need + cells_reserve(n_part, gen.draft_max) * (1 + n_lanes))


def _serve(cluster: Cluster, gen: GenConfig, clients: _Clients, clock: VirtualClock, *, n_parallel: int,
           agreement: float, seed: int, max_in_flight: int | None, propose: float, confidence: list | None,
           n_ctx: int | None, n_turns: int = 1, runner_up: float = 0.0) -> ClientsResult:
    """The real Scheduler on the twin serving `clients` (their first requests already sent) to the last answer.
    n_ctx (None): room for every slot's longest request at once (so the context never makes a request wait)."""
    gen = replace(_resolved(cluster, gen, n_parallel), stop_at_eos=False)
    pipe = SimPipeline(cluster, [], clock)
    n_lanes, size = lane_count(n_parallel, gen.cache_prompt), gen.max_branches   # as the Scheduler counts them
    pool, n_part, drafter_for = None, 0, None
    if gen.mode == "pipeinfer":
        n_part, n_seq_max = plan_partitions(size, in_flight_limit(max_in_flight, cluster.n_ranks), n_lanes=n_lanes)
        pool = PartitionPool(n_part, size, n_seq_max, n_lanes=n_lanes)
        cost = SimDraftCost(cluster, clock, pipe)   # one draft model, lent from generation to generation

        def drafter_for(prompt, text, chat):
            i = clients.num_of[id(prompt)]
            return _replay_drafter(clients.refs[i], seed + i, cost, agreement, propose, confidence, runner_up)
    if n_ctx is None:
        n_ctx = _roomy_ctx(gen, n_parallel, max(clients.n_prompts), n_part, n_lanes)
    sched = Scheduler(pipe, replace(gen, n_ctx=n_ctx), n_stages=cluster.n_ranks, n_parallel=n_parallel, pool=pool,
                      drafter_for=drafter_for, clock=clock)
    pipe.reference_of = lambda run_id: [clients.reference_of_prompt(g.req.prompt)
                                        for g in sched.executor.row_owners(run_id)]
    clients.drive(sched)
    n_requests = len(clients.refs)
    if len(clients.results) != n_requests:
        raise RuntimeError(f"internal: {len(clients.results)} of {n_requests} requests answered")
    return ClientsResult([clients.results[i] for i in range(n_requests)], throughput_limit(cluster),
                         pipe.stage_stats(), sched.stats, n_turns)


def simulate_clients(cluster: Cluster, gen: GenConfig, *, n_clients: int | None = None,
                     rate_per_s: float | None = None, n_requests: int, n_prompt: int = 64, n_parallel: int = 1,
                     agreement: float = 0.9, seed: int = 0, max_in_flight: int | None = None,
                     propose: float = 1.0, confidence: list | None = None, n_ctx: int | None = None,
                     runner_up: float = 0.0) -> ClientsResult:
    """The real Scheduler (decide/scheduler.py) serving `n_requests` requests of n_prompt + gen.n_predict tokens on
    the twin, in virtual time: `n_clients` closed-loop clients (each sends its next request when its last answer
    is complete), or requests arriving as a Poisson process of `rate_per_s`. gen.mode is the schedule: pipeinfer
    (the drafter lent where stages would idle) or iterative (interleaving only); n_parallel generations at once;
    gen.cache_prompt the prompt cache (these prompts share nothing, so it only holds slots and cells here).
    Request i's tokens are reference_tokens(n_prompt, n_predict, seed + i), its draft the replay draft simulate()
    uses on that reference. n_ctx (None): room for every slot's request at once, so that the context never makes a
    request wait (pass one to study a tight context)."""
    if (n_clients is None) == (rate_per_s is None):
        raise ValueError("give n_clients (closed loop) or rate_per_s (Poisson arrivals), not both")
    clock = VirtualClock()
    refs = [reference_tokens(n_prompt, gen.n_predict, seed + i) for i in range(n_requests)]
    clients = _Clients(refs, [n_prompt] * n_requests, gen.n_predict, clock)
    if n_clients is not None:   # each client sends its next request once its last answer is complete
        clients.after = lambda i: clients.n_sent if clients.n_sent < n_requests else None
        for i in range(min(n_clients, n_requests)):
            clients.send(0.0, i)
    else:
        t_s = 0.0
        for i, dt_s in enumerate(np.random.default_rng([seed, 17]).exponential(1.0 / rate_per_s, n_requests)):
            t_s += float(dt_s)
            clients.send(t_s, i)
    return _serve(cluster, gen, clients, clock, n_parallel=n_parallel, agreement=agreement, seed=seed,
                  max_in_flight=max_in_flight, propose=propose, confidence=confidence, n_ctx=n_ctx, runner_up=runner_up)


# ==================================================================== conversations (the prompt cache's workload)
def conversation_prompts(n_first: int, n_turns: int, n_predict: int, n_user: int) -> list[int]:
    """Prompt lengths of a conversation's turns: the first n_first tokens, then each turn's prompt is the one
    before, its answer (n_predict tokens) and a new user message of n_user tokens."""
    return [n_first + t * (n_predict + n_user) for t in range(n_turns)]


def simulate_conversations(cluster: Cluster, gen: GenConfig, *, n_conversations: int, n_turns: int, n_user: int,
                           n_first: int = 64, think_s: float = 0.0, n_parallel: int = 1, agreement: float = 0.9,
                           seed: int = 0, max_in_flight: int | None = None, propose: float = 1.0,
                           confidence: list | None = None, n_ctx: int | None = None) -> ClientsResult:
    """Multi-turn chat on the twin: `n_conversations` clients, each sending `n_turns` turns one after another
    (the next once the answer is complete and `think_s` has passed); turn t's prompt is turn t-1's prompt, its
    answer of gen.n_predict tokens and a new user message of n_user tokens (conversation_prompts). Conversation c
    is one token stream, reference_tokens(...) of seed + c, so every turn's answer is checked against it. With
    gen.cache_prompt the scheduler starts a turn from the whole chunks of the previous turn's prompt (an entry of
    core/prefixcache.py, while it is among the last CACHE_ENTRIES) and decodes the rest; without, from position 0.
    requests[c * n_turns + t] is turn t of conversation c (ClientsResult.later_turns: turns 2+)."""
    if n_conversations < 1 or n_turns < 1:
        raise ValueError("conversations and turns: at least 1 each")
    clock = VirtualClock()
    lengths = conversation_prompts(n_first, n_turns, gen.n_predict, n_user)
    streams = [reference_tokens(lengths[-1], gen.n_predict, seed + c) for c in range(n_conversations)]
    clients = _Clients([streams[c] for c in range(n_conversations) for _ in range(n_turns)],
                       lengths * n_conversations, gen.n_predict, clock)
    clients.after = lambda i: i + 1 if (i + 1) % n_turns else None
    clients.think_s = think_s
    for c in range(n_conversations):
        clients.send(0.0, c * n_turns)
    return _serve(cluster, gen, clients, clock, n_parallel=n_parallel, agreement=agreement, seed=seed,
                  max_in_flight=max_in_flight, propose=propose, confidence=confidence, n_ctx=n_ctx, n_turns=n_turns)


@dataclass
class CacheComparison:
    """One conversation workload served without and with the prompt cache (the same n_ctx for both)."""
    uncached: ClientsResult
    cached: ClientsResult


def compare_prompt_cache(cluster: Cluster, gen: GenConfig, *, n_parallel: int = 1,
                         max_in_flight: int | None = None, n_ctx: int | None = None, **workload) -> CacheComparison:
    """simulate_conversations with gen.cache_prompt off and on, in one context size (n_ctx None: what the run with
    the cache would take by default, which has more slots)."""
    if n_ctx is None:
        n_lanes = lane_count(n_parallel, True)
        limit = in_flight_limit(max_in_flight, cluster.n_ranks)
        n_part = plan_partitions(gen.max_branches, limit, n_lanes=n_lanes)[0] if gen.mode == "pipeinfer" else 0
        longest = conversation_prompts(workload.get("n_first", 64), workload["n_turns"], gen.n_predict,
                                       workload["n_user"])[-1]
        n_ctx = _roomy_ctx(gen, n_parallel, longest, n_part, n_lanes)
    runs = [simulate_conversations(cluster, replace(gen, cache_prompt=on), n_parallel=n_parallel,
                                   max_in_flight=max_in_flight, n_ctx=n_ctx, **workload) for on in (False, True)]
    return CacheComparison(*runs)


# ==================================================================== prompt processing across stages
@dataclass
class PromptSpeed:
    """An uncached prompt's processing on S stages and on one process holding the whole model."""
    n_prompt: int
    n_stages: int
    tokens_per_s: float          # S stages (the twin)
    one_stage_tokens_per_s: float
    chunk: int

    @property
    def speedup(self) -> float:
        return self.tokens_per_s / self.one_stage_tokens_per_s


def one_stage_prompt_s(stage: StageCost, n_prompt: int, chunk: int, head_overhead_ms: float = 0.0) -> float:
    """Seconds one process holding the whole model takes for an uncached prompt: its chunks one after another
    (each at the stage's cost for its rows; the last row of the last chunk is the only output), with the head's
    overhead per launch and per result."""
    sizes = [min(chunk, n_prompt - k) for k in range(0, n_prompt, chunk)]
    ms = sum(stage.ms(n, 1 if k == len(sizes) - 1 else 0) for k, n in enumerate(sizes))
    return (ms + head_overhead_ms * (len(sizes) + 1)) / 1e3


def prompt_speed(one: Cluster, staged: Cluster, n_prompt: int = 2000, chunk: int | None = None) -> PromptSpeed:
    """Uncached prompt tokens/s of `staged` (2 or more ranks: the twin's iterative generation of one token, the
    real Head launching the prompt's chunks) and of `one`'s single stage (one_stage_prompt_s)."""
    if one.n_ranks != 1:
        raise ValueError("`one` is one process holding the whole model: a cluster of one stage")
    gen = GenConfig(mode="iterative", n_predict=1, p_recovery=0.0, stop_at_eos=False, cache_prompt=False,
                    n_ctx=n_prompt + 64)
    if chunk is not None:
        gen = replace(gen, prompt_chunk=chunk, n_batch=max(gen.n_batch, chunk))
    stats = simulate(staged, gen, n_prompt=n_prompt).stats
    t_one = one_stage_prompt_s(one.stages[0], n_prompt, gen.prompt_chunk, one.head_overhead_ms)
    return PromptSpeed(n_prompt, staged.n_ranks, stats.pp_tokens_per_s, n_prompt / t_one, gen.prompt_chunk)
