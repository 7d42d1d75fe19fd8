"""The run's configuration: every option of a pipeline run, typed, built once from the command line
(cli/options.py: config_from_options, each option into its section by OPTION_FIELDS), checked once (here: every
Config is a valid one, however made), and handed whole to every rank (ranks/startup.py). A supervised job gets it as
JSON in its environment (PIPEINFER_CONFIG, forwarded by the launcher to every rank: supervisor/supervisor.py,
`pipeinfer attach`), with the values of its hosts (`for_places`, a hostfile's settings by `with_options`) put in.

A Config holds its sections as fields: config.stage (StageOptions), config.draft (DraftOptions), config.speculation
(SpeculationOptions), config.serving (ServingOptions), config.wire (WireOptions); the target's model and the mode
beside them. A part of the code that needs one section takes that section. An option left None ("decided at start-up":
p_recovery, draft_max, batch_rows, parallel) is decided by start-up, once, into Resolved (ranks/startup.py); the
head's GenConfig (decide/genconfig.gen_config) and the session are made from that, never from the None.
Adding an option: a field in its section, a click option in cli/options.py and its line in OPTION_FIELDS, and the
code that reads it.
"""
from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field, fields, replace
from pathlib import Path
from typing import Any, Callable, NamedTuple

from .errors import UserError
from .sampling import SamplingParams

MODES = ("iterative", "speculative", "pipeinfer")
KERNELS = ("repack", "no-repack", "tiled", "fast")   # engine/kernels.py: what each means
DEFAULT_KERNELS = "repack"
# --draft-head auto: the draft's output projection pruned to the most frequent 65,536 tokens (drafters/drafter.py)
DRAFT_HEAD_AUTO = 65536
NGRAM_LEVEL = "ngram"  # --draft ngram: the n-gram drafter (alone, or as a hierarchy's last level)
DEFAULT_DRAFT_MAX = 4  # --draft-max when not given: at most this, within the exact batch limit (engine/kernels.py)
PER_RANK_FIELDS = ("layer_split", "threads", "threads_batch")  # stage options "a,b,c": one value per target rank
# prompt tokens per decode: the most rows llama.cpp's CPU flash attention takes one row at a time; from 64 rows on
# it tiles the cells, and a row's result then depends on where the sequence's cells sit (mod 64), so a prompt
# decoded after other requests' cells, or from the prompt cache, would not be the cold answer's bits
# (tests/test_stage_engine.py pins both). Its cost against 512-token chunks: launch/bench/bench_prompt_speed.py
PROMPT_CHUNK = 63
DRAFT_RIDES = ("auto", "always", "never")  # --draft-rides (ranks/shape.ride_len decides auto)
CONFIG_ENV = "PIPEINFER_CONFIG"  # a supervised job's configuration, as JSON (Config.to_json)


@dataclass(frozen=True, kw_only=True)
class StageOptions:
    """How each stage loads and decodes its layers."""
    layer_split: str | None = None          # balanced | even | auto | fractions (core/topology.plan_layers)
    threads: str | None = None              # per rank: one value or a,b,c (None: core/cpus.default_threads)
    threads_batch: str | None = None        # per rank, batch decodes (None: threads)
    n_ctx: int = 4096
    n_batch: int = 512                      # largest batch a stage decodes (within n_ctx: Resolved.n_batch)
    prompt_chunk: int = PROMPT_CHUNK        # prompt tokens per decode (at most n_batch), at positions 0, C, 2C, ...
    cache_prompt: bool = True               # keep finished prompts on every stage for later requests (prefixcache.py)
    kernels: str = DEFAULT_KERNELS          # engine/kernels.py: repack | no-repack | tiled | fast
    tensor_parallel: int = 1                # every stage a tensor group of this many ranks (engine/slices.py)
    groups: str | None = None               # each stage's group size in rank order, "2,1,1" (core/topology.group_sizes)


