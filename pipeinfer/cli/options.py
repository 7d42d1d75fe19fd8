"""The options of the commands that load the pipeline (`generate`, `serve`), as click declares them, and the one
place they become the run's configuration (core/config.Config): `config_from_options` puts each into its section's
field by click's name (core/config.OPTION_FIELDS: the table lives in core, where a hostfile's settings are applied by
the same names), resolves the model files, the drafter and where it runs (`--draft-at auto` decided) and checks them
against each other, once.
"""
from __future__ import annotations

from dataclasses import fields
from pathlib import Path
from typing import Callable

import click
from click.core import ParameterSource

from ..core.errors import UserError
from ..core.sampling import SamplingParams
from ..engine.kernels import DEFAULT_DRAFT_MAX, DEFAULT_KERNELS, KERNELS
from ..core.config import (
    DRAFT_HEAD_AUTO,
    DRAFT_RIDES,
    MODES,
    NGRAM_LEVEL,
    OPTION_FIELDS,
    PROMPT_CHUNK,
    Config,
    DraftOptions,
    ServingOptions,
    draft_label,
)
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


def _auto_or_int(value: str, param) -> int | None:
    """'auto' (None: start-up picks by the number of ranks) or an integer in 1..255."""
    if value == "auto":
        return None
    if not (value.isdigit() and 1 <= int(value) <= 255):
        raise click.BadParameter(f"{value!r} is neither 'auto' nor an integer in 1..255", param=param)
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


# how a run speculates, declared once: the commands that run the pipeline (generate, serve) and the twin's
# `simulate`, which runs the same scheduler on a simulated cluster
SPECULATION_OPTIONS = [
    click.option("--mode", type=click.Choice(MODES), default="pipeinfer", show_default=True),
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
    click.option("--max-branches", default=1, show_default=True, type=click.IntRange(1, 16), help="max tree branches per run: with 2 or more, the draft's runner-ups go beside its chain as "
                                                                                   "siblings where the measured costs say they pay"),
    click.option("--cancel/--no-cancel", default=True, help="early inference cancellation"),
    click.option("--continuous/--no-continuous", default=True, help="more than one speculative run in flight"),
    click.option("--draft-rides", type=click.Choice(DRAFT_RIDES), default="auto", show_default=True,
                 help="while many requests generate, whether the draft's micro-batches ride their shared decodes: auto "
                      "where the decode costs measured at start-up and the running acceptance say draft rows buy more "
                      "than they cost (rows nearly free, as with --kernels tiled), always, or never"),
]


def speculation_options(f):
    for option in reversed(SPECULATION_OPTIONS):
        f = option(f)
    return f


