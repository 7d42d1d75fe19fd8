"""A toy target and a fake pipeline for the generation loop (no MPI, no llama.cpp), shared by the tests of the
head, the scheduler and the draft beside the pipeline.

The fake keeps a llama.cpp-like unified KV cache per stage (cells tagged with sequence ids, seq_cp adds
a tag, seq_rm removes one), enforces llama.cpp's rule that a sequence's positions in a batch continue
right after its last cell, and computes logits from the cells a token actually sees. The toy target's
next token depends on the whole context, so any stale or missing cell changes the output.

Stage "head" decodes at launch, like Pipeline.launch; stage "last" handles the same transactions later,
in order, one per few result_ready() polls, skipping runs cancelled before it reached them (as
StageWorker does), so several speculative runs are in flight and cancellations race with decoding.
"""
from __future__ import annotations

import time

from collections import deque
from types import SimpleNamespace

import numpy as np

from pipeinfer.drafters.drafter import Cutoffs, DraftNode, InSeries
from pipeinfer.decide.genconfig import GenConfig
from pipeinfer.decide.scheduler import Request, Scheduler, generate
from pipeinfer.core.kvplan import PartitionPool, plan_partitions
from pipeinfer.decide.port import Result
from pipeinfer.core.protocol import NO_RUN, Batch, KvOp
from pipeinfer.core.verify import row_tokens, run_logprobs, sample_at
from pipeinfer.core.sampling import SamplingParams, one_sampling

V = 29
PROMPT = [5, 17, 2, 9, 11, 3, 8, 1, 20, 14]
INF = 1 << 30


# ---------------------------------------------------------------- toy target
def target_next(ctx: list[int]) -> int:
    """Greedy next token; depends on every token of the context."""
    return (3 * ctx[-1] + 1 + sum(ctx)) % V


def logits_greedy(ctx: list[int]) -> np.ndarray:
    row = np.zeros(V, dtype=np.float32)
    row[target_next(ctx)] = 6.0
    return row


def logits_flat(ctx: list[int]) -> np.ndarray:
    """Several likely tokens: sampling often disagrees with the argmax the drafter proposes."""
    t = target_next(ctx)
    row = np.zeros(V, dtype=np.float32)
    row[t], row[(t + 1) % V], row[(t + 7) % V] = 3.0, 2.5, 2.0
    return row


def target_alone(prompt: list[int], n: int, logits_fn=logits_greedy,
                 sp: SamplingParams = SamplingParams()) -> list[int]:
    """The target alone: prompt + n tokens, position m drawn by sample_at from the logits of the context before m."""
    seq = list(prompt)
    for m in range(len(prompt), len(prompt) + n):
        seq.append(sample_at(logits_fn(seq), m, sp))
    return seq


class KvError(RuntimeError):
    pass


# ---------------------------------------------------------------- fake stage: a unified KV cache
class Cell:
    __slots__ = ("pos", "token", "seqs", "batch")

    def __init__(self, pos: int, token: int, seqs: set[int], batch: tuple[int, int] = (-1, 0)):
        self.pos, self.token, self.seqs = pos, token, seqs
        self.batch = batch  # (first position, rows) of the decode that computed it: its bits on a real stage


