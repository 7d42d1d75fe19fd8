"""Drafts of drafts (drafters/stack.py): the verification length rule, a hierarchy's chain equal to its first level's
alone whatever the levels below propose, the options that build one, and real hierarchies under mpiexec."""
import numpy as np
import pytest

from helpers import PROMPT, mpirun
from pipeinfer.core.config import Config, DraftOptions, draft_label
from pipeinfer.core.errors import UserError
from pipeinfer.drafters.drafter import Cutoffs, DraftNode, InSeries
from pipeinfer.drafters.stack import MAX_VERIFY, StackedDrafter, verify_len

CPU_ROWS = [26.3, 55.8, 70.1, 79.4, 96.0, 113.1, 126.0, 139.2]   # Coder 0.5B, 1 thread, repacked (measured here)
FLAT_ROWS = [10.0] * 8                                              # a batch as cheap as one row (PipeSpec's GPUs)


def test_on_cpu_costs_only_a_level_that_nearly_always_agrees_is_verified():
    assert verify_len(0.2, CPU_ROWS, 7) == 0
    assert verify_len(0.8, CPU_ROWS, 7) == 0
    assert verify_len(0.9, CPU_ROWS, 7) == 3    # 4 rows cost 3 single decodes: worth it at 90%
    assert verify_len(0.97, CPU_ROWS, 7) == 7
    assert verify_len(0.97, CPU_ROWS, 1) == 0   # 2 rows cost more than 2 single decodes: never


def test_where_a_batch_costs_one_row_any_agreement_pays():
    """PipeSpec's claim (a gain for any non-zero acceptance) holds exactly where verification is free."""
    for a in (0.05, 0.3, 0.9):
        assert verify_len(a, FLAT_ROWS, 7) >= 5
    assert verify_len(0.0, FLAT_ROWS, 7) == 0


class Chain:
    """A deterministic model over 16 tokens: after a context, token (3 * last + len) % 16 at probability 0.9, except
    where len % 5 == 4 (0.4: below a 0.5 cutoff). sync/step/extend as ModelDrafter's; decodes and rows counted."""

    n_vocab = 16
    exact_batch = None

    def __init__(self, row_costs=CPU_ROWS):
        self.row_costs = row_costs
        self.n_decodes = self.n_rows = 0

    def _logits(self, ctx):
        top = 0.4 if len(ctx) % 5 == 4 else 0.9
        p = np.full(self.n_vocab, (1 - top) / (self.n_vocab - 1))
        p[(3 * ctx[-1] + len(ctx)) % self.n_vocab] = top
        return np.log(p).astype(np.float32)

    def prefill(self, prompt):
        self.ctx = list(prompt)

    def sync(self, ctx):
        self.ctx = list(ctx)
        return self._logits(self.ctx)

    def step(self, n, token):
        self.n_decodes += 1
        self.n_rows += 1
        self.ctx = self.ctx[:n] + [token]
        return self._logits(self.ctx)

    def extend(self, n, tokens):
        if tokens:
            self.n_decodes += 1
            self.n_rows += len(tokens)
        self.ctx = self.ctx[:n] + list(tokens)
        return np.stack([self._logits(self.ctx[:n + k + 1]) for k in range(len(tokens))]) if tokens else \
            np.empty((0, self.n_vocab), np.float32)

    def draft(self, ctx, cut):
        """The model alone: its greedy chain, as ModelDrafter.draft gives one."""
        chain, ctx = [], list(ctx)
        while len(chain) < cut.n_max:
            p = np.exp(self._logits(ctx))
            t = int(np.argmax(p))
            if p[t] < cut.p_accept:
                break
            chain.append(t)
            ctx.append(t)
        return chain


class Proposer(InSeries):
    """A level below: proposes the upper's own next tokens, each wrong (shifted) with probability 1 - agreement."""

    ahead_chunk = 1

    def __init__(self, upper: Chain, agreement: float, seed: int = 0):
        self.upper, self.agreement, self.rng = upper, agreement, np.random.default_rng(seed)

    def prefill(self, prompt):
        pass

    def draft(self, ctx, cut):
        right = self.upper.draft(ctx, Cutoffs(0.0, 1.0, cut.n_max, 1))
        out = [t if self.rng.random() < self.agreement else (t + 1) % 16 for t in right]
        return [DraftNode(t, k - 1, k, {0}, 0.9) for k, t in enumerate(out)]


@pytest.mark.parametrize("agreement,rows", [(0.0, FLAT_ROWS), (0.5, FLAT_ROWS), (1.0, FLAT_ROWS), (0.95, CPU_ROWS),
                                            (0.3, CPU_ROWS)])
def test_a_hierarchy_drafts_what_its_first_level_drafts_alone(agreement, rows):
    upper = Chain(rows)
    stack = StackedDrafter(upper, Proposer(Chain(), agreement, seed=7), ["upper", "below"])
    stack.prefill([1, 2, 3])
    ctx = [1, 2, 3]
    cut = Cutoffs(0.5, 1.0, 6, 1)
    for _ in range(12):
        got = [n.token for n in stack.draft(ctx, cut)]
        assert got == upper.draft(ctx, cut)
        ctx = ctx + (got[:2] or [5])   # the target keeps two, or says another token
    upper_counts, below_counts = stack.levels()
    assert upper_counts.n_proposed > 0 and below_counts.n_kept <= below_counts.n_proposed