# options of every command that loads the pipeline (generate, serve): -m and --mode are Config's own fields, every
# other a section's field by its name (core/config.OPTION_FIELDS), but --fast-kernels (--kernels fast)
PIPELINE_OPTIONS = [
    click.option("-m", "--model", default=None, help="target GGUF path or registry name [default: qwen2.5-coder-1.5b]"),
    click.option("--layer-split", default=None,
                 help="layers per rank: balanced (equal time per stage, by the weights a token reads in each layer and "
                      "in the output projection), even (equal layer counts), auto (balanced at each rank's measured "
                      "speed), or fractions, rank 0 first, e.g. 0.2,0.4,0.4 [default: balanced]"),
    click.option("--tensor-parallel", "-tp", default=1, show_default=True, type=click.IntRange(1),
                 help="every pipeline stage a tensor group of N consecutive ranks that split each of its layers (attention "
                      "heads, feed-forward columns, the output's vocabulary) and add their partial sums twice a layer: "
                      "one stream runs faster on more machines, over links fast enough for 2 exchanges a layer"),
    click.option("--groups", default=None,
                 help="each stage's tensor group size, in rank order, e.g. 2,2 (two stages of 2 ranks) or 2,1,1 "
                      "[default: --tensor-parallel's]"),
    click.option("-t", "--threads", default=None,
                 help="threads per rank for single-token decodes: one value or a,b,c [default: the physical cores "
                      "each rank may run on, shared with the ranks of its host; SLURM_CPUS_PER_TASK in a Slurm job]"),
    click.option("-tb", "--threads-batch", default=None, help="threads per rank for batch decodes [default: --threads]"),
    click.option("-c", "--ctx-size", default=4096, show_default=True, type=click.IntRange(16), help="KV cache size per stage"),
    click.option("-b", "--batch-size", default=512, show_default=True, type=click.IntRange(1), help="largest batch per decode"),
    click.option("--prompt-chunk", default=PROMPT_CHUNK, show_default=True, type=click.IntRange(1),
                 help="prompt tokens per decode, at positions 0, C, 2C, ...; up to 63 a prompt's bits do not depend "
                      "on where its KV cells sit, which the prompt cache and --parallel's exactness rest on (more is "
                      "faster alone, 1.34x at 512 on one process, but a cached or concurrent prompt may then part "
                      "from its cold answer at a near tie)"),
    click.option("--cache-prompt", type=click.Choice(["on", "off"]), default="on", show_default=True,
                 help="keep each finished request's prompt on every stage and reuse its longest common prefix "
                      "(exact: the answer is the cold one's)"),
    click.option("--draft", multiple=True, help="draft GGUF or registry name: a small model, of the target's tokenizer at best (another is "
                      "translated through text); `pipeinfer models drafts TARGET` says which. Repeated, drafts of drafts: "
                      "--draft A --draft B, B drafts for A and A for the target (every level but the last of the "
                      "target's vocabulary; the last may be ngram)"),
    click.option("--draft-below-at", type=click.Choice(["inline", "thread"]), default="inline", show_default=True,
                 help="with --draft given more than once: the levels below the first draft in series inside the "
                      "drafter (inline), or each ahead in a thread of its own (thread)"),
    click.option("--drafter", type=click.Choice(["model", "ngram", "mtp", "replay"]), default=None,
                 help="[default: model if --draft (on the default target: gemma3-270m when installed) else ngram]; "
                      "mtp: the target's own multi-token-prediction layers, run by the last stage; replay is a "
                      "benchmark instrument (docs/speculation.md)"),
    click.option("--draft-vocab", type=click.Choice(["auto", "same", "translate"]), default="auto", show_default=True,
                 help="draft model vocabulary: same as the target (checked), or translate through text; auto picks"),
    click.option("--draft-at", type=click.Choice(["auto", "head", "thread", "rank"]), default="auto", show_default=True,
                 help="where the draft runs: head (in series with rank 0's stage), thread (beside it, in rank 0), rank "
                      "(an MPI rank of its own: the last; start one more rank than the target's stages); auto: thread "
                      "for a draft model (or the replay instrument, which spends one's compute) in pipeinfer mode, "
                      "else head"),
    click.option("--draft-threads", default=None, type=click.IntRange(1),
                 help="threads of the draft model [default: rank 0's --threads; on its own rank: as a stage's -t]"),
    click.option("--draft-head", default="auto", show_default=True, callback=lambda c, p, v: _draft_head(v),
                 help=f"tokens the draft model's output projection keeps, the most frequent first: a number, full, or auto "
                      f"({DRAFT_HEAD_AUTO:,}); the draft proposes only those, the output stays exact"),
    *SPECULATION_OPTIONS,
    click.option("--max-in-flight", default="auto", show_default=True, callback=lambda c, p, v: _auto_or_int(v, p),
                 help="max speculative runs in flight; auto: the target's stages + 2, at least 8"),
    click.option("--quiet-first/--no-quiet-first", default=True,
                 help="with the draft in a thread of rank 0, leave it idle while the first token after the prompt is "
                      "computed (docs/speculation.md)"),
    click.option("--batch-rows", default="auto", show_default=True, callback=lambda c, p, v: _auto_or_int(v, p),
                 help="next tokens of different requests one decode may carry (many users at once); auto: the most "
                      "the stages' kernels keep exact, measured at load (each answer stays what it is alone); more is "
                      "refused unless --kernels fast, which gives exactness up for speed"),
    click.option("--kernels", type=click.Choice(KERNELS), default=DEFAULT_KERNELS, show_default=True,
                 help="repack: repacked weights + flash attention (exact to the batch limit measured at load); "
                      "no-repack: exact to larger batches, slower; tiled: every matrix multiply through llama.cpp's "
                      "tiled kernel, exact to 32 rows, a decode of 16 rows costs about what 1 does (6.5x a repacked row): "
                      "for servers that always carry many users; fast: llama.cpp's defaults, batch-dependent logits "
                      "(docs/design.md, Exactness)"),
    click.option("--fast-kernels", is_flag=True, help="same as --kernels fast"),
    click.option("--poll-us", default=500, show_default=True, type=click.IntRange(0), help="sleep between message probes while waiting"),
    click.option("--stall-timeout", default=60.0, show_default=True, type=click.FloatRange(0),
                 help="seconds without a heartbeat from a rank before the job ends naming it (0: only lost ranks "
                      "are detected; docs/failures.md)"),
    click.option("--start-timeout", default=None, type=click.FloatRange(1), metavar="SECONDS",
                 help="with --np/--hostfile: seconds the pipeline's job may take to start [default: the models' "
                      "size at 50 MiB/s, at least 600]"),
]


