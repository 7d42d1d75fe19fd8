"""The head's scheduler against a fake two-stage pipeline and a toy target (no MPI, no llama.cpp).

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
import pytest

from pipeinfer.drafters.drafter import Cutoffs, DraftNode, NgramDrafter
from pipeinfer.ranks.head import GenConfig, Head, auto_p_recovery
from pipeinfer.ranks.scheduler import Request, Scheduler
from pipeinfer.core.kvplan import PartitionPool, plan_partitions
from pipeinfer.ranks.pipeline import Result
from pipeinfer.core.protocol import NO_RUN, Batch, KvOp, cp, kv_ops, rm
from pipeinfer.core.verify import SamplingParams, row_tokens, sample_at

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
    __slots__ = ("pos", "token", "seqs")

    def __init__(self, pos: int, token: int, seqs: set[int]):
        self.pos, self.token, self.seqs = pos, token, seqs


class ToyStage:
    """Cells in allocation order, as llama.cpp's slots are when nothing is freed in the middle."""

    def __init__(self, name: str, logits_fn, reference: list[int], garbage: int | None = None):
        self.name, self.logits_fn, self.reference, self.garbage = name, logits_fn, reference, garbage
        self.cells: list[Cell] = []
        self.n_compactions = 0

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
        new = [Cell(p, t, set(ids)) for p, t, ids in zip(batch.pos.tolist(), batch.tokens.tolist(), batch.seq_ids)]
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
        self.sampling = SamplingParams()

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

    def set_sampling(self, sp: SamplingParams) -> None:
        self.sampling = sp

    def _tokens(self, batch: Batch, logits: np.ndarray) -> np.ndarray:
        """What the last stage sends back: the token after each output row (protocol: RESULT)."""
        return row_tokens(logits, batch.output_pos, self.sampling)

    def launch(self, run_id: int, batch: Batch, speculative: bool, parent_id: int = NO_RUN) -> None:
        assert run_id not in self.speculative, f"run id {run_id} reused"
        assert not self.in_flight or run_id > self.in_flight[-1]
        self.speculative[run_id] = speculative
        logits = self._run_on(self.stages[0], batch)
        if self.distributed:
            self.queue.append(("decode", run_id, batch, parent_id))
        else:
            self.results.append(Result(run_id, False, self._tokens(batch, logits)))
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
        kind, *rest = self.queue.popleft()
        last = self.stages[-1]
        if kind == "kv":
            last.apply(rest[0])
            return
        run_id, batch, parent_id = rest
        if run_id in self.cancelled or parent_id in self.cancelled:
            self.cancelled.add(run_id)
            self.n_skipped += 1
            if self.abort_mid:
                self._check_fresh(last, batch)
                last.apply(batch.prefix_ops)
            self.results.append(Result(run_id, True, None))
        else:
            self.results.append(Result(run_id, False, self._tokens(batch, self._run_on(last, batch))))

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
class ToyDrafter:
    """Proposes the toy target's greedy continuation with seeded errors; with max_branches > 1 the first
    error also opens a second branch holding the right token (placed before the main one)."""

    def __init__(self, error_rate: float = 0.0, seed: int = 0, prob: float = 0.9):
        self.error_rate, self.prob = error_rate, prob
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
                    cut=Cutoffs(p_accept=0.5, p_split=0.1, n_max=n_max, max_branches=max_branches), **cfg_kw)
    streamed: list[int] = []
    sched = Scheduler(pipe, cfg, n_stages=2, pool=pool, drafter_for=lambda *_: drafter, eos=set(eos))
    heads = []  # the generation's Head, kept for the invariants at its end
    finish = sched._finish
    sched._finish = lambda g: (heads.append(g.head), finish(g))[1]
    out, stats = sched.generate(Request(list(PROMPT), n_predict, sampling, on_tokens=streamed.extend))
    pipe.finish()
    return SimpleNamespace(head=heads[0], pipe=pipe, pool=pool, drafter=drafter, n_part=n_part, out=out,
                           streamed=streamed, expected=reference[len(PROMPT):len(PROMPT) + n_predict], stats=stats)


