"""Start-up of one generation on every rank: topology, stage files, engines, transport; then head or worker.

open_session runs the steps in order: agree on protocol and build (liveness starts), split off the draft
rank, agree on the model, plan threads and layers, load the stage, then serve as a stage or open the head
(the pipeline and the drafter, drafters/factory.py).

Everything here runs once; per-token work happens in head.py / worker.py. Start-up data may be
pickled (allgather of versions and stage statistics); nothing per token is.
"""
from __future__ import annotations

import os
import sys
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Callable

from ..core.config import NGRAM_LEVEL, Config, Resolved, ServingOptions, StageOptions
from ..core import cpus
from ..core.errors import UserError
from ..core.kvplan import PartitionPool, in_flight_limit, lane_count, lane_seq_max, plan_partitions
from ..core.protocol import PROTOCOL_VERSION, Limits, kv_ops, rm
from ..core.recurrent import check_recurrent_config, has_recurrent_state, layer_kinds, seqs_per_run, stage_ok
from ..core.topology import (
    Groups,
    LayerRange,
    Topology,
    group_sizes,
    parse_per_rank_ints,
    plan_layers,
    split_from_speeds,
    stage_speeds,
)
from ..engine.kernels import DEFAULT_DRAFT_MAX, exact_table, record_exact, resolve_draft_max
from ..wire.launcher import mpi_library, world_size_mismatch
from ..wire.slurm import srun_world_mismatch
from ..engine.stagefile import (
    StageFileError,
    check_splittable,
    ensure_stage_file,
    layer_costs,
    range_check,
    read_info,
    vocab_bound,
)
from ..wire.transport import polite_barrier
from .group import lead_group, leader_values, serve_group_member
from .handshake import build_id
from ..decide.genconfig import GenConfig, auto_p_recovery, gen_config, runs_as_iterative
from .draft_rank import draft_thread_count, drafter_of, serve_draft_rank
from ..decide.batching import cost_sizes, default_parallel
from .session import HeadSession, RunResult, peak_rss_mb

if TYPE_CHECKING:
    from mpi4py import MPI

    from ..engine.stage import StageEngine
    from ..engine.stagefile import ModelInfo
    from ..wire.liveness import Liveness
    from ..wire.transport import Transport


def run(config: Config, prompt: list[int] | Callable[[], list[int]] | None = None, comm=None,
        **request) -> RunResult | None:
    """Run one generation of `prompt` (rank 0; keyword arguments as HeadSession.request); returns the result on
    rank 0 and None on the other ranks. prompt: the tokens, or a function that gives them once the stages are loaded
    (rank 0's command line tokenizes while the ranks start; its UserError ends the job before anything is
    generated)."""
    session = open_session(config, comm)
    if session is None:
        return None  # a stage rank: it served the pipeline until the head shut it down
    if callable(prompt):
        prompt = prompt()
    try:
        stats = session.generate(prompt, **request)
    finally:
        stats_per_rank, rss = session.close()
    stats.stage_stats = stats_per_rank
    return RunResult(session.last_tokens, stats, session.ranges, rss, session.probe_ms, session.resolved.p_recovery,
                     session.threads)


def open_session(config: Config, comm=None) -> HeadSession | None:
    """Load every rank's stage. Rank 0 gets a HeadSession (with what start-up resolved of the options left to it,
    Resolved, and the head's GenConfig made of it); the other ranks serve the pipeline until the head shuts it down,
    and get None."""
    ranks = _join(config, comm)                 # one protocol and build; liveness; the draft rank split off
    config = _rank0_files(config, ranks)        # rank 0's model and draft; a draft rank's travel to it (weights.py)
    if ranks.is_draft:
        serve_draft_rank(config, ranks.draft_comm, ranks.cores)
        ranks.live.close()
        return None
    if ranks.comm is None:  # a tensor group's member: its leader tells it what to load, then it mirrors the leader
        serve_group_member(config, ranks.group, ranks.cores, ranks.target_rank, sum(ranks.groups.sizes))
        ranks.live.close()
        return None
    several = ranks.comm.Get_size() > 1 or ranks.groups is not None  # the head embeds tokens for the first stage
    inputs = _head_inputs_soon(config.model, several) if ranks.comm.Get_rank() == 0 else None
    info = _agree_model(config, ranks)          # one target file on every stage
    if has_recurrent_state(info.arch) and config.stage.cache_prompt:  # no prompt cache for recurrent states
        if "cache_prompt" in config.set_by_user and ranks.comm.Get_rank() == 0:
            log(f"[pipeinfer] --cache-prompt off: {info.arch} keeps a recurrent state, which exists only at the end of "
                f"a cached prompt, not at every prefix a later prompt shares (core/recurrent.py)")
        config = config.with_options(cache_prompt="off")
    plan = _split_layers(config, ranks, info)   # threads and layers per rank
    stage = _load_stage(config, ranks.comm, plan, resolved_parallel(config, len(plan.ranges)), ranks.group)
    if ranks.comm.Get_rank() != 0:
        _serve_stage(config, ranks, stage)
        return None
    return _open_head(config, ranks, plan, stage, inputs.result())