def pipeline_options(f):
    for option in reversed(PIPELINE_OPTIONS):
        f = option(f)
    return f


def supervision_options(what: str):
    """--np, --hostfile and --rejoin (generate and serve): run without mpiexec as a supervised job that re-forms
    without a lost rank and resumes `what` (supervisor/supervisor.py)."""
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


class CheckedCommand(click.Command):
    """A command whose options can be checked without running it (`launch --dry-run`, cli/launch.py): `check`
    makes of click's parameters what the command makes of them before it starts MPI, raising what it would."""
    check: Callable[[dict], object] | None = None


def own_fields(cls, kw: dict, skip: tuple[str, ...] = ()) -> dict:
    """The keyword arguments of click that are fields of the dataclass `cls` (those in `skip` left out)."""
    return {f.name: kw[f.name] for f in fields(cls) if f.name not in skip}


def _known_draft(model: str) -> str | None:
    """The installed draft file known to suit the target, by what the target file is (models.identify), not by
    the name it was given: the default target named by its registry name, its path or a copy drafts alike."""
    from ..engine.models import KNOWN_DRAFTS, identify
    name = KNOWN_DRAFTS.get(identify(model) or "")
    return installed(name) if name else None


def _draft_levels(given: tuple[str, ...], drafter: str | None) -> tuple[str | None, tuple[str, ...]]:
    """--draft's values (click's tuple: one, several, or none) as (the draft file, the levels below it): registry
    names resolved to files, `ngram` kept as the n-gram level. `--draft ngram` alone is the n-gram drafter (no
    model)."""
    from ..engine.models import resolve_model
    levels = tuple(v if v == NGRAM_LEVEL else str(resolve_model(v)) for v in given)
    if levels[:1] == (NGRAM_LEVEL,) and len(levels) > 1:
        raise UserError("--draft ngram can only be the last level of a hierarchy: the levels above it verify its "
                        "tokens with a model")
    if levels == (NGRAM_LEVEL,):
        if drafter not in (None, "ngram"):
            raise UserError(f"--draft ngram is the n-gram drafter, not --drafter {drafter}")
        return None, ()
    return (levels[0] if levels else None), levels[1:]


