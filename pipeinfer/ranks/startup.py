"""Start-up of one generation on every rank: topology, stage files, engines, transport; then head or worker.

open_session runs the steps in order: agree on protocol and build (liveness starts), split off the draft
rank, agree on the model, plan threads and layers, load the stage, then serve as a stage or open the head
(the pipeline and the drafter, drafters/factory.py).

Everything here runs once; per-token work happens in head.py / worker.py. Start-up data may be
pickled (allgather of versions and stage statistics); nothing per token is.
"""
from __future__ import annotations

import os
import resource
import sys
from dataclasses import dataclass, field, replace

from ..core.errors import UserError
from ..core.kvplan import PartitionPool, garbage_seq, lane_count, lane_seq_max, plan_partitions
from ..core.metrics import Stats
from ..core.protocol import PROTOCOL_VERSION, Limits, kv_ops, rm
from ..core.topology import (
    LayerRange,
    Topology,
    mpi_library,
    parse_per_rank_ints,
    plan_layers,
    split_from_speeds,
    world_size_mismatch,
)
from ..engine.kernels import DEFAULT_DRAFT_MAX, DEFAULT_KERNELS, resolve_draft_max
from ..engine.stagefile import check_splittable, ensure_stage_file, layer_costs, read_info
from ..drafters.drafter import DRAFT_HEAD_AUTO
from ..drafters.factory import DraftSpec, make_drafter
from ..wire.transport import polite_barrier
from .handshake import build_id, model_fingerprint
from .head import GenConfig, Head, auto_p_recovery
from .scheduler import Request, Scheduler


@dataclass
class RunOptions:
    model: str
    prompt_tokens: list[int] | None = None   # rank 0 only
    gen: GenConfig = field(default_factory=GenConfig)
    layer_split: str | None = None
    threads: str | None = None
    threads_batch: str | None = None
    n_ctx: int = 4096
    draft: str | None = None
    drafter: str = "model"                    # model | ngram | replay
    replay_ref: str | None = None             # replay drafter: JSON of an earlier --json run
    replay_accuracy: float = 0.8              # replay drafter: probability each proposal is right
    draft_vocab: str = "auto"                 # auto | same | translate: how a draft model's vocabulary maps
    prompt_text: str | None = None            # raw user prompt (a translating drafter formats its own prompt)
    chat: bool = False                        # whether the prompt was chat-formatted
    max_in_flight: int = 8
    parallel: int = 1                         # generations at once (scheduler.py); 1: one after another
    poll_s: float = 0.0005
    kernels: str = DEFAULT_KERNELS            # kernels.py: repack | no-repack | fast (not batch-invariant)
    stall_timeout: float = 60.0               # liveness.py: a rank silent this long ends the job (0: only losses)
    draft_at: str = "head"                    # draftahead.py: head (in series) | thread (beside, rank 0) | rank (own)
    draft_threads: int | None = None          # the draft model's threads (None: see draft_thread_count)
    draft_head: int | None = DRAFT_HEAD_AUTO  # --draft-head: tokens the draft's output head keeps (None: all)
    on_tokens: object = None                  # callable(list of new token ids), rank 0
    on_progress: object = None                # callable(Stats, runs in flight), rank 0
    should_stop: object = None                # callable() -> bool, rank 0: True ends the generation early (a signal)


@dataclass
class RunResult:
    tokens: list[int]
    stats: Stats
    ranges: list[LayerRange]
    peak_rss_mb: list[float]
    probe_ms_per_layer: list[float] | None = None  # --layer-split auto's measurements, one per rank
    p_recovery: float = 0.0                         # the recovery factor used (-pr auto resolved)


def _peak_rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0


def run(opts: RunOptions, comm=None) -> RunResult | None:
    """Run one generation; returns the result on rank 0 and None on the other ranks."""
    session = open_session(opts, comm)
    if session is None:
        return None  # a stage rank: it served the pipeline until the head shut it down
    try:
        stats = session.generate(opts.prompt_tokens, prompt_text=opts.prompt_text, chat=opts.chat,
                                 on_tokens=opts.on_tokens, on_progress=opts.on_progress, should_stop=opts.should_stop)
    finally:
        stats_per_rank, rss = session.close()
    stats.stage_stats = stats_per_rank
    return RunResult(session.last_tokens, stats, session.ranges, rss, session.probe_ms, session.cfg.p_recovery)


