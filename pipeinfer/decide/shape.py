"""The shape of a PipeInfer micro-batch: how many draft tokens (choose_draft_len) and which of the draft's
runner-ups go beside them as one-token siblings (choose_siblings, add_siblings), from the stages' measured
decode costs and the running acceptance. Pure functions: the head (head.py) and the twin call them.

A sibling is the draft's second choice at a position where the draft is unsure. The run then holds a tree:
the main chain (branch 0) and, at depth d, the sibling as a branch of its own that shares the chain's first d
tokens (its KV sequence holds them, as a drafter's tree branch does). When the main token at depth d is wrong
and the sibling right, verification takes the sibling and the target's token after it: one token more than
the chain gives at that miss, for one row more in every stage's decode. Whether that pays depends on what a
row costs: on hosts where a 2-token decode costs nearly twice a 1-token one (CPU cores at one thread:
docs/speculation.md), only a sibling likelier than about the chain's own acceptance does.
"""
from __future__ import annotations

import numpy as np

from ..drafters.drafter import DraftNode


def choose_draft_len(acceptance: float, stage_ms: list[list[float]], draft_ms: tuple[float, float], cap: int) -> int:
    """Draft tokens per PipeInfer micro-batch: the b in 1..cap that adds the most accepted tokens per unit of
    time, counting the refills that wrong drafts cause.

    A micro-batch of b draft tokens adds sum_{i=1..b} a^i accepted tokens in expectation (each token needs
    every one before it accepted; a = acceptance). The pipeline runs one micro-batch per the slowest stage's
    cost at batch b (the head's stage, stage_ms[0], also drafts the b tokens at draft_ms = (per call, per
    token) ms), and with probability 1 - a^b the micro-batch breaks the speculation chain: everything
    launched after it is cancelled and the pipeline refills, which costs one pass through every stage at
    batch b. So the rate is gain / (bottleneck + (1 - a^b) x pass). Larger micro-batches pay off where
    batching is cheap and the pipeline is short; on CPUs where a 2-token decode costs nearly twice a 1-token
    one (docs/speculation.md), and on deep pipelines, the answer is 1 unless the draft is nearly always right.
    """
    best, best_rate = 1, -1.0
    for b in range(1, cap + 1):
        if any(len(ms) < b for ms in stage_ms):
            break
        gain = sum(acceptance ** i for i in range(1, b + 1))
        time = run_time_ms(b, b, acceptance, stage_ms, draft_ms)
        rate = gain / time if time > 0 else float("inf")
        if rate > best_rate * (1 + 1e-9):
            best, best_rate = b, rate
    return best


def draft_cost_fit(calls) -> tuple[float, float]:
    """(ms per call, ms per token) of recent draft calls [(tokens, ms)] by least squares; with one size seen
    so far, half each (a drafter that re-syncs its context pays about one decode per call), which also
    makes the other sizes worth a try."""
    if not calls:
        return 0.0, 0.0
    n = np.array([c[0] for c in calls], dtype=np.float64)
    ms = np.array([c[1] for c in calls], dtype=np.float64)
    if np.ptp(n) == 0:
        per = float(ms.mean() / (n[0] + 1))
        return per, per
    slope, icept = np.polyfit(n, ms, 1)
    return max(0.0, float(icept)), max(0.0, float(slope))


def run_time_ms(n_rows: int, b: int, acceptance: float, stage_ms: list[list[float]],
                draft_ms: tuple[float, float]) -> float:
    """What a micro-batch of n_rows rows, b of them the main chain, costs the pipeline (choose_draft_len's model):
    the slowest stage at n_rows, plus a refill through every stage when the chain breaks (1 - acceptance^b)."""
    head = stage_ms[0][n_rows - 1] + draft_ms[0] + b * draft_ms[1]
    bottleneck = max([head] + [ms[n_rows - 1] for ms in stage_ms[1:]])
    refill = head + sum(ms[n_rows - 1] for ms in stage_ms[1:])
    return bottleneck + (1 - acceptance ** b) * refill


