"""Sampling and lossless verification of chains and trees (invariants 9 and 10)."""
from __future__ import annotations

import numpy as np
import pytest

from pipeinfer.core.sampling import SamplingParams
from pipeinfer.core.verify import Node, TreeRun, consistent, is_useful, logits_to_probs, row_tokens, sample_at, verify

V = 8
GREEDY = SamplingParams()


def onehot(tok: int, v: int = V, margin: float = 5.0) -> np.ndarray:
    row = np.zeros(v, dtype=np.float32)
    row[tok] = margin
    return row


def vfy(run: TreeRun, logits: np.ndarray, accepted: list[int], sp: SamplingParams):
    """verify() as the head runs it: the last stage turns each output row's logits into a token first."""
    pos = {n.row: n.pos for n in run.nodes if n.row >= 0}
    return verify(run, row_tokens(logits, np.array([pos[r] for r in range(len(logits))]), sp), accepted)


def table(*toks: int) -> np.ndarray:
    """Logits rows whose greedy tokens are `toks`."""
    return np.stack([onehot(t) for t in toks])


def softmax(x: np.ndarray) -> np.ndarray:
    e = np.exp(x - x.max())
    return e / e.sum()


# ---------------------------------------------------------------- sampling
def test_sample_at_greedy_is_argmax():
    rng = np.random.default_rng(1)
    for pos in range(50):
        logits = rng.normal(size=40).astype(np.float32)
        for seed in (0, 1, 123):
            assert sample_at(logits, pos, SamplingParams(temp=0.0, seed=seed)) == int(np.argmax(logits))
    assert sample_at(np.array([0.0, 3.0, 3.0 - 1e-3, -1.0], np.float32), 7, SamplingParams(temp=-1.0)) == 1


def test_sample_at_sampled_is_deterministic_per_seed_and_position():
    logits = np.zeros(50, dtype=np.float32)  # uniform: every draw is an independent fair pick
    sp = SamplingParams(temp=1.0, seed=42)
    a = [sample_at(logits, pos, sp) for pos in range(200)]
    assert a == [sample_at(logits, pos, sp) for pos in range(200)]                 # same (seed, pos): same token
    assert len(set(a)) > 25                                                      # positions draw independently
    b = [sample_at(logits, pos, SamplingParams(temp=1.0, seed=43)) for pos in range(200)]
    assert sum(x != y for x, y in zip(a, b)) > 150                               # the seed matters too


def test_negative_seed_is_rejected_up_front_or_works():
    try:
        sp = SamplingParams(temp=1.0, seed=-1)
    except ValueError:
        return                                                    # rejected when the options are parsed: fine
    tok = sample_at(np.zeros(5, np.float32), 3, sp)
    assert 0 <= tok < 5 and tok == sample_at(np.zeros(5, np.float32), 3, sp)


def test_logits_to_probs_temperature():
    p = logits_to_probs(np.array([0.0, np.log(2.0)], np.float32), SamplingParams(temp=1.0))
    assert p == pytest.approx([1 / 3, 2 / 3])
    p = logits_to_probs(np.array([0.0, np.log(2.0)], np.float32), SamplingParams(temp=0.5))
    assert p == pytest.approx([1 / 5, 4 / 5])
    assert p.dtype == np.float64


def test_logits_to_probs_top_k():
    logits = np.array([1.0, 4.0, 2.0, 3.0], np.float32)
    p = logits_to_probs(logits, SamplingParams(temp=1.0, top_k=2))
    e3, e4 = np.exp(3.0), np.exp(4.0)
    assert p.tolist() == pytest.approx([0.0, e4 / (e3 + e4), 0.0, e3 / (e3 + e4)])
    assert p[0] == 0.0 and p[2] == 0.0                                             # tail exactly zero
    assert logits_to_probs(logits, SamplingParams(temp=1.0, top_k=4)) == pytest.approx(softmax(logits))  # k >= V: off
    assert logits_to_probs(logits, SamplingParams(temp=1.0, top_k=1)).tolist() == [0.0, 1.0, 0.0, 0.0]


