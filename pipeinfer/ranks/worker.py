"""Serve loop of a pipeline stage rank (ranks 1..N-1).

Handles transactions from the previous rank strictly in arrival order (which is the head's order,
see protocol.py) and forwards each one to the next rank; the last stage sends DECODE results back to
the head: one token id per output row. Cancellation arrives out of band from the next rank (the signal
travels backwards: head -> last stage -> ... -> rank 1), is recorded in a bounded set, relayed, and
checked before a run starts and by llama.cpp's abort callback while it decodes. While it serves, the stage
reports its counters to rank 0 out of band (STAGE_STATS: at most every REPORT_EVERY_S, between transactions or
while it waits, never mid-decode, only when they changed; a waiting stage's idle time grows, so an idle stage
reports too, and the page shows it idle rather than as busy as it last was).
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field

import numpy as np

from ..core.kvplan import garbage_seq
from ..core.metrics import rss_mb
from ..core.protocol import (
    NO_RUN,
    REPORT_EVERY_S,
    WORKER_KINDS,
    Batch,
    Flag,
    Header,
    Kind,
    Limits,
    ProtocolError,
    RowRules,
    SAMPLING_LEN,
    StageReport,
    Tag,
    check_header,
    check_kv_ops,
    pack_mtp,
    payload_shapes,
    unpack_sampling,
)
from ..core.topology import Topology
from ..core.sampling import RunSampling, SamplingParams, group_rows, one_sampling
from ..engine.mtp import MtpFeeder
from ..engine.stage import DecodeAborted, StageEngine
from ..wire.transport import Transport, bad_message

CANCEL_WINDOW = 4096  # cancelled ids older than the newest handled run by this much are forgotten


@dataclass
class StageStats:
    rank: int = 0
    n_decoded: int = 0             # runs decoded to the end
    n_tokens: int = 0              # tokens decoded
    n_cancelled_before: int = 0    # runs skipped because they were cancelled before this stage started them
    n_cancelled_mid: int = 0       # runs aborted in the middle of their decode
    n_kv_txns: int = 0             # KV transactions applied
    t_busy_s: float = 0.0          # time inside llama_decode
    t_idle_s: float = 0.0          # time waiting for a transaction
    bytes_sent: int = 0            # bytes this rank sent on (to the next rank; the last one: to the head)
    n_reports: int = 0             # STAGE_STATS reports sent to rank 0 while serving (it takes them all at shutdown)
    kv: list = None                # [seq, min pos, max pos] of non-empty sequences at shutdown
    rss_trace_mb: dict = field(default_factory=dict)  # RSS (MiB) when decoding first reached position 250 k, by k x 250


def _sampling_fits(sampling: RunSampling, lim, n_outputs: int) -> None:
    """ProtocolError when the SAMPLING groups in force name more rows than the run has."""
    try:
        group_rows(sampling, n_outputs)
    except ValueError as e:
        raise ProtocolError(str(e)) from None


class StageWorker:
    def __init__(self, topo: Topology, engine: StageEngine, transport: Transport, limits: Limits | None = None,
                 mtp: MtpFeeder | None = None):
        self.topo = topo
        self.engine = engine
        self.mtp = mtp                # the last stage's MTP head (--drafter mtp: engine/mtp.py), else None
        self.tx = transport
        self.limits = limits          # every header and payload is checked against these (protocol.py)
        self._last_run_in = NO_RUN    # run ids arrive in launch order
        self.cancelled: set[int] = set()
        self.stats = StageStats(rank=topo.rank)
        self._newest_run = -1
        # the last stage's rule for each output row's token and the log-probabilities it reports, by group (SAMPLING)
        self.sampling: RunSampling = one_sampling(SamplingParams())
        self._reported: tuple | None = None   # the counters of the last report sent (nothing new: nothing sent)
        self._t_report = time.perf_counter()  # when it was sent (or serving began)

    def _take_cancels(self) -> None:
        ids = self.tx.poll_cancel(self.topo.next_rank)  # for the last stage, next_rank is the head
        if ids:
            self.cancelled.update(ids)
            if self.topo.rank > 1:
                self.tx.send_cancel(self.topo.prev_rank, ids)  # relay backwards, never to the head

    def _idle(self) -> None:
        """Between probes while waiting for a transaction."""
        self._take_cancels()
        self._report()

    def _report(self) -> None:
        """Send rank 0 the counters (STAGE_STATS) if REPORT_EVERY_S has passed since the last report, something
        changed, and the last report's send has completed; else nothing (never waits)."""
        now = time.perf_counter()
        if now - self._t_report < REPORT_EVERY_S:
            return
        st = self.stats
        counters = (st.n_decoded, st.n_tokens, st.n_cancelled_before, st.n_cancelled_mid, st.n_kv_txns, st.t_busy_s,
                    self.tx.waited_s(), self.tx.bytes_sent)
        if counters == self._reported:
            return
        report = StageReport(self.topo.rank, st.n_reports + 1, *counters)  # StageReport's order after n_reports
        if self.tx.post_report(0, report.pack()):
            st.n_reports, self._reported, self._t_report = report.n_reports, counters, now

    def serve(self) -> StageStats:
        prev, nxt = self.topo.prev_rank, self.topo.next_rank
        while True:
            self._report()
            hdr = self.tx.wait_header(prev, while_idle=self._idle)
            self._check(hdr)
            self._take_cancels()
            if hdr.kind == Kind.SHUTDOWN:
                if not self.topo.is_last:
                    self.tx.send(nxt, hdr)
                break
            if hdr.kind == Kind.KV:
                ops = self.tx.recv_array(prev, Tag.KV, (hdr.n_tokens, 5), np.int32)
                self._valid(check_kv_ops, ops)
                self.engine.apply_kv_ops(ops)
                self.stats.n_kv_txns += 1
                if not self.topo.is_last:
                    self.tx.send(nxt, hdr, (Tag.KV, ops))
            elif hdr.kind == Kind.DECODE:
                self._decode(hdr)
            elif hdr.kind == Kind.SAMPLING:
                buf = self.tx.recv_array(prev, Tag.SAMPLING, (hdr.n_tokens, SAMPLING_LEN), np.int64)
                self.sampling = self._valid(lambda b, lim: unpack_sampling(b), buf)
                if not self.topo.is_last:
                    self.tx.send(nxt, hdr, (Tag.SAMPLING, buf))
            else:
                raise RuntimeError(f"rank {self.topo.rank}: unexpected transaction {hdr.kind.name} from rank {prev}")
        self.stats.t_idle_s = self.tx.t_wait_s
        self.stats.bytes_sent = self.tx.bytes_sent
        self.stats.kv = self.engine.kv_summary(exclude=garbage_seq(self.engine.n_seq_max))
        self.tx.flush()
        return self.stats

    def _check(self, hdr: Header) -> None:
        """Refuse a header before its payload is received (sizes bounded: protocol.Limits)."""
        if self.limits is None:
            return
        try:
            check_header(hdr, self.limits, WORKER_KINDS, self._last_run_in)
        except ProtocolError as e:
            raise bad_message(self.topo.prev_rank, e) from None
        if hdr.kind == Kind.DECODE:
            self._last_run_in = hdr.run_id

    def _valid(self, check, payload, *more):
        """check(payload, limits, *more), a bad payload refused with one line naming its sender."""
        if self.limits is None and check is check_kv_ops:
            return None
        try:
            return check(payload, self.limits, *more)
        except ProtocolError as e:
            raise bad_message(self.topo.prev_rank, e) from None

    def _decode(self, hdr: Header) -> None:
        prev = self.topo.prev_rank
        self._newest_run = max(self._newest_run, hdr.run_id)
        if len(self.cancelled) > CANCEL_WINDOW:
            self.cancelled = {r for r in self.cancelled if r > self._newest_run - CANCEL_WINDOW}
        out, started = None, False
        cancelled = bool(hdr.flags & Flag.CANCELLED) or hdr.run_id in self.cancelled or hdr.parent_id in self.cancelled
        rules = None
        if self.topo.is_last and hdr.n_rules:  # taken even for a cancelled run: the next run's follow on this tag
            rules = self.tx.recv_array(0, Tag.RULES, (hdr.n_rules,), np.int32)
        if not hdr.flags & Flag.CANCELLED:
            (_, meta_shape, _), (_, activ_shape, _) = payload_shapes(hdr)
            meta = self.tx.recv_array(prev, Tag.META, meta_shape, np.int32)
            activ = self.tx.recv_array(prev, Tag.ACTIV, activ_shape, np.float32)
            if not cancelled:
                started = True
                batch = self._valid(Batch.unpack_meta, meta, hdr)
                if rules is not None:
                    rules = self._valid(RowRules.unpack, rules, batch.n_outputs)
                if self.topo.is_last:
                    self._valid(_sampling_fits, self.sampling, batch.n_outputs)
                out = self._run(hdr, batch, activ, rules)
                cancelled = out is None
        if cancelled:
            # pass an empty transaction on: later stages and the head's FIFO stay aligned
            self.cancelled.add(hdr.run_id)
            hdr.flags |= Flag.CANCELLED
            self.stats.n_cancelled_before += not started
            if self.topo.is_last:
                hdr.kind, hdr.n_embd, hdr.n_rules = Kind.RESULT, 0, 0
            self.tx.send(self.topo.next_rank, hdr)
        elif self.topo.is_last:
            tokens, logprobs = out
            hdr.kind, hdr.n_rules = Kind.RESULT, 0
            hdr.n_embd = 0 if logprobs is None else logprobs.shape[1]
            mtp = self._mtp_proposal(batch, tokens)
            if mtp is not None:
                hdr.flags |= Flag.MTP
            self.tx.send(0, hdr, (Tag.TOKENS, tokens), *([] if logprobs is None else [(Tag.LOGPROBS, logprobs)]),
                         *([] if mtp is None else [(Tag.MTP, mtp)]))
        else:
            hdr.n_embd = out.shape[1]
            self.tx.send(self.topo.next_rank, hdr, (Tag.META, meta), (Tag.ACTIV, out))

    def _mtp_proposal(self, batch: Batch, tokens: np.ndarray) -> np.ndarray | None:
        """With the target's MTP head (--drafter mtp): its proposal after this run (the MTP payload), or None."""
        if self.mtp is None:
            return None
        got = self.mtp.after_run(batch.tokens, batch.pos, batch.output, self.engine.captured(len(tokens)), tokens)
        return None if got is None else pack_mtp(*got)

    def _run(self, hdr: Header, batch: Batch, activ: np.ndarray, rules: RowRules | None = None):
        """Decode one run: hidden states for the next stage, or on the last stage (tokens, logprobs): the token
        verification needs after each output row, under the run's rules (the logits stay in llama.cpp), and the
        LOGPROBS asked for (or None); None when it was cancelled mid-decode (non-speculative runs never are)."""
        self.engine.apply_kv_ops(batch.prefix_ops)
        run_id = hdr.run_id
        if hdr.flags & Flag.SPECULATIVE:
            def should_abort() -> bool:
                self._take_cancels()
                return run_id in self.cancelled
            self.engine.should_abort = should_abort
        t0 = time.perf_counter()
        try:
            if self.topo.is_last:
                out = self.engine.decode_tokens(batch, activ, self.sampling, rules)
            else:
                out = self.engine.decode(batch, activ)
        except DecodeAborted:
            self.stats.n_cancelled_mid += 1
            return None
        finally:
            self.engine.should_abort = None
            self.stats.t_busy_s += time.perf_counter() - t0
        self.stats.n_decoded += 1
        self.stats.n_tokens += batch.n_tokens
        mark = int(batch.pos.max()) // 250 * 250
        if mark and mark not in self.stats.rss_trace_mb:  # memory over a long generation (the soak test reads it)
            self.stats.rss_trace_mb[mark] = round(rss_mb(), 1)
        return out