def config_from_options(kw: dict, *, sampling: SamplingParams | None = None) -> Config:
    """The run's configuration from click's keyword arguments: each option into its section's field by its name
    (core/config.OPTION_FIELDS, the one table of them), the sampling the command makes of its own options, registry
    names resolved to files, the drafter and its place decided, the options checked against each other. An option
    the command lacks keeps its field's default (parallel: 1; None: per stage, resolved at start-up: decide/batching.default_parallel)."""
    from ..engine.models import DEFAULT_TARGET, resolve_model
    mode = kw["mode"]
    model = str(resolve_model(kw["model"] or DEFAULT_TARGET))
    draft, below = _draft_levels(kw["draft"], kw["drafter"])
    asked = kw["drafter"] or (NGRAM_LEVEL if kw["draft"] and draft is None else None)  # --draft ngram
    if draft is None and asked is None and mode != "iterative":
        draft = _known_draft(model)  # the default demo: Qwen target, Gemma draft through text translation
    drafter = asked or ("model" if draft else "ngram")
    if below and drafter != "model":
        raise UserError(f"--draft given {len(below) + 1} times builds a hierarchy of draft models: --drafter "
                        f"{drafter} drafts alone")
    draft_at = kw["draft_at"]
    if draft_at == "auto":  # beside the pipeline where a model drafts continuously (docs/speculation.md)
        beside = mode == "pipeinfer" and drafter in ("model", "replay")
        draft_at = "thread" if beside else "head"
    parallel = kw.get("parallel", 1)
    if mode == "speculative" and parallel is None:
        parallel = 1
    if drafter == "mtp" and mode != "iterative":
        if draft or below:
            raise UserError("--drafter mtp drafts with the target's own layers: drop --draft")
        if draft_at != "head":
            raise UserError(f"--drafter mtp runs on the last stage, its proposals come with the results: drop "
                            f"--draft-at {draft_at}")
        if parallel != 1:
            raise UserError("--drafter mtp drafts for one generation at a time: give --parallel 1")
    if draft_at == "rank" and drafter == "ngram" and mode != "iterative":
        from ..engine.drafts import draft_hint
        raise UserError(f"--draft-at rank (or a hostfile's role=draft host): the draft rank has no draft model: give "
                        f"{draft_hint(model)}, or drop role=draft (the n-gram drafter runs on the head)")
    ctx = click.get_current_context(silent=True)
    set_by_user = frozenset() if ctx is None else frozenset(
        name for name in ctx.params
        if ctx.get_parameter_source(name) in (ParameterSource.COMMANDLINE, ParameterSource.ENVIRONMENT))
    options = {name: value for name, value in kw.items() if name in OPTION_FIELDS}
    decided = {"draft": draft, "draft_below": below, "drafter": drafter, "draft_at": draft_at, "parallel": parallel,
               "kernels": "fast" if kw["fast_kernels"] else kw["kernels"]}
    first = Config(model, mode=mode, draft=DraftOptions(drafter_asked=asked is not None),
                   serving=ServingOptions(sampling=sampling or SamplingParams()), set_by_user=set_by_user)
    return first.with_options(**{**options, **decided})


def n_target_ranks(config: Config) -> int:
    """The ranks that hold the target's stages under this launcher: every rank but the draft's (--draft-at rank)."""
    return mpi_size() - (config.draft.at == "rank")


def _vocabulary_said(config: Config) -> str:
    """How a draft model drafts: in the target's token ids, or through text (another vocabulary); '' for the other
    drafters and a file whose vocabulary cannot be read (the run says so itself)."""
    if config.draft.drafter != "model" or not config.draft.model:
        return ""
    from ..drafters.factory import translates
    try:
        through_text = translates(config.model, config.draft.model, config.draft.vocab)
    except (UserError, ValueError, OSError):
        return ""
    return ", another vocabulary: drafting through text" if through_text else ", the target's vocabulary"


def drafter_note(config: Config) -> str:
    """Which drafter ran, for the statistics; where it was the n-gram fallback, how to give a better one."""
    if config.mode == "iterative":
        return "drafter: none (iterative)"
    note = f"drafter: {draft_label(config)}{_vocabulary_said(config)}"
    if config.draft.drafter == "ngram" and not config.draft.drafter_asked:
        from ..engine.drafts import draft_hint
        note += f" (for more accepted tokens with {Path(config.model).name}, give {draft_hint(config.model)})"
    return note
