"""A pipeline stage run by a tensor group: its leader's engine, and the loop of its other members.

The group's ranks each hold a slice of every layer of the stage (engine/slices.py). The leader is the stage as the
pipeline sees it (rank r of the stages' communicator): its GroupEngine has StageEngine's interface, and before each
operation on its own slice it sends the operation to the members on the group's communicator (protocol.py: a
tensor group's messages), so every member's engine runs the same decodes and KV operations in the same order. During
a decode every member adds its partial sums to the others' twice a layer (engine/group_sums.py, through `exchange`:
an MPI all-gather). On the last stage each member's logits cover its rows of the vocabulary; the leader gathers them.

A speculative run's cancellation reaches the leader; it rides the partial sums' exchange to the members, so every
member stops its decode at the same node (group_sums.PartialSums.aborting), and no member waits at an exchange
another member will never reach.
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable

import numpy as np

from ..core.config import Config
from ..core.errors import UserError
from ..core.protocol import Batch, Flag, Header, Kind, Tag, payload_shapes
from ..core.topology import Groups, Topology, parse_per_rank_ints
from ..core.verify import greedy_only, pick_best, row_best
from ..engine.group_sums import PartialSums
from ..engine.slices import Slice, SliceError, ensure_slice_file, vocab_slices
from ..wire.transport import Transport, polite_barrier

if TYPE_CHECKING:
    from ..engine.stage import StageEngine


@dataclass(frozen=True)
class GroupPlan:
    """What a member needs to load its slice as its leader loads its own (sent once at start-up, pickled)."""
    start: int                 # the stage's layers [start, end)
    end: int
    is_last: bool              # the last stage: vocabulary rows and logits
    shares: tuple[float, ...]  # each member's share of every layer (slices.Slice)
    n_ctx: int
    n_batch: int
    n_seq_max: int
    kernels: str
    vocab_rows: tuple[tuple[int, int], ...]  # each member's rows of the vocabulary (last stage)
    threads: tuple[int, ...]   # each member's threads (single-token decodes)
    threads_batch: tuple[int, ...]


SPIN_TESTS = 50  # tests of an exchange before each further test yields the core (os.sched_yield)


def exchange_over(comm) -> Callable[[np.ndarray], np.ndarray]:
    """PartialSums' exchange on an MPI communicator: every member's f32[n] in member order. An all-gather tested in a
    loop that yields the core after SPIN_TESTS tests: as fast as a blocking Allgather where each member has its cores
    (10 us for 6 KB between two ranks of this host), twice as fast where ranks share them (4 ranks on 2 cores: 1.0 ms
    instead of 1.9), where a blocking MPICH collective spins through the other rank's time slice."""
    size = comm.Get_size()

    def exchange(mine: np.ndarray) -> np.ndarray:
        every = np.empty((size, len(mine)), dtype=np.float32)
        req, tests = comm.Iallgather(mine, every), 0
        while not req.Test():
            tests += 1
            if tests > SPIN_TESTS:
                os.sched_yield()
        return every
    return exchange


