"""The options of the commands that load the pipeline (`generate`, `serve`), as click declares them and as
typed values.

`PipelineArgs.of(kw)` takes click's keyword arguments once; `resolve_pipeline` turns them into a
`PipelineSetup`: the model files, the drafter and where it runs (`--draft-at auto` decided), and the head's
GenConfig, which the commands hand to ranks.startup as RunOptions.
"""
from __future__ import annotations

from dataclasses import dataclass, fields
from pathlib import Path

import click

from ..core.errors import UserError
from ..core.verify import SamplingParams
from ..engine.kernels import DEFAULT_DRAFT_MAX, DEFAULT_KERNELS, KERNELS
from ..ranks.head import MODES, GenConfig
from ..drafters.drafter import DRAFT_HEAD_AUTO, Cutoffs
from .guard import installed, mpi_size


def _draft_head(value: str) -> int | None:
    """--draft-head: 'auto' (DRAFT_HEAD_AUTO), 'full' (None: every token), or a number of tokens >= 256."""
    if value == "auto":
        return DRAFT_HEAD_AUTO
    if value == "full":
        return None
    if not value.isdigit() or int(value) < 256:
        raise click.BadParameter(f"{value!r} is not auto, full or a number of tokens >= 256")
    return int(value)


def _auto_or_float(value: str, param) -> float | None:
    """'auto' (None: start-up picks by the number of ranks) or a number >= 0."""
    if value == "auto":
        return None
    try:
        x = float(value)
    except ValueError:
        x = -1.0
    if not x >= 0:
        raise click.BadParameter(f"{value!r} is neither 'auto' nor a number >= 0", param=param)
    return x


# options of every command that loads the pipeline (generate, serve); one PipelineArgs field each
PIPELINE_OPTIONS = [
    click.option("-m", "--model", default=None, help="target GGUF path or registry name [default: qwen2.5-coder-1.5b]"),
    click.option("--mode", type=click.Choice(MODES), default="pipeinfer", show_default=True),
    click.option("--layer-split", default=None,
                 help="layers per rank: balanced (equal time per stage, by the weights a token reads in each layer and "
                      "in the output projection), even (equal layer counts), auto (balanced at each rank's measured "
                      "speed), or fractions, rank 0 first, e.g. 0.2,0.4,0.4 [default: balanced]"),
    click.option("-t", "--threads", default=None, help="threads per rank for single-token decodes: one value or a,b,c"),
    click.option("-tb", "--threads-batch", default=None, help="threads per rank for batch decodes [default: --threads]"),
    click.option("-c", "--ctx-size", default=4096, show_default=True, type=click.IntRange(16), help="KV cache size per stage"),
    click.option("-b", "--batch-size", default=512, show_default=True, type=click.IntRange(1), help="largest batch per decode"),
    click.option("--draft", default=None, help="draft GGUF (same vocabulary as the target)"),
    click.option("--drafter", type=click.Choice(["model", "ngram", "replay"]), default=None,
                 help="[default: model if --draft (on the default target: gemma3-270m when installed) else ngram]; "
                      "replay is a benchmark instrument (see README)"),
    click.option("--draft-vocab", type=click.Choice(["auto", "same", "translate"]), default="auto", show_default=True,
                 help="draft model vocabulary: same as the target (checked), or translate through text; auto picks"),
    click.option("--draft-at", type=click.Choice(["auto", "head", "thread", "rank"]), default="auto", show_default=True,
                 help="where the draft runs: head (in series with rank 0's stage), thread (beside it, in rank 0), rank "
                      "(an MPI rank of its own: the last; start one more rank than the target's stages); auto: thread "
                      "for a draft model in pipeinfer mode with -np 1, else head"),
    click.option("--draft-threads", default=None, type=click.IntRange(1),
                 help="threads of the draft model [default: rank 0's --threads; on its own rank: cores / ranks]"),
    click.option("--draft-head", default="auto", show_default=True, callback=lambda c, p, v: _draft_head(v),
                 help=f"tokens the draft model's output projection keeps, the most frequent first: a number, full, or auto "
                      f"({DRAFT_HEAD_AUTO:,}); the draft proposes only those, the output stays exact"),
    click.option("--draft-max", default=None, type=click.IntRange(1, 64),
                 help=f"max draft tokens per speculative micro-batch [default: up to {DEFAULT_DRAFT_MAX}, within the exact "
                      f"batch limit]"),
    click.option("--micro-batch", type=click.Choice(["auto", "fixed"]), default="auto", show_default=True,
                 help="PipeInfer's draft tokens per micro-batch: auto picks 1..--draft-max from the decode costs measured "
                      "at start-up and the running acceptance; fixed always asks for --draft-max"),
    click.option("-pa", "--p-accept", default=0.5, show_default=True, type=click.FloatRange(0, 1), help="draft confidence cutoff"),
    click.option("-ps", "--p-split", default=0.1, show_default=True, type=click.FloatRange(0, 1), help="confidence to open a tree branch"),
    click.option("-pr", "--p-recovery", default="auto", show_default=True, callback=lambda c, p, v: _auto_or_float(v, p),
                 help="cutoff rise per micro-batch since the last acceptance; auto: 0.5 / (ranks - 1)"),
    click.option("-pd", "--p-decay", default=0.0, show_default=True, type=click.FloatRange(0), help="cutoff fall per failed draft while idle"),
    click.option("-np", "--max-branches", default=1, show_default=True, type=click.IntRange(1, 16), help="max tree branches per run"),
    click.option("--max-in-flight", default=8, show_default=True, type=click.IntRange(1, 255), help="max speculative runs in flight"),
    click.option("--cancel/--no-cancel", default=True, help="early inference cancellation"),
    click.option("--continuous/--no-continuous", default=True, help="more than one speculative run in flight"),
    click.option("--quiet-first/--no-quiet-first", default=True,
                 help="with the draft in a thread of rank 0, leave it idle while the first token after the prompt is "
                      "computed (README, The draft beside the pipeline)"),
    click.option("--kernels", type=click.Choice(KERNELS), default=DEFAULT_KERNELS, show_default=True,
                 help="repack: repacked weights + flash attention (exact to the batch limit measured at load); "
                      "no-repack: exact to larger batches, slower; fast: llama.cpp's defaults, batch-dependent logits "
                      "(README, Exactness)"),
    click.option("--fast-kernels", is_flag=True, help="same as --kernels fast"),
    click.option("--poll-us", default=500, show_default=True, type=click.IntRange(0), help="sleep between message probes while waiting"),
    click.option("--stall-timeout", default=60.0, show_default=True, type=click.FloatRange(0),
                 help="seconds without a heartbeat from a rank before the job ends naming it (0: only lost ranks "
                      "are detected; README, Failure behaviour)"),
]