@pytest.mark.parametrize("top_p, expected", [
    (0.3, [1.0, 0.0, 0.0, 0.0]),
    (0.5, [1.0, 0.0, 0.0, 0.0]),                       # the first token alone reaches 0.5
    (0.7, [0.5 / 0.8, 0.3 / 0.8, 0.0, 0.0]),
    (0.85, [0.5 / 0.95, 0.3 / 0.95, 0.15 / 0.95, 0.0]),
    (0.99, [0.5, 0.3, 0.15, 0.05]),
])
def test_logits_to_probs_top_p(top_p, expected):
    logits = np.log(np.array([0.5, 0.3, 0.15, 0.05])).astype(np.float32)
    p = logits_to_probs(logits, SamplingParams(temp=1.0, top_p=top_p))
    assert p.tolist() == pytest.approx(expected, abs=1e-6)
    assert p.sum() == pytest.approx(1.0)
    assert all(x == 0.0 for x, e in zip(p, expected) if e == 0.0)


def test_logits_to_probs_top_k_then_top_p():
    logits = np.log(np.array([0.05, 0.4, 0.3, 0.25])).astype(np.float32)
    p = logits_to_probs(logits, SamplingParams(temp=1.0, top_k=3, top_p=0.5))
    # top-k drops token 0; renormalized 0.4/0.95 = 0.42 < 0.5, so top-p keeps tokens 1 and 2
    assert p.tolist() == pytest.approx([0.0, 0.4 / 0.7, 0.3 / 0.7, 0.0], abs=1e-6)


def test_sampled_never_picks_a_zeroed_token():
    logits = np.array([3.0, 2.9, 2.8, -2.0, -2.0, -2.0], np.float32)
    sp = dict(temp=2.0, top_k=3)
    toks = {sample_at(logits, pos, SamplingParams(seed=s, **sp)) for s in range(20) for pos in range(20)}
    assert toks == {0, 1, 2}


# ---------------------------------------------------------------- runs used below
PROMPT = [3, 1, 4, 1, 5]  # accepted positions 0..4; the lead node re-decodes position 4


def chain_run(drafts: list[int], first_pos: int = 4, lead: int | None = 5, prefix: dict | None = None) -> TreeRun:
    """[lead @ first_pos] + drafts, every node with logits in row = node index, seqs [0, 1]."""
    nodes, pos = [], first_pos
    if lead is not None:
        nodes.append(Node(lead, pos, -1, [0, 1], 0))
        pos += 1
    for d in drafts:
        nodes.append(Node(d, pos, len(nodes) - 1, [1], len(nodes), drafted=True))
        pos += 1
    return TreeRun(1, nodes, prefix or {})


# ---------------------------------------------------------------- verify: greedy
def test_verify_chain_all_drafts_match_accepts_all_plus_bonus():
    run = chain_run([6, 2, 7])
    acc = list(PROMPT)
    v = vfy(run, table(6, 2, 7, 0), acc, GREEDY)
    assert v.new_tokens == [6, 2, 7, 0]                     # three drafts and the bonus token
    assert acc == PROMPT + [6, 2, 7, 0]                     # extended in place
    assert v.n_draft_accepted == 3
    assert v.deepest == 3                                   # the last draft's cell can join sequence 0


def test_verify_chain_first_mismatch():
    run = chain_run([6, 2, 7])
    acc = list(PROMPT)
    v = vfy(run, table(6, 3, 7, 0), acc, GREEDY)        # the target says 3 where the draft said 2
    assert v.new_tokens == [6, 3]                           # accepted prefix + the target's own token
    assert v.n_draft_accepted == 1
    assert v.deepest == 1


def test_verify_first_draft_wrong():
    acc = list(PROMPT)
    v = vfy(chain_run([6, 2, 7]), table(0, 2, 7, 0), acc, GREEDY)
    assert (v.new_tokens, v.n_draft_accepted, v.deepest) == ([0], 0, 0)   # only the lead node's cell is consistent


def test_verify_tree_correct_token_on_second_branch():
    # lead @4 -> {a=2 @5 (seq 1), b=6 @5 (seq 2) -> c=7 @6 (seq 2)}; the target says 6, then 7, then 1
    nodes = [Node(5, 4, -1, [0, 1, 2], 0),
             Node(2, 5, 0, [1], 1, drafted=True),
             Node(6, 5, 0, [2], 2, drafted=True),
             Node(7, 6, 2, [2], 3, drafted=True)]
    run = TreeRun(1, nodes)
    acc = list(PROMPT)
    logits = np.stack([onehot(6), onehot(0), onehot(7), onehot(1)])  # row 1 (branch a) must never be used
    v = vfy(run, logits, acc, GREEDY)
    assert v.new_tokens == [6, 7, 1]
    assert v.n_draft_accepted == 2
    assert v.deepest == 3 and run.nodes[v.deepest].seq_ids == [2]