def assert_clean_end(r: SimpleNamespace) -> None:
    """Invariants 4, 6, 7 at the end: seq 0 is exactly the accepted prefix on every stage, nothing else is
    held, nothing is in flight and every partition is back in the pool."""
    head, n = r.head, r.head.n_kv0
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


# ---------------------------------------------------------------- tests
def test_toy_target_is_not_trivial():
    gen = target_alone(PROMPT, 40)[len(PROMPT):]
    assert len(set(gen)) > 10


def test_iterative_equals_target():
    r = run_head("iterative", n_predict=25)
    assert r.out == r.expected and r.streamed == r.out
    assert (r.stats.n_generated, r.stats.n_runs, r.stats.n_spec_runs) == (25, 25, 0)
    assert r.pipe.max_in_flight == 1 and r.pipe.cancel_calls == []
    assert r.head.n_kv0 == len(PROMPT) + 24          # the last token is emitted but never decoded
    assert_clean_end(r)


def test_iterative_prompt_in_chunks():
    r = run_head("iterative", n_predict=5, n_batch=3)
    assert r.out == r.expected
    assert r.stats.n_runs == 4 + 4                   # ceil(10 / 3) prompt chunks + 4 single-token runs
    assert_clean_end(r)


@pytest.mark.parametrize("max_branches", [1, 2])
@pytest.mark.parametrize("error_rate", [0.0, 0.3, 1.0])
def test_speculative_equals_target(error_rate, max_branches):
    r = run_head("speculative", error_rate=error_rate, max_branches=max_branches, seed=3)
    assert r.out == r.expected and r.streamed == r.out
    assert_clean_end(r)
    assert r.pipe.max_in_flight == 1                 # synchronous: one run at a time
    assert r.stats.n_spec_runs > 0
    assert r.stats.n_draft_accepted <= r.stats.n_drafted
    if error_rate == 0.0:
        assert r.stats.n_spec_runs <= 40 // 5 + 2   # 4 drafts + 1 bonus token per run
        assert r.stats.n_draft_accepted >= 32
    if error_rate == 1.0:                            # every main-branch token is wrong; the second branch is right
        assert (r.stats.n_draft_accepted > 0) == (max_branches == 2)


PIPEINFER_CASES = [
    # error_rate, max_branches, abort_mid, cancel_lag, seed, poll_every
    (0.0, 1, False, 0, 0, 3),
    (0.1, 1, False, 0, 1, 3),
    (0.3, 1, False, 0, 2, 3),
    (0.3, 1, True, 0, 3, 2),
    (0.3, 1, False, 2, 9, 3),
    (0.3, 1, True, 4, 10, 2),
    (0.3, 2, False, 0, 4, 3),
    (0.3, 2, True, 1, 5, 5),
    (0.6, 1, True, 3, 6, 4),
    (1.0, 1, False, 0, 7, 3),
    (1.0, 2, True, 2, 8, 3),
]


@pytest.mark.parametrize("error_rate, max_branches, abort_mid, cancel_lag, seed, poll_every", PIPEINFER_CASES)
def test_pipeinfer_equals_target(error_rate, max_branches, abort_mid, cancel_lag, seed, poll_every):
    r = run_head("pipeinfer", error_rate=error_rate, max_branches=max_branches, abort_mid=abort_mid,
                 cancel_lag=cancel_lag, seed=seed, poll_every=poll_every)
    assert r.out == r.expected and r.streamed == r.out
    assert_clean_end(r)
    st = r.stats
    assert st.n_runs == len(r.pipe.speculative) and st.n_spec_runs == sum(r.pipe.speculative.values())
    assert st.n_draft_accepted <= st.n_drafted
    assert sum(len(c) for c in r.pipe.cancel_calls) >= st.n_cancelled
    if error_rate < 1.0:
        assert r.pipe.max_in_flight >= 3             # asynchronous: several runs in flight


def test_pipeinfer_perfect_drafts_cancel_nothing():
    r = run_head("pipeinfer", error_rate=0.0, n_predict=60)
    assert r.out == r.expected
    assert r.stats.n_cancelled == 0
    assert r.stats.n_spec_runs <= 60 // 4 + 3
    assert r.pipe.max_in_flight >= 3
    assert_clean_end(r)