def pipeline_options(f):
    for option in reversed(PIPELINE_OPTIONS):
        f = option(f)
    return f


def supervision_options(what: str):
    """--np, --hostfile and --rejoin (generate and serve): run without mpiexec as a supervised job that re-forms
    without a lost rank and resumes `what` (server/supervisor.py)."""
    options = [
        click.option("--np", "np", default=None, type=click.IntRange(1),
                     help="run without mpiexec: start the pipeline on this many ranks as a supervised job that "
                          f"re-forms without a lost rank and resumes {what} (on this machine, or --hostfile's hosts)"),
        click.option("--hostfile", default=None, help="with or without --np: the supervised job's hosts (as `launch`)"),
        click.option("--rejoin", is_flag=True, help="with --np/--hostfile: a lost host that answers again is taken "
                     "back while no request is in flight (and at the next re-form)"),
    ]

    def decorate(f):
        for option in reversed(options):
            f = option(f)
        return f
    return decorate


def own_fields(cls, kw: dict, skip: tuple[str, ...] = ()) -> dict:
    """The keyword arguments of click that are fields of the dataclass `cls` (those in `skip` left out)."""
    return {f.name: kw[f.name] for f in fields(cls) if f.name not in skip}


@dataclass(frozen=True)
class PipelineArgs:
    """PIPELINE_OPTIONS as given (draft_at may still be "auto"; resolve_pipeline decides it)."""
    model: str | None
    mode: str
    layer_split: str | None
    threads: str | None
    threads_batch: str | None
    ctx_size: int
    batch_size: int
    draft: str | None
    drafter: str | None
    draft_vocab: str
    draft_at: str
    draft_threads: int | None
    draft_head: int | None
    draft_max: int | None
    micro_batch: str
    p_accept: float
    p_split: float
    p_recovery: float | None
    p_decay: float
    max_branches: int
    max_in_flight: int
    cancel: bool
    continuous: bool
    quiet_first: bool
    kernels: str
    fast_kernels: bool
    poll_us: int
    stall_timeout: float

    @classmethod
    def of(cls, kw: dict) -> PipelineArgs:
        return cls(**own_fields(cls, kw))

    def cells_reserve(self) -> int:
        """KV cells the runs in flight may take beyond the prompt and the answer (auto --draft-max: at most the
        default)."""
        from ..core.kvplan import cells_reserve, plan_partitions
        n_part = 0 if self.mode == "iterative" else plan_partitions(self.max_branches, self.max_in_flight)[0]
        return cells_reserve(n_part, self.draft_max or DEFAULT_DRAFT_MAX)