@dataclass(frozen=True, kw_only=True)
class DraftOptions:
    """Which drafter proposes tokens, and where it runs."""
    model: str | None = None                # the draft GGUF's path (None: no draft model)
    below: tuple[str, ...] = ()             # drafts of drafts (drafters/stack.py): each level drafts for the one
                                            # before it, model first; GGUF paths, the last may be NGRAM_LEVEL
    below_at: str = "inline"                # the levels below the first: inline (in series) | thread (each ahead)
    drafter: str = "ngram"                  # model | ngram | mtp (the target's own MTP head) | replay
    drafter_asked: bool = True              # False: chosen for the user (the statistics say how to give a better one)
    vocab: str = "auto"                     # auto | same | translate
    at: str = "head"                        # head (in series) | thread (beside, rank 0) | rank (its own, the last)
    threads: int | None = None              # None: ranks/draft_rank.draft_thread_count, where the drafter is made
    head_tokens: int | None = DRAFT_HEAD_AUTO  # tokens the draft's output head keeps (None: all)
    replay_ref: str | None = None           # replay drafter: JSON of an earlier --json run
    replay_accuracy: float = 0.8            # replay drafter: probability each proposal is right
    replay_runner_up: float = 0.0           # replay drafter: probability a wrong proposal's runner-up is right

    def __post_init__(self) -> None:
        object.__setattr__(self, "below", tuple(self.below))  # a list from JSON (Config.from_json)


@dataclass(frozen=True, kw_only=True)
class SpeculationOptions:
    """The head's speculation (the paper's section IV): the confidence cutoffs, how they move, the runs in flight."""
    p_accept: float = 0.5
    p_split: float = 0.1
    p_recovery: float | None = None         # cutoff rise per micro-batch launched since the last acceptance
                                            # (None: decide/genconfig.auto_p_recovery(ranks), in Resolved)
    p_decay: float = 0.0                    # cutoff fall per failed draft while no result is waiting
    max_branches: int = 1
    max_in_flight: int | None = None        # None: kvplan.in_flight_limit(stages), where partitions are planned
    draft_max: int | None = None            # draft tokens per micro-batch (None: within the exact batch limit,
                                            # in Resolved)
    adaptive_draft: bool = True             # --micro-batch auto: size micro-batches by measured stage costs
    cancel: bool = True                     # False: never send cancellation signals
    continuous: bool = True                 # False: at most one speculative run in flight
    quiet_first: bool = True                # a drafter in a thread of rank 0 waits while the first token is computed
    draft_rides: str = "auto"               # draft rows in other requests' shared decodes: auto | always | never


@dataclass(frozen=True, kw_only=True)
class ServingOptions:
    """The generations: their defaults, and how many share the pipeline."""
    n_predict: int = 128                    # tokens per answer unless a request says otherwise
    sampling: SamplingParams = field(default_factory=SamplingParams)
    stop_at_eos: bool = True
    parallel: int | None = 1                # generations at once (None: per stage, in Resolved)
    batch_rows: int | None = None           # next tokens of different generations per decode (None: the exact
                                            # limit, in Resolved)


@dataclass(frozen=True, kw_only=True)
class WireOptions:
    """How the ranks wait for each other."""
    poll_s: float = 0.0005                  # sleep between message probes while waiting
    stall_timeout: float = 60.0             # wire/liveness.py: a rank silent this long ends the job (0: only losses)
    start_timeout: float | None = None      # supervisor/child.py: seconds a supervised job may take to start
                                            # (None: from the models' size)


# the sections of a Config: its field name -> the section's class
SECTIONS = {"stage": StageOptions, "draft": DraftOptions, "speculation": SpeculationOptions,
            "serving": ServingOptions, "wire": WireOptions}


def _same(value):
    return value


def _on(value: str) -> bool:
    """--cache-prompt on|off."""
    if value not in ("on", "off"):
        raise ValueError(f"on or off, not {value!r}")
    return value == "on"


class OptionField(NamedTuple):
    """Where a command-line option goes in a Config: a field of a section, and how click's value becomes the
    field's (most are the same)."""
    section: str
    field: str
    convert: Callable[[Any], Any] = _same


