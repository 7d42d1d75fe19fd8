"""The toy pipeline with generation slots (tests/toy.py's, whose stages keep each slot's canonical sequence) and a
scheduler over it: what the scheduler's and the prompt cache's tests build on."""
from __future__ import annotations

import numpy as np
from toy import FakePipeline, KvError, ToyDrafter, ToyStage, logits_greedy

from pipeinfer.core.kvplan import PartitionPool, lane_canonical, lane_count, lane_seq_max, plan_partitions
from pipeinfer.core.protocol import KvOp
from pipeinfer.decide.genconfig import GenConfig
from pipeinfer.decide.scheduler import Scheduler


class LaneStage(ToyStage):
    """ToyStage with several canonical sequences: consecutive COMPACT ops keep every sequence they name."""

    def check_canonical(self) -> None:
        pass  # each generation's output is checked against its own target-alone answer instead

    def apply(self, ops: np.ndarray) -> None:
        rows = np.asarray(ops).reshape(-1, 5)
        if len(rows) == 1 and rows[0][0] == KvOp.RM and rows[0][1] == -1:
            self.cells = []  # seq_rm(-1): every cell (llama.cpp), so the next one goes to cell 0
            return
        keep = [int(r[1]) for r in rows if r[0] == KvOp.COMPACT]
        if keep:
            k = len(rows) - len(keep)
            assert all(r[0] == KvOp.COMPACT for r in rows[k:]), "COMPACT ends its transaction"
            for op, seq, _, p0, p1 in rows[:k].tolist():  # what an entry keeps: the cells go in the compaction
                assert op == KvOp.RM and p0 >= 0 and p1 == -1, "before a COMPACT only trims of cache entries"
                for c in self.cells:
                    if c.pos >= p0:
                        c.seqs.discard(seq)
            self.cells = [c for c in self.cells if c.seqs & set(keep)]
            for c in self.cells:
                c.seqs &= set(keep)
            self.n_compactions += 1
            return
        super().apply(ops)


class LanePipeline(FakePipeline):
    def __init__(self, canon: set[int], **kw):
        super().__init__([], **kw)
        self.canon = canon
        self.stages = [LaneStage(s.name, s.logits_fn, [], s.garbage) for s in self.stages]

    def _check_fresh(self, stage, batch) -> None:
        for s in {s for ids in batch.seq_ids for s in ids} - self.canon:
            if stage.seq_cells(s):
                raise KvError(f"{stage.name}: sequence {s} still holds {sorted(stage.seq_cells(s))} at a new run")

    def kv(self, ops) -> None:
        if len(ops) == 0:
            return
        self.stages[0].apply(ops)
        if self.distributed:
            self.queue.append(("kv", ops))


def make(mode: str, *, n_parallel: int, n_ctx: int = 4096, max_in_flight: int = 4, n_max: int = 3,
         logits_fn=logits_greedy, n_stages: int = 2, error_rate: float = 0.2, poll_every: int = 3,
         p_recovery: float = 0.5, cache_prompt: bool = True, prompt_chunk: int = 63, batch_rows: int = 1,
         stage_ms=None):
    n_lanes = lane_count(n_parallel, cache_prompt)
    n_part, n_seq = plan_partitions(1, max_in_flight, n_lanes=n_lanes)
    if mode == "iterative":  # no partitions: the slots' canonical sequences follow sequence 0 (as startup plans it)
        n_part, n_seq = 0, lane_seq_max(0, 1, n_lanes)
    canon = {lane_canonical(k, n_part, 1) for k in range(n_lanes)}
    pipe = LanePipeline(canon, logits_fn=logits_fn, poll_every=poll_every, garbage=n_seq - 1)
    for stage in pipe.stages:
        stage.n_cells = n_ctx
    pool = PartitionPool(n_part, 1, n_seq, n_lanes=n_lanes) if mode == "pipeinfer" else None
    lent = iter(range(1 << 30))
    cfg = GenConfig(mode=mode, n_ctx=n_ctx, draft_max=n_max, p_recovery=p_recovery,
                    cache_prompt=cache_prompt, prompt_chunk=prompt_chunk, batch_rows=batch_rows, stage_ms=stage_ms)
    sched = Scheduler(pipe, cfg, n_stages=n_stages, n_parallel=n_parallel, pool=pool,
                      drafter_for=lambda p, t, c: ToyDrafter(error_rate, next(lent), 0.9))  # one per lease
    return sched, pipe, pool