@dataclass(frozen=True)
class PipelineSetup:
    """The pipeline options resolved: the model files, the drafter and where it runs, the head's GenConfig."""
    args: PipelineArgs
    model: str                 # the target GGUF's path
    draft: str | None          # the draft GGUF's path (None: no draft model)
    drafter: str               # model | ngram | replay
    draft_at: str              # head | thread | rank
    gen: GenConfig

    @property
    def n_target_ranks(self) -> int:
        """The ranks that hold the target's stages: every rank but the draft's (--draft-at rank)."""
        return mpi_size() - (self.draft_at == "rank")

    def draft_label(self, replay_accuracy: float | None = None) -> str:
        """The draft_model column: the drafter for the model-free ones, else the draft file's name."""
        if self.args.mode == "iterative":
            return ""
        label = {"ngram": "ngram", "replay": f"replay@{replay_accuracy}"}.get(self.drafter,
                                                                             Path(self.draft or "").name)
        return label if self.draft_at == "head" else f"{label} ({self.draft_at})"

    def drafter_note(self) -> str:
        """Which drafter ran, for the statistics; where it was the n-gram fallback, how to give a better one."""
        if self.args.mode == "iterative":
            return "drafter: none (iterative)"
        note = f"drafter: {self.draft_label()}"
        if self.drafter == "ngram" and self.args.drafter is None:
            note += (f" (no draft model is known for {Path(self.model).name}: give --draft SMALL.gguf, a small model "
                     "of the same family or vocabulary, for more accepted tokens)")
        return note

    def run_options(self, **more):
        """ranks.startup.RunOptions for these options; `more`: what the command adds (prompt, callbacks)."""
        from ..ranks.startup import RunOptions
        a = self.args
        return RunOptions(model=self.model, gen=self.gen, layer_split=a.layer_split, threads=a.threads,
                          threads_batch=a.threads_batch, n_ctx=a.ctx_size, draft=self.draft, drafter=self.drafter,
                          max_in_flight=a.max_in_flight, poll_s=a.poll_us / 1e6,
                          kernels="fast" if a.fast_kernels else a.kernels, draft_vocab=a.draft_vocab,
                          stall_timeout=a.stall_timeout, draft_at=self.draft_at, draft_threads=a.draft_threads,
                          draft_head=a.draft_head, **more)


def _known_draft(model: str) -> str | None:
    """The installed draft file known to suit the target, by what the target file is (models.identify), not by
    the name it was given: the default target named by its registry name, its path or a copy drafts alike."""
    from ..engine.models import KNOWN_DRAFTS, identify
    name = KNOWN_DRAFTS.get(identify(model) or "")
    return installed(name) if name else None


def resolve_pipeline(a: PipelineArgs, *, n_predict: int, sampling: SamplingParams,
                     stop_at_eos: bool) -> PipelineSetup:
    """The model files (registry names resolved), the drafter and its place, checked against each other."""
    from ..engine.models import DEFAULT_TARGET, resolve_model
    model = str(resolve_model(a.model or DEFAULT_TARGET))
    draft = str(resolve_model(a.draft)) if a.draft else None
    if draft is None and a.drafter is None and a.mode != "iterative":
        draft = _known_draft(model)  # the default demo: Qwen target, Gemma draft through text translation
    drafter = a.drafter or ("model" if draft else "ngram")
    draft_at = a.draft_at
    if draft_at == "auto":  # measured: results/bench_draft_layout.csv (README, The draft beside the pipeline)
        beside = a.mode == "pipeinfer" and drafter in ("model", "replay") and a.max_branches == 1
        draft_at = "thread" if beside else "head"
    if draft_at != "head" and a.max_branches > 1:
        raise UserError(f"--draft-at {draft_at} drafts chains: -np/--max-branches must be 1")
    if draft_at == "rank" and drafter == "ngram" and a.mode != "iterative":
        raise UserError("--draft-at rank: the draft rank has no draft model (give --draft MODEL.gguf; the n-gram "
                        "drafter costs nothing and runs on the head)")
    gen = GenConfig(
        mode=a.mode, n_predict=n_predict, sampling=sampling,
        cut=Cutoffs(a.p_accept, a.p_split, a.draft_max, a.max_branches),
        p_recovery=a.p_recovery, p_decay=a.p_decay, cancel=a.cancel, continuous=a.continuous,
        quiet_first=a.quiet_first, n_batch=a.batch_size, stop_at_eos=stop_at_eos,
        adaptive_draft=a.micro_batch == "auto")
    return PipelineSetup(a, model, draft, drafter, draft_at, gen)