@dataclass
class HeadSession:
    """Rank 0's end of a loaded pipeline: runs generations one after another (`pipeinfer serve` runs many),
    then shuts the pipeline down."""
    opts: RunOptions
    cfg: GenConfig                      # resolved: draft max, n_batch, n_ctx, p_recovery
    comm: object
    engine: object
    transport: object
    pipe: object
    pool: PartitionPool | None
    drafter_for: object                 # callable(prompt tokens, prompt text, chat) -> Drafter, or None
    tok: object
    eos: set[int]
    ranges: list[LayerRange]
    exact_per_rank: list[int | None]
    n_seq_max: int
    probe_ms: list[float] | None = None
    live: object = None                 # liveness.Liveness (several ranks)
    beside: object = None               # the drafter beside the pipeline (ThreadDrafter, or the draft rank's client)
    last_tokens: list[int] = field(default_factory=list)
    n_generations: int = 0
    _next_run: int = 0
    _n_runs: int = 0
    _sched: Scheduler | None = None

    def scheduler(self) -> Scheduler:
        """The scheduler of several generations at once (--parallel), from an empty KV cache on every stage;
        submit Requests made by `request` and run it."""
        if self._sched is None:
            if self.n_generations:
                self.pipe.kv(kv_ops(rm(-1)))
            self._sched = Scheduler(self.pipe, self.cfg, n_stages=self.pipe.topo.n_ranks, n_parallel=self.opts.parallel,
                                    pool=self.pool, n_part=self.pool.n_partitions if self.pool else 0,
                                    drafter_for=self.drafter_for, eos=self.eos, first_run_id=self._next_run)
        return self._sched

    def load(self) -> dict:
        """What the pipeline holds now, for /health (read from another thread: a snapshot, not a lock)."""
        sched = self._sched
        return {"generating": len(sched.gens) if sched else None, "waiting": len(sched.waiting) if sched else 0,
                "most_generating": sched.stats.max_active if sched else None,
                "runs_in_flight": len(self.pipe.in_flight),
                "partitions_free": self.pool.n_free if self.pool else 0,
                "partitions": self.pool.n_partitions if self.pool else 0}

    def request(self, prompt: list[int], *, n_predict: int | None = None, sampling=None, prompt_text: str | None = None,
                chat: bool = False, on_tokens=None, should_stop=None, on_done=None, replay=()) -> Request:
        """A Request for `scheduler()`; on_done(tokens, stats) gets the statistics `generate` reports."""
        def done(tokens: list[int], stats: Stats) -> None:
            self._n_runs += stats.n_runs
            self.n_generations += 1
            stats.kernels, stats.exact_batch, stats.draft_at = self.opts.kernels, self.exact_per_rank, self.opts.draft_at
            if on_done is not None:
                on_done(tokens, stats)
        return Request(list(prompt), self.cfg.n_predict if n_predict is None else n_predict,
                       self.cfg.sampling if sampling is None else sampling, prompt_text, chat, on_tokens, should_stop,
                       done, replay=list(replay))

    def generate(self, prompt: list[int], *, n_predict: int | None = None, sampling=None, prompt_text: str | None = None,
                 chat: bool = False, on_tokens=None, on_progress=None, should_stop=None) -> Stats:
        """One generation from an empty KV cache on every stage; the tokens are in `last_tokens`."""
        cfg = self.cfg
        if n_predict is not None:
            cfg = replace(cfg, n_predict=n_predict)
        if sampling is not None:
            cfg = replace(cfg, sampling=sampling)
        if self.n_generations:  # nothing of the previous generation stays: every cell freed, from cell 0 again
            self.pipe.kv(kv_ops(rm(-1)))
        drafter = None if cfg.mode == "iterative" else self.drafter_for(prompt, prompt_text, chat)
        head = Head(self.pipe, cfg, self.pool, drafter, eos=self.eos, on_tokens=on_tokens, on_progress=on_progress,
                    should_stop=should_stop, first_run_id=self._next_run)
        self.last_tokens = head.generate(prompt)
        self._next_run = head.last_run_id
        self._n_runs += head.stats.n_runs
        self.n_generations += 1
        head.stats.n_kv0 = head.n_kv0
        head.stats.kernels = self.opts.kernels
        head.stats.exact_batch = self.exact_per_rank
        head.stats.exact_batch_draft = getattr(drafter, "exact_batch", None)
        head.stats.draft_at = self.opts.draft_at
        return head.stats

    def close(self) -> tuple[list[dict], list[float]]:
        """Shut the pipeline down; every rank's stage statistics (worker.StageStats as dicts, rank 0 first)
        and peak RSS (MiB)."""
        from .worker import StageStats
        head_stage = StageStats(rank=0, n_decoded=self._n_runs, t_idle_s=self.transport.t_wait_s if self.transport else 0.0,
                                kv=self.engine.kv_summary(exclude=garbage_seq(self.n_seq_max)),
                                bytes_sent=self.transport.bytes_sent if self.transport else 0)
        self.pipe.shutdown()
        if self.beside is not None:
            self.beside.close()
        polite_barrier(self.comm, self.opts.poll_s)
        stage_stats = self.comm.gather(None, root=0)[1:]
        rss = self.comm.gather(_peak_rss_mb(), root=0)
        if self.live is not None:
            self.live.close()
        self.tok.close()
        self.engine.close()
        return [vars(head_stage)] + stage_stats, rss


