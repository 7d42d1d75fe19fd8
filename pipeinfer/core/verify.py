"""Sampling and verification: pure functions over token trees and logits.

A run is a small tree of nodes at absolute positions. Each node's logits predict the next position.
Verification walks the accepted sequence forward: while some node of the run holds the last accepted
token at position m-1 and its whole context agrees with the accepted tokens, the target's token for
position m is drawn from that node's logits and appended.

Sampling is *per position*: the token at position m is drawn with an RNG seeded by (seed, m) from the
target's distribution given the accepted context. So a position's token never depends on what the
draft proposed, which makes every mode lossless: greedy output is token for token the target's, and
sampled output is distributed exactly as sampling from the target alone (it is even the same sample
for the same seed, up to float noise in the logits). This is SpecInfer's multi-step speculative
sampling with deterministic (one-hot) proposals: a proposal x with q = onehot(x) is accepted with
probability min(1, p(x)/q(x)) = p(x), and on rejection the residual norm(max(p - q, 0)) excludes x,
which is the same as drawing y ~ p once and accepting the child whose token equals y.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from .sampling import RunSampling, SamplingParams, group_rows, one_sampling, widest_logprobs


def logits_to_probs(logits: np.ndarray, sp: SamplingParams) -> np.ndarray:
    """logits: f32[n_vocab] -> probabilities after temperature, top-k and top-p (f64[n_vocab])."""
    x = logits.astype(np.float64) / max(sp.temp, 1e-6)
    if sp.top_k > 0 and sp.top_k < len(x):
        kth = np.partition(x, -sp.top_k)[-sp.top_k]
        x = np.where(x >= kth, x, -np.inf)
    p = np.exp(x - x.max())
    p /= p.sum()
    if sp.top_p < 1.0:
        order = np.argsort(-p, kind="stable")
        keep = np.cumsum(p[order]) - p[order] < sp.top_p  # smallest prefix whose mass reaches top_p
        mask = np.zeros_like(p, dtype=bool)
        mask[order[keep]] = True
        p = np.where(mask, p, 0.0)
        p /= p.sum()
    return p


def sample_at(logits: np.ndarray, pos: int, sp: SamplingParams) -> int:
    """The target's token for position `pos` given logits f32[n_vocab] of position pos-1."""
    if sp.temp <= 0:
        return int(np.argmax(logits))
    p = logits_to_probs(logits, sp)
    rng = np.random.default_rng([sp.seed % 2**63, pos])  # any int seed, negative included
    return int(rng.choice(len(p), p=p))


@dataclass
class Node:
    token: int
    pos: int
    parent: int = -1          # index of the parent node in the same run; -1: attaches to the run's prefix
    seq_ids: list[int] = field(default_factory=list)
    row: int = -1             # row of this node's logits in the run's result; -1: no logits requested
    drafted: bool = False     # proposed by the drafter (counts for the acceptance rate)


@dataclass
class TreeRun:
    """The head's view of one run: its nodes and the speculative tokens it assumes before its first node."""
    run_id: int
    nodes: list[Node]
    prefix: dict[int, int] = field(default_factory=dict)  # pos -> token assumed at positions before the nodes

    def path(self, i: int) -> list[Node]:
        out = []
        while i >= 0:
            out.append(self.nodes[i])
            i = self.nodes[i].parent
        return out[::-1]


def reached(run: TreeRun, i: int, accepted: list[int]) -> bool:
    """Node i's context before it (run prefix and ancestors) agrees with every accepted position it covers:
    verification reached node i's position along its path."""
    m = len(accepted)
    if any(pos < m and accepted[pos] != tok for pos, tok in run.prefix.items()):
        return False
    return all(n.pos >= m or accepted[n.pos] == n.token for n in run.path(i)[:-1])


def consistent(run: TreeRun, i: int, accepted: list[int]) -> bool:
    """Node i's context (run prefix + ancestors + itself) agrees with every accepted position it covers."""
    n = run.nodes[i]
    return reached(run, i, accepted) and (n.pos >= len(accepted) or accepted[n.pos] == n.token)


