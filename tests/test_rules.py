"""A request's rules on the wire and at the last stage: RULES and LOGPROBS round trips and checks, the rows'
answer contexts over a speculative tree, biases and penalties, masks applied and log-probabilities read."""
import numpy as np
import pytest

from pipeinfer.core.decoding import Constraint, Decoding, TokenLogprob
from pipeinfer.core.protocol import (Limits, ProtocolError, RowRules, mask_words, pack_logprobs, unpack_logprobs)
from pipeinfer.core.sampling import SamplingParams, joined_sampling, one_sampling
from pipeinfer.core.verify import Node, TreeRun, row_logprobs, row_tokens, run_logprobs, shaped_logits
from pipeinfer.decide.head import token_logprobs
from pipeinfer.decide.rules import RunRules, row_biases, row_contexts

LIM = Limits(n_batch=16, n_embd=8, n_vocab=70, n_seq_max=4, n_ctx=64)


def _rules(n_rows=2, with_mask=True):
    mask = np.zeros((n_rows, mask_words(LIM.n_vocab)), np.int32)
    mask[:, 0] = 0b1010
    return RowRules(mask if with_mask else None, np.array([0, 1], np.int32), np.array([3, 69], np.int32),
                    np.array([-1.5, 2.0], np.float32))


@pytest.mark.parametrize("with_mask", [True, False])
def test_rules_round_trip(with_mask):
    r = _rules(with_mask=with_mask)
    back = RowRules.unpack(r.pack(2), LIM, 2)
    assert (back.mask is None) == (not with_mask)
    if with_mask:
        assert np.array_equal(back.mask, r.mask)
    assert back.bias_row.tolist() == [0, 1] and back.bias_token.tolist() == [3, 69]
    assert back.bias_value.tolist() == [-1.5, 2.0]


@pytest.mark.parametrize("spoil, match", [
    (lambda b: b[:-1], "expected"),
    (lambda b: np.concatenate([[3], b[1:]]).astype(np.int32), "for a run of 2 rows"),
    (lambda b: b.astype(np.int64), "malformed RULES"),
])
def test_bad_rules_are_refused(spoil, match):
    with pytest.raises(ProtocolError, match=match):
        RowRules.unpack(spoil(_rules().pack(2)), LIM, 2)


def test_a_bias_outside_the_vocabulary_is_refused():
    r = _rules()
    r.bias_token[1] = 70
    with pytest.raises(ProtocolError, match="vocabulary"):
        RowRules.unpack(r.pack(2), LIM, 2)


def test_joined_rules_keep_each_runs_rows_and_theirs_alone():
    """A shared run's RULES: each run's masks and biases on its own rows, every token allowed on a run's rows that had
    none; shaping the shared rows gives each row what its own run's rules give it alone."""
    rng = np.random.default_rng(4)
    parts = [(_rules(2), 2), (None, 1), (_rules(2, with_mask=False), 2), (None, 0)]
    joined = RowRules.joined(parts)
    assert joined.bias_row.tolist() == [0, 1, 3, 4] and joined.mask.shape == (5, mask_words(LIM.n_vocab))
    back = RowRules.unpack(joined.pack(5), LIM, 5)
    logits = rng.normal(size=(5, 70)).astype(np.float32)
    shared = shaped_logits(logits, back)
    at = 0
    for rules, n in parts:
        alone = logits[at:at + n] if rules is None else shaped_logits(logits[at:at + n], rules)
        assert np.array_equal(shared[at:at + n], alone)
        at += n
    assert RowRules.joined([(None, 1), (None, 2)]) is None
    assert RowRules.joined([(_rules(2, with_mask=False), 2), (None, 1)]).mask is None


def test_each_rows_token_and_logprobs_are_its_own_in_a_shared_run():
    """Rows drawn by several generations' sampling in one run: each row's token and log-probabilities equal what
    its own generation's run of those rows alone gives (log-probabilities as wide as the widest asked)."""
    rng = np.random.default_rng(5)
    logits = rng.normal(size=(6, 70)).astype(np.float32)
    pos = np.arange(10, 16, dtype=np.int32)
    own = [(one_sampling(SamplingParams()), 2), (one_sampling(SamplingParams(0.8, 5, 0.9, 3), 4), 1),
           (one_sampling(SamplingParams(1.2, 0, 1.0, 9)), 2), (one_sampling(SamplingParams(), 1), 1)]
    shared = joined_sampling(own)
    tokens = row_tokens(logits, pos, shared)
    chosen, ids, top = run_logprobs(logits, tokens, shared)
    assert ids.shape == (6, 4)
    at = 0
    for sampling, n in own:
        rows = slice(at, at + n)
        alone = row_tokens(logits[rows], pos[rows], sampling)
        assert np.array_equal(tokens[rows], alone)
        k = sampling[0].top_logprobs
        if k is not None:
            c, i, t = row_logprobs(logits[rows], alone, k)
            assert np.array_equal(chosen[rows], c) and np.array_equal(ids[rows, :k], i) and np.array_equal(top[rows, :k], t)
        at += n
    assert run_logprobs(logits, tokens, joined_sampling([(one_sampling(SamplingParams()), 6)])) is None