# ---- the start-up steps, in open_session's order; every rank makes the same collective calls in each
@dataclass
class _Ranks:
    """Where this rank stands once every rank runs the same protocol and build (_join)."""
    world: MPI.Comm               # every rank started
    comm: MPI.Comm                # the target's stages: the world, less the draft rank with --draft-at rank
    cores: int                    # this rank's threads when -t does not say (core/cpus.default_threads)
    draft_comm: MPI.Comm | None = None  # --draft-at rank: a duplicate of the world, the head's link to the draft rank
    live: Liveness | None = None  # several ranks
    is_draft: bool = False        # this rank is the draft rank
    groups: Groups | None = None  # --tensor-parallel / --groups: which target ranks form each stage's group
    group: MPI.Comm | None = None  # this rank's tensor group (its stage's ranks, the leader first), in a group
    target_rank: int = 0          # this rank among the target's ranks (the draft rank left out)


@dataclass
class _LayerPlan:
    """Every rank's threads and layers, agreed by all (_split_layers)."""
    info: ModelInfo               # the target's GGUF summary (stagefile.read_info)
    threads: list[int]            # --threads, one per rank
    threads_b: list[int]          # --threads-batch, one per rank
    ranges: list[LayerRange]
    probe_ms: list[float] | None  # --layer-split auto's measurements, one per rank


@dataclass
class _Stage:
    """This rank's loaded stage and the settings resolved on it (_load_stage)."""
    topo: Topology
    engine: StageEngine
    resolved: Resolved            # what start-up decided of the options left to it, the same on every stage
    cfg: GenConfig                # the head's parameters: the options, `resolved` in place of their Nones
    exact_per_rank: list[int | None]
    n_part: int                   # KV partitions for speculative runs (kvplan.py)
    n_seq_max: int
    transport: Transport | None   # None on one rank
    limits: Limits


def _join(config: Config, comm) -> _Ranks:
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
        live = Liveness(world, config.wire.stall_timeout)
        _agree(world, live, build_id(), "runs another build")
    cores = _host_threads(world)
    if config.draft.at != "rank":
        return _with_groups(config, _Ranks(world, world, cores, live=live))
    # the world's last rank drafts; the others are the target's stages
    if world.Get_size() < 2:
        raise UserError("--draft-at rank needs a rank of its own for the draft: start one more rank than the "
                        "target's stages (mpiexec -n N+1)")
    is_draft = world.Get_rank() == world.Get_size() - 1
    stages = world.Split(1 if is_draft else 0, world.Get_rank())
    ranks = _Ranks(world, stages, cores, draft_comm=world.Dup(), live=live, is_draft=is_draft)
    return ranks if is_draft else _with_groups(config, ranks)


def _with_groups(config: Config, ranks: _Ranks) -> _Ranks:
    """With tensor groups, `comm` becomes the stages' leaders (None on a member) and `group` this rank's group
    (collective over the target's ranks)."""
    stage = config.stage
    if not stage.groups and stage.tensor_parallel == 1:
        return ranks
    try:
        groups = Groups(tuple(group_sizes(stage.groups, stage.tensor_parallel, ranks.comm.Get_size())))
    except ValueError as e:
        raise UserError(str(e)) from None
    rank = ranks.comm.Get_rank()
    group = ranks.comm.Split(groups.stage_of(rank), rank)
    leader = rank in groups.leaders
    leaders = ranks.comm.Split(0 if leader else 1, rank)
    return replace(ranks, comm=leaders if leader else None, groups=groups, group=group, target_rank=rank)


def _host_threads(world) -> int:
    """This rank's default threads (core/cpus.default_threads), collective over the world: the ranks that share
    memory with this one (MPI's COMM_TYPE_SHARED: its host) exchange the CPU sets they may run on."""
    from mpi4py import MPI
    mine = cpus.affinity()
    host = world.Split_type(MPI.COMM_TYPE_SHARED)
    try:
        return cpus.default_threads(mine, host.allgather(mine), host.Get_rank(), os.environ)
    finally:
        host.Free()


