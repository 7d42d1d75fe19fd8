"""Cross-vocabulary drafting: a draft model with its own tokenizer proposes tokens of the target's vocabulary.

The draft model (e.g. Gemma 3 270M, vocabulary 262,144) never sees target token ids. Each call:

1. the generated part of the target context (everything after the prompt: accepted tokens and the
   speculation chain) becomes bytes through the target's token pieces; an unfinished UTF-8 character
   at the end (``tail``) is held back, the complete text is re-tokenized in the draft vocabulary (no
   special tokens) and appended to the draft's own prompt (the user text in the draft's chat format);
2. token healing (``heal=True``): the last draft token of that text is taken off again and the first
   drafted token must start with its bytes (plus ``tail``), so the draft can continue a word or an
   indentation the way its own tokenizer would have split it, not only after the arbitrary boundary
   that the target's tokens left;
3. the draft runs greedily: first it re-emits the known text it must (the healed token, ``tail``),
   then up to ``n_max`` tokens that start after it, while its top probability is >= ``p_accept`` (the
   healed token: its probability among the allowed tokens); its end-of-generation token ends the text
   (never proposed). Draft seq 0 keeps what it decoded, with the logits after each token, so a call
   decodes only tokens seq 0 does not hold yet: continuing its own chain (drafting ahead beside the
   pipeline) re-emits the healed token and the window's text at no cost (ModelDrafter.step);
4. the drafted bytes beyond what the target already has are translated by tokenizing, in the target
   vocabulary, a *window*: the text of the last few target tokens + the new text. The window's tokens
   must reproduce those target tokens exactly (otherwise a smaller window is tried, and then nothing
   is proposed), so a target token that would merge with the new text ("hel" + "lo") never yields a
   bogus proposal. An unfinished UTF-8 character at the end of the new text is cut off first;
5. the last translated token may be the prefix of a longer one ("\\n" before "\\n", " " before a word,
   ")" before ":\\n" in Qwen's tokenizer), so it is kept only if it survives re-tokenizing the window
   with a look-ahead appended: the draft's most likely next token (its arg-max after the last drafted
   token, available at no extra cost; also with its last character repeated, in case it is the start
   of a longer run such as indentation), or the end of the text when the draft stopped on its
   end-of-generation token. Without a look-ahead the last token is dropped; when the draft stopped
   inside a word that the look-ahead does not finish, the tokens of that word are dropped.

A proposed token's confidence is the *product* of the draft probabilities of the draft tokens whose
bytes overlap its bytes (the first, healed, draft token counts with its probability among the tokens
allowed there). Verification samples every position from the target, so what is proposed never
changes the output, only how much of it is accepted.

The translation steps are pure functions over ``encode(text) -> ids`` / ``piece(id) -> bytes``
callables (tested without a model); :class:`TranslatingDrafter` wires them to a :class:`ModelDrafter`.
"""
from __future__ import annotations

import bisect
import re
import zipfile
from dataclasses import dataclass
from typing import Callable, Sequence

import numpy as np

from .drafter import Cutoffs, DraftNode, InSeries

_LETTERS = re.compile(r"[^\W\d_]+")
_TRAILING_LETTERS = re.compile(r"[^\W\d_]+$")

Encode = Callable[[str], list[int]]
Piece = Callable[[int], bytes]


# ---------------------------------------------------------------------------------------- pure logic
def utf8_split(data: bytes) -> tuple[bytes, bytes]:
    """(head, tail): tail is an unfinished multi-byte UTF-8 character at the very end (0 to 3 bytes).

    Invalid bytes elsewhere are left in ``head`` (they are not unfinished, just invalid)."""
    n = len(data)
    for k in range(1, min(4, n) + 1):
        b = data[n - k]
        if 0x80 <= b <= 0xBF:       # continuation byte: keep looking for the lead byte
            continue
        need = 2 if 0xC0 <= b <= 0xDF else 3 if 0xE0 <= b <= 0xEF else 4 if 0xF0 <= b <= 0xF7 else 1
        return (data[:n - k], data[n - k:]) if k < need else (data, b"")
    return data, b""