def test_verify_tree_deepest_is_branch_node():
    nodes = [Node(5, 4, -1, [0, 1, 2], 0), Node(2, 5, 0, [1], 1, drafted=True), Node(6, 5, 0, [2], 2, drafted=True)]
    acc = list(PROMPT)
    v = vfy(TreeRun(1, nodes), table(6, 0, 3), acc, GREEDY)
    assert v.new_tokens == [6, 3] and v.deepest == 2


def test_verify_prefix_conflict_accepts_nothing():
    # a PipeInfer run built on speculation [6, 2] at positions 5, 6: its first node sits at 7
    run = chain_run([0, 1], first_pos=7, lead=None, prefix={5: 6, 6: 2})
    acc = PROMPT + [6, 3, 0]                                   # position 6 was accepted as 3, not 2
    v = vfy(run, table(1, 4), acc, GREEDY)
    assert (v.new_tokens, v.n_draft_accepted, v.deepest) == ([], 0, -1)
    assert acc == PROMPT + [6, 3, 0]
    assert not is_useful(run, acc)


def test_verify_prefix_agrees_accepts():
    run = chain_run([0, 1], first_pos=7, lead=None, prefix={5: 6, 6: 2})
    acc = PROMPT + [6, 2, 0]
    v = vfy(run, table(1, 4), acc, GREEDY)
    assert v.new_tokens == [1, 4] and v.n_draft_accepted == 2 and v.deepest == 1


def test_verify_run_not_reached_yet_accepts_nothing():
    run = chain_run([0, 1], first_pos=7, lead=None, prefix={5: 6, 6: 2})
    acc = PROMPT + [6]                                         # position 6 is not decided yet
    v = vfy(run, table(1, 4), acc, GREEDY)
    assert (v.new_tokens, v.deepest) == ([], -1)
    assert is_useful(run, acc)


def test_verify_nodes_without_logits_are_not_used():
    # a prompt chunk: only the last node asks for logits
    nodes = [Node(t, p, p - 1, [0], -1) for p, t in enumerate(PROMPT)]
    nodes[-1].row = 0
    acc = list(PROMPT)
    v = vfy(TreeRun(1, nodes), table(2), acc, GREEDY)
    assert v.new_tokens == [2] and v.n_draft_accepted == 0 and v.deepest == 4


def test_consistent_checks_ancestors_and_prefix():
    nodes = [Node(5, 4, -1, [1], 0), Node(6, 5, 0, [1], 1), Node(7, 6, 1, [1], 2)]
    run = TreeRun(1, nodes, {3: 1})
    assert consistent(run, 2, PROMPT + [6])
    assert not consistent(run, 2, PROMPT + [0])          # an ancestor disagrees
    assert not consistent(run, 2, PROMPT[:3] + [9, 5])   # the prefix disagrees
    assert consistent(run, 2, PROMPT[:4])                # nothing decided yet at its positions


# ---------------------------------------------------------------- is_useful (invariant 10)
def test_is_useful_invalid_first_token():
    run = chain_run([6, 2], first_pos=5, lead=None)       # drafts for positions 5, 6
    assert not is_useful(run, PROMPT + [0])               # position 5 was accepted as 0
    assert is_useful(run, PROMPT + [6])
    assert is_useful(run, list(PROMPT))                   # position 5 not decided: may still be right


def test_is_useful_superfluous():
    run = chain_run([6, 2])                               # nodes at 4, 5, 6: predict positions 5, 6, 7
    assert is_useful(run, PROMPT + [6, 2])                # node @6 predicts position 7
    assert not is_useful(run, PROMPT + [6, 2, 7])         # everything it predicts is accepted
    assert not is_useful(run, PROMPT + [6, 2, 7, 1, 1])


def test_is_useful_checks_every_branch():
    nodes = [Node(2, 5, -1, [1], 0, drafted=True), Node(8 % V, 6, 0, [1], 1, drafted=True),
             Node(6, 5, -1, [2], 2, drafted=True), Node(7, 6, 2, [2], 3, drafted=True)]
    run = TreeRun(1, nodes)
    assert is_useful(run, PROMPT + [6])                   # only the second branch agrees
    assert is_useful(run, PROMPT + [6, 7])
    assert not is_useful(run, PROMPT + [6, 0])            # second branch broken at position 6
    assert not is_useful(run, PROMPT + [3])               # no branch agrees
    acc = PROMPT + [6]
    assert vfy(run, table(0, 0, 7, 1), acc, GREEDY).new_tokens == [7, 1]