# every command-line option that is a Config field, by click's name (the name set_by_user and a hostfile's settings
# use); model and mode are Config's own fields, and a command's sampling options (--temp, --top-k, --top-p, --seed)
# make serving.sampling whole (cli/main.py)
OPTION_FIELDS: dict[str, OptionField] = {
    "layer_split": OptionField("stage", "layer_split"),
    "tensor_parallel": OptionField("stage", "tensor_parallel"),
    "groups": OptionField("stage", "groups"),
    "threads": OptionField("stage", "threads"),
    "threads_batch": OptionField("stage", "threads_batch"),
    "ctx_size": OptionField("stage", "n_ctx"),
    "batch_size": OptionField("stage", "n_batch"),
    "prompt_chunk": OptionField("stage", "prompt_chunk"),
    "cache_prompt": OptionField("stage", "cache_prompt", _on),
    "kernels": OptionField("stage", "kernels"),
    "draft": OptionField("draft", "model"),
    "draft_below": OptionField("draft", "below", tuple),
    "draft_below_at": OptionField("draft", "below_at"),
    "drafter": OptionField("draft", "drafter"),
    "draft_vocab": OptionField("draft", "vocab"),
    "draft_at": OptionField("draft", "at"),
    "draft_threads": OptionField("draft", "threads"),
    "draft_head": OptionField("draft", "head_tokens"),
    "replay_ref": OptionField("draft", "replay_ref"),
    "replay_accuracy": OptionField("draft", "replay_accuracy"),
    "replay_runner_up": OptionField("draft", "replay_runner_up"),
    "p_accept": OptionField("speculation", "p_accept"),
    "p_split": OptionField("speculation", "p_split"),
    "p_recovery": OptionField("speculation", "p_recovery"),
    "p_decay": OptionField("speculation", "p_decay"),
    "max_branches": OptionField("speculation", "max_branches"),
    "max_in_flight": OptionField("speculation", "max_in_flight"),
    "draft_max": OptionField("speculation", "draft_max"),
    "micro_batch": OptionField("speculation", "adaptive_draft", lambda value: value == "auto"),
    "cancel": OptionField("speculation", "cancel"),
    "continuous": OptionField("speculation", "continuous"),
    "quiet_first": OptionField("speculation", "quiet_first"),
    "draft_rides": OptionField("speculation", "draft_rides"),
    "n_predict": OptionField("serving", "n_predict"),
    "ignore_eos": OptionField("serving", "stop_at_eos", lambda value: not value),
    "parallel": OptionField("serving", "parallel"),
    "batch_rows": OptionField("serving", "batch_rows"),
    "poll_us": OptionField("wire", "poll_s", lambda us: us / 1e6),
    "stall_timeout": OptionField("wire", "stall_timeout"),
    "start_timeout": OptionField("wire", "start_timeout"),
}


