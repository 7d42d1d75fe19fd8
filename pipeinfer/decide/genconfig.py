"""The head's parameters (GenConfig): the run's stage, speculation and serving options with what start-up resolved
and measured (gen_config, from a Config and its Resolved), or as the twin sets them (without a model file)."""
from __future__ import annotations

from dataclasses import dataclass, field

from ..core.config import DEFAULT_DRAFT_MAX, MODES, PROMPT_CHUNK, Config, Resolved
from ..core.recurrent import seqs_per_run
from ..core.sampling import SamplingParams
from ..drafters.drafter import Cutoffs


def auto_p_recovery(n_ranks: int) -> float:
    """The default recovery factor: 0.5 per micro-batch over the stages after the head's.

    A draft of confidence c keeps launching while c >= p_accept + k * p_recovery, i.e. about
    (c - p_accept) / p_recovery + 1 micro-batches past the last verification; with this factor a confident
    draft (0.9 over -pa 0.5) runs about 0.8 * (n_ranks - 1) + 1 ahead: enough to keep the other stages busy,
    not so many that cancelled runs queue behind them (measured: docs/speculation.md).
    """
    return 0.5 / max(1, n_ranks - 1)


@dataclass(frozen=True, kw_only=True)
class GenConfig:
    """The head's parameters, flat, each a value (no "decided later" but p_recovery in the twin): the stage,
    speculation and serving options a generation reads (core/config.py's sections), and what start-up measured."""
    mode: str = "iterative"
    # the stage's
    n_ctx: int = 4096
    n_batch: int = 512                  # the largest decode (within n_ctx)
    prompt_chunk: int = PROMPT_CHUNK    # prompt tokens per decode (within n_batch)
    cache_prompt: bool = True
    # the speculation's
    p_accept: float = 0.5
    p_split: float = 0.1
    p_recovery: float | None = 0.0      # None: auto_p_recovery(ranks), which only the twin resolves (twin/sim.py);
                                        # the head refuses it (check_gen_config)
    p_decay: float = 0.0
    max_branches: int = 1
    draft_max: int = DEFAULT_DRAFT_MAX  # draft tokens per micro-batch (the cap where stage_ms sizes them)
    adaptive_draft: bool = True
    cancel: bool = True
    continuous: bool = True
    quiet_first: bool = True
    draft_rides: str = "auto"
    # the serving's
    n_predict: int = 128
    sampling: SamplingParams = field(default_factory=SamplingParams)
    stop_at_eos: bool = True
    batch_rows: int = 1                 # next tokens of different generations one decode may carry (the exact limit)
    # each stage's decode time (ms) for 1..limit tokens, rank 0 first (startup.py measures it):
    # with it PipeInfer sizes each micro-batch by choose_draft_len (draft_max is then the cap)
    stage_ms: tuple[tuple[float, ...], ...] | None = None
    # a target with recurrent layers (core/recurrent.py): each drafted token of a run in a sequence of its own
    # (nested), so a partly accepted run commits the state after its last accepted token
    state_per_token: bool = False

    @property
    def seqs_per_run(self) -> int:
        """Sequence ids in a speculative run's partition (core/recurrent.seqs_per_run)."""
        return seqs_per_run(self.state_per_token, self.max_branches, self.draft_max)

    @property
    def cutoffs(self) -> Cutoffs:
        """What the drafter is asked for, before the head moves the cutoffs."""
        return Cutoffs(self.p_accept, self.p_split, self.draft_max, self.max_branches)


def runs_as_iterative(mode: str, n_stages: int, draft_at: str) -> bool:
    """Whether the head runs --mode pipeinfer as iterative: on one stage (one rank, or one tensor group) with its draft
    in a thread beside it. One stage returns each run's tokens as it launches it, so a draft working ahead never has a
    run in flight to speculate beside and only takes the stage's cores: measured on one group of 2, one stream at
    0.75-0.91x iterative with no speculative run launched, 8 users at 10.2 tokens/s against iterative's 24.1. A draft
    in series on the head, or on a rank of its own, has its proposals ready at launch: PipeInfer is kept."""
    return mode == "pipeinfer" and n_stages == 1 and draft_at == "thread"


def gen_config(config: Config, resolved: Resolved) -> GenConfig:
    """The head's parameters: the run's options as given, with what start-up resolved (the batch sizes, p_recovery,
    draft_max, batch_rows) and measured (stage costs) in place of their Nones."""
    stage, spec, serving = config.stage, config.speculation, config.serving
    return GenConfig(
        mode=config.mode, n_ctx=stage.n_ctx, n_batch=resolved.n_batch, prompt_chunk=resolved.prompt_chunk,
        cache_prompt=stage.cache_prompt,
        p_accept=spec.p_accept, p_split=spec.p_split, p_recovery=resolved.p_recovery, p_decay=spec.p_decay,
        max_branches=spec.max_branches, draft_max=resolved.draft_max, adaptive_draft=spec.adaptive_draft,
        cancel=spec.cancel, continuous=spec.continuous, quiet_first=spec.quiet_first, draft_rides=spec.draft_rides,
        n_predict=serving.n_predict, sampling=serving.sampling, stop_at_eos=serving.stop_at_eos,
        batch_rows=resolved.batch_rows, stage_ms=resolved.stage_ms, state_per_token=resolved.state_per_token)


def check_gen_config(cfg: GenConfig) -> None:
    if cfg.mode not in MODES:
        raise ValueError(f"unknown mode {cfg.mode!r}")
    if cfg.p_recovery is None:
        raise ValueError("p_recovery is unresolved: pass a number (auto_p_recovery gives the default)")
