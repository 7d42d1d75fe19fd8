"""One generation's rules for its runs' output rows (core/decoding.Decoding): the constraint's masks and the
biases (logit_bias, frequency and presence penalties), as the last stage applies them (protocol.RowRules).

Each output row of a run sits at the end of a context: the accepted tokens, the run's speculative prefix, and
its own path in the tree. A row's rules are those of its whole answer context (the tokens after the prompt), so
a row that verification later uses was shaped exactly as the target alone would be at that point, and one whose
context turns out wrong is never used. The grammar state follows the accepted tokens (`commit`); a row's mask is
computed from there over its speculative tail.
"""
from __future__ import annotations

from collections import Counter

import numpy as np

from ..core.decoding import Decoding
from ..core.protocol import RowRules, mask_words
from ..core.verify import TreeRun


def row_contexts(run: TreeRun, accepted: list[int], answer_at: int) -> list[list[int] | None]:
    """The answer context (tokens at positions answer_at..pos) of each output row of `run`, in row order; None
    where a position is known neither to the run nor as accepted (such a row is never used)."""
    rows = sorted((n.row, i) for i, n in enumerate(run.nodes) if n.row >= 0)
    out: list[list[int] | None] = []
    for _, i in rows:
        own = {n.pos: n.token for n in run.path(i)}
        ctx = []
        for q in range(answer_at, run.nodes[i].pos + 1):
            tok = own.get(q, run.prefix.get(q, accepted[q] if q < len(accepted) else None))
            if tok is None:
                ctx = None
                break
            ctx.append(tok)
        out.append(ctx)
    return out


def row_biases(decoding: Decoding, contexts: list[list[int] | None]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(row i32[k], token i32[k], bias f32[k]): logit_bias on every row, and OpenAI's penalties from the tokens of
    each row's answer context (frequency: per occurrence; presence: once)."""
    rows, tokens, values = [], [], []
    for r, ctx in enumerate(contexts):
        for t, b in decoding.logit_bias:
            rows.append(r), tokens.append(t), values.append(b)
        if ctx and (decoding.frequency_penalty or decoding.presence_penalty):
            for t, n in Counter(ctx).items():
                rows.append(r), tokens.append(t)
                values.append(-(decoding.frequency_penalty * n + decoding.presence_penalty))
    return (np.array(rows, dtype=np.int32), np.array(tokens, dtype=np.int32), np.array(values, dtype=np.float32))


class RunRules:
    """One generation's rules: `for_run` at each launch, `commit` as tokens are accepted.

    masker: an engine/grammar.RowMasker for the constraint (None without one): commit(tokens) over the answer's
    accepted tokens, masks(paths) -> i32[n_rows, words] for the tokens after them."""

    def __init__(self, decoding: Decoding, answer_at: int, n_vocab: int, masker=None):
        self.decoding, self.answer_at, self.n_vocab, self.masker = decoding, answer_at, n_vocab, masker
        self.committed: list[int] = []   # the answer's tokens the masker has taken

    def commit(self, accepted: list[int]) -> None:
        """The answer's accepted tokens so far; the masker takes them up to the first end of generation (what
        verification accepted beyond it is never emitted)."""
        answer = accepted[self.answer_at:]
        if self.masker is not None and len(answer) > len(self.committed):
            new = answer[len(self.committed):]
            end = next((i + 1 for i, t in enumerate(new) if t in self.masker.eos_ids), len(new))
            if not self.masker.done:
                self.masker.commit(new[:end])
        self.committed = answer

    def for_run(self, run: TreeRun, accepted: list[int]) -> RowRules | None:
        contexts = row_contexts(run, accepted, self.answer_at)
        if not contexts:
            return None
        mask = self._masks(contexts) if self.masker is not None else None
        return RowRules(mask, *row_biases(self.decoding, contexts))

    def _masks(self, contexts: list[list[int] | None]) -> np.ndarray:
        """A row whose context does not continue the committed tokens is never used: it allows every token."""
        c = self.committed
        tails = [ctx[len(c):] if ctx is not None and len(ctx) >= len(c) and ctx[:len(c)] == c else None
                 for ctx in contexts]
        mask = np.full((len(contexts), mask_words(self.n_vocab)), -1, dtype=np.int32)
        live = [r for r, t in enumerate(tails) if t is not None]
        if live:
            mask[live] = self.masker.masks([tails[r] for r in live])
        return mask