def target_side(gen: Sequence[int], piece: Piece, window: int) -> tuple[bytes, bytes, list[int]]:
    """The generated target tokens as (complete bytes, unfinished UTF-8 tail, translation window).

    Tokens without text (special/control tokens such as Qwen's <|im_end|>) contribute no bytes and are
    barriers: text tokenization never reproduces them, so the window holds at most `window` of the
    tokens after the last one."""
    pieces = [piece(t) for t in gen]
    head, tail = utf8_split(b"".join(pieces))
    start = len(gen)
    while start > 0 and len(gen) - start < window and pieces[start - 1]:
        start -= 1
    return head, tail, list(gen[start:])


def heal_split(draft_tokens: Sequence[int], piece: Piece, tail: bytes, n_heal: int) -> tuple[list[int], bytes]:
    """Take the last `n_heal` draft tokens off the draft context: (kept tokens, bytes the draft must emit first).

    The bytes are those tokens' text plus the target's unfinished UTF-8 `tail`."""
    n_heal = min(n_heal, len(draft_tokens))
    kept = list(draft_tokens[:len(draft_tokens) - n_heal])
    return kept, b"".join(piece(t) for t in draft_tokens[len(kept):]) + tail


@dataclass
class DraftText:
    data: bytes                              # bytes of the drafted tokens (end-of-generation excluded)
    spans: list[tuple[int, int, float]]      # (start, end, probability) of each drafted token in `data`
    ended: bool                              # the draft emitted its end-of-generation token
    n_tokens: int                            # drafted tokens with text


def chain_text(tokens: Sequence[int], probs: Sequence[float], piece: Piece,
               is_eog: Callable[[int], bool]) -> DraftText:
    """Bytes of a greedy draft chain, up to its first end-of-generation token (ended) or textless token."""
    data, spans = b"", []
    for t, p in zip(tokens, probs):
        if is_eog(t):
            return DraftText(data, spans, True, len(spans))
        b = piece(t)
        if not b:                            # another control token: the text stops, without an end
            break
        spans.append((len(data), len(data) + len(b), float(p)))
        data += b
    return DraftText(data, spans, False, len(spans))


def shift_spans(spans: Sequence[tuple[int, int, float]], offset: int) -> list[tuple[int, int, float]]:
    """Spans moved `offset` bytes to the left; spans that end before 0 are dropped."""
    return [(s - offset, e - offset, p) for s, e, p in spans if e - offset > 0]


def _tokens_of(encode: Encode, piece: Piece, win: list[int], data: bytes) -> list[int] | None:
    """Tokens of the complete text in `data` if they start with `win` and give the bytes back, else None."""
    full, _ = utf8_split(data)
    try:
        toks = encode(full.decode("utf-8"))  # strict: a window that starts inside a character is no good
    except UnicodeDecodeError:
        return None
    if toks[:len(win)] != win or b"".join(piece(t) for t in toks) != full:
        return None                          # the window's tokens merge with the new text
    return toks[len(win):]


