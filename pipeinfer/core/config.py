"""The run's configuration: every option of a pipeline run, typed, built once from the command line
(cli/options.py: config_from_options), checked once (here: every Config is a valid one, `replace` included), and
handed whole to every rank (ranks/startup.py). A supervised job gets it as JSON in its environment
(PIPEINFER_CONFIG, forwarded by the launcher to every rank: supervisor/supervisor.py, `pipeinfer attach`), with the
values of its hosts (`for_places`, a hostfile's settings) put in by `dataclasses.replace`.

The ranks derive what they run from it: the head's GenConfig (ranks/startup.py, with what start-up measured),
the drafter (drafters/factory.make_drafter), the stage engines. Config is made of sections (StageOptions,
DraftOptions, SpeculationOptions, ServingOptions, WireOptions); adding an option: a field in its section, a click
option in cli/options.py, and the code that reads it.
"""
from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field, fields, replace
from pathlib import Path

from .errors import UserError
from .sampling import SamplingParams

MODES = ("iterative", "speculative", "pipeinfer")
KERNELS = ("repack", "no-repack", "tiled", "fast")   # engine/kernels.py: what each means
DEFAULT_KERNELS = "repack"
# --draft-head auto: the draft's output projection pruned to the most frequent 65,536 tokens (drafters/drafter.py)
DRAFT_HEAD_AUTO = 65536
DEFAULT_DRAFT_MAX = 4  # --draft-max when not given: at most this, within the exact batch limit (engine/kernels.py)
PER_RANK_FIELDS = ("layer_split", "threads", "threads_batch")  # "a,b,c": one value per target rank
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
    threads: str | None = None              # per rank: one value or a,b,c (None: cores / ranks)
    threads_batch: str | None = None        # per rank, batch decodes (None: threads)
    n_ctx: int = 4096
    n_batch: int = 512                      # largest batch a stage decodes
    prompt_chunk: int = PROMPT_CHUNK        # prompt tokens per decode (at most n_batch), at positions 0, C, 2C, ...
    cache_prompt: bool = True               # keep finished prompts on every stage for later requests (prefixcache.py)
    kernels: str = DEFAULT_KERNELS          # engine/kernels.py: repack | no-repack | tiled | fast


@dataclass(frozen=True, kw_only=True)
class DraftOptions:
    """Which drafter proposes tokens, and where it runs."""
    draft: str | None = None                # the draft GGUF's path (None: no draft model)
    drafter: str = "ngram"                  # model | ngram | replay
    drafter_asked: bool = True              # False: chosen for the user (the statistics say how to give a better one)
    draft_vocab: str = "auto"               # auto | same | translate
    draft_at: str = "head"                  # head (in series) | thread (beside, rank 0) | rank (its own, the last)
    draft_threads: int | None = None        # None: ranks/draft_rank.draft_thread_count
    draft_head: int | None = DRAFT_HEAD_AUTO  # tokens the draft's output head keeps (None: all)
    replay_ref: str | None = None           # replay drafter: JSON of an earlier --json run
    replay_accuracy: float = 0.8            # replay drafter: probability each proposal is right
    replay_runner_up: float = 0.0           # replay drafter: probability a wrong proposal's runner-up is right


@dataclass(frozen=True, kw_only=True)
class SpeculationOptions:
    """The head's speculation (the paper's section IV): the confidence cutoffs, how they move, the runs in flight."""
    p_accept: float = 0.5
    p_split: float = 0.1
    p_recovery: float | None = None         # cutoff rise per micro-batch launched since the last acceptance
                                            # (None: ranks/head.auto_p_recovery(ranks), resolved at start-up)
    p_decay: float = 0.0                    # cutoff fall per failed draft while no result is waiting
    max_branches: int = 1
    max_in_flight: int | None = None        # None: kvplan.in_flight_limit(stages)
    draft_max: int | None = None            # draft tokens per micro-batch (None: within the exact batch limit)
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
    parallel: int | None = 1                # generations at once (None: per stage, resolved at start-up)
    batch_rows: int | None = None           # next tokens of different generations per decode (None: the exact limit)


@dataclass(frozen=True, kw_only=True)
class WireOptions:
    """How the ranks wait for each other."""
    poll_s: float = 0.0005                  # sleep between message probes while waiting
    stall_timeout: float = 60.0             # wire/liveness.py: a rank silent this long ends the job (0: only losses)