def test_a_level_that_always_agrees_is_verified_in_batches_one_that_never_does_is_asked_rarely():
    agreeing = StackedDrafter(Chain(FLAT_ROWS), Proposer(Chain(), 1.0), ["a", "b"])
    never = StackedDrafter(Chain(CPU_ROWS), Proposer(Chain(), 0.0), ["a", "b"])
    for stack in (agreeing, never):
        stack.prefill([1, 2, 3])
        ctx = [1, 2, 3]
        for _ in range(40):
            chain = [n.token for n in stack.draft(ctx, Cutoffs(0.0, 1.0, 4, 1))]
            ctx += chain
    assert agreeing.upper.n_rows / agreeing.upper.n_decodes > 2     # whole chains in one decode
    assert never.levels()[1].n_calls <= 8                           # 160 tokens: asked after 8, 24, 56, 120 cycles
    assert never.upper.n_rows == never.upper.n_decodes              # never verified: one row a decode
    assert never.agreement() < 0.5


def test_draft_options_build_levels():
    from pipeinfer.cli.options import _draft_levels
    assert _draft_levels(("ngram",), None) == (None, ())
    with pytest.raises(UserError, match="last level"):
        _draft_levels(("ngram", "ngram"), None)
    with pytest.raises(UserError, match="n-gram drafter, not --drafter replay"):
        _draft_levels(("ngram",), "replay")
    config = Config("/m/t.gguf", draft=DraftOptions(model="/m/a.gguf", below=("/m/b.gguf", "ngram"), drafter="model",
                                                    at="thread"))
    assert draft_label(config) == "a.gguf<b.gguf<ngram (thread)"
    assert Config.from_json(config.to_json()) == config


def test_a_level_above_another_needs_the_targets_vocabulary(models):
    from pipeinfer.drafters.factory import make_drafter
    draft = DraftOptions(model="ngram", below=(str(models["draft60"]),), drafter="model")
    with pytest.raises(UserError, match="needs the target's vocabulary"):
        make_drafter(draft, target=str(models["q8"]), mode="pipeinfer", n_ctx=256, kernels="repack", max_branches=1,
                     seed=0, n_vocab=512, n_threads=1, n_threads_batch=1)


def test_max_verify_fits_the_probe():
    assert MAX_VERIFY + 1 == len(CPU_ROWS)


N = 48


@pytest.mark.mpi
@pytest.mark.parametrize("mode,n_ranks,draft_at,below_at", [
    ("speculative", 2, "head", "inline"), ("pipeinfer", 2, "thread", "inline"), ("pipeinfer", 3, "head", "inline"),
    ("speculative", 3, "head", "inline"), ("pipeinfer", 3, "rank", "inline"), ("pipeinfer", 2, "head", "thread"),
    ("speculative", 2, "thread", "thread")])
def test_three_levels_are_exact(models, mode, n_ranks, draft_at, below_at):
    """draft90 drafting for the target, draft60 for draft90, the n-gram drafter for draft60: the target's tokens,
    the levels in series or each below the first ahead in a thread of its own."""
    from synth import reference_greedy
    ref = reference_greedy(models["q8"], PROMPT, N)
    out = mpirun(n_ranks, {"model": str(models["q8"]), "prompt": PROMPT, "n": N, "mode": mode,
                           "draft": str(models["draft90"]), "draft_below": [str(models["draft60"]), "ngram"],
                           "draft_at": draft_at, "draft_below_at": below_at})
    assert out["tokens"] == ref
    s = out["stats"]
    # over a draft rank's link the levels' counts are not reported (draftahead.DraftClient.levels)
    assert [lv["level"] for lv in s["draft_levels"]] == ([] if draft_at == "rank" else ["d90.gguf", "d60.gguf", "ngram"])
    if draft_at == "head" and below_at == "inline":  # beside: a draft may be late, nothing launched; in series: never
        assert s["n_spec_runs"] > 0 and s["n_draft_accepted"] > 0
        assert s["draft_levels"][0]["proposed"] > 0 and s["draft_levels"][1]["calls"] > 0


def test_the_twin_prices_a_hierarchy_by_the_same_rule():
    from pipeinfer.twin.levels import CPU_ROWS as CPU, FLAT_ROWS as FLAT, Level, price
    eight, one = Level("8B", 400.0, 0.8), Level("1B", 70.0, 0.7)
    assert price([eight]).ms_per_token == 400.0
    cpu, flat = price([eight, one], CPU), price([eight, one], FLAT)
    assert cpu.verify == (0,) and cpu.ms_per_token == 400.0          # on CPUs the 1B at 70% does not pay
    assert flat.verify[0] > 0 and flat.ms_per_token < 400.0 * 0.7    # where a batch costs one row it does
    agreeing = price([eight, Level("1B", 70.0, 0.95)], CPU)
    assert agreeing.verify[0] > 0 and agreeing.ms_per_token < 400.0
    three = price([eight, Level("1B", 70.0, 0.95), Level("ngram", 0.0, 0.3)], FLAT)
    assert len(three.verify) == 2 and three.ms_per_token <= price([eight, Level("1B", 70.0, 0.95)], FLAT).ms_per_token