def translate(window: Sequence[int], new: bytes, spans: Sequence[tuple[int, int, float]], encode: Encode,
              piece: Piece, *, ended: bool, lookahead: bytes | None, max_tokens: int) -> list[tuple[int, float]]:
    """Target tokens (with confidences) for the text `new` that follows the target tokens `window`.

    window: the last target tokens of the context (text tokens only; may be empty at the start);
    new: drafted bytes that follow them; spans: (start, end, prob) of the draft tokens in `new`;
    ended: the text ends after `new` (the draft emitted its end-of-generation token);
    lookahead: bytes the draft expects next (b"": the end of the text; None: unknown).

    The window's text + `new` + `lookahead` is tokenized; its first tokens must equal the window (else
    a shorter window is tried; none fits: nothing is proposed). The proposals are the following tokens
    that lie within `new` (an unfinished UTF-8 character at its end is never translated) and that do
    not change when the look-ahead's last character is repeated (the look-ahead may be the start of a
    longer run, "  " of "    "). Without a look-ahead the last token is dropped. When `new` ends inside
    a word that the look-ahead continues and may not finish (all letters), the word's tokens are
    dropped too.
    """
    if ended:
        lookahead = b""
    window = list(window)
    ahead = lookahead or b""
    variants = [ahead]
    if ahead:
        last = utf8_split(ahead)[0].decode("utf-8", errors="replace")[-1:]
        if last:
            variants.append(ahead + last.encode())
    for k in (range(len(window), 0, -1) if window else [0]):
        win = window[len(window) - k:]
        wb = b"".join(piece(t) for t in win)
        n_new = len(utf8_split(wb + new)[0]) - len(wb)   # complete characters only
        if n_new <= 0:
            return []                        # no complete new character yet
        found = [_tokens_of(encode, piece, win, wb + new + v) for v in variants]
        if found[0] is not None:
            break
    else:
        return []
    # the tokens within `new`, agreed on by every look-ahead variant
    props: list[int] = []
    a = 0
    for i, t in enumerate(found[0]):
        a += len(piece(t))
        if a > n_new or any(f is None or i >= len(f) or f[i] != t for f in found[1:]):
            break
        props.append(t)
    n = len(props)
    if lookahead is None:
        n -= 1
    elif lookahead and n:
        # the draft stopped inside a word that the look-ahead continues (and may not finish): the target
        # may split the whole word differently, so no proposal may touch the word's known part
        new_text = utf8_split(new)[0].decode("utf-8", errors="replace")
        ahead_text = utf8_split(lookahead)[0].decode("utf-8", errors="replace")
        if new_text and ahead_text and _LETTERS.fullmatch(ahead_text) and _LETTERS.match(new_text[-1]):
            word = len(_TRAILING_LETTERS.search(new_text).group().encode())
            keep_bytes = n_new - word        # new bytes before the word
            a = 0
            for i, t in enumerate(props[:n]):
                a += len(piece(t))
                if a > keep_bytes:
                    n = i
                    break
    out: list[tuple[int, float]] = []
    a = 0
    for t in props[:max(0, min(n, max_tokens))]:
        b = a + len(piece(t))
        p = 1.0
        for s, e, q in spans:
            if s < b and e > a:
                p *= q
        out.append((t, p))
        a = b
    return out


PREFIX_INDEX_FORMAT = 1  # bump when the cached layout or piece rules change


class PrefixIndex:
    """Token ids of a vocabulary sorted by their bytes, to find every token whose text starts with a prefix."""

    def __init__(self, keys: list[bytes], ids: np.ndarray):
        self.keys, self.ids = keys, ids   # keys sorted; ids[i] is the token whose text is keys[i]

    @classmethod
    def build(cls, n_vocab: int, piece: Piece) -> PrefixIndex:
        pairs = sorted((b, t) for t in range(n_vocab) if (b := piece(t)))
        return cls([b for b, _ in pairs], np.array([t for _, t in pairs], dtype=np.int64))

    @classmethod
    def cached(cls, model_path: str, n_vocab: int, piece: Piece) -> PrefixIndex:
        """build(), kept next to the stage files: 262k pieces take about 1.5 s, loading the file 0.1 s."""
        from ..core.files import derived_path, write_atomically
        path = derived_path(model_path, "prefix-index", "npz", n_vocab, PREFIX_INDEX_FORMAT)
        try:
            with np.load(path) as f:
                blob, ends, ids = f["blob"].tobytes(), f["ends"], f["ids"]
            starts = np.concatenate([[0], ends[:-1]])
            return cls([blob[a:b] for a, b in zip(starts.tolist(), ends.tolist())], ids)
        except (OSError, KeyError, ValueError, EOFError, zipfile.BadZipFile):
            pass  # not cached yet, or unreadable: build and (re)write it
        idx = cls.build(n_vocab, piece)
        try:
            write_atomically(path, lambda tmp: np.savez(
                tmp, blob=np.frombuffer(b"".join(idx.keys), dtype=np.uint8),
                ends=np.cumsum([len(k) for k in idx.keys], dtype=np.int64), ids=idx.ids))
        except OSError:
            pass  # a read-only cache only costs the rebuild next time
        return idx

    def starting_with(self, prefix: bytes) -> np.ndarray:
        lo = bisect.bisect_left(self.keys, prefix)
        end = prefix.rstrip(b"\xff")         # the smallest byte string greater than every extension
        hi = bisect.bisect_left(self.keys, end[:-1] + bytes([end[-1] + 1])) if end else len(self.keys)
        return self.ids[lo:hi]


# ---------------------------------------------------------------------------------------- chat format
def draft_prompt_text(draft_tok, user_text: str, chat: bool, template: str | None = None) -> str:
    """The draft's own prompt: `user_text` in the draft's chat format when `chat` (the GGUF's template,
    else `template`, else a built-in one recognised from the vocabulary), else the text as is."""
    if not chat:
        return user_text
    from ..engine.tokenizer import apply_chat, builtin_template
    return apply_chat(draft_tok, user_text, template or draft_tok.chat_template() or builtin_template(draft_tok))