class GroupEngine:
    """The leader's engine: StageEngine's interface over the group (module docstring)."""

    def __init__(self, engine: StageEngine, tx, plan: GroupPlan, path: str):
        self.engine = engine
        self.path = path              # the leader's slice file (kernels.py keys its exact batch limit by it)
        self.tx = tx                  # wire.Transport on the group's communicator (the leader is its rank 0)
        self.plan = plan
        self.members = range(1, len(plan.shares))
        self._wish: Callable[[], bool] | None = None
        self.n_vocab = plan.vocab_rows[-1][1] if plan.is_last else engine.n_vocab
        # every attribute the pipeline reads of an engine, the leader's slice's
        for name in ("n_embd", "n_batch", "n_ctx", "n_seq_max", "recurrent", "embd_input", "capture_hidden",
                     "kernels", "n_threads", "huge_page_bytes"):
            setattr(self, name, getattr(engine, name))

    @property
    def should_abort(self) -> Callable[[], bool] | None:
        return self._wish

    @should_abort.setter
    def should_abort(self, wish: Callable[[], bool] | None) -> None:
        """The worker's cancellation test: asked at each exchange, its answer taken by every member at once."""
        self._wish = wish
        sums = self.engine.sums
        sums.wish_to_abort = wish
        self.engine.should_abort = (lambda: sums.aborting) if wish is not None else None

    def _send(self, hdr: Header, *payloads) -> None:
        for m in self.members:
            self.tx.send(m, hdr, *payloads)

    def decode(self, batch: Batch, embd: np.ndarray | None = None) -> np.ndarray:
        out = self._decode(batch, embd, Flag.NONE)
        return self._gather(out) if self.plan.is_last else out

    def decode_tokens(self, batch: Batch, embd, sampling, rules=None):
        """As StageEngine.decode_tokens. When every row is greedy and nothing else of the logits is asked, each member
        sends each row's best logit and where (verify.row_best: 8 bytes a row, not 4 x its vocabulary rows)."""
        from ..engine.stage import draw_tokens
        if not greedy_only(sampling, rules, batch.n_outputs):
            return draw_tokens(self.decode(batch, embd), batch, sampling, rules)
        bests = [row_best(self._decode(batch, embd, Flag.ARGMAX))]
        bests += [self.tx.recv_array(m, Tag.SLICE_LOGITS, (batch.n_outputs, 2), np.float32) for m in self.members]
        return pick_best(bests, [a for a, _ in self.plan.vocab_rows]), None

    def _decode(self, batch: Batch, embd: np.ndarray, flags: Flag) -> np.ndarray:
        """The decode sent to every member (flags: what they send back), then run on the leader's slice."""
        meta = batch.pack_meta()
        flags |= Flag.SPECULATIVE if self._wish is not None else Flag.NONE
        hdr = Header(Kind.DECODE, n_tokens=batch.n_tokens, n_meta=len(meta), flags=flags,
                     n_outputs=batch.n_outputs, n_embd=embd.shape[1])
        self._send(hdr, (Tag.META, meta), (Tag.ACTIV, np.ascontiguousarray(embd, dtype=np.float32)))
        self.engine.sums.begin()
        return self.engine.decode(batch, embd)

    def _gather(self, mine: np.ndarray) -> np.ndarray:
        """The whole vocabulary's logits f32[n_outputs, n_vocab]: the leader's rows, then each member's."""
        parts = [mine]
        for m in self.members:
            a, b = self.plan.vocab_rows[m]
            parts.append(self.tx.recv_array(m, Tag.SLICE_LOGITS, (len(mine), b - a), np.float32))
        return np.concatenate(parts, axis=1)

    def apply_kv_ops(self, ops: np.ndarray) -> None:
        ops = np.asarray(ops, dtype=np.int32).reshape(-1, 5)
        if len(ops):
            self._send(Header(Kind.KV, n_tokens=len(ops)), (Tag.KV, ops))
            self.engine.apply_kv_ops(ops)

    def clear_kv(self) -> None:
        self._send(Header(Kind.CLEAR))
        self.engine.clear_kv()

    def captured(self, n: int) -> np.ndarray:
        return self.engine.captured(n)

    def seq_pos_range(self, seq: int) -> tuple[int, int]:
        return self.engine.seq_pos_range(seq)

    def kv_summary(self, exclude: int | None = None) -> list[list[int]]:
        return self.engine.kv_summary(exclude)

    def close(self) -> None:
        self._send(Header(Kind.SHUTDOWN))
        self.tx.flush()
        self.engine.close()


def serve_member(engine: StageEngine, tx, plan: GroupPlan, my_index: int) -> None:
    """A member that is not the leader: mirror the leader's operations on this member's slice until SHUTDOWN."""
    from ..engine.stage import DecodeAborted
    sums = engine.sums
    while True:
        hdr = tx.wait_header(0)
        if hdr.kind == Kind.SHUTDOWN:
            break
        if hdr.kind == Kind.CLEAR:
            engine.clear_kv()
        elif hdr.kind == Kind.KV:
            engine.apply_kv_ops(tx.recv_array(0, Tag.KV, (hdr.n_tokens, 5), np.int32))
        elif hdr.kind == Kind.DECODE:
            (_, meta_shape, _), (_, activ_shape, _) = payload_shapes(hdr)
            batch = Batch.unpack_meta(tx.recv_array(0, Tag.META, meta_shape, np.int32))
            activ = tx.recv_array(0, Tag.ACTIV, activ_shape, np.float32)
            engine.should_abort = (lambda: sums.aborting) if hdr.flags & Flag.SPECULATIVE else None
            sums.begin()
            try:
                out = engine.decode(batch, activ)
            except DecodeAborted:  # every member stopped at the same node (module docstring): nothing to send
                continue
            if plan.is_last:
                tx.send_payload(0, Tag.SLICE_LOGITS, row_best(out) if hdr.flags & Flag.ARGMAX else out)
        else:
            raise RuntimeError(f"group member {my_index}: unexpected {hdr.kind.name} from its leader")
    tx.flush()