def test_pipeinfer_cancels_with_draft_errors():
    r = run_head("pipeinfer", error_rate=0.3, seed=11, n_predict=60)
    assert r.out == r.expected
    assert r.stats.n_cancelled > 0
    assert r.pipe.cancel_calls, "no cancellation signal was sent"
    assert r.pipe.n_skipped > 0                      # some reached the last stage before it ran them
    assert_clean_end(r)


def test_pipeinfer_no_cancel_sends_no_signal():
    r = run_head("pipeinfer", error_rate=0.3, seed=12, cancel=False)
    assert r.out == r.expected
    assert r.pipe.cancel_calls == [] and r.pipe.n_skipped == 0
    assert r.stats.n_cancelled > 0                   # the head still ignores the useless runs
    assert_clean_end(r)


def test_pipeinfer_not_continuous_keeps_one_speculative_run():
    r = run_head("pipeinfer", error_rate=0.2, seed=13, continuous=False)
    assert r.out == r.expected
    assert r.pipe.max_in_flight <= 3
    assert_clean_end(r)


def test_pipeinfer_recovery_raises_the_cutoff():
    # p_accept 0.5 rises by 0.25 per micro-batch launched since the last acceptance: 0.5, 0.75, then 1.0 stops
    r = run_head("pipeinfer", error_rate=0.3, seed=17, p_recovery=0.25)
    assert r.out == r.expected
    assert set(r.drafter.p_accepts) == {0.5, 0.75}
    assert_clean_end(r)


@pytest.mark.parametrize("n_ranks, expected, runs_ahead_at_0_9", [(1, 0.5, 1), (2, 0.5, 1), (3, 0.25, 2),
                                                                   (5, 0.125, 4), (9, 0.0625, 7)])
def test_auto_recovery_fills_the_stages_after_the_head(n_ranks, expected, runs_ahead_at_0_9):
    pr = auto_p_recovery(n_ranks)
    assert pr == expected
    # micro-batches a 0.9-confident draft launches over -pa 0.5 before the cutoff passes 0.9
    assert sum(1 for k in range(20) if 0.5 + k * pr <= 0.9 + 1e-9) == runs_ahead_at_0_9


def test_head_needs_a_resolved_recovery_factor():
    with pytest.raises(ValueError, match="p_recovery is unresolved"):
        Head(FakePipeline(target_alone(PROMPT, 8)), GenConfig(p_recovery=None), lambda: 1)


def test_pipeinfer_decay_lowers_the_cutoff():
    # the drafter is 0.4 confident: never enough for p_accept 0.5, enough after one decay step
    r = run_head("pipeinfer", error_rate=0.3, seed=18, drafter_prob=0.4, p_decay=0.1)
    assert r.out == r.expected
    assert r.stats.n_spec_runs > 0 and set(r.drafter.p_accepts) >= {0.5, 0.4}
    assert_clean_end(r)
    r = run_head("pipeinfer", error_rate=0.3, seed=18, drafter_prob=0.4)
    assert r.out == r.expected and r.stats.n_spec_runs == 0   # no decay: wait for results instead
    assert_clean_end(r)


@pytest.mark.parametrize("mode", ["speculative", "pipeinfer"])
def test_with_ngram_drafter(mode):
    # prompt lookup on this target proposes mostly wrong tokens: a stress test with a real drafter
    r = run_head(mode, drafter=NgramDrafter(), n_predict=60)
    assert r.out == r.expected
    assert r.stats.n_spec_runs > 0
    assert_clean_end(r)


def test_pipeinfer_results_always_ready():
    # the last stage answers on the first poll: no room to speculate, PipeInfer degrades to iterative
    r = run_head("pipeinfer", error_rate=0.3, seed=16, poll_every=1)
    assert r.out == r.expected
    assert r.stats.n_spec_runs == 0 and r.stats.n_runs == 40
    assert_clean_end(r)


def test_pipeinfer_single_rank():
    r = run_head("pipeinfer", error_rate=0.3, seed=14, distributed=False)
    assert r.out == r.expected
    assert r.stats.n_spec_runs > 0
    assert_clean_end(r)


def test_pipeinfer_prompt_in_chunks_and_small_pool():
    r = run_head("pipeinfer", error_rate=0.2, seed=15, n_batch=4, max_in_flight=2)
    assert r.out == r.expected
    assert r.n_part == 2
    assert_clean_end(r)