class ToyStage:
    """Cells in allocation order, as llama.cpp's slots are when nothing is freed in the middle."""

    def __init__(self, name: str, logits_fn, reference: list[int], garbage: int | None = None):
        self.name, self.logits_fn, self.reference, self.garbage = name, logits_fn, reference, garbage
        self.cells: list[Cell] = []
        self.n_compactions = 0
        self.n_cells: int | None = None  # the context's cells, when checked (a decode beyond them fails)

    def seq_cells(self, s: int) -> dict[int, Cell]:
        out: dict[int, Cell] = {}
        for c in self.cells:
            if s in c.seqs:
                if c.pos in out:
                    raise KvError(f"{self.name}: sequence {s} holds two cells at position {c.pos}")
                out[c.pos] = c
        return out

    def check_canonical(self) -> None:
        """Invariant 4: sequence 0 holds positions 0..k-1 and they are the target's own tokens."""
        held = self.seq_cells(0)
        k = len(held)
        if sorted(held) != list(range(k)):
            raise KvError(f"{self.name}: sequence 0 holds positions {sorted(held)}")
        toks = [held[p].token for p in range(k)]
        if toks != self.reference[:k]:
            raise KvError(f"{self.name}: sequence 0 holds tokens {toks}, expected {self.reference[:k]}")

    def apply(self, ops: np.ndarray) -> None:
        for op, src, dst, p0, p1 in np.asarray(ops).reshape(-1, 5).tolist():
            lo, hi = (p0 if p0 >= 0 else 0), (p1 if p1 >= 0 else INF)
            sel = [c for c in self.cells if src in c.seqs and lo <= c.pos < hi]
            if op == KvOp.RM:
                for c in sel:
                    c.seqs.discard(src)
            elif op == KvOp.CP:
                for c in sel:
                    if dst in c.seqs:  # llama.cpp asserts this never happens
                        raise KvError(f"{self.name}: cell at {c.pos} already carries sequence {dst}")
                    c.seqs.add(dst)
                if dst != self.garbage:  # garbage may hold several cells at one position
                    self.seq_cells(dst)
            elif op == KvOp.KEEP:
                for c in self.cells:
                    c.seqs &= {src}
            elif op == KvOp.COMPACT:
                self.cells = [c for c in self.cells if src in c.seqs]
                for c in self.cells:
                    c.seqs = {src}
                self.n_compactions += 1
            else:
                raise KvError(f"unknown KV op {op}")
            if any(not c.seqs for c in self.cells):  # kvplan.py: a freed cell would be refilled out of order
                raise KvError(f"{self.name}: op {op} freed a cell in the middle of the cache")
        self.check_canonical()

    def decode(self, batch: Batch) -> np.ndarray:
        per_seq: dict[int, list[int]] = {}
        for p, ids in zip(batch.pos.tolist(), batch.seq_ids):
            for s in ids:
                per_seq.setdefault(s, []).append(p)
        for s, ps in per_seq.items():  # llama.cpp: positions continue right after the sequence's last cell
            last = max(self.seq_cells(s), default=-1)
            if sorted(ps) != list(range(last + 1, last + 1 + len(ps))):
                raise KvError(f"{self.name}: inconsistent sequence positions: seq {s} ends at {last}, "
                              f"batch has {sorted(ps)}")
        if self.n_cells is not None and len(self.cells) + len(batch.pos) > self.n_cells:
            raise KvError(f"{self.name}: no KV slot for {len(batch.pos)} tokens: {len(self.cells)} of {self.n_cells} "
                          f"cells held (llama_decode would return 1)")
        shape = (int(batch.pos.min()), len(batch.pos))
        new = [Cell(p, t, set(ids), shape) for p, t, ids in zip(batch.pos.tolist(), batch.tokens.tolist(), batch.seq_ids)]
        self.cells += new
        rows = []
        for c, out in zip(new, batch.output.tolist()):
            if not out:
                continue
            views = []
            for s in sorted(c.seqs):  # a token sees the cells of all its sequences: they must be the same
                held = self.seq_cells(s)
                try:
                    views.append([held[q] for q in range(c.pos + 1)])
                except KeyError as e:
                    raise KvError(f"{self.name}: sequence {s} misses position {e} below {c.pos}") from None
            if any([id(x) for x in v] != [id(x) for x in views[0]] for v in views):
                raise KvError(f"{self.name}: token at {c.pos} sees different cells in sequences {sorted(c.seqs)}")
            slot = {id(x): i for i, x in enumerate(self.cells)}
            if [slot[id(x)] for x in views[0]] != sorted(slot[id(x)] for x in views[0]):
                raise KvError(f"{self.name}: token at {c.pos} sees its cells out of position order")
            rows.append(self.logits_fn([x.token for x in views[0]]))
        return np.array(rows, dtype=np.float32).reshape(-1, V)