def resolved_parallel(config: Config, n_stages: int) -> int:
    """Generations at once: --parallel, else per stage (scheduler.default_parallel: more when rows of several share a
    decode); the synchronous speculative baseline runs one at a time."""
    if config.mode == "speculative":
        return 1
    serving = config.serving
    return serving.parallel or default_parallel(n_stages, batching=serving.batch_rows != 1)


def check_world_size(world_size: int, library_version: str) -> None:
    """Every rank, first: MPI's world is the job the launcher started. A launcher of another MPI than the library
    mpi4py loads starts N processes that each see a world of one: N separate jobs would each generate the text; so
    does srun with a PMI plugin the library does not speak (wire/slurm.py)."""
    library = mpi_library(library_version)[1]
    msg = srun_world_mismatch(world_size, library, os.environ) or world_size_mismatch(world_size, library, os.environ)
    if msg:
        raise UserError(msg)


def _agree_model(config: Config, ranks: _Ranks):
    """The target's GGUF summary, read on rank 0 (the only host that must have the file: a rank whose host lacks it,
    or has another file at that path, gets its stage file from rank 0, ranks/weights.py); a draft model checked
    before any model loads."""
    def read():
        info = read_info(config.model)
        draft_arch = None
        if config.draft.model and config.mode != "iterative":
            # a missing, foreign or truncated draft fails here, before any model loads
            draft_arch = read_info(config.draft.model).arch
            for level in config.draft.below:  # drafts of drafts: every level's file, before any model loads
                if level != NGRAM_LEVEL:
                    read_info(level)
        try:
            check_recurrent_config(info.arch, config.mode, config.speculation.max_branches, draft_arch)
        except UserError as e:
            raise StageFileError(str(e)) from None  # every rank reports it (below)
        if drafts_with_mtp(config):
            from ..engine.mtp import mtp_refusal
            why = mtp_refusal(config.model) or (None if ranks.comm.Get_size() > 1 else
                                                "the MTP head runs on the last stage, beside the head's: give 2 or "
                                                "more ranks")
            if why:
                raise StageFileError(f"--drafter mtp: {why}")
        return info
    if ranks.comm.Get_size() == 1:
        return read()
    try:
        got = (read(), None) if ranks.comm.Get_rank() == 0 else None
    except StageFileError as e:
        got = (None, str(e))
    info, err = ranks.comm.bcast(got, root=0)
    if err:
        raise StageFileError(err)
    return info


def _rank0_files(config: Config, ranks: _Ranks) -> Config:
    """Every rank takes rank 0's model and draft (a host without the model resolves the options without it), and with
    --draft-at rank the draft rank gets the draft model, and the target's vocabulary, from rank 0 when its host lacks
    them (ranks/weights.py)."""
    world = ranks.world
    if world.Get_size() == 1:
        return config
    draft = config.draft
    model, *rank0_draft = world.bcast((config.model, draft.model, draft.below, draft.drafter, draft.at), root=0)
    draft = replace(draft, **dict(zip(("model", "below", "drafter", "at"), rank0_draft)))
    config = replace(config, model=model, draft=draft)
    if draft.at != "rank":
        return config
    from . import weights
    from ..engine.stagefile import STAGE_FORMAT

    def obtain(src: str, want: tuple, fmt: int, what: str) -> str:  # collective: every rank of the world calls it
        got = weights.obtain(world, src, want if ranks.is_draft else None, config.wire.poll_s, fmt=fmt, what=what)
        return str(got or weights.local_view(src))
    model = obtain(config.model, ("vocab",), STAGE_FORMAT, "vocabulary")
    if draft.model and config.mode != "iterative":
        draft = replace(draft, model=obtain(draft.model, ("whole",), 0, "draft model"),
                        below=tuple(level if level == NGRAM_LEVEL else obtain(level, ("whole",), 0, "draft model")
                                    for level in draft.below))
    return replace(config, model=model, draft=draft) if ranks.is_draft else config