@pytest.mark.parametrize("mode", ["iterative", "speculative", "pipeinfer"])
def test_sampled_equals_target_alone(mode):
    """Per-position seeded sampling: every mode gives the very sample the target alone gives (inv. 9)."""
    sp = SamplingParams(temp=1.0, seed=21)
    r = run_head(mode, sampling=sp, logits_fn=logits_flat, error_rate=0.1, seed=22,
                 max_branches=1 if mode == "iterative" else 2)
    assert r.out == r.expected
    assert r.out != target_alone(PROMPT, 40)[len(PROMPT):]   # sampling really happened
    assert_clean_end(r)


@pytest.mark.parametrize("mode", ["iterative", "speculative", "pipeinfer"])
def test_stops_before_eos(mode):
    gen = target_alone(PROMPT, 40)[len(PROMPT):]
    k = next(i for i in range(5, 40) if gen[i] not in gen[:i])   # a token first produced at index k
    r = run_head(mode, eos=frozenset({gen[k]}), error_rate=0.2, seed=4)
    assert r.out == gen[:k] and r.streamed == r.out
    assert r.stats.n_generated == k
    assert_clean_end(r)


@pytest.mark.parametrize("n_predict", [1, 2, 5])
@pytest.mark.parametrize("mode", ["iterative", "speculative", "pipeinfer"])
def test_short_generations(mode, n_predict):
    r = run_head(mode, n_predict=n_predict, error_rate=0.2, seed=5)
    assert r.out == r.expected
    assert r.stats.n_generated == n_predict
    assert_clean_end(r)


@pytest.mark.parametrize("mode", ["speculative", "pipeinfer"])
def test_drafter_takes_the_prompt_while_the_pipeline_does(mode, monkeypatch):
    """The draft model's prompt processing overlaps the target's: prefill comes before the first result."""
    log = []
    next_result = FakePipeline.next_result
    monkeypatch.setattr(FakePipeline, "next_result", lambda self: log.append("result") or next_result(self))

    class Probe(ToyDrafter):
        def prefill(self, prompt):
            log.append("prefill")
            super().prefill(prompt)

    drafter = Probe(0.2, 3)
    r = run_head(mode, drafter=drafter)
    assert drafter.prefilled == list(PROMPT)
    assert log[:2] == ["prefill", "result"] and log.count("prefill") == 1
    assert r.out == r.expected


def test_head_rejects_bad_configuration():
    pipe = FakePipeline(target_alone(PROMPT, 8))
    with pytest.raises(ValueError, match="unknown mode"):
        Scheduler(pipe, GenConfig(mode="turbo"), n_stages=2)
    with pytest.raises(ValueError, match="needs a drafter"):
        Scheduler(pipe, GenConfig(mode="pipeinfer"), n_stages=2, pool=PartitionPool(2, 1, 4))
    with pytest.raises(ValueError, match="needs a drafter"):
        Scheduler(pipe, GenConfig(mode="speculative"), n_stages=2, drafter_for=lambda *_: ToyDrafter())
    with pytest.raises(ValueError, match="one generation at a time"):
        Scheduler(pipe, GenConfig(mode="speculative"), n_stages=2, n_parallel=2, pool=PartitionPool(2, 1, 4),
                  drafter_for=lambda *_: ToyDrafter())
    with pytest.raises(ValueError, match="empty prompt"):
        Scheduler(pipe, GenConfig(mode="iterative"), n_stages=2).submit(Request([], 8))


# ---------------------------------------------------------------- the fake itself
def _prompted_pipe() -> tuple[FakePipeline, list[int]]:
    ref = target_alone(PROMPT, 8)
    pipe = FakePipeline(ref)
    out = np.zeros(len(PROMPT), np.int32)
    out[-1] = 1
    pipe.launch(1, Batch(np.array(PROMPT, np.int32), np.arange(len(PROMPT), dtype=np.int32), [[0]] * len(PROMPT),
                         out, kv_ops()), False)
    return pipe, ref


