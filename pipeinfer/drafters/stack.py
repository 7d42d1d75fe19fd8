"""Drafts of drafts (PipeSpec's hierarchy, McDanel et al. 2025): a draft model in the target's vocabulary whose own
proposals come from a cheaper drafter below it, verified in one batch.

    target  <- verifies ->  level 1 (`upper`: a ModelDrafter of the target's vocabulary)
                            level 1 <- verifies ->  level 2 (`lower`: any drafter, itself a stack or not)

Level 1's chain is what it would draft alone, token for token: at each position it proposes its own most likely
token, and the level below only decides how many of level 1's decodes are one batch. The level below proposes a
chain after the context; level 1 decodes that chain in one batch (ModelDrafter.extend) and walks it: where its own
top token is the proposed one, the next row's logits are already there; at the first token it disagrees with,
level 1's own token goes in the chain, the rows after it are rolled back (seq 0 truncated), and the level below is
asked again from there. Output exactness is untouched (the target verifies whatever level 1 proposes), and level 1's
agreement with the target is what it is alone: the hierarchy buys only cost, where a batch of b rows costs less
than b single decodes. How much of the chain below is verified at once is chosen each time (verify_len) from what
level 1's decodes of 1..8 rows cost, measured once, and how often the level below has agreed so far: on CPUs where
a decode costs about its rows in single decodes, only a level below that nearly always agrees is worth verifying,
and otherwise level 1 drafts alone, asking the level below one token now and then to keep its agreement measured
(docs/speculation.md, Drafts of drafts).

The drafter as a whole runs where --draft-at puts it (in series on the head, in a thread beside the pipeline, or on a
rank of its own), asynchronous with the target's stages. Inside it the levels run in series, or with
--draft-below-at thread each level below the first drafts ahead in a thread of its own (draftahead.ThreadDrafter,
steered to the level above's context) and the level above takes what it has ready, never waiting.
"""
from __future__ import annotations

import time
from dataclasses import dataclass

from .drafter import Cutoffs, Drafter, DraftNode, InSeries, ModelDrafter, main_chain, top_candidates

MAX_VERIFY = 7           # proposals of the level below verified in one decode at most (8 rows with the pending token)
AGREE_PRIOR, PRIOR_CHECKS = 0.5, 4  # the running agreement of the level below starts here, weighing as 4 checks
EXPLORE_FIRST, EXPLORE_MAX = 8, 256  # while verifying does not pay, the level below is still asked one token
                                     # after 8 cycles, then 16, 32, .. (a model below catches up on every token since)


def verify_len(agreement: float, row_ms: list[float], cap: int, below_ms: float = 0.0) -> int:
    """How many of the level below's proposals to verify in the next decode, 0..cap: the L that gives the upper level
    the most tokens per ms. The decode holds the upper level's own last token and L proposals (row_ms[L]: the ms of
    L + 1 rows), the level below spends below_ms per proposal, and it gives 1 + a + a^2 + .. + a^L tokens in
    expectation (a proposal counts when every one before it was right); L = 0 is the upper level alone, one token per
    row_ms[0]."""
    best, best_rate = 0, 1.0 / row_ms[0] if row_ms and row_ms[0] > 0 else 0.0
    for n in range(1, min(cap, len(row_ms) - 1) + 1):
        gain = sum(agreement ** j for j in range(n + 1))
        ms = row_ms[n] + n * below_ms
        rate = gain / ms if ms > 0 else float("inf")
        if rate > best_rate * (1 + 1e-9):
            best, best_rate = n, rate
    return best


def level_ms_per_token(agreement: float, row_ms: list[float], cap: int, below_ms: float = 0.0) -> tuple[float, int]:
    """(ms per token of the upper level drafted with the level below's help, the L verify_len chooses): what a level
    costs the one above it, for the twin's hierarchies (twin/levels.py)."""
    n = verify_len(agreement, row_ms, cap, below_ms)
    return (row_ms[n] + n * below_ms) / sum(agreement ** j for j in range(n + 1)), n


@dataclass
class LevelCounts:
    """What one level of a hierarchy did for the level above it, in one generation."""
    name: str
    n_proposed: int = 0          # tokens it proposed to the level above (the first level: to the target)
    n_kept: int = 0              # of those, the ones the level above agreed with (the first level: 0, the head counts)
    n_calls: int = 0             # times it was asked
    busy_s: float = 0.0          # its own drafting time (the levels below excluded)

    def as_dict(self) -> dict:
        return {"level": self.name, "proposed": self.n_proposed, "kept": self.n_kept, "calls": self.n_calls,
                "busy_s": round(self.busy_s, 4)}