def _stage_file(config: Config, comm, start: int, end: int, with_vocab: bool):
    """This rank's stage file for layers [start, end): written from its host's copy of the model, or, when its host
    lacks it, received from rank 0 into the host's weights cache (collective over comm). Rank 0, whose host always
    has the model, writes its own in a thread while it sends the other hosts theirs (a re-form's new ranges: the
    write is disk work the transfer need not wait for)."""
    from concurrent.futures import ThreadPoolExecutor

    from ..engine.stagefile import STAGE_FORMAT
    from . import weights
    mine = weights.local_view(config.model)
    if comm.Get_size() == 1:
        return ensure_stage_file(mine, start, end, with_vocab=with_vocab)
    if comm.Get_rank() == 0:
        with ThreadPoolExecutor(1, thread_name_prefix="pipeinfer-stage-file") as pool:
            own = pool.submit(ensure_stage_file, mine, start, end, with_vocab)
            weights.obtain(comm, config.model, ("stage", start, end, with_vocab), config.wire.poll_s,
                           fmt=STAGE_FORMAT)
            return own.result()
    got = weights.obtain(comm, config.model, ("stage", start, end, with_vocab), config.wire.poll_s, fmt=STAGE_FORMAT)
    return got if got is not None else ensure_stage_file(mine, start, end, with_vocab=with_vocab)


def _split_layers(config: Config, ranks: _Ranks, info) -> _LayerPlan:
    """Every rank's threads and layer range (--layer-split auto times each rank in turn), agreed by all."""
    comm, stage = ranks.comm, config.stage
    rank, size = comm.Get_rank(), comm.Get_size()
    try:
        check_splittable(info, size)
        cores = comm.allgather(ranks.cores)
        if ranks.groups is None:
            threads = parse_per_rank_ints(stage.threads, size, "--threads", default=cores)
            threads_b = parse_per_rank_ints(stage.threads_batch, size, "--threads-batch", default=threads[rank])
        else:  # one value per target rank, members too: the leaders' are the stages'
            threads = leader_values(stage.threads, ranks.groups, cores)
            threads_b = [b or t for b, t in zip(leader_values(stage.threads_batch, ranks.groups, None), threads)]
        probe_ms = None
        if stage.layer_split is not None and stage.layer_split.strip() == "auto" and size > 1:
            kinds = None  # a hybrid's probe holds a layer of each kind, as every stage must (core/recurrent.py)
            if has_recurrent_state(info.arch):
                kinds = comm.bcast(model_layer_kinds(config.model) if rank == 0 else None, root=0)
            probe_ms = auto_split(comm, info, threads[rank], threads_b[rank],
                                  stage_file=lambda a, b, v: _stage_file(config, comm, a, b, v), kinds=kinds)
        layer_cost, tail_cost = comm.bcast(layer_costs(config.model) if rank == 0 else None, root=0)
        # the architecture's rules on where a stage may start and end (stagefile.RangeCheck), from rank 0's header:
        # the balanced split keeps to them, a split that breaks one ends the job here, on every rank, in one line
        check = comm.bcast(range_check(config.model) if rank == 0 and size > 1 else None, root=0)
        ranges = plan_layers(stage.layer_split, info.n_layer, size, layer_cost, tail_cost,
                             speeds=stage_speeds(split_from_speeds(probe_ms) if probe_ms else None, ranks.groups),
                             allowed=(lambda a, b: check.refusal(a, b) is None) if check else None)
        refused = next(filter(None, (check.refusal(r.start, r.end) for r in ranges)), None) if check else None
        if refused:
            raise StageFileError(refused)
    except ValueError as e:
        raise UserError(str(e)) from None
    if any(r.n_layers == 0 for r in ranges):
        raise UserError("every rank needs at least one layer: a fraction of 0 in --layer-split is not supported")
    if ranks.live is not None:
        _agree(comm, ranks.live, ",".join(str(r) for r in ranges), "computed another layer plan")
    return _LayerPlan(info, threads, threads_b, ranges, probe_ms)