@dataclass(frozen=True)
class Config:
    """Every option of a pipeline run, by section: file paths, not registry names; the drafter and where it runs
    decided (never "auto"). Options left None are decided at start-up, into Resolved."""
    model: str                              # the target GGUF's path
    mode: str = "pipeinfer"                 # iterative | speculative | pipeinfer
    stage: StageOptions = field(default_factory=StageOptions)
    draft: DraftOptions = field(default_factory=DraftOptions)
    speculation: SpeculationOptions = field(default_factory=SpeculationOptions)
    serving: ServingOptions = field(default_factory=ServingOptions)
    wire: WireOptions = field(default_factory=WireOptions)
    set_by_user: frozenset[str] = frozenset()  # options the command line set (click's names: OPTION_FIELDS's, model,
                                               # mode): a hostfile's settings do not override them

    def __post_init__(self) -> None:
        for name, kind in SECTIONS.items():
            if not isinstance(getattr(self, name), kind):
                raise TypeError(f"Config.{name} is a {kind.__name__}, not {type(getattr(self, name)).__name__}")
        stage, draft = self.stage, self.draft
        if self.mode not in MODES:
            raise ValueError(f"unknown mode {self.mode!r} (one of {', '.join(MODES)})")
        if stage.kernels not in KERNELS:
            raise ValueError(f"unknown kernels {stage.kernels!r} (one of {', '.join(KERNELS)})")
        rides = self.speculation.draft_rides
        if rides not in DRAFT_RIDES:
            raise ValueError(f"unknown --draft-rides {rides!r} (one of {', '.join(DRAFT_RIDES)})")
        if draft.at not in ("head", "thread", "rank"):
            raise ValueError(f"--draft-at {draft.at!r} is not resolved (head, thread or rank)")
        if self.mode == "speculative" and self.serving.parallel not in (None, 1):
            raise UserError("--mode speculative runs one request at a time (--parallel 1)")
        if draft.at == "rank" and draft.drafter == "ngram" and self.mode != "iterative":
            raise UserError("--draft-at rank: the draft rank has no draft model (give --draft SMALL.gguf)")
        if stage.prompt_chunk < 1:
            raise UserError(f"--prompt-chunk {stage.prompt_chunk}: at least 1 token")
        if draft.drafter == "replay" and not draft.replay_ref:
            raise UserError("--drafter replay needs --replay-ref FILE.json (from an earlier --json run)")
        if stage.tensor_parallel < 1:
            raise UserError(f"--tensor-parallel {stage.tensor_parallel}: at least 1 rank per group")
        if stage.groups and stage.tensor_parallel > 1:
            raise UserError("give --groups or --tensor-parallel, not both")
        if (stage.groups or stage.tensor_parallel > 1) and draft.drafter == "mtp" and self.mode != "iterative":
            raise UserError("--drafter mtp does not run on a tensor group's last stage yet: use --draft or pipeline stages")

    def with_options(self, **options) -> Config:
        """This configuration with command-line options set as click gives them, by click's names
        (with_options(ctx_size=2048, draft_at="thread", cache_prompt="off")): each into its section's field
        (OPTION_FIELDS), checked once, as a whole."""
        changes: dict[str, dict] = {}
        for name, value in options.items():
            if name not in OPTION_FIELDS:
                raise ValueError(f"{name!r} is not an option of a pipeline run")
            where = OPTION_FIELDS[name]
            changes.setdefault(where.section, {})[where.field] = where.convert(value)
        return replace(self, **{section: replace(getattr(self, section), **values)
                                for section, values in changes.items()})

    def for_places(self, places: list[int], n_first: int) -> Config:
        """This configuration for a job on the ranks at `places` of a first job of `n_first` ranks (a supervised job
        re-formed on the slots left): a stage option with one value per rank keeps the values of those places, in
        order (a lost rank's share of the layers goes, the rest are re-planned in proportion); named values as they
        are."""
        def keep(value: str | None) -> str | None:
            parts = value.split(",") if value else []
            return ",".join(parts[p] for p in places) if len(parts) == n_first > 1 else value
        stage = replace(self.stage, **{name: keep(getattr(self.stage, name)) for name in PER_RANK_FIELDS})
        if stage.groups or stage.tensor_parallel > 1:  # a group keeps the members left (a smaller group, re-sliced)
            from .topology import Groups, group_sizes
            groups = Groups(tuple(group_sizes(stage.groups, stage.tensor_parallel, n_first)))
            left = [groups.stage_of(p) for p in places]
            sizes = [sum(1 for s in left if s == k) for k in dict.fromkeys(left)]
            stage = replace(stage, groups=",".join(map(str, sizes)), tensor_parallel=1)
        return replace(self, stage=stage)

    def to_json(self) -> str:
        """{"model", "mode", "set_by_user": [click's names], "stage": {...}, "draft": {...}, "speculation": {...},
        "serving": {..., "sampling": {...}}, "wire": {...}}"""
        return json.dumps({**asdict(self), "set_by_user": sorted(self.set_by_user)}, sort_keys=True)

    @classmethod
    def from_json(cls, text: str) -> Config:
        """The Config `to_json` wrote (ValueError naming what is wrong with any other text)."""
        try:
            d = json.loads(text)
            if not isinstance(d, dict):
                raise TypeError(f"a JSON object is expected, not {type(d).__name__}")
            unknown = _unknown(d, cls) + [f"{name}.{key}" for name, kind in SECTIONS.items()
                                          for key in _unknown(d.get(name, {}), kind)]
            if unknown:
                raise ValueError(f"unknown fields {sorted(unknown)} (another pipeinfer version?)")
            sections = {name: kind(**d.get(name, {})) for name, kind in SECTIONS.items() if name != "serving"}
            serving = d.get("serving", {})
            sampling = SamplingParams(**serving.get("sampling", {}))
            sections["serving"] = ServingOptions(**{**serving, "sampling": sampling})
            return cls(**{**d, **sections, "set_by_user": frozenset(d.get("set_by_user", ()))})
        except (TypeError, json.JSONDecodeError, AttributeError) as e:
            raise ValueError(f"not a pipeinfer configuration: {e}") from None