def open_session(opts: RunOptions, comm=None) -> HeadSession | None:
    """Load every rank's stage. Rank 0 gets a HeadSession; the other ranks serve the pipeline until the head
    shuts it down, and get None."""
    ranks = _join(opts, comm)                 # one protocol and build; liveness; the draft rank split off
    if ranks.is_draft:
        serve_draft_rank(opts, ranks.draft_comm, ranks.world.Get_size())
        ranks.live.close()
        return None
    info = _agree_model(opts, ranks)          # one target file on every stage
    plan = _split_layers(opts, ranks, info)   # threads and layers per rank
    stage = _load_stage(opts, ranks.comm, plan)
    if ranks.comm.Get_rank() != 0:
        _serve_stage(opts, ranks, stage)
        return None
    return _open_head(opts, ranks, plan, stage)


# ---- the start-up steps, in open_session's order; every rank makes the same collective calls in each
@dataclass
class _Ranks:
    """Where this rank stands once every rank runs the same protocol and build (_join)."""
    world: object                 # every rank started
    comm: object                  # the target's stages: the world, less the draft rank with --draft-at rank
    draft_comm: object = None     # --draft-at rank: a duplicate of the world, the head's link to the draft rank
    live: object = None           # liveness.Liveness (several ranks)
    is_draft: bool = False        # this rank is the draft rank


@dataclass
class _LayerPlan:
    """Every rank's threads and layers, agreed by all (_split_layers)."""
    info: object                  # the target's GGUF summary (stagefile.read_info)
    threads: list[int]            # --threads, one per rank
    threads_b: list[int]          # --threads-batch, one per rank
    ranges: list[LayerRange]
    probe_ms: list[float] | None  # --layer-split auto's measurements, one per rank


@dataclass
class _Stage:
    """This rank's loaded stage and the settings resolved on it (_load_stage)."""
    topo: Topology
    engine: object
    cfg: GenConfig                # resolved: draft max, n_batch, n_ctx, p_recovery, stage costs
    exact_per_rank: list[int | None]
    n_part: int                   # KV partitions for speculative runs (kvplan.py)
    n_seq_max: int
    transport: object             # None on one rank
    limits: Limits


