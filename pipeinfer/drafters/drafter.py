"""Drafters: propose a token tree continuing a context, with confidence cutoffs.

Tree rule (the paper's, and the original's): starting after the context, each active branch takes
its top candidate while the candidate's probability is >= p_accept (+ adjustment); a further
candidate with probability >= p_split (+ adjustment) opens a new branch, up to max_branches; at most
n_max tokens in the tree. Branch 0 is the main chain; continuous speculation builds on it.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Protocol

import numpy as np

from ..core.config import DRAFT_HEAD_AUTO, PROMPT_CHUNK  # noqa: F401 (DRAFT_HEAD_AUTO: declared with the options)
from ..core.protocol import Batch, cp, kv_ops, rm
from ..engine.kernels import DEFAULT_KERNELS, exact_batch_limit

# --draft-head auto: a draft model's output projection keeps its 65,536 most frequent tokens (stagefile.head_tokens;
# what it buys: docs/speculation.md, Draft head).


@dataclass
class DraftNode:
    token: int
    parent: int                  # index in the tree, -1: continues the context
    depth: int                   # 0 for the first drafted position
    branches: set[int] = field(default_factory=set)  # branch indices (0 = main) that contain this node
    prob: float = 1.0            # the drafter's confidence
    alt: int = -1                # the drafter's runner-up at this node's position (-1: none known) ...
    alt_prob: float = 0.0        # ... and its probability: where both are unsure, the head adds it as a sibling


@dataclass(frozen=True)
class Cutoffs:
    p_accept: float = 0.5
    p_split: float = 0.1
    n_max: int = 4
    max_branches: int = 1


class Drafter(Protocol):
    """What the head asks of any drafter. One in series (`asynchronous` False) drafts when asked (`draft`); one
    beside the pipeline (AheadDrafter: draftahead.DraftClient) drafts ahead by itself, steered, and the head only
    reads what is ready."""
    asynchronous: bool          # drafts ahead beside the pipeline (the AheadDrafter methods), or in series
    remote: bool                # over a network link (--draft-at rank), not in rank 0's own process
    exact_batch: int | None     # the draft model's exact batch limit, reported with the statistics (None: none)
    ahead_chunk: int            # tokens worth drafting per call when it drafts ahead

    def prefill(self, prompt: list[int]) -> None:
        """Take in the prompt ahead of the first draft (the head calls it while the target's pipeline
        works on the prompt, so a draft model's prompt processing is off the critical path)."""
        ...

    def draft(self, context: list[int], cut: Cutoffs) -> list[DraftNode]:
        """A tree of proposals for positions len(context).., parents before children; [] if unconfident."""
        ...

    def levels(self) -> list:
        """A hierarchy's counts per level since its last prefill (stack.py); [] for a drafter of one level."""
        ...

    def offer(self, tail: tuple[int, int], pos: int, token: int, prob: float) -> None:
        """A proposal the target's own MTP head made with a result (mtpdraft.py); other drafters ignore it."""
        ...


class AheadDrafter(Drafter, Protocol):
    """A drafter beside the pipeline, drafting ahead on the chain the head steers it to."""
    n_stale: int                # its running counters: proposals dropped (their chain was gone), ...
    n_calls: int                # ... drafter calls, ...
    bytes_in: int               # ... and bytes received (bytes_out: sent)

    @property
    def bytes_out(self) -> int: ...

    def steer(self, target: list[int], horizon: int, p_min: float, n_chunk: int) -> None:
        """Draft on `target` up to `horizon`, n_chunk tokens per call, stopping below p_min."""
        ...

    def ready(self, context: list[int], p_accept: float, n_max: int) -> tuple[list[DraftNode], bool]:
        """(chain, unconfident): what is drafted after `context` with confidence >= p_accept, at most n_max."""
        ...

    def wait(self, until) -> None:
        """Sleep politely until a proposal arrives or until() holds."""
        ...


class InSeries:
    """The attributes of a drafter that drafts only when asked, in rank 0's process (Drafter)."""
    asynchronous = False
    remote = False
    exact_batch: int | None = None
    ahead_chunk = 1             # tokens worth drafting per call when it drafts ahead (a translating drafter: more)

    def close(self) -> None:
        """Free what it loaded (a draft model's context)."""

    def levels(self) -> list:
        """A hierarchy's counts per level (stack.LevelCounts, from the level drafting for the target down); [] for
        a drafter of one level."""
        return []

    def offer(self, tail: tuple[int, int], pos: int, token: int, prob: float) -> None:
        """A proposal of the target's MTP head: only mtpdraft.MtpDrafter drafts with them."""


def top_candidates(logits: np.ndarray, k: int = 8) -> tuple[np.ndarray, np.ndarray]:
    """The k most likely tokens, most likely first, and their probabilities: (i64[k], f64[k]).

    argpartition and one exp pass, not a full softmax and sort: over a 262,144-token vocabulary (Gemma 3) that
    costs more than the draft model's decode (docs/speculation.md, Draft head).
    """
    k = min(k, len(logits))
    top = np.argpartition(-logits, k - 1)[:k]
    top = top[np.argsort(-logits[top], kind="stable")]
    m = float(logits[top[0]])
    z = float(np.exp(logits - np.float32(m)).sum(dtype=np.float64))
    return top, np.exp(logits[top].astype(np.float64) - m) / z


def main_chain(tree: list[DraftNode]) -> list[int]:
    """Indices of branch 0's nodes, in order of depth."""
    return [i for i, n in enumerate(tree) if 0 in n.branches]


class ModelDrafter(InSeries):
    """A draft GGUF with the target's vocabulary, run whole in one process with its own KV sequences.

    Draft sequence 0 holds the context the drafter last saw, then what it drafted after it; the logits
    after each of its last KEEP_LOGITS positions are kept. A call whose context is a prefix of what seq 0
    holds, or continues it, decodes only tokens seq 0 does not hold yet: continuing the previous
    speculation costs no re-decode, and a chain re-drafted over tokens it already holds (the translating
    drafter's healed token, a draft ahead re-rooted inside its own chain) costs nothing for those.
    Sequences 1.. are tree branches, cleared after each call.
    """

    KEEP_LOGITS = 32   # logits rows kept (a Gemma 3 row is 262,144 floats = 1 MB)

    def __init__(self, path, *, n_ctx: int, max_branches: int, n_threads: int, n_threads_batch: int,
                 kernels: str = DEFAULT_KERNELS, head_tokens: int | None = None):
        from ..engine.stage import (  # llama.cpp: imported where a model is loaded, not by the twin
            StageEngine,
            TokenEmbedder,
        )
        from ..engine.stagefile import ensure_pruned_head, read_info
        n_vocab = read_info(path).n_vocab
        # --draft-head: the output projection over the head_tokens most frequent tokens only (stagefile.py);
        # the rest of the vocabulary gets logit -inf, so the draft never proposes it
        self.keep: np.ndarray | None = None
        self._embed = None
        load = path
        if head_tokens is not None and head_tokens < n_vocab:
            load, self.keep = ensure_pruned_head(path, head_tokens)
            self._embed = TokenEmbedder(path)
        self.engine = StageEngine(load, n_ctx=n_ctx, n_batch=max(64, max_branches), n_seq_max=max(1, max_branches),
                                  n_threads=n_threads, n_threads_batch=n_threads_batch,
                                  embd_input=self.keep is not None, capture_hidden=False, kernels=kernels)
        # reported with the statistics; the draft's numerics do not touch the output's exactness
        self.exact_batch = None if kernels == "fast" else exact_batch_limit(self.engine, load, kernels, n_threads,
                                                                              n_threads_batch)
        self.n_vocab = n_vocab
        self._kv: list[int] = []                  # tokens in draft seq 0
        self._out: dict[int, np.ndarray] = {}     # n -> logits after self._kv[:n] (the last KEEP_LOGITS n)
        self.n_decodes = 0
        self.row_costs: list[float] | None = None  # ms of a decode of 1, 2, .. rows (row_ms), once a hierarchy asks

    def close(self) -> None:
        self.engine.close()

    def _decode(self, batch: Batch) -> np.ndarray:
        """f32[n_outputs, n_vocab] logits of a batch (a pruned head's logits scattered into the vocabulary)."""
        if self.keep is None:
            return self.engine.decode(batch)
        part = self.engine.decode(batch, self._embed(batch.tokens))
        logits = np.full((len(part), self.n_vocab), -np.inf, dtype=np.float32)
        logits[:, self.keep] = part
        return logits

    def _truncate(self, n: int) -> None:
        """Seq 0 keeps its first n tokens."""
        if n < len(self._kv):
            self.engine.apply_kv_ops(kv_ops(rm(0, n, -1)))
            del self._kv[n:]
            for k in [k for k in self._out if k > n]:
                del self._out[k]

    def _record(self, tokens: list[int], logits: np.ndarray) -> None:
        """tokens were decoded at the end of seq 0; logits: f32[len(tokens) or 1, n_vocab], the last row
        after the last token."""
        self._kv += tokens
        self._out[len(self._kv)] = logits[-1]
        if len(self._out) > self.KEEP_LOGITS:
            del self._out[min(self._out)]

    def sync(self, context: list[int]) -> np.ndarray:
        """Make draft seq 0 start with `context` and return the logits after its last token (what seq 0
        holds beyond the context stays, for step() to reuse)."""
        c = 0
        for a, b in zip(self._kv, context):
            if a != b:
                break
            c += 1
        n = len(context)
        if c == n and n in self._out:
            return self._out[n]
        c = min(c, n - 1)  # the last context token is re-decoded to get its logits
        self._truncate(c)
        # chunks at the positions the target's prompt chunks take (0, C, 2C, ...): a draft that is the target
        # itself then holds the target's own bits and agrees with it at every near tie
        size = min(self.engine.n_batch, PROMPT_CHUNK)
        start = c
        while start < n:
            end = min(n, (start // size + 1) * size)
            chunk = context[start:end]
            self._record(chunk, self._decode(Batch.chain(chunk, start, last_only=True)))
            self.n_decodes += 1
            start = end
        return self._out[n]

    def step(self, n: int, token: int) -> np.ndarray:
        """The logits after seq 0's first n tokens and `token` (decoded at position n unless seq 0 already
        holds it there); afterwards seq 0 starts with those n + 1 tokens."""
        if n < len(self._kv) and self._kv[n] == token and n + 1 in self._out:
            return self._out[n + 1]
        self._truncate(n)
        self._record([token], self._decode(Batch.chain([token], n)))
        self.n_decodes += 1
        return self._out[n + 1]

    def extend(self, n: int, tokens: list[int]) -> np.ndarray:
        """f32[len(tokens), n_vocab]: row k the logits after seq 0's first n tokens and tokens[:k + 1], in one decode
        of the tokens seq 0 does not hold yet (a level above verifying the chain a level below proposed: the
        verification of drafts of drafts, stack.py); afterwards seq 0 starts with those n + len(tokens) tokens."""
        if not tokens:
            return np.empty((0, self.n_vocab), dtype=np.float32)
        held = 0
        while held < len(tokens) and n + held < len(self._kv) and self._kv[n + held] == tokens[held] \
                and n + held + 1 in self._out:
            held += 1
        if held < len(tokens):
            self._truncate(n + held)
            rest = tokens[held:]
            rows = self._decode(Batch.chain(rest, n + held))
            self.n_decodes += 1
            for k, t in enumerate(rest):
                self._record([t], rows[k:k + 1])
        return np.stack([self._out[n + k + 1] for k in range(len(tokens))])

    def row_ms(self, n: int, max_rows: int) -> list[float]:
        """ms of one decode of 1..max_rows rows after seq 0's first n tokens (at least one): 1, 2, 4, .. rows timed
        once each, the sizes between interpolated; seq 0 is left with those n tokens. What a level above pays to
        verify a chain (stack.py)."""
        self._truncate(n)
        token = self._kv[n - 1]
        sizes = sorted({*(1 << i for i in range(max_rows.bit_length()) if 1 << i <= max_rows), max_rows})
        timed = []
        for rows in sizes:
            t0 = time.perf_counter()
            self._decode(Batch.chain([token] * rows, n))
            timed.append((time.perf_counter() - t0) * 1e3)
            self.engine.apply_kv_ops(kv_ops(rm(0, n, -1)))
        return [float(v) for v in np.interp(np.arange(1, max_rows + 1), sizes, timed)]

    def prefill(self, prompt: list[int]) -> None:
        self.sync(prompt)

    def follow(self, context: list[int], tokens: list[int]) -> None:
        """Decode `tokens` after `context` as drafting them would (the replay instrument's compute): one
        single-token decode each, nothing more when context continues the last call's chain, one re-decode
        after a rejected token."""
        self.sync(context)
        for k, t in enumerate(tokens):
            self.step(len(context) + k, t)

    def draft(self, context: list[int], cut: Cutoffs) -> list[DraftNode]:
        if cut.max_branches > 1:
            self._truncate(len(context))  # branches copy seq 0: nothing of it beyond the context
        logits0 = self.sync(context)
        pos0 = len(context)
        tree: list[DraftNode] = []
        # active branches: branch index -> (draft seq id, last node index, logits after it)
        active: dict[int, tuple[int, int, np.ndarray]] = {0: (0, -1, logits0)}
        n_branches = 1
        for depth in range(cut.n_max):
            step: list[tuple[int, int]] = []  # (branch, node index) taken at this depth
            for b, (seq, last, logits) in list(active.items()):
                top, p = top_candidates(logits)  # p[f]: probability of token top[f]
                if p[0] < cut.p_accept:
                    del active[b]
                    continue
                for f in range(1, len(top)):
                    if n_branches >= cut.max_branches or p[f] < cut.p_split:
                        break
                    nb = n_branches
                    n_branches += 1
                    self.engine.apply_kv_ops(kv_ops(rm(nb), cp(seq, nb)))
                    i = last
                    while i >= 0:  # the new branch shares b's nodes so far
                        tree[i].branches.add(nb)
                        i = tree[i].parent
                    tree.append(DraftNode(int(top[f]), last, depth, {nb}, float(p[f])))
                    active[nb] = (nb, len(tree) - 1, None)
                    step.append((nb, len(tree) - 1))
                tree.append(DraftNode(int(top[0]), last, depth, {b}, float(p[0]),
                                      int(top[1]) if len(top) > 1 else -1, float(p[1]) if len(top) > 1 else 0.0))
                active[b] = (seq, len(tree) - 1, None)
                step.append((b, len(tree) - 1))
            if not step:
                break
            if len(step) == 1 and active[step[0][0]][0] == 0:   # the main chain alone: seq 0 may hold it
                b, i = step[0]
                active[b] = (0, i, self.step(pos0 + depth, tree[i].token))
            else:
                # this depth's tokens, one per branch, each in its branch's draft sequence
                toks = np.array([tree[i].token for _, i in step], dtype=np.int32)
                batch = Batch(toks, np.full(len(step), pos0 + depth, dtype=np.int32),
                              [[active[b][0]] for b, _ in step], np.ones(len(step), dtype=np.int32), kv_ops())
                logits = self._decode(batch)
                self.n_decodes += 1
                for k, (b, i) in enumerate(step):
                    active[b] = (active[b][0], i, logits[k])
                    if active[b][0] == 0:
                        self._record([tree[i].token], logits[k:k + 1])
            if len(tree) >= cut.n_max:
                break
        # keep the main chain in seq 0 for the next call; drop the other branches
        self.engine.apply_kv_ops(kv_ops(*[rm(s) for s in range(1, n_branches)]))
        return tree


class NgramDrafter(InSeries):
    """Prompt-lookup decoding: continue the longest recent n-gram match found earlier in the context."""

    def __init__(self, n_min: int = 1, n_max: int = 4):
        self.n_min, self.n_max = n_min, n_max

    def prefill(self, prompt: list[int]) -> None:
        pass  # nothing to process: the context is searched at each draft

    def draft(self, context: list[int], cut: Cutoffs) -> list[DraftNode]:
        ctx = np.asarray(context)
        for n in range(min(self.n_max, len(ctx) - 1), self.n_min - 1, -1):
            tail = ctx[-n:]
            windows = np.lib.stride_tricks.sliding_window_view(ctx[:-1], n)
            hits = np.flatnonzero((windows == tail).all(axis=1))
            if len(hits) == 0:
                continue
            start = int(hits[-1]) + n  # most recent earlier occurrence
            cont = ctx[start:start + cut.n_max].tolist()
            # confidence grows with the match length; the same cutoffs as a model drafter apply
            prob = n / (n + 1.0)
            if not cont or prob < cut.p_accept:
                return []
            return [DraftNode(int(t), k - 1, k, {0}, prob) for k, t in enumerate(cont)]
        return []


class ReplayDrafter(InSeries):
    """BENCHMARK INSTRUMENT, not a real drafter: replays a known continuation with a set accuracy.

    Given the reference tokens of an earlier single-node run of the same prompt (prompt + output), it
    proposes the reference token at each position, right with probability `accuracy` (seeded per
    position) and otherwise a wrong token, with confidence `accuracy`. So that its cost is realistic it
    spends a real small model's compute per proposed token (`burner`, e.g. Gemma 3 270M, whose output is
    discarded). It lets benchmarks sweep the acceptance rate on the real target.

    With `runner_up` > 0 each proposal carries a runner-up (DraftNode.alt): where the proposal is wrong, the
    reference token with probability runner_up, else another wrong one; its probability is what that promises,
    (1 - accuracy) x runner_up (the twin's trees, decide/shape.py).
    """

    runner_up = 0.0

    def __init__(self, reference: list[int], accuracy: float, n_vocab: int, seed: int = 0,
                 burner: ModelDrafter | None = None):
        if not 0.0 <= accuracy <= 1.0:
            raise ValueError(f"replay accuracy must be in [0, 1], got {accuracy}")
        self.ref, self.accuracy, self.n_vocab, self.seed = list(reference), accuracy, n_vocab, seed
        self.burner = burner
        self.exact_batch = burner.exact_batch if burner is not None else None

    def prefill(self, prompt: list[int]) -> None:
        if self.burner is not None:  # the burner's prompt processing, as a real draft model's
            self.burner.prefill([t % self.burner.n_vocab for t in prompt])

    def draft(self, context: list[int], cut: Cutoffs) -> list[DraftNode]:
        if self.accuracy < cut.p_accept:
            return []
        pos0 = len(context)
        tokens, alts = [], []
        for pos in range(pos0, min(pos0 + cut.n_max, len(self.ref))):
            rng = np.random.default_rng([self.seed, pos])
            right = rng.random() < self.accuracy
            tokens.append(self.ref[pos] if right else (self.ref[pos] + 1 + pos % 7) % self.n_vocab)
            alts.append(self.runner_up_at(pos, right, rng))
        if self.burner is not None and tokens:
            v = self.burner.n_vocab
            self.burner.follow([t % v for t in context], [t % v for t in tokens])
        return [DraftNode(t, k - 1, k, {0}, self.accuracy, *alt) for k, (t, alt) in enumerate(zip(tokens, alts))]

    def runner_up_at(self, pos: int, right: bool, rng) -> tuple[int, float]:
        """(runner-up token, its probability) at pos where the proposal is right or not; (-1, 0.0) without."""
        if self.runner_up <= 0.0:
            return -1, 0.0
        hit = not right and rng.random() < self.runner_up
        return self.runner_up_token(pos, hit), (1 - self.accuracy) * self.runner_up

    def runner_up_token(self, pos: int, hit: bool) -> int:
        """The runner-up proposed at pos: the reference token where it is right (hit), else a wrong one (not the
        wrong proposal's either)."""
        return self.ref[pos] if hit else (self.ref[pos] + 9 + pos % 5) % self.n_vocab