def _load_stage(config: Config, comm, plan: _LayerPlan, parallel: int, group=None) -> _Stage:
    """This rank's stage engine, what start-up resolves on every stage (Resolved, and the head's GenConfig made of
    it), the links between them. parallel: generations at once, resolved (resolved_parallel). group: the stage's
    tensor group, this rank its leader (ranks/group.py), or None."""
    rank, size = comm.Get_rank(), comm.Get_size()
    topo = Topology(rank, size, tuple(plan.ranges))
    stage, spec, poll_s = config.stage, config.speculation, config.wire.poll_s
    n_lanes = lane_count(parallel, stage.cache_prompt)
    # a target with recurrent layers keeps each drafted token's state in a sequence of its own (core/recurrent.py):
    # its partitions hold draft_max sequences, which the exact batch limit does not bound (each token decodes alone)
    state_per_token = config.mode != "iterative" and has_recurrent_state(plan.info.arch)
    if config.mode == "iterative":
        n_part, n_seq_max = 0, lane_seq_max(0, 1, n_lanes)
    else:
        size_run = seqs_per_run(state_per_token, spec.max_branches, spec.draft_max or DEFAULT_DRAFT_MAX)
        n_part, n_seq_max = plan_partitions(size_run, in_flight_limit(spec.max_in_flight, size), n_lanes=n_lanes)
    n_batch = min(stage.n_batch, stage.n_ctx)
    my = topo.my_range
    # rank 0's host's table of kernel keys: a stage like one measured before takes its exact batch limit (kernels.py)
    known = comm.bcast(exact_table() if rank == 0 and stage.kernels != "fast" else None, root=0)
    if group is not None:
        engine = lead_group(config, group, topo, plan.threads[rank], plan.threads_b[rank], n_batch, n_seq_max)
        exact, key = _exact(stage, engine, engine.path, plan.threads[rank], plan.threads_b[rank], known)
    else:
        path = _stage_file(config, comm, my.start, my.end, topo.is_last) if size > 1 else None
        engine, exact, key = _load_engine(stage, topo, config.model if size == 1 else path, plan.threads[rank],
                                          plan.threads_b[rank], n_batch, n_seq_max, known=known,
                                          capture_states=topo.is_last and drafts_with_mtp(config))
    if engine.recurrent != has_recurrent_state(plan.info.arch):
        raise RuntimeError(f"internal: llama.cpp {'keeps' if engine.recurrent else 'keeps no'} recurrent states for "
                           f"{plan.info.arch}, core/recurrent.py's tables say otherwise")
    polite_barrier(comm, poll_s)  # ranks finish loading at different times: the early ones wait without spinning
    exact_per_rank, keys = zip(*comm.allgather((exact, key)))
    exact_per_rank = list(exact_per_rank)
    if rank == 0 and size > 1 and exact is not None:
        record_exact({k: e for e, k in zip(exact_per_rank, keys) if k})  # what the next job's ranks may take
    resolved = _resolve(config, comm, engine, exact_per_rank, parallel=parallel, n_batch=n_batch,
                        state_per_token=state_per_token)
    transport = None
    if size > 1:
        from ..wire.transport import Transport
        transport = Transport(comm.Dup(), comm.Dup(), poll_s=poll_s)
    polite_barrier(comm, poll_s)  # every stage loaded before the clock starts
    n_vocab = comm.bcast(vocab_bound(config.model, plan.info) if rank == 0 else None, root=0)
    limits = Limits(n_batch=n_batch, n_embd=plan.info.n_embd, n_vocab=n_vocab,
                    n_seq_max=n_seq_max, n_ctx=stage.n_ctx)
    return _Stage(topo, engine, resolved, _head_mode(gen_config(config, resolved), size, config.draft.at),
                  exact_per_rank, n_part, n_seq_max, transport,
                  limits)


def _head_mode(cfg: GenConfig, n_stages: int, draft_at: str) -> GenConfig:
    """The head's GenConfig: --mode pipeinfer as iterative where genconfig.runs_as_iterative says (said on rank 0),
    without loading a draft."""
    if not runs_as_iterative(cfg.mode, n_stages, draft_at):
        return cfg
    log("[pipeinfer] one pipeline stage: PipeInfer has no stage to keep busy beside a run, so it runs as iterative "
        "(no draft loaded); --mode speculative verifies drafts on one stage")
    return replace(cfg, mode="iterative")


def drafts_with_mtp(config: Config) -> bool:
    """Whether the target's own MTP head drafts (--drafter mtp): the last stage then feeds it (engine/mtp.py)."""
    return config.mode != "iterative" and config.draft.drafter == "mtp"


def _load_engine(stage: StageOptions, topo: Topology, path: str, n_threads: int, n_threads_batch: int, n_batch: int,
                 n_seq_max: int, known: dict | None = None, capture_states: bool = False):
    """This rank's StageEngine over `path` (on one rank, the model; on several, its stage file: _stage_file's), its
    exact batch limit and the kernel key of that limit (kernels.py; None, None with --kernels fast). capture_states:
    the last stage keeps each output row's state for the MTP head."""
    from ..engine.stage import StageEngine  # imports llama_cpp: after the cheap checks
    embd_input = topo.n_ranks > 1
    engine = StageEngine(path, n_ctx=stage.n_ctx, n_batch=n_batch, n_seq_max=n_seq_max,
                         n_threads=n_threads, n_threads_batch=n_threads_batch,
                         embd_input=embd_input, capture_hidden=not topo.is_last, kernels=stage.kernels,
                         capture_states=capture_states)
    return (engine, *_exact(stage, engine, path, n_threads, n_threads_batch, known))