def _unknown(d: dict, cls) -> list[str]:
    """The keys of `d` that are not fields of the dataclass `cls` (TypeError: `d` is not an object)."""
    if not isinstance(d, dict):
        raise TypeError(f"{cls.__name__}: a JSON object is expected, not {type(d).__name__}")
    return sorted(set(d) - {f.name for f in fields(cls)})


@dataclass(frozen=True, kw_only=True)
class Resolved:
    """What start-up decided of the options a Config leaves to it, the same on every target rank
    (ranks/startup.py): the head's GenConfig (decide/genconfig.gen_config) and the session are made from these, and
    nothing after start-up reads the Config's Nones. (The per-rank threads are the layer plan's; --max-in-flight is
    decided where the partitions are planned, the draft's threads where its drafter is made.)"""
    parallel: int                           # generations at once (--parallel, else per stage; speculative: 1)
    n_batch: int                            # the largest decode: --batch-size within the context
    prompt_chunk: int                       # --prompt-chunk within n_batch
    p_recovery: float                       # -pr, else decide/genconfig.auto_p_recovery(stages)
    draft_max: int                          # --draft-max, else the most within the exact batch limit (at most
                                            # DEFAULT_DRAFT_MAX); iterative: --draft-max or DEFAULT_DRAFT_MAX, unused
    batch_rows: int                         # --batch-rows, else the smallest exact batch limit of the stages
    state_per_token: bool = False           # a target with recurrent layers: each drafted token in a sequence of its
                                            # own (core/recurrent.py)
    # with --micro-batch auto in pipeinfer mode: each stage's decode time (ms) for 1..limit tokens, rank 0 first
    stage_ms: tuple[tuple[float, ...], ...] | None = None


def draft_label(config: Config) -> str:
    """The draft_model column: the drafter for the model-free ones, else the draft file's name (a hierarchy's: each
    level's, from the one drafting for the target down, joined by '<')."""
    if config.mode == "iterative":
        return ""
    draft = config.draft
    label = {"ngram": "ngram", "mtp": "mtp", "replay": f"replay@{draft.replay_accuracy}"}.get(draft.drafter,
                                                                               Path(draft.model or "").name)
    if draft.drafter == "model" and draft.below:  # drafts of drafts: each level, then the one drafting for it
        label = "<".join([label, *(Path(level).name for level in draft.below)])
    return label if draft.at == "head" else f"{label} ({draft.at})"


def cells_reserve(config: Config, n_stages: int) -> int:
    """KV cells the runs in flight may take beyond the prompt and the answer (auto --draft-max: at most the
    default)."""
    from .kvplan import cells_reserve as reserve, in_flight_limit, plan_partitions
    spec = config.speculation
    n_part = 0 if config.mode == "iterative" else plan_partitions(spec.max_branches,
                                                                  in_flight_limit(spec.max_in_flight, n_stages))[0]
    return reserve(n_part, spec.draft_max or DEFAULT_DRAFT_MAX)


def check_fits(config: Config, n_prompt: int, n_predict: int, n_stages: int) -> None:
    """The one context-fit check of the front ends: a prompt and its answer fit the context beside the runs in
    flight (the scheduler checks the same against the context as the stages planned it)."""
    from .kvplan import ContextBudget
    budget = ContextBudget(config.stage.n_ctx, cells_reserve(config, n_stages))
    if not budget.fits(n_prompt, n_predict):
        raise UserError(f"{budget.refusal(n_prompt, n_predict)} (-c/--ctx-size)")
