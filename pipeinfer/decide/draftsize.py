"""How big each micro-batch of one generation is, and which runner-ups go beside its chain: the draft-size policy
beside the head (head.py). It learns from what verification found (the chain's drafts right or wrong, the siblings
right against what their probabilities promised, what drafting cost) and answers with shape.py's pure rules on the
stages' measured costs."""
from __future__ import annotations

from collections import deque

from ..core.metrics import Stats
from ..core.verify import TreeRun, chain_checks, reached
from ..drafters.drafter import DraftNode
from .genconfig import GenConfig
from .shape import add_siblings, choose_draft_len, choose_siblings, draft_cost_fit, fixed_siblings, ride_len

# the running acceptance starts from this prior, weighing as this many checks: a lucky start does not decide
ACCEPTANCE_PRIOR, PRIOR_CHECKS = 0.6, 8


class DraftSizer:
    """One generation's micro-batch sizes (draft_len, ride_len) and siblings (with_siblings), by its running
    acceptance and the drafter's measured cost."""

    def __init__(self, cfg: GenConfig, stats: Stats, draft_obs: deque[tuple[int, float]] | None = None):
        self.cfg, self.stats = cfg, stats
        self.n_checked = 0          # draft tokens verification reached (their predecessors accepted)
        self.n_agreed = 0           # ... and found right
        self.sib_promised = 0.0     # runner-up probabilities of the siblings verification reached
        # recent (tokens proposed, ms) calls of the drafter in series: every holder's (the scheduler shares one), so
        # a generation newly lent it prices its first micro-batches by what the drafter cost the others
        self.draft_obs: deque[tuple[int, float]] = deque(maxlen=32) if draft_obs is None else draft_obs
        self.stage_ms = None if cfg.stage_ms is None else [list(ms) for ms in cfg.stage_ms]

    def acceptance(self) -> float:
        """The running acceptance of the chain's drafts, with the prior."""
        return (self.n_agreed + ACCEPTANCE_PRIOR * PRIOR_CHECKS) / (self.n_checked + PRIOR_CHECKS)

    def drafted(self, n_tokens: int, ms: float) -> None:
        """A call of the drafter in series proposed n_tokens in ms."""
        self.draft_obs.append((n_tokens, ms))

    def checked(self, chain: list[tuple[int, int]], accepted: list[int], m_before: int) -> None:
        """Verification accepted positions m_before.. of `accepted`: the chain's (pos, token) drafts they decided."""
        checked, agreed = chain_checks(chain, accepted, m_before)
        self.n_checked += checked
        self.n_agreed += agreed

    def siblings_checked(self, run: TreeRun, siblings: dict[int, float], accepted: list[int]) -> None:
        """A verified run's siblings (node index -> probability) whose chain reached them: how many were right,
        against what their probabilities promised (the correction choose_siblings applies)."""
        m = len(accepted)
        for i, prob in siblings.items():
            n = run.nodes[i]
            if n.pos < m and reached(run, i, accepted):
                self.sib_promised += prob
                self.stats.n_siblings_right += accepted[n.pos] == n.token

    def draft_len(self) -> int:
        """Draft tokens for the next micro-batch: choose_draft_len on the measured costs and the running acceptance,
        or --draft-max without stage costs. A drafter beside the pipeline costs the head nothing per token."""
        cutoffs = self.cfg.cutoffs
        if self.stage_ms is None or self.cfg.mode != "pipeinfer":
            return cutoffs.n_max
        n = choose_draft_len(self.acceptance(), self.stage_ms, draft_cost_fit(self.draft_obs), cutoffs.n_max)
        self.stats.draft_len_hist[n] = self.stats.draft_len_hist.get(n, 0) + 1
        return n

    def ride_len(self, n_rows: int, draft_ms: float | None = None) -> int:
        """Draft tokens worth riding a shared decode of n_rows other rows, within the batch's rows: by --draft-rides,
        0 (never), that or a micro-batch's size (always), or as shape.ride_len finds on the measured costs and the
        running acceptance (auto: 0 where they buy less than those rows, or without stage costs). draft_ms: what a
        ride has cost the head in drafting so far (the scheduler's ride costs), else the fit of the drafter's calls."""
        cap = min(self.cfg.cutoffs.n_max, self.cfg.batch_rows - n_rows)
        if self.cfg.draft_rides == "never" or self.cfg.mode != "pipeinfer" or self.cfg.state_per_token or cap < 1:
            return 0
        k = 0
        if self.stage_ms is not None:
            cost = draft_cost_fit(self.draft_obs) if draft_ms is None else (draft_ms, 0.0)
            k = ride_len(n_rows, self.acceptance(), self.stage_ms, cost, cap)
        if k == 0 and self.cfg.draft_rides == "always":
            k = min(cap, self.draft_len())
        return k

    def with_siblings(self, chain: list[DraftNode], p_split: float) -> list[DraftNode]:
        """The chain with the runner-ups that pay as one-token siblings (shape.py): by the measured stage costs when
        there are any, else every runner-up >= p_split, within --max-branches and the batch cap."""
        cutoffs = self.cfg.cutoffs
        room = cutoffs.max_branches - 1
        if self.stage_ms is None:
            keep, depths = fixed_siblings(chain, cutoffs.n_max, room, p_split)
            chain = chain[:keep]
        else:
            sibling_rate = (self.stats.n_siblings_right + 1.0) / (self.sib_promised + 1.0)
            depths = choose_siblings(chain, self.acceptance(), sibling_rate, self.stage_ms,
                                     draft_cost_fit(self.draft_obs), cutoffs.n_max, room, p_split)
        if depths:
            self.stats.n_siblings += len(depths)
        return add_siblings(chain, depths) if depths else chain