def _exact(stage: StageOptions, engine, path: str, n_threads: int, n_threads_batch: int, known: dict | None):
    """(the engine's exact batch limit, the kernel key of that limit) (kernels.py; None, None with --kernels fast)."""
    from ..engine.kernels import exact_batch_limit, kernel_key
    if stage.kernels == "fast":
        return None, None
    exact = exact_batch_limit(engine, path, stage.kernels, n_threads, n_threads_batch, known)
    return exact, kernel_key(path, stage.kernels, n_threads, n_threads_batch, engine.embd_input, engine.capture_hidden)


def _resolve(config: Config, comm, engine, exact_per_rank: list[int | None], *, parallel: int, n_batch: int,
             state_per_token: bool) -> Resolved:
    """What start-up decides of the options left to it, the same on every stage: p_recovery by the stages, the
    draft max and batch rows within the exact batch limits, and with --micro-batch auto every stage's decode costs
    (stage_costs: every rank times its stage in turn)."""
    spec = config.speculation
    batch_rows = _batch_rows(config.serving, exact_per_rank)
    # per-token states: every drafted token decodes alone, so the exact batch limit does not bound a micro-batch
    draft_max = (spec.draft_max or DEFAULT_DRAFT_MAX) if state_per_token else \
        _draft_max(config.mode, spec.draft_max, exact_per_rank)
    stage_ms = None
    if config.mode == "pipeinfer" and spec.adaptive_draft and draft_max > 1:
        sizes = cost_sizes(draft_max, batch_rows, parallel, comm.Get_size())
        stage_ms = stage_costs(comm, engine, draft_max, sizes, config.wire.poll_s)
    return Resolved(parallel=parallel, n_batch=n_batch, prompt_chunk=min(config.stage.prompt_chunk, n_batch),
                    p_recovery=auto_p_recovery(comm.Get_size()) if spec.p_recovery is None else spec.p_recovery,
                    draft_max=draft_max, batch_rows=batch_rows, state_per_token=state_per_token, stage_ms=stage_ms)


def _mtp_feeder(config: Config, stage: _Stage):
    """The last stage's MTP head, on the MTP part of its host's copy of the target (engine/mtp.py)."""
    from ..engine.mtp import MtpFeeder, MtpHead, ensure_mtp_file
    from ..wire.hosts import host_name
    from . import weights
    mine = weights.local_view(config.model)
    if not mine.is_file():
        raise UserError(f"--drafter mtp: the MTP head runs on the last rank, whose host ({host_name()}) has no copy of "
                        f"{config.model}: copy the model there")
    try:
        return MtpFeeder(MtpHead(ensure_mtp_file(mine), n_ctx=config.stage.n_ctx, n_batch=stage.limits.n_batch,
                                 n_threads=stage.engine.n_threads))
    except RuntimeError as e:  # llama.cpp refused the MTP part: said in one line, the job ends on every rank
        raise UserError(f"--drafter mtp on the last rank ({host_name()}): {e}") from None


def _serve_stage(config: Config, ranks: _Ranks, stage: _Stage) -> None:
    """A stage rank: serve the pipeline until the head shuts it down, then report to rank 0 (HeadSession.close)."""
    from .worker import StageWorker
    comm, poll_s = ranks.comm, config.wire.poll_s
    mtp = _mtp_feeder(config, stage) if stage.topo.is_last and drafts_with_mtp(config) else None
    try:
        stats = StageWorker(stage.topo, stage.engine, stage.transport, stage.limits, mtp).serve()
    finally:
        if mtp is not None:
            mtp.close()
    polite_barrier(comm, poll_s)
    comm.gather(vars(stats), root=0)
    polite_barrier(comm, poll_s)  # rank 0 has taken every report this stage sent (HeadSession.close)
    comm.gather(peak_rss_mb(), root=0)
    stage.engine.close()  # a group's leader: its members stop
    ranks.live.close()


