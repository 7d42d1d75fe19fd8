"""ModelDrafter on a real (synthetic) GGUF through llama.cpp: what seq 0 holds is reused, and reuse never
changes a draft."""
import numpy as np
import pytest

from pipeinfer.drafters.drafter import Cutoffs, ModelDrafter
from synth import PROMPT_TOKENS

CHAIN = Cutoffs(p_accept=0.0, p_split=1.0, n_max=3, max_branches=1)


def _drafter(path):
    return ModelDrafter(str(path), n_ctx=256, max_branches=4, n_threads=1, n_threads_batch=1)


def _tokens(tree):
    return [(n.token, n.parent, n.depth, sorted(n.branches)) for n in tree]


@pytest.fixture(scope="module")
def reused_and_fresh(models):
    return _drafter(models["draft90"]), models["draft90"]


def test_continuing_the_chain_decodes_only_new_tokens(reused_and_fresh):
    d, _ = reused_and_fresh
    ctx = list(PROMPT_TOKENS)
    d.draft(ctx, CHAIN)
    for _ in range(4):
        chain = [n.token for n in d.draft(ctx, CHAIN)]  # the same call again: everything held
        n0 = d.n_decodes
        assert [n.token for n in d.draft(ctx, CHAIN)] == chain and d.n_decodes == n0
        ctx += chain[:2]                                # accepted 2 of 3: the third is held, one new
        d.draft(ctx, CHAIN)
        assert d.n_decodes == n0 + 2, "held: the context and the chain's third token; decoded: 2 new tokens"


def test_reuse_never_changes_a_draft(reused_and_fresh):
    """A drafter that keeps seq 0 across calls (context moves forward, back, off its chain; trees with
    branches in between) drafts exactly what a fresh drafter drafts for each context."""
    d, path = reused_and_fresh
    fresh = _drafter(path)
    tree_cut = Cutoffs(p_accept=0.0, p_split=0.0, n_max=5, max_branches=3)
    ctx = list(PROMPT_TOKENS)
    contexts = []
    for i in range(10):
        cut = tree_cut if i % 4 == 3 else CHAIN
        got = d.draft(ctx, cut)
        contexts.append((list(ctx), cut, got))
        chain = [n.token for n in got if 0 in n.branches]
        if i % 3 == 2:
            ctx = ctx[:-2] + [(ctx[-1] + 7) % 500 + 3]   # a rejection: off the chain, shorter
        else:
            ctx = ctx + chain[:1 + i % 3]
    for ctx, cut, got in contexts:
        fresh._truncate(0)
        fresh._out.clear()
        assert _tokens(fresh.draft(ctx, cut)) == _tokens(got)


def test_profile_times_a_same_vocabulary_draft_untranslated(models):
    from pipeinfer.engine.kernels import DEFAULT_KERNELS
    from pipeinfer.twin.profile import measure_draft
    d = measure_draft(models["draft90"], 1, DEFAULT_KERNELS, target=str(models["f32"]))
    assert d["ms_per_token"] > 0 and "translating" not in d


def test_pruned_head_gives_the_full_heads_logits_for_kept_tokens(models):
    """--draft-head: the pruned draft's logits at the kept ids are the full draft's, bit for bit (same kernel,
    same rows); every other token gets -inf, so drafts only ever hold kept tokens."""
    full = _drafter(models["draft90"])
    pruned = ModelDrafter(str(models["draft90"]), n_ctx=256, max_branches=4, n_threads=1, n_threads_batch=1,
                          head_tokens=384)
    assert pruned.n_vocab == full.n_vocab == 512 and len(pruned.keep) == 384
    ctx = list(PROMPT_TOKENS)
    a, b = full.sync(ctx), pruned.sync(ctx)
    np.testing.assert_array_equal(b[pruned.keep], a[pruned.keep])
    assert np.isneginf(np.delete(b, pruned.keep)).all()
    tree = pruned.draft(ctx, Cutoffs(p_accept=0.0, p_split=0.0, n_max=5, max_branches=3))
    assert tree and all(n.token in set(pruned.keep.tolist()) for n in tree)