def _one(tok: int, pos: int, seqs: list[int], ops=()) -> Batch:
    return Batch(np.array([tok], np.int32), np.array([pos], np.int32), [seqs], np.array([1], np.int32), kv_ops(*ops))


def test_fake_pipeline_computes_the_target():
    pipe, ref = _prompted_pipe()
    pipe.launch(2, _one(ref[10], 10, [0]), False)
    assert [int(pipe.next_result().tokens[0]), int(pipe.next_result().tokens[0])] == \
        [ref[10], ref[11]]


@pytest.mark.parametrize("batch, what", [
    (_one(0, 11, [0]), "inconsistent sequence positions"),                    # skips position 10
    (_one(0, 10, [0, 4]), "inconsistent sequence positions"),                 # seq 4 is empty
    (_one(0, 10, [0, 4], [cp(0, 4, 5, 10)]), "misses position"),              # seq 4 lacks 0..4
    (_one(1, 10, [0]), "sequence 0 holds tokens"),                           # a wrong token in sequence 0
])
def test_fake_pipeline_enforces_llama_rules(batch, what):
    """The fake must reject what llama.cpp rejects (or what breaks invariants), or the tests above prove nothing."""
    pipe, ref = _prompted_pipe()
    if what == "sequence 0 holds tokens":
        batch.tokens[0] = (ref[10] + 1) % V
    with pytest.raises(KvError, match=what):
        pipe.launch(2, batch, True)


def test_fake_pipeline_rejects_reused_partition():
    pipe, ref = _prompted_pipe()
    pipe.launch(2, _one(ref[10], 10, [3], [cp(0, 3, 0, 10)]), True)
    with pytest.raises(KvError, match="still holds"):
        pipe.launch(3, _one(ref[10], 10, [3], [rm(3), cp(0, 3, 0, 10)]), True)  # seq 3 never cleared


def test_fake_pipeline_rejects_two_cells_at_one_position():
    pipe, ref = _prompted_pipe()
    pipe.launch(2, _one(ref[10], 10, [3], [cp(0, 3, 0, 10)]), True)
    pipe.launch(3, _one(ref[10], 10, [0]), False)
    with pytest.raises(AssertionError, match="commit copy"):
        pipe.kv(kv_ops(cp(3, 0, 10, 11)))                      # a commit of a position seq 0 already holds
    with pytest.raises(KvError, match="two cells at position 10"):
        pipe.stages[0].apply(kv_ops(cp(3, 0, 10, 11)))        # and what the stage would then hold


@pytest.mark.parametrize("mode, error_rate", [("speculative", 0.3), ("pipeinfer", 0.3), ("pipeinfer", 0.0)])
def test_compacts_when_retired_cells_fill_the_cache(mode, error_rate):
    """Retired cells are never freed in the middle (the fake rejects that); when they would fill the
    context, the head collects what is in flight and every stage compacts, and generation goes on."""
    n_predict, n_ctx = 150, len(PROMPT) + 150 + 60
    r = run_head(mode, n_predict=n_predict, error_rate=error_rate, seed=5, n_ctx=n_ctx, max_in_flight=4)
    assert r.out == r.expected
    assert (r.stats.n_compactions >= 1) == (error_rate > 0), r.stats  # perfect drafts leave no garbage to speak of
    assert all(st.n_compactions == r.stats.n_compactions for st in r.pipe.stages)
    assert max(len(st.cells) for st in r.pipe.stages) <= n_ctx
    assert_clean_end(r)


def test_fake_pipeline_rejects_freeing_a_cell():
    pipe, ref = _prompted_pipe()
    pipe.launch(2, _one(ref[10], 10, [3], [cp(0, 3, 0, 10)]), True)
    with pytest.raises(KvError, match="freed a cell"):
        pipe.kv(kv_ops(rm(3)))                                 # the run's own cell would become a hole


