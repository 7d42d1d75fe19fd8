"""Prompt-lookup drafting (NgramDrafter), main_chain and top_candidates; no model is loaded."""
from __future__ import annotations

import numpy as np
import pytest

from pipeinfer.drafters.drafter import Cutoffs, DraftNode, NgramDrafter, main_chain, top_candidates


def draft(context, p_accept=0.0, n_max=4, n_min=1, ngram_max=4):
    return NgramDrafter(n_min, ngram_max).draft(list(context), Cutoffs(p_accept=p_accept, n_max=n_max))


def tokens(tree: list[DraftNode]) -> list[int]:
    return [n.token for n in tree]


def test_continues_the_longest_match():
    # tail [1, 2] matches at 0 (bigram): continue with what followed it
    tree = draft([1, 2, 3, 4, 1, 2], n_max=3)
    assert tokens(tree) == [3, 4, 1]
    assert [n.parent for n in tree] == [-1, 0, 1] and [n.depth for n in tree] == [0, 1, 2]
    assert all(n.branches == {0} for n in tree)
    assert all(n.prob == pytest.approx(2 / 3) for n in tree)   # confidence n / (n + 1) for an n-gram match


def test_prefers_longer_ngram_over_more_recent_shorter_one():
    # [7, 8, 9] occurs at 0 (trigram match) while the unigram [9] also occurs more recently at 5
    ctx = [7, 8, 9, 1, 2, 9, 3, 7, 8, 9]
    tree = draft(ctx, n_max=2)
    assert tokens(tree) == [1, 2] and tree[0].prob == pytest.approx(3 / 4)


def test_uses_the_most_recent_earlier_match():
    tree = draft([5, 1, 7, 1, 8, 1], n_max=4)               # unigram [1] at 1 and 3: the later one wins
    assert tokens(tree) == [8, 1]                            # truncated by the end of the context
    assert tree[0].prob == pytest.approx(0.5)


def test_continuation_may_overlap_the_tail():
    assert tokens(draft([1, 1, 1], n_max=4)) == [1]


@pytest.mark.parametrize("n_max", [1, 2, 3, 5])
def test_respects_n_max(n_max):
    ctx = [1, 2, 3, 4, 5, 6, 7, 8, 1, 2]
    tree = draft(ctx, n_max=n_max)
    assert tokens(tree) == [3, 4, 5, 6, 7][:n_max]


def test_respects_ngram_length_limit():
    ctx = [4, 5, 6, 7, 0, 9, 5, 6, 7, 1, 4, 5, 6, 7]
    # with 4-grams, [4, 5, 6, 7] matches at 0 -> continue with 0
    assert tokens(draft(ctx, n_max=1, ngram_max=4)) == [0]
    # limited to 3-grams, [5, 6, 7] last occurred at 6 -> continue with 1
    assert tokens(draft(ctx, n_max=1, ngram_max=3)) == [1]


def test_min_ngram_length():
    ctx = [3, 9, 4, 5, 9]                                    # only a unigram match
    assert tokens(draft(ctx, n_min=1)) == [4, 5, 9]
    assert draft(ctx, n_min=2) == []


@pytest.mark.parametrize("ctx", [[], [1], [1, 2], [1, 2, 3, 4], [5, 5, 6, 7, 8]])
def test_no_match_returns_empty(ctx):
    assert draft(ctx) == []


def test_confidence_below_p_accept_returns_empty():
    ctx = [1, 2, 3, 4, 1, 2]                                 # bigram match: confidence 2/3
    assert tokens(draft(ctx, p_accept=0.6)) == [3, 4, 1, 2]
    assert draft(ctx, p_accept=0.7) == []
    ctx = [5, 1, 7, 1]                                       # unigram match: confidence 1/2
    assert tokens(draft(ctx, p_accept=0.5)) == [7, 1]        # >= p_accept is confident enough
    assert draft(ctx, p_accept=0.51) == []


def test_draft_is_a_valid_tree_for_the_head():
    ctx = list(range(10)) * 3
    tree = draft(ctx, n_max=4)
    assert tokens(tree) == [0, 1, 2, 3]
    for i, n in enumerate(tree):
        assert n.parent < i and (n.parent < 0 or tree[n.parent].depth == n.depth - 1)
        assert isinstance(n.token, int)
    assert main_chain(tree) == [0, 1, 2, 3]


# ---------------------------------------------------------------- main_chain
def test_main_chain_of_a_tree():
    #  depth 0: a (branches 0, 1)  depth 1: b (0), c (1)  depth 2: d (0), e (1)
    tree = [DraftNode(10, -1, 0, {0, 1}), DraftNode(11, 0, 1, {0}), DraftNode(12, 0, 1, {1}),
            DraftNode(13, 1, 2, {0}), DraftNode(14, 2, 2, {1})]
    assert main_chain(tree) == [0, 1, 3]
    assert [tree[i].token for i in main_chain(tree)] == [10, 11, 13]


def test_main_chain_empty():
    assert main_chain([]) == []
    assert main_chain([DraftNode(1, -1, 0, {1})]) == []


def test_top_candidates_match_a_full_softmax_and_sort():
    rng = np.random.default_rng(3)
    for n_vocab in (5, 1000, 262144):
        logits = (rng.standard_normal(n_vocab) * 4).astype(np.float32)
        top, p = top_candidates(logits, 8)
        x = logits.astype(np.float64)
        full = np.exp(x - x.max())
        full /= full.sum()
        order = np.argsort(-full, kind="stable")[:8]
        assert top.tolist() == order.tolist()
        assert p == pytest.approx(full[order], rel=1e-5)