def is_useful(run: TreeRun, accepted: list[int]) -> bool:
    """Can the run still add a token? Some consistent node must sit at or after the last accepted position.

    False means the run is invalid (every branch disagrees with what was accepted) or superfluous
    (everything it could predict is already accepted): cancel it. Checks every branch of the tree.
    """
    m = len(accepted)
    return any(n.pos >= m - 1 and consistent(run, i, accepted) for i, n in enumerate(run.nodes))


def chain_checks(chain: list[tuple[int, int]], accepted: list[int], m_before: int) -> tuple[int, int]:
    """(checked, agreed) for the speculation chain's (position, token) entries, in position order, that the
    last verification decided (positions m_before..len(accepted)-1): every entry up to and including the first
    wrong one was checked. Counting here, not per verified run, sees the wrong drafts too: a run whose
    first draft is wrong is cancelled before its own result comes back."""
    checked = agreed = 0
    for pos, tok in chain:
        if pos < m_before:
            continue
        if pos >= len(accepted):
            break
        checked += 1
        if accepted[pos] != tok:
            break
        agreed += 1
    return checked, agreed


@dataclass
class Verdict:
    new_tokens: list[int]      # tokens appended to the accepted sequence
    n_draft_accepted: int      # drafted nodes found consistent and used
    deepest: int               # index of the deepest consistent node whose cell can join seq 0, -1 if none
    rows: list[int] = field(default_factory=list)  # the output row each new token was drawn from


def apply_mask(logits: np.ndarray, mask: np.ndarray) -> None:
    """Set logits (f32[n_rows, n_vocab], in place) to -inf where mask (int32[n_rows, >= (n_vocab+31)//32], bit
    set = allowed) forbids the token. Pure numpy and branch-free (a boolean-indexed write costs ~0.8 ms a row
    on a 151,936-token vocabulary with a mixed mask, this ~0.1 ms): each row's words as little-endian bytes,
    unpacked least-significant bit first, give one 0/1 per token, turned into a bound of +inf (allowed) or
    -inf (not) that np.minimum applies."""
    n_rows, n_vocab = logits.shape
    if mask.shape[0] != n_rows or mask.shape[1] * 32 < n_vocab:
        raise ValueError(f"mask {mask.shape} does not cover logits {logits.shape}")
    words = np.ascontiguousarray(mask, dtype="<i4").view(np.uint8)
    bound = np.unpackbits(words, axis=1, count=n_vocab, bitorder="little").astype(logits.dtype)
    bound *= 2
    bound -= 1
    bound *= np.inf   # +-1 times inf: no 0 * inf = nan
    np.minimum(logits, bound, out=logits)


def shaped_logits(logits: np.ndarray, rules) -> np.ndarray:
    """A copy of logits f32[n_rows, n_vocab] with protocol.RowRules applied: the biases added, then every token a
    row's mask does not allow at -inf (the raw logits stay as they are: log-probabilities are read from them)."""
    out = logits.copy()
    if len(rules.bias_row):
        np.add.at(out, (rules.bias_row, rules.bias_token), rules.bias_value)
    if rules.mask is not None:
        apply_mask(out, rules.mask)
    return out