# ---------------------------------------------------------------- fake pipeline
class FakePipeline:
    """What Head uses of Pipeline: launch, kv, cancel, result_ready, next_result, distributed, in_flight."""

    def __init__(self, reference: list[int], logits_fn=logits_greedy, distributed: bool = True,
                 poll_every: int = 3, abort_mid: bool = False, cancel_lag: int = 0, garbage: int | None = None,
                 step_s: float = 0.0):
        self.distributed = distributed
        self.step_s = step_s          # > 0: the last stage takes this much real time per transaction (a drafter
        self._next_step_t = 0.0       # in a thread then has time to draft, as beside a real pipeline)
        self.cancel_lag = cancel_lag  # the cancel signal reaches the last stage after this many of its steps
        self.poll_every = poll_every
        self.abort_mid = abort_mid  # a cancelled run was aborted mid-decode: its prefix copies happened
        self.garbage = garbage
        self.stages = [ToyStage("head stage", logits_fn, reference, garbage)]
        if distributed:
            self.stages.append(ToyStage("last stage", logits_fn, reference, garbage))
        self.queue: deque = deque()       # transactions on their way to the last stage, in the head's order
        self.results: deque[Result] = deque()
        self.in_flight: deque[int] = deque()
        self.cancelled: set[int] = set()  # what the last stage knows (out of band)
        self.pending_cancels: list[tuple[int, list[int]]] = []  # (due step, run ids) still on their way
        self.n_steps = 0
        self.speculative: dict[int, bool] = {}
        self.cancel_calls: list[list[int]] = []
        self.polls = 0
        self.max_in_flight = 0
        self.n_skipped = 0
        self.sampling = one_sampling(SamplingParams())
        self.sampling_sent: list = []   # every RunSampling the head set, in order

    @staticmethod
    def _check_fresh(stage: ToyStage, batch: Batch) -> None:
        """Invariant 7: a run's sequences (other than 0) are empty when it starts."""
        for s in {s for ids in batch.seq_ids for s in ids} - {0}:
            if stage.seq_cells(s):
                raise KvError(f"{stage.name}: sequence {s} still holds {sorted(stage.seq_cells(s))} at a new run")

    def _run_on(self, stage: ToyStage, batch: Batch) -> np.ndarray:
        self._check_fresh(stage, batch)
        stage.apply(batch.prefix_ops)
        out = stage.decode(batch)
        stage.check_canonical()
        return out

    def set_sampling(self, sampling) -> None:
        """In order with the runs, as SAMPLING travels (the last stage draws by what came before each run)."""
        self.sampling_sent.append(sampling)
        if self.distributed:
            self.queue.append(("sampling", sampling))
        else:
            self.sampling = sampling

    def _result(self, run_id: int, batch: Batch, logits: np.ndarray, rules) -> Result:
        """What the last stage sends back: the token after each output row, and the log-probabilities asked
        (protocol: RESULT), under the run's rules, each row by its group's sampling."""
        tokens = row_tokens(logits, batch.output_pos, self.sampling, rules)
        return Result(run_id, False, tokens, run_logprobs(logits, tokens, self.sampling))

    def launch(self, run_id: int, batch: Batch, speculative: bool, parent_id: int = NO_RUN, rules=None) -> None:
        assert run_id not in self.speculative, f"run id {run_id} reused"
        assert not self.in_flight or run_id > self.in_flight[-1]
        self.speculative[run_id] = speculative
        logits = self._run_on(self.stages[0], batch)
        if self.distributed:
            self.queue.append(("decode", run_id, batch, parent_id, rules))
        else:
            self.results.append(self._result(run_id, batch, logits, rules))
        self.in_flight.append(run_id)
        self.max_in_flight = max(self.max_in_flight, len(self.in_flight))

    def kv(self, ops: np.ndarray) -> None:
        if len(ops) == 0:
            return
        n0 = len(self.stages[0].seq_cells(0))
        for op, src, dst, p0, p1 in np.asarray(ops).reshape(-1, 5).tolist():
            if op == KvOp.CP and dst != self.garbage:  # invariant 6: a commit copies only new positions into seq 0
                assert dst == 0 and p0 == n0 and p1 > p0, f"commit copy {src}->{dst} [{p0}, {p1}), seq 0 ends at {n0}"
        self.stages[0].apply(ops)
        if self.distributed:
            self.queue.append(("kv", ops))

    def cancel(self, run_ids: list[int]) -> None:
        assert run_ids and all(self.speculative[r] for r in run_ids), "only speculative runs are cancelled (inv. 8)"
        self.cancel_calls.append(list(run_ids))
        self.pending_cancels.append((self.n_steps + self.cancel_lag, list(run_ids)))
        self._deliver_cancels()

    def _deliver_cancels(self) -> None:
        due = [ids for step, ids in self.pending_cancels if step <= self.n_steps]
        self.pending_cancels = [(step, ids) for step, ids in self.pending_cancels if step > self.n_steps]
        for ids in due:
            self.cancelled.update(ids)

    def _step(self) -> None:
        """The last stage handles its oldest transaction (StageWorker semantics)."""
        self._deliver_cancels()
        self.n_steps += 1
        while self.queue[0][0] == "sampling":  # SAMPLING takes no step of its own (the stage's cadence stays)
            self.sampling = self.queue.popleft()[1]
            if not self.queue:
                return
        kind, *rest = self.queue.popleft()
        last = self.stages[-1]
        if kind == "kv":
            last.apply(rest[0])
            return
        run_id, batch, parent_id, rules = rest
        if run_id in self.cancelled or parent_id in self.cancelled:
            self.cancelled.add(run_id)
            self.n_skipped += 1
            if self.abort_mid:
                self._check_fresh(last, batch)
                last.apply(batch.prefix_ops)
            self.results.append(Result(run_id, True, None))
        else:
            self.results.append(self._result(run_id, batch, self._run_on(last, batch), rules))

    def _due(self) -> bool:
        if self.step_s <= 0:
            return True
        now = time.perf_counter()
        if now < self._next_step_t:
            return False
        self._next_step_t = now + self.step_s
        return True

    def result_ready(self) -> bool:
        self.polls += 1
        if self.queue and self.polls % self.poll_every == 0 and self._due():
            self._step()
        return bool(self.results)

    def next_result(self) -> Result:
        if not self.in_flight:
            raise RuntimeError("no run in flight")
        expected = self.in_flight.popleft()
        while not self.results:
            if not self.queue:
                raise RuntimeError("deadlock: waiting for a result nobody computes")
            while not self._due():
                time.sleep(self.step_s / 10)
            self._step()
        res = self.results.popleft()
        assert res.run_id == expected, (res.run_id, expected)
        return res

    def finish(self) -> None:
        """Shutdown: the last stage handles everything still queued (KV transactions after the last result)."""
        while self.queue:
            self._step()
        assert not self.results and not self.in_flight