@dataclass(frozen=True)
class Config(StageOptions, DraftOptions, SpeculationOptions, ServingOptions, WireOptions):
    """Every option of a pipeline run, resolved: file paths, not registry names; the drafter and where it runs
    decided (never "auto"). Its sections are the classes it is made of: a part of the code that needs one section
    takes that type (the head's GenConfig is the stage, speculation and serving sections as start-up resolved
    them); every option keeps its command-line name as a field of the one Config."""
    model: str                              # the target GGUF's path
    mode: str = "pipeinfer"                 # iterative | speculative | pipeinfer
    set_by_user: frozenset[str] = frozenset()  # options the command line set (click's names, as the fields'): a
                                               # hostfile's settings do not override them

    def __post_init__(self) -> None:
        if self.mode not in MODES:
            raise ValueError(f"unknown mode {self.mode!r} (one of {', '.join(MODES)})")
        if self.kernels not in KERNELS:
            raise ValueError(f"unknown kernels {self.kernels!r} (one of {', '.join(KERNELS)})")
        if self.draft_rides not in DRAFT_RIDES:
            raise ValueError(f"unknown --draft-rides {self.draft_rides!r} (one of {', '.join(DRAFT_RIDES)})")
        if self.draft_at not in ("head", "thread", "rank"):
            raise ValueError(f"--draft-at {self.draft_at!r} is not resolved (head, thread or rank)")
        if self.mode == "speculative" and self.parallel not in (None, 1):
            raise UserError("--mode speculative runs one request at a time (--parallel 1)")
        if self.draft_at == "rank" and self.drafter == "ngram" and self.mode != "iterative":
            raise UserError("--draft-at rank: the draft rank has no draft model (give --draft SMALL.gguf)")
        if self.prompt_chunk < 1:
            raise UserError(f"--prompt-chunk {self.prompt_chunk}: at least 1 token")
        if self.drafter == "replay" and not self.replay_ref:
            raise UserError("--drafter replay needs --replay-ref FILE.json (from an earlier --json run)")

    def for_places(self, places: list[int], n_first: int) -> "Config":
        """This configuration for a job on the ranks at `places` of a first job of `n_first` ranks (a supervised job
        re-formed on the slots left): an option with one value per rank keeps the values of those places, in order
        (a lost rank's share of the layers goes, the rest are re-planned in proportion); named values as they are."""
        def keep(value: str | None) -> str | None:
            parts = value.split(",") if value else []
            return ",".join(parts[p] for p in places) if len(parts) == n_first > 1 else value
        return replace(self, **{name: keep(getattr(self, name)) for name in PER_RANK_FIELDS})

    def to_json(self) -> str:
        return json.dumps({**asdict(self), "set_by_user": sorted(self.set_by_user)}, sort_keys=True)

    @classmethod
    def from_json(cls, text: str) -> "Config":
        """The Config `to_json` wrote (ValueError naming what is wrong with any other text)."""
        try:
            d = json.loads(text)
            if not isinstance(d, dict):
                raise TypeError(f"a JSON object is expected, not {type(d).__name__}")
            unknown = set(d) - {f.name for f in fields(cls)}
            if unknown:
                raise ValueError(f"unknown fields {sorted(unknown)} (another pipeinfer version?)")
            return cls(**{**d, "sampling": SamplingParams(**d.get("sampling", {})),
                          "set_by_user": frozenset(d.get("set_by_user", ()))})
        except (TypeError, json.JSONDecodeError, AttributeError) as e:
            raise ValueError(f"not a pipeinfer configuration: {e}") from None


def draft_label(config: Config) -> str:
    """The draft_model column: the drafter for the model-free ones, else the draft file's name."""
    if config.mode == "iterative":
        return ""
    label = {"ngram": "ngram", "replay": f"replay@{config.replay_accuracy}"}.get(config.drafter,
                                                                                Path(config.draft or "").name)
    return label if config.draft_at == "head" else f"{label} ({config.draft_at})"


def cells_reserve(config: Config, n_stages: int) -> int:
    """KV cells the runs in flight may take beyond the prompt and the answer (auto --draft-max: at most the
    default)."""
    from .kvplan import cells_reserve as reserve, in_flight_limit, plan_partitions
    n_part = 0 if config.mode == "iterative" else plan_partitions(config.max_branches,
                                                                  in_flight_limit(config.max_in_flight, n_stages))[0]
    return reserve(n_part, config.draft_max or DEFAULT_DRAFT_MAX)


def check_fits(config: Config, n_prompt: int, n_predict: int, n_stages: int) -> None:
    """The one context-fit check of the front ends: a prompt and its answer fit the context beside the runs in
    flight (the scheduler checks the same against the context as the stages planned it)."""
    from .kvplan import ContextBudget
    budget = ContextBudget(config.n_ctx, cells_reserve(config, n_stages))
    if not budget.fits(n_prompt, n_predict):
        raise UserError(f"{budget.refusal(n_prompt, n_predict)} (-c/--ctx-size)")