def _head_inputs_soon(model: str, several: bool):
    """Rank 0: a future of the head's tokenizer and token embedder (None on one rank: the stage takes tokens), loaded
    in a thread (0.3 s here, C code and a file mapping) while the stages load, not after them."""
    from concurrent.futures import ThreadPoolExecutor

    def load():
        from ..engine.stage import TokenEmbedder
        from ..engine.tokenizer import Tokenizer
        return Tokenizer(model), TokenEmbedder(model) if several else None
    pool = ThreadPoolExecutor(1, thread_name_prefix="pipeinfer-head-inputs")
    future = pool.submit(load)
    pool.shutdown(wait=False)
    return future


def _open_head(config: Config, ranks: _Ranks, plan: _LayerPlan, stage: _Stage, inputs) -> HeadSession:
    """Rank 0: the pipeline over every stage, the partitions, the drafter and the tokenizer, as a HeadSession.
    inputs: (the tokenizer, the token embedder or None), _head_inputs_soon's."""
    from .pipeline import Pipeline
    cfg = stage.cfg
    tok, embedder = inputs
    pipe = Pipeline(stage.topo, stage.engine, embedder=embedder, transport=stage.transport, limits=stage.limits)
    pool = None
    if cfg.mode != "iterative":
        pool = PartitionPool(stage.n_part, cfg.seqs_per_run, stage.n_seq_max,
                             lane_count(stage.resolved.parallel, cfg.cache_prompt))
    drafter_for, beside = _head_drafter(config, ranks, plan, stage)
    eos = set() if not cfg.stop_at_eos else {t for t in tok.eos}
    if ranks.live is not None:
        ranks.live.in_flight = lambda: len(pipe.in_flight)
    return HeadSession(config, stage.resolved, cfg, ranks.comm, stage.engine, stage.transport, pipe, pool, drafter_for,
                       tok, eos, plan.ranges, stage.exact_per_rank, stage.n_seq_max, plan.probe_ms, ranks.live, beside,
                       threads=list(plan.threads))


def _head_drafter(config: Config, ranks: _Ranks, plan: _LayerPlan, stage: _Stage):
    """The head's drafter_for (None in iterative mode) and the drafter beside the pipeline (--draft-at thread
    or rank; else None)."""
    n_vocab, n_ctx, poll_s = stage.limits.n_vocab, config.stage.n_ctx, config.wire.poll_s
    if config.draft.at == "rank":
        from ..core.protocol import Tag
        from ..drafters.draftahead import DraftClient, MpiEnd
        from ..wire.transport import Transport
        draft_comm = ranks.draft_comm
        end = MpiEnd(Transport(draft_comm, draft_comm, poll_s), draft_comm.Get_size() - 1, Tag.DRAFT_CTRL,
                     Tag.PROPOSAL)
        beside = DraftClient(end, n_ctx, n_vocab, poll_s)
        return _begin_each(beside), beside
    if stage.cfg.mode == "iterative":
        return None, None
    n_dft = draft_thread_count(config.draft, plan.threads[0], ranks.cores)
    drafter_for = drafter_of(config, n_vocab=plan.info.n_vocab, n_threads=n_dft,
                             n_threads_batch=n_dft if config.draft.threads else plan.threads_b[0])
    if config.draft.at != "thread":
        return drafter_for, None
    from ..drafters.draftahead import ThreadDrafter
    beside = ThreadDrafter(drafter_for, n_ctx, n_vocab, poll_s)
    return _begin_each(beside.client), beside


def _begin_each(client):
    """drafter_for of a drafter beside the pipeline: each generation begins on it (prompt, text, chat)."""
    def begin(prompt, text, chat):
        client.begin(prompt, text or "", chat)
        return client
    return begin


def _agree(comm, live, mine, what: str) -> None:
    """Every rank's value equals rank 0's, or a UserError naming the first rank (and host) that differs."""
    from .handshake import first_disagreement
    msg = first_disagreement(comm.allgather(mine), what, live.who)
    if msg:
        raise UserError(msg)


# --batch-rows auto with --kernels fast (no exactness to keep): 16 rows, from where llama.cpp's tiled matrix multiply
# costs about what 8 rows do (docs/benchmarks.md)
FAST_BATCH_ROWS = 16


def _smallest_limit(exact_per_rank: list[int | None]) -> int | None:
    """The smallest exact batch limit of the stages (None with --kernels fast, which measures none)."""
    known = [x for x in exact_per_rank if x is not None]
    return min(known) if known else None