def _join(opts: RunOptions, comm) -> _Ranks:
    """Every rank on one protocol and build, liveness started; with --draft-at rank, the draft rank split off."""
    from mpi4py import MPI
    world = comm or MPI.COMM_WORLD
    if comm is None:
        check_world_size(world.Get_size(), MPI.Get_library_version())
    versions = world.allgather(PROTOCOL_VERSION)
    if len(set(versions)) != 1:
        raise UserError(f"ranks run different pipeinfer protocol versions: {versions}")
    live = None
    if world.Get_size() > 1:  # from here on, a rank that dies or goes silent is named and ends the job (liveness.py)
        from ..wire.liveness import Liveness
        live = Liveness(world, opts.stall_timeout)
        _agree(world, live, build_id(), "runs another build")
    if opts.draft_at != "rank":
        return _Ranks(world, world, live=live)
    # the world's last rank drafts; the others are the target's stages
    if world.Get_size() < 2:
        raise UserError("--draft-at rank needs a rank of its own for the draft: start one more rank than the "
                        "target's stages (mpiexec -n N+1)")
    is_draft = world.Get_rank() == world.Get_size() - 1
    stages = world.Split(1 if is_draft else 0, world.Get_rank())
    return _Ranks(world, stages, draft_comm=world.Dup(), live=live, is_draft=is_draft)


def check_world_size(world_size: int, library_version: str) -> None:
    """Every rank, first: MPI's world is the job the launcher started. A launcher of another MPI than the library
    mpi4py loads starts N processes that each see a world of one: N separate jobs would each generate the text."""
    msg = world_size_mismatch(world_size, mpi_library(library_version)[1], os.environ)
    if msg:
        raise UserError(msg)


def _agree_model(opts: RunOptions, ranks: _Ranks):
    """The target's GGUF summary, the same file on every stage; a draft model checked before any model loads."""
    info = read_info(opts.model)
    if ranks.live is not None:
        _agree(ranks.comm, ranks.live, model_fingerprint(opts.model), f"has another model file at {opts.model} "
                                                                      f"(size:sha256 of header, first and last MiB)")
    if opts.draft and opts.gen.mode != "iterative":
        read_info(opts.draft)  # a missing, foreign or truncated draft fails here, before any model loads
    return info


