"""The head's end of the pipeline: runs the first stage locally, sends transactions on, collects results.

With one rank the head holds the whole model and a run's result is ready as soon as it is launched.
With N ranks the head decodes the first stage at launch (synchronously, as in the paper) and sends the
hidden states on; results come back from the last rank in launch order (a FIFO of run ids).

The stages' live counters: each stage rank reports them out of band (STAGE_STATS, protocol.StageReport);
`poll_reports`, called by the generation thread between steps and while it waits for a result, takes the
reports waiting (at most every POLL_REPORTS_S) and refreshes `reports`, rank 0's own stage first (its decodes
timed here; its idle time is its wait for results plus what the front end reports it waited for a request).
Other threads read `reports`: a dict replaced whole, never changed in place. `drain_reports` takes every report
left at shutdown.
"""
from __future__ import annotations

import time
from collections import deque
from typing import TYPE_CHECKING

import numpy as np

from ..core.protocol import (
    HEAD_KINDS,
    MTP_LEN,
    NO_RUN,
    STATS_LEN,
    Batch,
    Flag,
    Header,
    Kind,
    Limits,
    ProtocolError,
    RowRules,
    StageReport,
    Tag,
    check_header,
    check_tokens,
    pack_sampling,
    unpack_logprobs,
    unpack_mtp,
)
from ..core.topology import Topology
from ..core.sampling import RunSampling, SamplingParams, one_sampling
from ..decide.port import Result

if TYPE_CHECKING:  # llama.cpp and MPI stay unimported where only the interface is used (the twin, twin/sim.py)
    from ..engine.stage import StageEngine, TokenEmbedder
    from ..wire.transport import Transport

POLL_REPORTS_S = 0.25   # rank 0 looks for its stages' reports at most this often (they come at most once a second)
DRAIN_TIMEOUT_S = 60.0  # at shutdown, every report a stage sent is due at once (its sends completed before)