def _batch_rows(serving: ServingOptions, exact_per_rank: list[int | None]) -> int:
    """Next tokens of different generations per decode: --batch-rows, or the smallest exact batch limit of the stages
    (kernels.py: their rows keep the bits they get alone); more than that only with --kernels fast."""
    limit, asked = _smallest_limit(exact_per_rank), serving.batch_rows
    if limit is None:  # --kernels fast: no limit, no exactness
        return asked or FAST_BATCH_ROWS
    if asked is None:
        return limit
    if asked > limit:
        raise UserError(f"--batch-rows {asked} is more than the exact batch limit of {limit} measured on "
                        f"rank {exact_per_rank.index(limit)}: rows of a larger decode would not keep the bits they get "
                        f"alone (--kernels fast allows it and gives exactness up; --kernels no-repack is exact to larger "
                        f"batches on some hosts)")
    return asked


def _draft_max(mode: str, asked: int | None, exact_per_rank: list[int | None]) -> int:
    """The run's draft tokens per micro-batch: --draft-max (`asked`), or the largest that keeps every stage's
    verification batches within its exact batch limit (kernels.py); in iterative mode, which drafts nothing,
    --draft-max or the default."""
    limit = _smallest_limit(exact_per_rank)
    if mode == "iterative" or limit is None:  # --kernels fast: no limit, no exactness
        return asked or DEFAULT_DRAFT_MAX
    try:
        return resolve_draft_max(asked, limit, lead=mode == "speculative")
    except ValueError as e:
        raise UserError(f"{e} [limit measured on rank {exact_per_rank.index(limit)}]") from None


def stage_costs(comm, engine, draft_max: int, up_to: int, poll_s: float) -> tuple[tuple[float, ...], ...]:
    """Every rank's decode time (ms) for 1..up_to tokens, rank 0 first: timed for 1..draft_max (a micro-batch's
    sizes) and every 4th size beyond (the sizes a ride may make: costs there are smooth), the rest interpolated
    (cost_curve); the ranks take turns, so the timings do not compete for cores (--micro-batch auto sizes
    PipeInfer's micro-batches, and the draft rows that ride others' decodes, by them)."""
    from ..engine.kernels import time_decodes
    sizes = cost_probe_sizes(draft_max, up_to)
    mine = None
    for r in range(comm.Get_size()):
        polite_barrier(comm, poll_s)
        if r == comm.Get_rank():
            mine = cost_curve(sizes, time_decodes(engine, sizes), up_to)
    return tuple(comm.allgather(mine))


def cost_probe_sizes(draft_max: int, up_to: int) -> list[int]:
    """The decode sizes stage_costs times: 1..draft_max, then every 4th, and up_to."""
    head = list(range(1, min(draft_max, up_to) + 1))
    return head + sorted(set(range(len(head) + 4, up_to + 1, 4)) | ({up_to} if up_to > len(head) else set()))


def cost_curve(sizes: list[int], ms: list[float], up_to: int) -> tuple[float, ...]:
    """ms for 1..up_to tokens from the sizes timed (linear between them)."""
    import numpy as np
    return tuple(round(float(x), 3) for x in np.interp(np.arange(1, up_to + 1), sizes, ms))


def auto_split(comm, info, n_threads: int, n_threads_batch: int, stage_file, kinds: list[str] | None = None) -> list[float]:
    """--layer-split auto: each rank times the same probe layers in turn; returns every rank's ms per layer
    (split_from_speeds turns them into speeds for plan_layers). kinds: a hybrid's layer kinds (the probe's layers
    then hold one of each, as every stage must: core/recurrent.py)."""
    import time

    import numpy as np

    from ..core.protocol import Batch
    from ..engine.stage import StageEngine
    n_probe = max(1, info.n_layer // comm.Get_size())
    while kinds is not None and n_probe < info.n_layer and not stage_ok(kinds, 0, n_probe):
        n_probe += 1
    probe = stage_file(0, n_probe, False)
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


def model_layer_kinds(path) -> list[str] | None:
    """Each layer's kind (core/recurrent.layer_kinds) from a GGUF's header: None for a model without recurrent
    layers or whose kinds are not known here."""
    from ..engine.ggufheader import read_header
    first = read_header(path)
    arch = first.fields["general.architecture"]
    arrays = tuple(k for k, (vtype, _, _) in first.spans.items() if vtype == 9 and k.startswith(f"{arch}."))
    fields = read_header(path, keep_arrays=arrays).fields if arrays else first.fields
    n_layer = int(fields[f"{arch}.block_count"]) - int(fields.get(f"{arch}.nextn_predict_layers", 0))
    return layer_kinds(arch, fields, n_layer)


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)