# ---- micro-batch size from measured costs (choose_draft_len) and the acceptance it runs on (draft_checks)
def test_draft_len_is_one_where_batching_costs_as_much_as_separate_decodes():
    from pipeinfer.ranks.head import choose_draft_len
    costly = [[38.0, 73.0, 104.0], [52.0, 100.0, 129.0]]   # this project's AVX2 host, 2 ranks x 1 thread
    assert choose_draft_len(0.7, costly, (0.0, 20.0), 3) == 1
    assert choose_draft_len(0.9, costly, (0.0, 20.0), 3) == 1
    assert choose_draft_len(0.95, costly, (30.0, 10.0), 3) == 3  # a costly call, cheap tokens: fill it
    cheap = [[38.0, 40.0, 42.0], [52.0, 54.0, 56.0]]        # batching nearly free (memory-bound kernels)
    assert choose_draft_len(0.7, cheap, (0.0, 1.0), 3) == 3
    assert choose_draft_len(0.7, cheap, (0.0, 1.0), 2) == 2  # --draft-max is the cap
    assert choose_draft_len(0.05, [[38.0, 60.0], [52.0, 70.0]], (0.0, 1.0), 2) == 1  # rarely right: not worth a row
    # the rate it maximises: sum a^i / (bottleneck + P(chain breaks) x one pass), the head paying for drafts
    a, ms = 0.8, [[10.0, 12.0], [30.0, 31.0]]
    rates = [a / (max(15.0, 30.0) + (1 - a) * (15.0 + 30.0)),
             (a + a * a) / (max(22.0, 31.0) + (1 - a * a) * (22.0 + 31.0))]
    assert choose_draft_len(a, ms, (0.0, 5.0), 2) == 1 + rates.index(max(rates))
    assert choose_draft_len(0.5, ms, (0.0, 25.0), 2) == 1    # drafting on the head makes it the bottleneck
    # a deep pipeline: a wrong draft in a big micro-batch costs a long refill, so smaller batches win
    deep = [[40.0, 55.0, 70.0]] * 8
    assert choose_draft_len(0.9, deep, (0.0, 0.0), 3) == 1
    assert choose_draft_len(0.9, deep[:2], (0.0, 0.0), 3) == 3


def test_draft_cost_fit_separates_per_call_and_per_token_costs():
    from pipeinfer.ranks.head import draft_cost_fit
    assert draft_cost_fit([]) == (0.0, 0.0)
    assert draft_cost_fit([(1, 60.0), (1, 60.0)]) == (30.0, 30.0)  # one size seen: half each
    c0, c1 = draft_cost_fit([(1, 50.0), (3, 90.0), (2, 70.0)])
    assert c0 == pytest.approx(30.0) and c1 == pytest.approx(20.0)


def test_chain_checks_count_drafts_up_to_the_first_wrong_one():
    from pipeinfer.core.verify import chain_checks
    chain = [(5, 50), (6, 60), (7, 70)]
    base = [0, 1, 2, 3, 4]
    assert chain_checks(chain, base + [50, 60, 71], 5) == (3, 2)   # 5, 6 right; 7 checked and wrong
    assert chain_checks(chain, base + [51, 60, 70], 5) == (1, 0)   # 5 wrong: 6 and 7 never reached
    assert chain_checks(chain, base + [50], 5) == (1, 1)           # 6 and 7 not decided yet
    assert chain_checks(chain, base + [50, 60], 6) == (1, 1)       # 5 was counted by an earlier verification
    assert chain_checks([], base + [50], 5) == (0, 0)              # nothing drafted for it (a cover run)


def test_twin_sizes_micro_batches_by_its_costs():
    from pipeinfer.twin.cluster import Cluster, Link, StageCost
    from pipeinfer.twin.sim import simulate
    costly = Cluster([StageCost([38.0, 73.0, 104.0], 20.0), StageCost([52.0, 100.0, 129.0], 25.0)], [Link()] * 2, 64,
                     20.0)
    res = simulate(costly, GenConfig(mode="pipeinfer", n_predict=96, cut=Cutoffs(0.5, 0.1, 3, 1), p_recovery=None,
                                     stop_at_eos=False), agreement=0.6)
    assert set(res.stats.draft_len_hist) == {1}  # (a streak of right drafts, near 0.95, would make it 3)
    fixed = simulate(costly, GenConfig(mode="pipeinfer", n_predict=96, cut=Cutoffs(0.5, 0.1, 3, 1), p_recovery=None,
                                       stop_at_eos=False, adaptive_draft=False), agreement=0.6)
    assert not fixed.stats.draft_len_hist and fixed.stats.n_drafted > res.stats.n_drafted
