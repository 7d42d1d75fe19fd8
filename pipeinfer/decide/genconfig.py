"""The head's parameters: the run's stage, speculation and serving sections (core/config.py) as start-up resolved
them, and what it measured (GenConfig), made from the command line's configuration (gen_config)."""
from __future__ import annotations

from dataclasses import dataclass, fields

from ..core.config import DEFAULT_DRAFT_MAX, MODES, Config, ServingOptions, SpeculationOptions, StageOptions
from ..core.recurrent import seqs_per_run
from ..drafters.drafter import Cutoffs


def auto_p_recovery(n_ranks: int) -> float:
    """The default recovery factor: 0.5 per micro-batch over the stages after the head's.

    A draft of confidence c keeps launching while c >= p_accept + k * p_recovery, i.e. about
    (c - p_accept) / p_recovery + 1 micro-batches past the last verification; with this factor a confident
    draft (0.9 over -pa 0.5) runs about 0.8 * (n_ranks - 1) + 1 ahead: enough to keep the other stages busy,
    not so many that cancelled runs queue behind them. Measured on 2 ranks (launch/bench/bench_repeat.py --config): 0.5 beat
    0.25 and 0.1 at every agreement tried.
    """
    return 0.5 / max(1, n_ranks - 1)


@dataclass(frozen=True, kw_only=True)
class GenConfig(StageOptions, SpeculationOptions, ServingOptions):
    """The head's parameters: the run's stage, speculation and serving sections (core/config.py) as start-up
    resolved them (n_batch, prompt_chunk, draft_max, p_recovery, batch_rows), and what it measured."""
    mode: str = "iterative"
    p_recovery: float | None = 0.0   # None until resolved: auto_p_recovery(number of ranks)
    draft_max: int | None = DEFAULT_DRAFT_MAX
    batch_rows: int = 1              # next tokens of different generations one decode may carry (the exact limit)
    # each stage's decode time (ms) for 1..limit tokens, rank 0 first (startup.py measures it):
    # with it PipeInfer sizes each micro-batch by choose_draft_len (draft_max is then the cap)
    stage_ms: tuple[tuple[float, ...], ...] | None = None
    # a target with recurrent layers (core/recurrent.py): each drafted token of a run in a sequence of its own
    # (nested), so a partly accepted run commits the state after its last accepted token
    state_per_token: bool = False

    @property
    def seqs_per_run(self) -> int:
        """Sequence ids in a speculative run's partition (core/recurrent.seqs_per_run)."""
        return seqs_per_run(self.state_per_token, self.max_branches, self.draft_max or DEFAULT_DRAFT_MAX)

    @property
    def cut(self) -> Cutoffs:
        """What the drafter is asked for, before the head moves the cutoffs."""
        return Cutoffs(self.p_accept, self.p_split, self.draft_max, self.max_branches)


def gen_config(config: Config, *, n_batch: int, p_recovery: float, batch_rows: int = 1) -> GenConfig:
    """The head's parameters from the run's configuration (n_batch, p_recovery and batch_rows as start-up resolved
    them; draft_max, None for auto, is resolved by start-up after)."""
    own = {f.name: getattr(config, f.name) for f in fields(GenConfig) if hasattr(config, f.name)}
    return GenConfig(**{**own, "n_batch": n_batch, "prompt_chunk": min(config.prompt_chunk, n_batch),
                        "p_recovery": p_recovery, "batch_rows": batch_rows})


def check_gen_config(cfg: GenConfig) -> None:
    if cfg.mode not in MODES:
        raise ValueError(f"unknown mode {cfg.mode!r}")
    if cfg.p_recovery is None:
        raise ValueError("p_recovery is unresolved: pass a number (auto_p_recovery gives the default)")