# ---------------------------------------------------------------- sampled verification (invariant 9)
# Position 3 onwards of a 3-position chain over a vocabulary of 6, temperature 0.8.
L = np.array([[2.0, 0.5, 1.2, -1.0, 0.3, 1.0],
              [0.1, 1.5, -0.5, 0.9, 0.0, 0.4],
              [1.0, 0.0, 0.0, 2.0, -1.0, 0.5]], dtype=np.float32)
TEMP = 0.8
N_SEEDS = 6000
TV_BOUND = 0.03            # total variation distance bound; expected TV for 6000 draws over 6 tokens is ~0.012
CHI2_CRIT_DF5 = 20.515     # chi-square critical value, 5 degrees of freedom, p = 0.001


def spec_chain(d1: int, d2: int) -> TreeRun:
    return TreeRun(1, [Node(2, 2, -1, [0, 1], 0), Node(d1, 3, 0, [1], 1, drafted=True),
                       Node(d2, 4, 1, [1], 2, drafted=True)])


def run_seeds(run: TreeRun) -> list[list[int]]:
    out = []
    for seed in range(N_SEEDS):
        acc = [0, 1, 2]
        out.append(vfy(run, L, acc, SamplingParams(temp=TEMP, seed=seed)).new_tokens)
    return out


def check_distribution(samples: list[int], p: np.ndarray) -> None:
    n = len(samples)
    counts = np.bincount(samples, minlength=len(p)).astype(np.float64)
    tv = 0.5 * np.abs(counts / n - p).sum()
    chi2 = ((counts - n * p) ** 2 / (n * p)).sum()
    assert tv < TV_BOUND, (tv, counts / n, p)
    assert chi2 < CHI2_CRIT_DF5, (chi2, counts, n * p)


@pytest.fixture(scope="module")
def sampled_runs():
    p0 = softmax(L[0] / TEMP)
    low, high = int(np.argmin(p0)), int(np.argmax(p0))
    assert p0[low] < 0.05 and p0[high] > 0.45
    return {"low": run_seeds(spec_chain(low, 1)), "high": run_seeds(spec_chain(high, 1)), "low_tok": low,
            "high_tok": high}


@pytest.mark.parametrize("which", ["low", "high"])
def test_sampled_first_token_matches_target_distribution(sampled_runs, which):
    """The accepted token at position 3 is distributed as softmax(L0 / temp), whatever the draft proposed."""
    check_distribution([t[0] for t in sampled_runs[which]], softmax(L[0] / TEMP))


def test_sampled_draft_with_low_target_probability_is_rejected_at_its_rate(sampled_runs):
    runs, d1 = sampled_runs["low"], sampled_runs["low_tok"]
    p_d1 = softmax(L[0] / TEMP)[d1]
    frac = sum(len(t) > 1 for t in runs) / N_SEEDS           # the draft was accepted: a second token follows
    assert frac == pytest.approx(p_d1, abs=0.01)
    assert all((len(t) > 1) == (t[0] == d1) for t in runs)


def test_sampled_second_token_conditional_distribution(sampled_runs):
    runs, d1 = sampled_runs["high"], sampled_runs["high_tok"]
    second = [t[1] for t in runs if t[0] == d1]
    assert len(second) > 2500
    check_distribution(second, softmax(L[1] / TEMP))


def test_sampled_token_does_not_depend_on_the_draft(sampled_runs):
    """Per-position seeding: for a given seed, the token at position 3 is the same whatever was drafted,
    and equals what the target alone samples there."""
    low, high = sampled_runs["low"], sampled_runs["high"]
    assert all(a[0] == b[0] for a, b in zip(low, high))
    alone = [sample_at(L[0], 3, SamplingParams(temp=TEMP, seed=s)) for s in range(N_SEEDS)]
    assert [t[0] for t in high] == alone


def test_sampled_chain_equals_target_alone():
    # drafts equal to what the target samples at this seed: the run returns the target's own three samples + bonus
    sp = SamplingParams(temp=TEMP, seed=7)
    t3 = sample_at(L[0], 3, sp)
    t4 = sample_at(L[1], 4, sp)
    t5 = sample_at(L[2], 5, sp)
    acc = [0, 1, 2]
    assert vfy(spec_chain(t3, t4), L, acc, sp).new_tokens == [t3, t4, t5]