class Pipeline:
    """The head's end of the pipeline (module docstring): decide/port.PipePort over MPI ranks and llama.cpp stages."""

    def __init__(self, topo: Topology, engine: StageEngine, embedder: TokenEmbedder | None = None,
                 transport: Transport | None = None, limits: Limits | None = None):
        self.topo = topo
        self.limits = limits          # every RESULT is checked against these before its payload (protocol.py)
        self._last_result = NO_RUN
        self.engine = engine
        self.embedder = embedder
        self.tx = transport
        self.in_flight: deque[int] = deque()  # run ids in launch order
        self.sampling: RunSampling = one_sampling(SamplingParams())
        self._local: deque[Result] = deque()   # single-rank results
        self.last = topo.n_ranks - 1
        self.n_decoded = 0                     # rank 0's own stage: runs decoded, their tokens, time in llama_decode
        self.n_tokens = 0
        self.t_busy_s = 0.0
        self.t_wait_requests_s = 0.0           # time the front end waited for a request with nothing to do
        self.reports: dict[int, StageReport] = {}  # the latest counters of each rank (rank 0's own included)
        self._t_polled = -POLL_REPORTS_S

    @property
    def distributed(self) -> bool:
        return self.topo.n_ranks > 1

    def launch(self, run_id: int, batch: Batch, speculative: bool, parent_id: int = NO_RUN,
               rules: RowRules | None = None) -> None:
        """A run into the pipeline; `rules` (a request's masks and biases for its output rows) go straight to the
        last stage, which applies them before it draws the rows' tokens."""
        flags = Flag.SPECULATIVE if speculative else Flag.NONE
        self.engine.apply_kv_ops(batch.prefix_ops)
        self.n_decoded += 1
        self.n_tokens += batch.n_tokens
        if not self.distributed:
            t0 = time.perf_counter()
            embd = self.embedder(batch.tokens) if self.embedder is not None else None  # a tensor group's input
            tokens, logprobs = self.engine.decode_tokens(batch, embd, self.sampling, rules)
            self.t_busy_s += time.perf_counter() - t0
            self._local.append(Result(run_id, False, tokens, None if logprobs is None else unpack_logprobs(logprobs)))
        else:
            meta = batch.pack_meta()
            packed = rules.pack(batch.n_outputs) if rules is not None else None
            embd = self.embedder(batch.tokens)
            t0 = time.perf_counter()
            hidden = self.engine.decode(batch, embd)
            self.t_busy_s += time.perf_counter() - t0
            hdr = Header(Kind.DECODE, run_id, batch.n_tokens, len(meta), flags, parent_id, batch.n_outputs,
                         hidden.shape[1], 0 if packed is None else len(packed))
            self.tx.send(1, hdr, (Tag.META, meta), (Tag.ACTIV, hidden))
            if packed is not None:
                self.tx.send_i32(self.last, Tag.RULES, packed)
        self.in_flight.append(run_id)

    def set_sampling(self, sampling: RunSampling) -> None:
        """How the last stage turns each output row into a token, and how many log-probabilities it reports, group
        by group of rows, from the next run on (in order with runs)."""
        self.sampling = sampling
        if self.distributed:
            self.tx.send(1, Header(Kind.SAMPLING, n_tokens=len(sampling)), (Tag.SAMPLING, pack_sampling(sampling)))

    def kv(self, ops: np.ndarray) -> None:
        """Apply KV ops on every stage, in order with the runs around them."""
        if len(ops) == 0:
            return
        self.engine.apply_kv_ops(ops)
        if self.distributed:
            self.tx.send(1, Header(Kind.KV, n_tokens=len(ops)), (Tag.KV, ops))

    def cancel(self, run_ids: list[int]) -> None:
        """Out of band: to the last stage, which relays it backwards."""
        if self.distributed and run_ids:
            self.tx.send_cancel(self.last, run_ids)

    def result_ready(self) -> bool:
        return bool(self._local) or (self.distributed and bool(self.in_flight) and self.tx.header_ready(self.last))

    def next_result(self) -> Result:
        """The oldest run's result, waiting politely for it."""
        if not self.in_flight:
            raise RuntimeError("no run in flight")
        expected = self.in_flight[0]  # stays counted as in flight while we wait for it (liveness.py reports it)
        if not self.distributed:
            res = self._local.popleft()
        else:
            hdr = self.tx.wait_header(self.last, while_idle=self.poll_reports)
            try:
                if self.limits is not None:
                    check_header(hdr, self.limits, HEAD_KINDS, self._last_result)
                elif hdr.kind != Kind.RESULT:
                    raise ProtocolError(f"unexpected transaction {hdr.kind.name} (the head takes RESULT)")
                self._last_result = hdr.run_id
                cancelled = bool(hdr.flags & Flag.CANCELLED)
                tokens = None if cancelled else self.tx.recv_array(self.last, Tag.TOKENS, (hdr.n_outputs,), np.int32)
                if tokens is not None and self.limits is not None:
                    check_tokens(tokens, self.limits)
                logprobs = mtp = None
                if not cancelled and hdr.n_embd:
                    logprobs = unpack_logprobs(self.tx.recv_array(self.last, Tag.LOGPROBS, (hdr.n_outputs, hdr.n_embd),
                                                                  np.int32))
                if not cancelled and hdr.flags & Flag.MTP:
                    mtp = unpack_mtp(self.tx.recv_array(self.last, Tag.MTP, (MTP_LEN,), np.int32),
                                     self.limits.n_vocab if self.limits is not None else None)
            except ProtocolError as e:
                from ..wire.transport import (
                    bad_message,  # mpi4py: not imported where the twin runs
                )
                raise bad_message(self.last, e) from None
            res = Result(hdr.run_id, cancelled, tokens, logprobs, mtp)
        self.in_flight.popleft()
        if res.run_id != expected:
            raise RuntimeError(f"results out of order: expected run {expected}, got {res.run_id}")
        return res

    def shutdown(self) -> None:
        if self.distributed:
            self.tx.send(1, Header(Kind.SHUTDOWN))
            self.tx.flush()

    # ---------------------------------------------------------------- the stages' counters
    def own_report(self) -> StageReport:
        """Rank 0's own stage now (call it on the generation thread: the transport's wait is read live)."""
        waited = self.tx.waited_s() if self.tx is not None else 0.0
        return StageReport(0, n_decoded=self.n_decoded, n_tokens=self.n_tokens, t_busy_s=self.t_busy_s,
                           t_idle_s=waited + self.t_wait_requests_s,
                           bytes_sent=self.tx.bytes_sent if self.tx is not None else 0)

    def poll_reports(self, waited_s: float = 0.0) -> None:
        """The generation thread's look at the stages: add waited_s (time the front end just waited for a request)
        to rank 0's idle time; at most every POLL_REPORTS_S, take every report waiting from each stage (the
        newest counts) and refresh `reports`. Never blocks."""
        self.t_wait_requests_s += waited_s
        now = time.perf_counter()
        if now - self._t_polled < POLL_REPORTS_S:
            return
        self._t_polled = now
        self._take_reports()

    def _take_reports(self) -> None:
        reports = {**self.reports, 0: self.own_report()}
        for rank in range(1, self.topo.n_ranks):
            while (buf := self.tx.take_report(rank, STATS_LEN)) is not None:
                try:
                    reports[rank] = StageReport.unpack(buf, rank)
                except ProtocolError as e:
                    from ..wire.transport import bad_message  # mpi4py: not imported where the twin runs
                    raise bad_message(rank, e) from None
        self.reports = reports

    def drain_reports(self, sent: dict[int, int], poll_s: float) -> None:
        """At shutdown: take the reports left until each rank's count in `sent` (its StageStats.n_reports), so that
        no message stays unreceived; each was sent before the stage ended, so they are all due at once."""
        deadline = time.monotonic() + DRAIN_TIMEOUT_S
        while True:
            self._take_reports()
            short = {r: n for r, n in sent.items() if n and (r not in self.reports or self.reports[r].n_reports < n)}
            if not short:
                return
            if time.monotonic() > deadline:
                raise RuntimeError(f"stage reports missing at shutdown (rank: reports sent): {short}")
            time.sleep(poll_s)