def leader_values(text: str | None, groups: Groups, default: list[int] | None) -> list[int | None]:
    """-t / -tb under tensor groups: one value, or one per target rank (members too), as the stages' leaders take
    them (the pipeline's ranks); default: the leaders' own (None: left to the caller)."""
    n = sum(groups.sizes)
    values = parse_per_rank_ints(text, n, "--threads", default=[0] * n) if text else None
    return [values[r] if values else (default[s] if default else None) for s, r in enumerate(groups.leaders)]


def member_threads(config: Config, cores: int, target_rank: int, n_targets: int) -> tuple[int, int]:
    """A member's (threads, threads for batches): -t's and -tb's value for its rank (one value: every rank's), else
    the cores its host gives it (core/cpus.default_threads), as a stage rank's."""
    def own(text: str | None, default: int) -> int:
        return parse_per_rank_ints(text, n_targets, "--threads", default=[default] * n_targets)[target_rank]
    n = own(config.stage.threads, cores)
    return n, own(config.stage.threads_batch, n)


def _load_slice(config: Config, group, plan: GroupPlan) -> tuple[StageEngine, str]:
    """This member's slice of the stage, loaded, its partial sums exchanged over the group."""
    from ..engine.stage import StageEngine  # imports llama_cpp
    from ..wire.hosts import host_name
    from .weights import local_view
    index = group.Get_rank()
    mine = local_view(config.model)
    if not mine.is_file():
        raise UserError(f"tensor group of layers {plan.start}-{plan.end}: rank {index} of the group ({host_name()}) "
                        f"has no copy of {config.model}; a group's members slice their host's own copy: copy it there")
    try:
        path = str(ensure_slice_file(mine, plan.start, plan.end, plan.is_last, Slice(index, plan.shares)))
    except SliceError as e:
        raise UserError(str(e)) from None
    engine = StageEngine(path, n_ctx=plan.n_ctx, n_batch=plan.n_batch, n_seq_max=plan.n_seq_max,
                         n_threads=plan.threads[index], n_threads_batch=plan.threads_batch[index], embd_input=True,
                         capture_hidden=not plan.is_last, kernels=plan.kernels,
                         sums=PartialSums(exchange_over(group)))
    return engine, path


def lead_group(config: Config, group, topo: Topology, n_threads: int, n_threads_batch: int, n_batch: int,
               n_seq_max: int) -> GroupEngine:
    """The leader's side of a group's start-up (collective over the group, with serve_group_member): each member's
    threads gathered, the plan sent, every slice loaded; the leader's GroupEngine."""
    poll_s = config.wire.poll_s
    polite_barrier(group, poll_s)
    threads = group.allgather((n_threads, n_threads_batch))
    shares = tuple(float(t) for t, _ in threads)
    my = topo.my_range
    try:
        rows = tuple(vocab_slices(config.model, shares)) if topo.is_last else ()
    except SliceError as e:
        raise UserError(str(e)) from None
    plan = GroupPlan(my.start, my.end, topo.is_last, shares, config.stage.n_ctx, n_batch, n_seq_max,
                     config.stage.kernels, rows, tuple(t for t, _ in threads), tuple(b for _, b in threads))
    group.bcast(plan, root=0)
    engine, path = _load_slice(config, group, plan)
    link = group.Dup()
    polite_barrier(group, poll_s)  # every member loaded before the first decode (the leader's first probes)
    return GroupEngine(engine, Transport(link, link, poll_s), plan, path)


def serve_group_member(config: Config, group, cores: int, target_rank: int, n_targets: int) -> None:
    """A member's whole life: its share of the start-up (lead_group), then mirror its leader until SHUTDOWN."""
    poll_s = config.wire.poll_s
    polite_barrier(group, poll_s)  # the leader plans its stage first: wait without spinning a core
    group.allgather(member_threads(config, cores, target_rank, n_targets))
    plan = group.bcast(None, root=0)
    engine, _ = _load_slice(config, group, plan)
    link = group.Dup()
    polite_barrier(group, poll_s)
    try:
        serve_member(engine, Transport(link, link, poll_s), plan, group.Get_rank())
    finally:
        engine.close()