class StackedDrafter(InSeries):
    """`upper` drafts for the target; `lower` drafts for `upper` (see the module docstring). `names`: the levels'
    labels from upper down, for the statistics. Upper's decode costs of 1..MAX_VERIFY + 1 rows are measured at the
    first prefill and kept on `upper` (ModelDrafter.row_costs), which every generation's stack shares. Beside the
    pipeline it proposes each token as soon as it is drafted (InSeries.ahead_chunk)."""

    def __init__(self, upper: ModelDrafter, lower: Drafter, names: list[str]):
        self.upper, self.lower = upper, lower
        self.exact_batch = upper.exact_batch
        self.below_s = 0.0     # the level below's drafting time ...
        self.below_tokens = 0  # ... and the tokens it proposed (what a proposal costs: verify_len's below_ms)
        self.n_checked = 0     # proposals of the level below compared with the upper level's token ...
        self.n_agreed = 0      # ... and equal to it
        self._asked = 0
        self._explore_gap = EXPLORE_FIRST  # cycles until the level below is next asked while verifying does not pay
        self._explore_at = EXPLORE_FIRST
        self._own = LevelCounts(names[0])
        self._below = LevelCounts(names[1])  # the level below as this one saw it (what it proposed, what was kept)

    def levels(self) -> list[LevelCounts]:
        """Each level's counts, upper first: this level's, the level below's as this one saw it, then the deeper
        levels' as the level below reports them."""
        return [self._own, self._below, *self.lower.levels()[1:]]

    def agreement(self) -> float:
        """The level below's running agreement with this level, with the prior."""
        return (self.n_agreed + AGREE_PRIOR * PRIOR_CHECKS) / (self.n_checked + PRIOR_CHECKS)

    def prefill(self, prompt: list[int]) -> None:
        for level in self.levels():
            level.n_proposed = level.n_kept = level.n_calls = 0
            level.busy_s = 0.0
        self.upper.prefill(prompt)
        if self.upper.row_costs is None:
            self.upper.row_costs = self.upper.row_ms(len(prompt), MAX_VERIFY + 1)
        self.lower.prefill(prompt)

    def close(self) -> None:
        self.upper.close()
        self.lower.close()

    def draft(self, context: list[int], cut: Cutoffs) -> list[DraftNode]:
        t0 = time.perf_counter()
        t_below = 0.0
        self._own.n_calls += 1
        ctx = list(context)
        logits = self.upper.sync(ctx)  # after ctx; None while ctx's last token is the upper's own, not decoded yet
        chain: list[DraftNode] = []
        while len(chain) < cut.n_max:
            below_ms = 1e3 * self.below_s / self.below_tokens if self.below_tokens else 0.0
            n_verify = verify_len(self.agreement(), self.upper.row_costs, min(MAX_VERIFY, cut.n_max - len(chain)),
                                  below_ms)
            self._asked += 1
            proposed: list[int] = []
            exploring = n_verify == 0 and self._asked >= self._explore_at
            if exploring:
                self._explore_gap = min(EXPLORE_MAX, 2 * self._explore_gap)
                self._explore_at = self._asked + self._explore_gap
            elif n_verify > 0:
                self._explore_gap = EXPLORE_FIRST
            if self.lower.asynchronous:  # drafting ahead in a thread of its own: take what it has ready, never wait
                self.lower.steer(ctx, len(ctx) + MAX_VERIFY, cut.p_accept, 1)
                proposed = [n.token for n in self.lower.ready(ctx, cut.p_accept, max(1, n_verify))[0]]
                self._below.n_calls += 1
                self._below.n_proposed += len(proposed)
            elif n_verify > 0 or exploring:
                t1 = time.perf_counter()
                below = self.lower.draft(ctx, Cutoffs(cut.p_accept, 1.0, max(1, n_verify), 1))
                proposed = [below[i].token for i in main_chain(below)][:max(1, n_verify)]
                dt = time.perf_counter() - t1
                t_below += dt
                self.below_s += dt
                self.below_tokens += max(1, len(proposed))
                self._below.n_calls += 1
                self._below.n_proposed += len(proposed)
            # one decode: the upper's own last token (where it is not decoded yet) and the proposals verified
            undecoded = [ctx[-1]] if logits is None else []
            rows = self.upper.extend(len(ctx) - len(undecoded), undecoded + proposed[:n_verify])
            if logits is None:
                logits, rows = rows[0], rows[1:]
            k = 0  # proposals the upper level agreed with
            while len(chain) < cut.n_max:
                top, p = top_candidates(logits)
                if p[0] < cut.p_accept:
                    break
                token = int(top[0])
                chain.append(DraftNode(token, len(chain) - 1, len(chain), {0}, float(p[0]),
                                       int(top[1]) if len(top) > 1 else -1, float(p[1]) if len(top) > 1 else 0.0))
                ctx.append(token)
                if k < len(proposed):
                    self.n_checked += 1
                    self.n_agreed += proposed[k] == token
                if k < len(rows) and proposed[k] == token:
                    logits = rows[k]
                    k += 1
                else:  # the proposals ran out or went elsewhere: ask again after the upper's own token
                    k += k < len(proposed) and proposed[k] == token
                    logits = None
                    break
            self._below.n_kept += k
            if logits is not None and len(chain) < cut.n_max:
                break  # below the cutoff: the upper level is unsure here
        self._own.busy_s += time.perf_counter() - t0 - t_below
        self._own.n_proposed += len(chain)
        self._below.busy_s += t_below
        return chain