def row_logprobs(logits: np.ndarray, tokens: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The target's log-probabilities (log-softmax of the raw logits f32[n_rows, n_vocab], as llama-cpp-python
    reports them) of each row's chosen token i32[n_rows] and of its k most likely tokens, most likely first:
    (f32[n_rows], i32[n_rows, k], f32[n_rows, k])."""
    x = logits.astype(np.float64)
    top = x.max(axis=1, keepdims=True)
    logz = top + np.log(np.exp(x - top).sum(axis=1, keepdims=True))
    chosen = x[np.arange(len(x)), tokens] - logz[:, 0]
    if k == 0:
        return chosen.astype(np.float32), np.zeros((len(x), 0), np.int32), np.zeros((len(x), 0), np.float32)
    ids = np.argpartition(-x, k - 1, axis=1)[:, :k]
    order = np.argsort(-np.take_along_axis(x, ids, axis=1), axis=1, kind="stable")
    ids = np.take_along_axis(ids, order, axis=1)
    return (chosen.astype(np.float32), ids.astype(np.int32),
            (np.take_along_axis(x, ids, axis=1) - logz).astype(np.float32))


def row_tokens(logits: np.ndarray, row_pos: np.ndarray, sampling: SamplingParams | RunSampling,
               rules=None) -> np.ndarray:
    """The target's token after each output row: i32[n_rows] from logits f32[n_rows, n_vocab] of the rows at
    positions row_pos i32[n_rows] (the last stage computes this and sends it instead of the logits), after a
    request's rules (protocol.RowRules: its constraint's masks and its biases) when it has any, each row drawn by
    its group's sampling parameters (one SamplingParams: every row alike). A row's token depends only on its own
    logits, position and parameters, whatever the other rows of its run."""
    if isinstance(sampling, SamplingParams):
        sampling = one_sampling(sampling)
    if rules is not None:
        logits = shaped_logits(logits, rules)
    out = np.argmax(logits, axis=1).astype(np.int32)
    for d, rows in group_rows(sampling, len(logits)):
        if d.params.temp > 0:
            out[rows] = [sample_at(row, int(p) + 1, d.params) for row, p in zip(logits[rows], row_pos[rows])]
    return out


def run_logprobs(logits: np.ndarray, tokens: np.ndarray, sampling: RunSampling) -> tuple | None:
    """row_logprobs of each group's rows with the group's own k, in one array as wide as the widest asked (the
    narrower groups' columns left zero past their k; a group that asks none: k = 0); None when no group asks."""
    k_max = widest_logprobs(sampling)
    if k_max is None:
        return None
    n = len(logits)
    chosen, ids, top = np.zeros(n, np.float32), np.zeros((n, k_max), np.int32), np.zeros((n, k_max), np.float32)
    for d, rows in group_rows(sampling, n):
        k = d.top_logprobs or 0
        chosen[rows], ids[rows, :k], top[rows, :k] = row_logprobs(logits[rows], tokens[rows], k)
    return chosen, ids, top


def verify(run: TreeRun, targets: np.ndarray, accepted: list[int]) -> Verdict:
    """Extend `accepted` (in place) with every token the run's rows determine: targets i32[n_rows] holds the
    target's token after each output row (row_tokens), drawn per position, so the proposals do not matter."""
    new, rows, n_draft = [], [], 0
    while True:
        m = len(accepted)
        hit = next((i for i, n in enumerate(run.nodes)
                    if n.pos == m - 1 and n.row >= 0 and consistent(run, i, accepted)), None)
        if hit is None:
            break
        n_draft += run.nodes[hit].drafted
        y = int(targets[run.nodes[hit].row])
        accepted.append(y)
        new.append(y)
        rows.append(run.nodes[hit].row)
    deepest = -1
    for i, n in enumerate(run.nodes):
        if n.pos < len(accepted) and consistent(run, i, accepted) and (deepest < 0 or n.pos > run.nodes[deepest].pos):
            deepest = i
    return Verdict(new, n_draft, deepest, rows)


def greedy_only(sampling: RunSampling, rules, n_rows: int) -> bool:
    """Whether every row's token is its logits' arg-max and nothing else of the logits is asked: no rules, every
    group at temperature 0, no log-probabilities (a tensor group's last stage then gathers each member's best only)."""
    return (rules is None and widest_logprobs(sampling) is None
            and all(d.params.temp <= 0 for d, _ in group_rows(sampling, n_rows)))


def row_best(logits: np.ndarray) -> np.ndarray:
    """f32[n_rows, 2]: each row's largest logit and its index (the first, as np.argmax), the index as f32."""
    idx = np.argmax(logits, axis=1)
    return np.stack([logits[np.arange(len(logits)), idx], idx.astype(np.float32)], axis=1)


def pick_best(bests: list[np.ndarray], offsets: list[int]) -> np.ndarray:
    """i32[n_rows]: the arg-max over every slice of the vocabulary, from each slice's row_best (slices in vocabulary
    order, slice k starting at token offsets[k]): the largest logit, the first slice's among equals, which is
    np.argmax over the whole row."""
    values = np.stack([b[:, 0] for b in bests])                                    # [slices, rows]
    where = np.argmax(values, axis=0)                                              # first slice holding the max
    rows = np.arange(values.shape[1])
    index = np.stack([b[:, 1] for b in bests])[where, rows].astype(np.int64)
    return (index + np.asarray(offsets, dtype=np.int64)[where]).astype(np.int32)