# ---------------------------------------------------------------- fake drafter
class ToyDrafter(InSeries):
    """Proposes the toy target's greedy continuation with seeded errors; with max_branches > 1 the first
    error also opens a second branch holding the right token (placed before the main one). With runner_ups it
    drafts chains only, each token with a runner-up (DraftNode.alt: the right token where the token is wrong, a
    wrong one elsewhere), as a drafter beside the pipeline does: the head makes siblings of them (shape.py)."""

    def __init__(self, error_rate: float = 0.0, seed: int = 0, prob: float = 0.9, runner_ups: bool = False):
        self.error_rate, self.prob, self.runner_ups = error_rate, prob, runner_ups
        self.rng = np.random.default_rng(seed)
        self.p_accepts: list[float] = []  # the cutoff of every call
        self.prefilled: list[int] | None = None

    def prefill(self, prompt: list[int]) -> None:
        assert self.prefilled is None and not self.p_accepts, "prefill comes once, before any draft"
        self.prefilled = list(prompt)

    def draft(self, context: list[int], cut: Cutoffs) -> list[DraftNode]:
        self.p_accepts.append(cut.p_accept)
        if cut.p_accept > self.prob:
            return []
        tree: list[DraftNode] = []
        ctx, last, n_branches = list(context), -1, 1
        for depth in range(cut.n_max):
            if len(tree) >= cut.n_max:
                break
            right = target_next(ctx)
            tok = right
            if self.rng.random() < self.error_rate:
                tok = int((right + 1 + self.rng.integers(V - 1)) % V)
            if self.runner_ups:
                tree.append(DraftNode(tok, last, depth, {0}, self.prob, right if tok != right else (right + 1) % V, 0.3))
                last = len(tree) - 1
                ctx.append(tok)
                continue
            if tok != right and n_branches < cut.max_branches and len(tree) + 2 <= cut.n_max:
                nb, n_branches = n_branches, n_branches + 1
                i = last
                while i >= 0:
                    tree[i].branches.add(nb)
                    i = tree[i].parent
                tree.append(DraftNode(right, last, depth, {nb}, 0.3))
            tree.append(DraftNode(tok, last, depth, {0}, self.prob))
            last = len(tree) - 1
            ctx.append(tok)
        return tree