# ---------------------------------------------------------------------------------------- the drafter
class TranslatingDrafter(InSeries):
    """Drafts target tokens with a draft model of another vocabulary (see the module docstring).

    drafter: a ModelDrafter on the draft GGUF (its engine, KV sequence 0, `sync` and `step` are used; chains only);
    target_tok, draft_tok: Tokenizers of the two GGUFs (encode/piece/is_eog/chat_template/n_vocab);
    n_prompt: number of target prompt tokens at the start of every context;
    prompt_text, chat: the raw user prompt and whether the chat format applies (the draft gets its own);
    draft_chat: format the draft's prompt as chat or not, whatever `chat` says (None: as `chat`; a base
        draft model such as Gemma 3 270M (not -it) agreed a little more often with the plain text);
    draft_template: chat template (or llama.cpp built-in name) for the draft when its GGUF has none
        (default: the GGUF's own, else "gemma" or "chatml" recognised from the vocabulary);
    window: target tokens re-tokenized together with the drafted text (boundary merges);
    heal: token healing of the draft context's last token.
    """

    # beside the pipeline (draftahead.py), draft this many new draft tokens per call: the last one is often
    # not proposed (the look-ahead cannot settle its boundary), so short calls propose little
    ahead_chunk = 4

    def __init__(self, drafter, target_tok, draft_tok, *, n_prompt: int, prompt_text: str, chat: bool,
                 draft_chat: bool | None = None, draft_template: str | None = None, window: int = 4,
                 heal: bool = True):
        self.drafter, self.tt, self.dt = drafter, target_tok, draft_tok
        self.exact_batch = drafter.exact_batch
        self.n_prompt, self.window, self.heal = n_prompt, window, heal
        use_chat = chat if draft_chat is None else draft_chat
        self.prompt = draft_tok.encode(draft_prompt_text(draft_tok, prompt_text, use_chat, draft_template),
                                       add_special=True, parse_special=True)
        self._tpieces: dict[int, bytes] = {}
        self._dpieces: dict[int, bytes] = {}
        self._index: PrefixIndex | None = None
        self.n_calls = 0           # draft() calls
        self.n_draft_tokens = 0    # draft tokens drafted (with text, healed one included; not the end token)
        self.n_proposed = 0        # target tokens proposed
        self.n_backoff = 0         # calls whose drafted text gave no target token (it did not fit the context,
                                   # merged with its last tokens, or was only an unsure last token)

    def close(self) -> None:
        self.drafter.close()

    # ---- cached tokenizer access
    def tpiece(self, t: int) -> bytes:
        b = self._tpieces.get(t)
        if b is None:
            b = self._tpieces[t] = self.tt.piece(t)
        return b

    def dpiece(self, t: int) -> bytes:
        b = self._dpieces.get(t)
        if b is None:
            b = self._dpieces[t] = self.dt.piece(t)
        return b

    def tencode(self, text: str) -> list[int]:
        return self.tt.encode(text, add_special=False, parse_special=False)

    @property
    def index(self) -> PrefixIndex:
        if self._index is None:
            path = getattr(self.dt, "path", None)
            self._index = (PrefixIndex.cached(path, self.dt.n_vocab, self.dpiece) if path
                           else PrefixIndex.build(self.dt.n_vocab, self.dpiece))
        return self._index

    # ---- drafting
    def _heal_plan(self, dtoks: list[int], tail: bytes) -> tuple[list[int], bytes, np.ndarray | None]:
        """(draft context tokens after the prompt, bytes the draft must emit first, allowed first tokens)."""
        for h in ((1, 0) if self.heal and dtoks else (0,)):
            kept, need = heal_split(dtoks, self.dpiece, tail, h)
            if not need or not self.heal:
                return kept, need, None
            allowed = self.index.starting_with(need)
            if len(allowed):
                return kept, need, allowed
        return dtoks, tail, None             # unconstrained; the draft must emit `tail` by itself

    def _greedy(self, dctx: list[int], allowed: np.ndarray | None, need: bytes, cut: Cutoffs
                ) -> tuple[list[int], list[float], int | None]:
        """Greedy chain on draft seq 0 after `dctx`: (tokens, probabilities, look-ahead token or None).

        The chain first re-emits `need` (the healed token's and the window's known text: seq 0 usually
        holds those tokens from an earlier call, so they cost no decode), the first token among `allowed`
        when given, then up to n_max tokens that start after it. It stops at a token below the cutoff, at one
        that contradicts `need`, and at an end-of-generation token (returned, not decoded); the look-ahead
        is the draft's arg-max after the last token (also when it fell below the cutoff)."""
        d = self.drafter
        logits = d.sync(dctx)
        toks: list[int] = []
        probs: list[float] = []
        look = None
        n_bytes = n_new = 0
        for depth in range(len(need) + cut.n_max + 1):   # every token has text: a bound, not a budget
            if depth == 0 and allowed is not None:   # the arg-max among the allowed tokens, renormalised
                x = logits[allowed]
                i = int(np.argmax(x))
                t = int(allowed[i])
            else:
                x = logits
                t = int(np.argmax(x))
                i = t
            if np.isfinite(x[i]):
                pt = float(1.0 / np.exp(x - x[i]).sum(dtype=np.float64))  # f32 exp: 262k-entry vocabularies
            else:
                pt = 0.0   # every allowed token lies outside a pruned draft head (--draft-head): stop here
            b = self.dpiece(t)
            is_new = n_bytes >= len(need)            # starts after the known text (the healed token is not new)
            if pt < cut.p_accept or (is_new and n_new == cut.n_max):
                look = t
                break
            toks.append(t)
            probs.append(pt)
            if self.dt.is_eog(t) or not b:
                break
            if n_bytes < len(need) and b[:len(need) - n_bytes] != need[n_bytes:n_bytes + len(b)]:
                break                                # left the known text: nothing of this call is proposed
            n_bytes += len(b)
            n_new += is_new
            logits = d.step(len(dctx) + len(toks) - 1, t)   # free where seq 0 holds it from an earlier call
        return toks, probs, look

    def prefill(self, prompt: list[int]) -> None:
        self.drafter.prefill(self.prompt)  # the draft's own rendering of the prompt, in its vocabulary
        if self.heal:
            _ = self.index  # built now, not at the first draft (262k draft tokens: about a second)

    def draft(self, context: list[int], cut: Cutoffs) -> list[DraftNode]:
        self.n_calls += 1
        if len(context) < self.n_prompt:
            raise ValueError(f"context of {len(context)} tokens is shorter than the prompt ({self.n_prompt})")
        gen = context[self.n_prompt:]
        if cut.n_max < 1 or cut.p_accept >= 1.0 or (gen and self.tt.is_eog(gen[-1])):
            return []
        head, tail, window = target_side(gen, self.tpiece, self.window)
        text = head.decode("utf-8", errors="replace")
        dtoks = self.dt.encode(text, add_special=False, parse_special=False) if text else []
        if self.heal and dtoks and b"".join(self.dpiece(t) for t in dtoks) != head:
            kept, need, allowed = dtoks, tail, None   # the draft's pieces do not give the text back: no healing
        else:
            kept, need, allowed = self._heal_plan(dtoks, tail)
        dctx = self.prompt + kept
        if len(dctx) + cut.n_max + 2 > self.drafter.engine.n_ctx:
            return []
        toks, probs, look = self._greedy(dctx, allowed, need, cut)
        dt = chain_text(toks, probs, self.dpiece, self.dt.is_eog)
        self.n_draft_tokens += dt.n_tokens
        if not dt.data.startswith(need) or len(dt.data) == len(need):
            if dt.data and not dt.data.startswith(need):
                self.n_backoff += 1
            return []
        new = dt.data[len(need):]
        if look is None or dt.ended:
            lookahead = None
        elif self.dt.is_eog(look):
            lookahead = b""
        else:
            lookahead = self.dpiece(look) or None
        props = translate(window, new, shift_spans(dt.spans, len(need)), self.tencode, self.tpiece,
                          ended=dt.ended, lookahead=lookahead, max_tokens=cut.n_max)
        if not props and new:
            self.n_backoff += 1
        self.n_proposed += len(props)
        return [DraftNode(t, k - 1, k, {0}, p) for k, (t, p) in enumerate(props)]