def ride_len(n_rows: int, acceptance: float, stage_ms: list[list[float]], draft_ms: tuple[float, float],
             cap: int) -> int:
    """Draft tokens that ride a shared decode of n_rows other rows (users' next tokens and prompt chunks, each a
    certain token or cell), or 0 where draft rows buy less than those rows do.

    Riding k draft tokens makes the decode n_rows + k rows and adds sum_{i=1..k} a^i tokens in expectation; a
    broken chain costs no refill here (the other rows are certain, and the holder's next token is covered apart).
    So k rides where (n_rows + gain) / t(n_rows + k) beats n_rows / t(n_rows), t the slowest stage's cost at that
    many rows (the head's stage also drafts the k tokens at draft_ms = (per call, per token)); the k of the best
    rate wins. Where a row costs what it costs alone (repacked kernels: 3 rows 2.7x one) a draft row, right
    with probability < 1, never beats a certain one; where rows are nearly free (tiled kernels) it does. Sizes
    beyond the measured costs are not assumed."""
    def rate(k: int) -> float:
        n = n_rows + k
        head = stage_ms[0][n - 1] + (draft_ms[0] + k * draft_ms[1] if k else 0.0)
        bottleneck = max([head] + [ms[n - 1] for ms in stage_ms[1:]])
        return (n_rows + sum(acceptance ** i for i in range(1, k + 1))) / bottleneck if bottleneck > 0 else 0.0
    if n_rows < 1 or any(len(ms) < n_rows for ms in stage_ms):
        return 0
    best, best_rate = 0, rate(0)
    for k in range(1, cap + 1):
        if any(len(ms) < n_rows + k for ms in stage_ms):
            break
        if rate(k) > best_rate * (1 + 1e-9):
            best, best_rate = k, rate(k)
    return best


def has_runner_up(n: DraftNode, p_split: float) -> bool:
    """Node n names a runner-up other than its own token, with a probability >= p_split."""
    return n.alt >= 0 and n.alt != n.token and n.alt_prob >= p_split


def choose_siblings(chain: list[DraftNode], acceptance: float, sibling_rate: float, stage_ms: list[list[float]],
                    draft_ms: tuple[float, float], cap: int, max_siblings: int, p_split: float) -> list[int]:
    """Depths of the chain whose runner-up joins the micro-batch as a sibling, by the rate choose_draft_len
    maximizes: accepted tokens per unit of pipeline time.

    A sibling at depth d is reached when the chain's d tokens before it are right (acceptance^d) and is right
    itself with its runner-up probability, scaled by sibling_rate (how often siblings were right over what
    their probabilities promised: drafts are not calibrated); it then adds one token. Candidates, likeliest
    first, join while the rate grows: at most max_siblings (--max-branches - 1), rows within cap (the exact
    batch limit), each with a runner-up probability >= p_split."""
    b = len(chain)
    cand = sorted(((acceptance ** d * n.alt_prob * sibling_rate, d) for d, n in enumerate(chain)
                   if has_runner_up(n, p_split)), reverse=True)
    if not cand or max_siblings < 1 or b >= cap or any(len(ms) < b + 1 for ms in stage_ms):
        return []
    gain = sum(acceptance ** i for i in range(1, b + 1))
    rate = gain / max(1e-9, run_time_ms(b, b, acceptance, stage_ms, draft_ms))
    picked: list[int] = []
    for value, d in cand:
        n = b + len(picked) + 1
        if n > cap or len(picked) >= max_siblings or any(len(ms) < n for ms in stage_ms):
            break
        new_rate = (gain + value) / max(1e-9, run_time_ms(n, b, acceptance, stage_ms, draft_ms))
        if new_rate <= rate * (1 + 1e-9):
            break
        gain, rate = gain + value, new_rate
        picked.append(d)
    return sorted(picked)


def fixed_siblings(chain: list[DraftNode], cap: int, max_siblings: int, p_split: float) -> tuple[int, list[int]]:
    """Without measured costs (--micro-batch fixed): (chain tokens kept, sibling depths). Every runner-up >= p_split
    from the first depth on joins, at most max_siblings, the chain shortened to keep the rows within cap; a
    sibling needs the chain token at its depth."""
    keep, picked = len(chain), []
    for d, n in enumerate(chain):
        if len(picked) >= max_siblings or not has_runner_up(n, p_split):
            continue
        room = min(keep, cap - len(picked) - 1)
        if d >= room:
            break
        keep = room
        picked.append(d)
    return keep, picked


def add_siblings(chain: list[DraftNode], depths: list[int]) -> list[DraftNode]:
    """The chain (branch 0) as a tree with the runner-up at each of `depths` as a one-token branch of its own
    (branches 1, 2, ... in depth order), every chain node before it in that branch too (its sequence holds them)."""
    tree = [DraftNode(n.token, n.parent, n.depth, set(n.branches), n.prob, n.alt, n.alt_prob) for n in chain]
    for k, d in enumerate(sorted(depths), start=1):
        for i in range(d):
            tree[i].branches.add(k)
        n = chain[d]
        tree.append(DraftNode(n.alt, n.parent, d, {k}, n.alt_prob))
    return tree