# ---------------------------------------------------------------- harness
def run_head(mode: str, *, n_predict: int = 40, error_rate: float = 0.0, seed: int = 0, n_max: int = 4,
             max_branches: int = 1, max_in_flight: int = 6, distributed: bool = True, poll_every: int = 3,
             abort_mid: bool = False, cancel_lag: int = 0, sampling: SamplingParams = SamplingParams(),
             logits_fn=logits_greedy, eos: frozenset = frozenset(), drafter_prob: float = 0.9,
             drafter=None, step_s: float = 0.0, **cfg_kw) -> SimpleNamespace:
    reference = target_alone(PROMPT, n_predict + 64, logits_fn, sampling)
    n_part, n_seq = plan_partitions(max_branches, max_in_flight)
    pipe = FakePipeline(reference, logits_fn, distributed, poll_every, abort_mid, cancel_lag, garbage=n_seq - 1,
                        step_s=step_s)
    pool = PartitionPool(n_part, max_branches, n_seq) if mode != "iterative" else None
    if drafter is None and mode != "iterative":
        drafter = ToyDrafter(error_rate, seed, drafter_prob)
    cfg = GenConfig(mode=mode, n_predict=n_predict, sampling=sampling,
                    draft_max=n_max, max_branches=max_branches, **cfg_kw)
    streamed: list[int] = []
    sched = Scheduler(pipe, cfg, n_stages=2, pool=pool, drafter_for=lambda *_: drafter, eos=set(eos))
    heads = []  # the generation's Head, kept for the invariants at its end
    finish = sched._finish
    sched._finish = lambda g: (heads.append(g.head), finish(g))[1]
    out, stats = generate(sched, Request(list(PROMPT), n_predict, sampling, on_tokens=streamed.extend))
    pipe.finish()
    return SimpleNamespace(head=heads[0], pipe=pipe, pool=pool, drafter=drafter, n_part=n_part, out=out,
                           streamed=streamed, expected=reference[len(PROMPT):len(PROMPT) + n_predict], stats=stats)


def assert_clean_end(r: SimpleNamespace) -> None:
    """Invariants 4, 6, 7 at the end: seq 0 is exactly the accepted prefix on every stage, nothing else is
    held, nothing is in flight and every partition is back in the pool."""
    head, n = r.head, r.head.seq0_end
    assert len(PROMPT) <= n <= len(head.accepted)
    for stage in r.pipe.stages:
        held = stage.seq_cells(0)
        assert sorted(held) == list(range(n)), stage.name
        assert [held[p].token for p in range(n)] == head.accepted[:n], stage.name
        others = sorted({s for c in stage.cells for s in c.seqs} - {0, r.pipe.garbage})
        assert others == [], f"{stage.name}: sequences {others} still hold cells"
    assert not head.flights and not r.pipe.in_flight
    if r.pool is not None:
        assert r.pool.n_free == r.n_part
        assert sorted(r.pool.take() for _ in range(r.n_part)) == list(range(r.n_part))