def test_shaped_logits_add_biases_then_mask_and_leave_the_raw_logits():
    logits = np.arange(2 * 70, dtype=np.float32).reshape(2, 70)
    raw = logits.copy()
    out = shaped_logits(logits, _rules())
    assert np.array_equal(logits, raw)
    allowed = np.isfinite(out)
    assert allowed[:, [1, 3]].all() and allowed.sum() == 4  # bits 1 and 3 of each row
    assert out[0, 3] == raw[0, 3] - 1.5 and out[1, 1] == raw[1, 1]
    assert row_tokens(logits, np.array([5, 6]), SamplingParams(), _rules()).tolist() == [3, 3]
    sampled = row_tokens(logits, np.array([5, 6]), SamplingParams(temp=1.0, seed=3), _rules())
    assert set(sampled.tolist()) <= {1, 3}


def test_row_logprobs_are_the_log_softmax_and_survive_the_wire():
    rng = np.random.default_rng(0)
    logits = rng.normal(size=(3, 70)).astype(np.float32) * 3
    tokens = np.array([5, 0, 69], np.int32)
    chosen, ids, top = row_logprobs(logits, tokens, 4)
    ref = logits.astype(np.float64) - np.log(np.exp(logits.astype(np.float64)).sum(axis=1, keepdims=True))
    assert np.allclose(chosen, ref[np.arange(3), tokens], atol=1e-6)
    assert ids.tolist() == np.argsort(-ref, axis=1, kind="stable")[:, :4].tolist()
    assert np.allclose(top, np.take_along_axis(ref, ids, axis=1), atol=1e-6)
    back = unpack_logprobs(pack_logprobs(chosen, ids, top))
    assert all(np.array_equal(a, b) for a, b in zip(back, (chosen, ids, top)))
    lps = token_logprobs(back, rows=[2, 0], tokens=[69, 5])
    assert lps[0] == TokenLogprob(69, float(chosen[2]), tuple(zip(ids[2].tolist(), top[2].tolist())))
    assert row_logprobs(logits, tokens, 0)[1].shape == (3, 0)


def _tree() -> TreeRun:
    # accepted: prompt [1, 2] + answer [7]; the run assumes 8 at position 3 (the chain) and drafts a tree:
    # 9 at 4, then 10 or 11 at 5
    nodes = [Node(9, 4, -1, [1], 0), Node(10, 5, 0, [1], 1), Node(11, 5, 0, [2], 2)]
    return TreeRun(5, nodes, prefix={3: 8})


def test_row_contexts_follow_the_prefix_and_each_branch():
    assert row_contexts(_tree(), [1, 2, 7], answer_at=2) == [[7, 8, 9], [7, 8, 9, 10], [7, 8, 9, 11]]
    assert row_contexts(_tree(), [1, 2], answer_at=2) == [None, None, None]  # position 2 unknown to all


def test_biases_and_penalties_per_row():
    d = Decoding(logit_bias=((4, -100.0),), frequency_penalty=0.5, presence_penalty=0.25)
    rows, toks, vals = row_biases(d, [[7, 7, 8], [], None])
    got = sorted(zip(rows.tolist(), toks.tolist(), vals.tolist()))
    assert got == [(0, 4, -100.0), (0, 7, -1.25), (0, 8, -0.75), (1, 4, -100.0), (2, 4, -100.0)]


class _Masker:
    """Records what RunRules asks of a grammar.RowMasker."""
    eos_ids, done = [0], False

    def __init__(self):
        self.committed, self.asked = [], []

    def commit(self, tokens):
        self.committed += tokens

    def masks(self, paths):
        self.asked.append(paths)
        return np.zeros((len(paths), mask_words(70)), np.int32)


def test_run_rules_mask_only_rows_that_continue_the_accepted_answer():
    m = _Masker()
    rules = RunRules(Decoding(constraint=Constraint("json_object")), answer_at=2, n_vocab=70, masker=m)
    rules.commit([1, 2, 7])
    r = rules.for_run(_tree(), [1, 2, 7])
    assert m.committed == [7] and m.asked == [[[8, 9], [8, 9, 10], [8, 9, 11]]]
    assert (r.mask == 0).all()
    rules.commit([1, 2, 7, 5, 0, 6])  # an answer that ended (EOS 0): the masker takes it up to the EOS
    assert m.committed == [7, 5, 0]
    r = rules.for_run(_tree(), [1, 2, 7, 5, 0, 6])  # the tree's rows no longer continue the answer
    assert (r.mask == -1).all() and len(m.asked) == 1