def _split_layers(opts: RunOptions, ranks: _Ranks, info) -> _LayerPlan:
    """Every rank's threads and layer range (--layer-split auto times each rank in turn), agreed by all."""
    comm = ranks.comm
    rank, size = comm.Get_rank(), comm.Get_size()
    try:
        check_splittable(info, size)
        threads = parse_per_rank_ints(opts.threads, size, "--threads", default=max(1, (os.cpu_count() or 2) // size))
        threads_b = parse_per_rank_ints(opts.threads_batch, size, "--threads-batch", default=threads[rank])
        probe_ms = None
        if opts.layer_split is not None and opts.layer_split.strip() == "auto" and size > 1:
            probe_ms = auto_split(comm, opts.model, info, threads[rank], threads_b[rank])
        layer_cost, tail_cost = layer_costs(opts.model)
        ranges = plan_layers(opts.layer_split, info.n_layer, size, layer_cost, tail_cost,
                             speeds=split_from_speeds(probe_ms) if probe_ms else None)
    except ValueError as e:
        raise UserError(str(e)) from None
    if any(r.n_layers == 0 for r in ranges):
        raise UserError("every rank needs at least one layer: a fraction of 0 in --layer-split is not supported")
    if ranks.live is not None:
        _agree(comm, ranks.live, ",".join(str(r) for r in ranges), "computed another layer plan")
    return _LayerPlan(info, threads, threads_b, ranges, probe_ms)


def _load_stage(opts: RunOptions, comm, plan: _LayerPlan) -> _Stage:
    """This rank's stage engine, the generation settings resolved on every stage, the links between them."""
    rank, size = comm.Get_rank(), comm.Get_size()
    topo = Topology(rank, size, tuple(plan.ranges))
    n_lanes = lane_count(opts.parallel)
    if opts.gen.mode == "iterative":
        n_part, n_seq_max = 0, lane_seq_max(0, 1, n_lanes)
    else:
        n_part, n_seq_max = plan_partitions(opts.gen.cut.max_branches, opts.max_in_flight, n_lanes=n_lanes)
    n_batch = min(opts.gen.n_batch, opts.n_ctx)
    engine, exact = _load_engine(opts, topo, plan.threads[rank], plan.threads_b[rank], n_batch, n_seq_max)
    exact_per_rank = comm.allgather(exact)
    cfg = _resolve_gen(opts, comm, engine, n_batch, exact_per_rank)
    transport = None
    if size > 1:
        from ..wire.transport import Transport
        transport = Transport(comm.Dup(), comm.Dup(), poll_s=opts.poll_s)
    polite_barrier(comm, opts.poll_s)  # every stage loaded before the clock starts
    limits = Limits(n_batch=n_batch, n_embd=plan.info.n_embd, n_vocab=_vocab_bound(opts.model, plan.info),
                    n_seq_max=n_seq_max, n_ctx=opts.n_ctx)
    return _Stage(topo, engine, cfg, exact_per_rank, n_part, n_seq_max, transport, limits)


def _load_engine(opts: RunOptions, topo: Topology, n_threads: int, n_threads_batch: int, n_batch: int,
                 n_seq_max: int):
    """This rank's StageEngine (on several ranks, over its stage file) and its exact batch limit (kernels.py)."""
    from ..engine.kernels import exact_batch_limit
    from ..engine.stage import StageEngine  # imports llama_cpp: after the cheap checks
    my = topo.my_range
    if topo.n_ranks == 1:
        path, embd_input = opts.model, False
    else:
        path, embd_input = ensure_stage_file(opts.model, my.start, my.end, with_vocab=topo.is_last), True
    engine = StageEngine(path, n_ctx=opts.n_ctx, n_batch=n_batch, n_seq_max=n_seq_max,
                         n_threads=n_threads, n_threads_batch=n_threads_batch,
                         embd_input=embd_input, capture_hidden=not topo.is_last, kernels=opts.kernels)
    exact = None if opts.kernels == "fast" else exact_batch_limit(engine, path, opts.kernels, n_threads, n_threads_batch)
    return engine, exact


def _resolve_gen(opts: RunOptions, comm, engine, n_batch: int, exact_per_rank: list[int | None]) -> GenConfig:
    """The generation settings the pipeline runs: draft max, n_batch, n_ctx, p_recovery, and with --micro-batch
    auto every stage's decode costs (stage_costs: every rank times its stage in turn)."""
    cfg = opts.gen
    cfg = replace(cfg, cut=replace(cfg.cut, n_max=_draft_max(cfg, exact_per_rank)), n_batch=n_batch, n_ctx=opts.n_ctx,
                  p_recovery=auto_p_recovery(comm.Get_size()) if cfg.p_recovery is None else cfg.p_recovery)
    if cfg.mode == "pipeinfer" and cfg.adaptive_draft and cfg.cut.n_max > 1:
        cfg = replace(cfg, stage_ms=stage_costs(comm, engine, cfg.cut.n_max, opts.poll_s))
    return cfg


def _serve_stage(opts: RunOptions, ranks: _Ranks, stage: _Stage) -> None:
    """A stage rank: serve the pipeline until the head shuts it down, then report to rank 0 (HeadSession.close)."""
    from .worker import StageWorker
    comm = ranks.comm
    stats = StageWorker(stage.topo, stage.engine, stage.transport, stage.limits).serve()
    polite_barrier(comm, opts.poll_s)
    comm.gather(vars(stats), root=0)
    comm.gather(_peak_rss_mb(), root=0)
    ranks.live.close()
    stage.engine.close()


def _open_head(opts: RunOptions, ranks: _Ranks, plan: _LayerPlan, stage: _Stage) -> HeadSession:
    """Rank 0: the pipeline over every stage, the partitions, the drafter and the tokenizer, as a HeadSession."""
    from ..engine.stage import TokenEmbedder
    from ..engine.tokenizer import Tokenizer
    from .pipeline import Pipeline
    cfg = stage.cfg
    embedder = TokenEmbedder(opts.model) if stage.topo.n_ranks > 1 else None
    pipe = Pipeline(stage.topo, stage.engine, embedder=embedder, transport=stage.transport, limits=stage.limits)
    pool = None
    if cfg.mode != "iterative":
        pool = PartitionPool(stage.n_part, cfg.cut.max_branches, stage.n_seq_max, lane_count(opts.parallel))
    drafter_for, beside = _head_drafter(opts, ranks, plan, stage)
    tok = Tokenizer(opts.model)
    eos = set() if not cfg.stop_at_eos else {t for t in tok.eos}
    if ranks.live is not None:
        ranks.live.in_flight = lambda: len(pipe.in_flight)
    return HeadSession(opts, cfg, ranks.comm, stage.engine, stage.transport, pipe, pool, drafter_for, tok, eos,
                       plan.ranges, stage.exact_per_rank, stage.n_seq_max, plan.probe_ms, ranks.live, beside)


def _head_drafter(opts: RunOptions, ranks: _Ranks, plan: _LayerPlan, stage: _Stage):
    """The head's drafter_for (None in iterative mode) and the drafter beside the pipeline (--draft-at thread
    or rank; else None)."""
    n_vocab = stage.limits.n_vocab
    if opts.draft_at == "rank":
        from ..core.protocol import Tag
        from ..drafters.draftahead import DraftClient, MpiEnd
        from ..wire.transport import Transport
        draft_comm = ranks.draft_comm
        end = MpiEnd(Transport(draft_comm, draft_comm, opts.poll_s), draft_comm.Get_size() - 1, Tag.DRAFT_CTRL,
                     Tag.PROPOSAL)
        beside = DraftClient(end, opts.n_ctx, n_vocab, opts.poll_s)
        return _begin_each(beside), beside
    if stage.cfg.mode == "iterative":
        return None, None
    n_dft = draft_thread_count(opts, plan.threads[0], stage.topo.n_ranks)
    drafter_for = make_drafter(draft_spec(opts, plan.info, n_dft, n_dft if opts.draft_threads else plan.threads_b[0]))
    if opts.draft_at != "thread":
        return drafter_for, None
    from ..drafters.draftahead import ThreadDrafter
    beside = ThreadDrafter(drafter_for, opts.n_ctx, n_vocab, opts.poll_s)
    return _begin_each(beside.client), beside


def _begin_each(client):
    """drafter_for of a drafter beside the pipeline: each generation begins on it (prompt, text, chat)."""
    def begin(prompt, text, chat):
        client.begin(prompt, text or "", chat)
        return client
    return begin


def draft_thread_count(opts: RunOptions, threads_rank0: int, n_world: int) -> int:
    """--draft-threads, else rank 0's threads beside its stage (head, thread), or the cores shared by the ranks
    on its own rank (the target's default: cores / ranks)."""
    if opts.draft_threads:
        return opts.draft_threads
    return threads_rank0 if opts.draft_at != "rank" else max(1, (os.cpu_count() or 2) // n_world)


def serve_draft_rank(opts: RunOptions, draft_comm, n_world: int) -> None:
    """The draft rank (--draft-at rank): load the draft, then draft ahead for the head until it ends the session."""
    from ..core.protocol import Tag
    from ..drafters.draftahead import DraftService, MpiEnd, lower_priority
    lower_priority()  # this thread: the draft's decodes; the liveness thread keeps its priority
    info = read_info(opts.model)  # the target's vocabulary: token ids, and a translating drafter's tokenizer
    drafter_for = None
    if opts.gen.mode != "iterative":
        n = draft_thread_count(opts, 0, n_world)
        drafter_for = make_drafter(draft_spec(opts, info, n, n))
    from ..wire.transport import Transport
    end = MpiEnd(Transport(draft_comm, draft_comm, opts.poll_s), 0, Tag.PROPOSAL, Tag.DRAFT_CTRL)
    DraftService(drafter_for, end, opts.n_ctx, _vocab_bound(opts.model, info)).serve()
    end.flush()


def _vocab_bound(model: str, info) -> int:
    """Token ids on the wire are below this: the vocabulary, or the embedding/output rows when padded beyond it."""
    from ..engine.ggufheader import read_header
    rows = [t.shape[1] for name, t in read_header(model).tensors.items()
            if name in ("token_embd.weight", "output.weight") and len(t.shape) == 2]
    return max([info.n_vocab, *rows]) or 2**31 - 1


def _agree(comm, live, mine, what: str) -> None:
    """Every rank's value equals rank 0's, or a UserError naming the first rank (and host) that differs."""
    from .handshake import first_disagreement
    msg = first_disagreement(comm.allgather(mine), what, live.who)
    if msg:
        raise UserError(msg)


def _draft_max(cfg: GenConfig, exact_per_rank: list[int | None]) -> int | None:
    """The run's draft tokens per micro-batch: --draft-max, or the largest that keeps every stage's
    verification batches within its exact batch limit (kernels.py); None in iterative mode."""
    if cfg.mode == "iterative":
        return cfg.cut.n_max
    known = [x for x in exact_per_rank if x is not None]
    if not known:  # --kernels fast: no limit, no exactness
        return cfg.cut.n_max or DEFAULT_DRAFT_MAX
    limit = min(known)
    try:
        return resolve_draft_max(cfg.cut.n_max, limit, lead=cfg.mode == "speculative")
    except ValueError as e:
        raise UserError(f"{e} [limit measured on rank {exact_per_rank.index(limit)}]") from None


def stage_costs(comm, engine, up_to: int, poll_s: float) -> tuple[tuple[float, ...], ...]:
    """Every rank's decode time (ms) for 1..up_to tokens, rank 0 first; the ranks take turns, so the timings
    do not compete for cores (--micro-batch auto sizes PipeInfer's micro-batches by them)."""
    from ..engine.kernels import time_decodes
    mine = None
    for r in range(comm.Get_size()):
        polite_barrier(comm, poll_s)
        if r == comm.Get_rank():
            mine = tuple(round(x, 3) for x in time_decodes(engine, list(range(1, up_to + 1))))
    return tuple(comm.allgather(mine))


def auto_split(comm, model: str, info, n_threads: int, n_threads_batch: int) -> list[float]:
    """--layer-split auto: each rank times the same probe layers in turn; returns every rank's ms per layer
    (split_from_speeds turns them into speeds for plan_layers)."""
    import time

    import numpy as np

    from ..core.protocol import Batch, kv_ops, rm
    from ..engine.stage import StageEngine
    n_probe = max(1, info.n_layer // comm.Get_size())
    probe = ensure_stage_file(model, 0, n_probe, with_vocab=False)
    eng = StageEngine(probe, n_ctx=256, n_batch=32, n_seq_max=1, n_threads=n_threads, n_threads_batch=n_threads_batch,
                      embd_input=True, capture_hidden=True)
    rng = np.random.default_rng(0)
    ms = []
    for r in range(comm.Get_size()):  # one rank at a time: the probes must not compete for cores
        polite_barrier(comm)
        if r == comm.Get_rank():
            for n in (1, 8):  # single-token and micro-batch decodes; the fastest of 6 (robust to noise)
                b = Batch.chain(np.zeros(n, np.int32), 0)
                best = float("inf")
                for _ in range(6):
                    t0 = time.perf_counter()
                    eng.decode(b, rng.standard_normal((n, eng.n_embd), dtype=np.float32))
                    best = min(best, (time.perf_counter() - t0) * 1e3)
                    eng.apply_kv_ops(kv_ops(rm(0)))
                ms.append(best)
    eng.close()
    polite_barrier(comm)
    mine = sum(ms) / n_probe if ms else 0.0
    all_ms = comm.allgather(mine)
    if comm.Get_rank() == 0:
        log("[pipeinfer] --layer-split auto: ms per probe layer " + ", ".join(f"{t:.2f}" for t in all_ms)
            + " (the split balances the stages' times at these speeds, the output projection counted)")
    return all_ms


def draft_spec(opts: RunOptions, info, n_threads: int, n_threads_batch: int) -> DraftSpec:
    """What spec/factory.make_drafter needs from the run's options (info: the target's GGUF summary)."""
    return DraftSpec(opts.model, opts.draft, kind=opts.drafter, vocab=opts.draft_vocab, mode=opts.gen.mode,
                     n_ctx=opts.n_ctx, max_branches=opts.gen.cut.max_branches, n_threads=n_threads,
                     n_threads_batch=n_threads_batch, kernels=opts.kernels, head_tokens=opts.draft_head,
                     n_vocab=info.n_vocab, replay_ref=opts.replay_ref, replay_accuracy=opts.replay_accuracy,
                     seed=opts.gen.sampling.seed)


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)
