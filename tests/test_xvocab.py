"""Cross-vocabulary drafting (pipeinfer/drafters/translating.py).

Most tests run the translation logic on toy tokenizers (greedy longest match over a byte vocabulary,
which merges like BPE: "hel" + "lo" -> "hello") and an oracle draft model, without llama.cpp; the
`real` ones load the vocabularies of the real Qwen2.5-Coder-1.5B and Gemma 3 270M GGUFs (vocab only,
under a second each) and are skipped when the files are missing.
"""
from __future__ import annotations

import math
import os
import warnings

import numpy as np
import pytest

from pipeinfer.drafters.drafter import Cutoffs, InSeries
from pipeinfer.drafters.translating import (PrefixIndex, TranslatingDrafter, chain_text, heal_split, shift_spans, target_side,
                              translate, utf8_split)

EMOJI_SPLIT = "\U0001F9A9"   # flamingo: split over two Qwen tokens and four Gemma byte tokens


# ------------------------------------------------------------------------------------ toy tokenizers
class ToyTok:
    """Greedy longest match over bytes 0..255 + `words`; `specials` are textless control tokens."""

    def __init__(self, words, specials=(), eog=()):
        self.vocab: list[bytes] = [bytes([i]) for i in range(256)]
        for w in words:
            b = w.encode() if isinstance(w, str) else w
            if b not in self.vocab:
                self.vocab.append(b)
        self.ids = {b: i for i, b in enumerate(self.vocab)}
        self.special = {}
        for name in specials:
            self.special[name] = len(self.vocab)
            self.vocab.append(b"")
        self.eog = {self.special[n] for n in eog}
        self.max_len = max(len(b) for b in self.vocab)
        self.n_vocab = len(self.vocab)

    def encode(self, text, add_special=True, parse_special=True):
        return self.encode_bytes(text.encode())

    def encode_bytes(self, data: bytes) -> list[int]:
        out, i = [], 0
        while i < len(data):
            for n in range(min(self.max_len, len(data) - i), 0, -1):
                t = self.ids.get(data[i:i + n])
                if t is not None:
                    out.append(t)
                    i += n
                    break
        return out

    def piece(self, t, special=False):
        return self.vocab[t]

    def is_eog(self, t):
        return t in self.eog

    def chat_template(self):
        return None

    def enc(self, text):
        return self.encode(text, False, False)

    def text(self, toks):
        return b"".join(self.piece(t) for t in toks)


# target: GPT-style (leading spaces, merged newlines), draft: a different split
TARGET = ToyTok(["hel", "lo", "hello", " world", " ", "\n", "\n\n", "   ", " def", " foo", "foo", "def", "():",
                 "():\n", "é", "\xe6\x97\xa5".encode("latin-1"), "日本", EMOJI_SPLIT.encode()[:3], " return",
                 "ret", "urn"], specials=["<|im_end|>"], eog=["<|im_end|>"])
DRAFT = ToyTok(["he", "llo", " wor", "ld", "\n", "    ", "def", " foo", "()", ":", "日", "本", "é", "return",
                "re", " re"], specials=["<end_of_turn>"], eog=["<end_of_turn>"])


def tr(window_text_or_ids, new: bytes | str, *, tok=TARGET, ended=False, lookahead=None, max_tokens=8, spans=None):
    window = tok.enc(window_text_or_ids) if isinstance(window_text_or_ids, str) else list(window_text_or_ids)
    new = new.encode() if isinstance(new, str) else new
    spans = spans if spans is not None else [(0, len(new), 1.0)]
    return translate(window, new, spans, tok.enc, tok.piece, ended=ended, lookahead=lookahead, max_tokens=max_tokens)


def texts(props, tok=TARGET):
    return [tok.piece(t) for t, _ in props]


# ------------------------------------------------------------------------------------ UTF-8 handling
@pytest.mark.parametrize("text", ["", "abc", "é", "日本", EMOJI_SPLIT, "a" + EMOJI_SPLIT])
def test_utf8_split_holds_back_unfinished_characters(text):
    data = text.encode()
    assert utf8_split(data) == (data, b"")
    for cut in range(1, len(data)):
        head, tail = utf8_split(data[:cut])
        assert head + tail == data[:cut]
        head.decode("utf-8")                      # strict: the head is always complete
        assert len(tail) <= 3 and (not tail or tail[0] >= 0xC0)     # a lead byte and its continuation


def test_utf8_split_leaves_invalid_bytes_in_the_head():
    assert utf8_split(b"a\x80") == (b"a\x80", b"")      # a stray continuation byte is not unfinished
    assert utf8_split(b"a\xff") == (b"a\xff", b"")


def test_partial_character_at_the_end_of_the_draft_is_not_translated():
    e = EMOJI_SPLIT.encode()
    props = tr("x", b"\n" + e[:2], lookahead=b"")        # the draft stopped inside the emoji
    assert texts(props) == [b"\n"]
    assert tr("x", e[:3], lookahead=b"") == []            # nothing complete: nothing proposed, no bogus token
    assert texts(tr("x", b"\n" + e[:2], lookahead=e[2:])) == [b"\n"]   # even when the look-ahead finishes it


def test_multibyte_character_split_across_context_and_draft():
    e = EMOJI_SPLIT.encode()
    ctx = TARGET.enc(" ") + [TARGET.ids[e[:3]]]           # target tokens end inside the emoji
    head, tail, window = target_side(ctx, TARGET.piece, 4)
    assert head == b" " and tail == e[:3] and window == ctx
    props = tr(window, e[3:] + b" foo", ended=True)        # the draft text continues after the tail
    assert texts(props) == [e[3:], b" foo"]


def test_multibyte_characters_translate_to_whole_target_tokens():
    props = tr("hello", " 日本é\n".encode(), ended=True)
    assert b"".join(texts(props)) == " 日本é\n".encode() and texts(props)[1] == "日本".encode()


def test_window_starting_inside_a_character_backs_off_to_a_smaller_one():
    e = EMOJI_SPLIT.encode()
    window = [TARGET.ids[e[3:]], TARGET.ids[b" "]]        # first window token: the emoji's last byte only
    assert texts(tr(window, b"\n", ended=True)) == [b"\n"]    # window [" "] (k=2 does not decode)
    assert tr(window, b"foo", ended=True) == []                # window [" "]: " " + "foo" merge


# ------------------------------------------------------------------------------------ boundary merges
def test_context_token_that_would_merge_with_the_draft_backs_off():
    assert tr("hel", "lo world", ended=True) == []         # "hel"+"lo" -> "hello": not what the context holds
    assert tr("\n", "\nfoo", ended=True) == []             # "\n"+"\n" -> "\n\n"
    assert tr(" ", "foo", ended=True) == []                # " "+"foo" -> " foo"
    assert texts(tr("\n", "   def", ended=True)) == [b"   ", b"def"]   # no merge: proposed


def test_window_gives_the_tokens_after_the_context():
    assert texts(tr("hello", " world\n", ended=True)) == [b" world", b"\n"]
    assert texts(tr("x\n", "   def", ended=True)) == [b"   ", b"def"]


def test_last_token_dropped_without_lookahead_and_kept_when_stable():
    assert texts(tr("hello", " world\n")) == [b" world"]                        # unknown continuation
    assert texts(tr("hello", " world\n", lookahead=b"\n")) == [b" world"]      # "\n"+"\n" would merge
    assert texts(tr("hello", " world\n", lookahead=b"foo")) == [b" world", b"\n"]
    assert texts(tr("x", "():", lookahead=b"\n")) == []                        # "():" becomes "():\n"
    assert texts(tr("x", " foo ", lookahead=b"foo")) == [b" foo"]             # " " becomes " foo"
    assert texts(tr("x", " foo ", lookahead=b"")) == [b" foo", b" "]          # b"": the text ends


def test_lookahead_decides_how_the_new_text_splits():
    # "    " alone is "   " + " "; before "def" the target writes "   " + " def": only "   " is proposed
    assert texts(tr("x\n", "    ", lookahead=b"def")) == [b"   "]
    assert texts(tr("x\n", "    ", ended=True)) == [b"   ", b" "]
    # the look-ahead may be the start of a longer run: "\n " + " " could be "\n" + "   " + ...
    assert texts(tr("hello world", "\n ", lookahead=b" ")) == [b"\n"]


def test_draft_stopping_inside_a_word():
    assert texts(tr("x", " foo(ret", lookahead=b"ur")) == [b" foo", b"("]          # "ret|ur..." may split otherwise
    assert texts(tr("x", " foo(ret", lookahead=b"urn(")) == [b" foo", b"(", b"ret"]  # the word ends in view
    assert texts(tr("x", " foo(re", lookahead=b"_")) == [b" foo", b"(", b"r", b"e"]  # not a letter: the word ends


def test_max_tokens_and_confidence_is_the_product_of_overlapping_draft_tokens():
    new = b" world\n"
    spans = [(0, 4, 0.9), (4, 6, 0.8), (6, 7, 0.5)]        # " wor" | "ld" | "\n"
    props = tr("hello", new, spans=spans, ended=True)
    assert texts(props) == [b" world", b"\n"]
    assert props[0][1] == pytest.approx(0.72) and props[1][1] == pytest.approx(0.5)
    assert len(tr("hello", new, spans=spans, ended=True, max_tokens=1)) == 1


def test_empty_window_at_the_start_of_the_answer():
    assert texts(tr([], "hello world", ended=True)) == [b"hello", b" world"]


# ------------------------------------------------------------------------------------ context side
def test_special_tokens_are_barriers_for_the_window():
    im_end = TARGET.special["<|im_end|>"]
    gen = TARGET.enc("hello") + [im_end] + TARGET.enc("\n foo")
    head, tail, window = target_side(gen, TARGET.piece, 8)
    assert head == b"hello\n foo" and tail == b"" and window == TARGET.enc("\n foo")
    assert target_side(gen + [im_end], TARGET.piece, 8)[2] == []
    assert texts(tr(window, " world", ended=True)) == [b" world"]


def test_chain_text_stops_at_end_of_turn():
    eot = DRAFT.special["<end_of_turn>"]
    toks = DRAFT.enc(" foo") + [eot] + DRAFT.enc("def")
    dt = chain_text(toks, [0.9, 0.8, 0.7], DRAFT.piece, DRAFT.is_eog)
    assert dt.data == b" foo" and dt.ended and dt.n_tokens == 1 and dt.spans == [(0, 4, 0.9)]
    dt = chain_text(DRAFT.enc("he") + DRAFT.enc("llo"), [0.9, 0.8], DRAFT.piece, DRAFT.is_eog)
    assert dt.data == b"hello" and not dt.ended and dt.spans == [(0, 2, 0.9), (2, 5, 0.8)]


def test_heal_split_and_shift_spans():
    toks = DRAFT.enc("he llo")
    kept, need = heal_split(toks, DRAFT.piece, b"\xc3", 1)
    assert DRAFT.text(kept) == b"he " and need == b"llo\xc3"
    assert heal_split([], DRAFT.piece, b"", 1) == ([], b"")
    assert shift_spans([(0, 3, 0.5), (3, 5, 0.6)], 3) == [(0, 2, 0.6)]
    assert shift_spans([(0, 4, 0.5), (4, 5, 0.6)], 3) == [(-3, 1, 0.5), (1, 2, 0.6)]


def test_prefix_index():
    idx = PrefixIndex.build(DRAFT.n_vocab, DRAFT.piece)
    assert sorted(DRAFT.piece(int(t)) for t in idx.starting_with(b"re")) == [b"re", b"return"]
    assert {DRAFT.piece(int(t)) for t in idx.starting_with(b"\xff")} == {b"\xff"}
    assert len(idx.starting_with(b"zzzq")) == 0


def test_prefix_index_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("PIPEINFER_STAGE_CACHE", str(tmp_path / "cache"))
    model = tmp_path / "draft.gguf"
    model.write_bytes(b"stands for the model file: the cache is keyed by its path, size and mtime")
    calls = []

    def piece(t):
        calls.append(t)
        return DRAFT.piece(t)

    built = PrefixIndex.cached(str(model), DRAFT.n_vocab, piece)
    n_calls = len(calls)
    assert n_calls == DRAFT.n_vocab and len(list((tmp_path / "cache").glob("draft.prefix-index.*.npz"))) == 1
    loaded = PrefixIndex.cached(str(model), DRAFT.n_vocab, piece)   # from the file: no piece calls
    assert len(calls) == n_calls
    assert loaded.keys == built.keys and np.array_equal(loaded.ids, built.ids)
    assert list(loaded.starting_with(b"re")) == list(built.starting_with(b"re"))
    for f in (tmp_path / "cache").glob("*.npz"):
        f.write_bytes(b"not an npz")                                 # unreadable: rebuilt and rewritten
    assert PrefixIndex.cached(str(model), DRAFT.n_vocab, piece).keys == built.keys
    assert len(calls) == 2 * n_calls
    model.write_bytes(b"another model")                              # another file: another cache entry
    PrefixIndex.cached(str(model), DRAFT.n_vocab, piece)
    assert len(calls) == 3 * n_calls and len(list((tmp_path / "cache").glob("*.npz"))) == 2


# ------------------------------------------------------------------------------------ whole drafter, oracle model
class OracleDraftModel(InSeries):
    """Stands in for ModelDrafter: a 'model' that knows the text `script` and predicts its next draft token
    (the first token of the draft tokenization of the rest) with probability `p`, or its end of turn at the end;
    off the script it is unsure. Implements the parts TranslatingDrafter uses (sync, step)."""

    def __init__(self, tok: ToyTok, script: str, p: float = 0.9):
        self.tok, self.script, self.p = tok, script.encode(), p
        self.n_prompt = 0
        self._kv, self.n_decodes = [], 0
        self.engine = self
        self.n_ctx = 4096
        self.decoded_positions: list[int] = []

    def logits_for(self, seq):
        text = self.tok.text(seq[self.n_prompt:])
        x = np.zeros(self.tok.n_vocab, dtype=np.float32)
        if self.script.startswith(text):
            rest = self.script[len(text):]
            nxt = self.tok.encode_bytes(rest)[0] if rest else self.tok.special["<end_of_turn>"]
            x[nxt] = math.log(self.p * (self.tok.n_vocab - 1) / (1 - self.p))
        return x

    def sync(self, ctx):
        if self._kv[:len(ctx)] != list(ctx):   # seq 0 keeps what it holds beyond a context it starts with
            self._kv = list(ctx)
        return self.logits_for(list(ctx))

    def step(self, n, t):
        if n >= len(self._kv) or self._kv[n] != t:   # else held from an earlier call, as ModelDrafter keeps it
            self._kv = self._kv[:n] + [t]
            self.decoded_positions.append(n)
            self.n_decodes += 1
        return self.logits_for(self._kv[:n + 1])


SCRIPT = "hello world\n   def foo():\n   return 日本é " + EMOJI_SPLIT + " foo\n"


def make_oracle_drafter(script=SCRIPT, p=0.9, heal=True, n_prompt=3):
    model = OracleDraftModel(DRAFT, script, p)
    td = TranslatingDrafter(model, TARGET, DRAFT, n_prompt=n_prompt, prompt_text="Q:", chat=False, heal=heal)
    model.n_prompt = len(td.prompt)
    return td, model


@pytest.mark.parametrize("heal", [True, False])
def test_oracle_draft_proposes_the_targets_canonical_tokens(heal):
    td, _ = make_oracle_drafter(heal=heal)
    prompt = [7, 8, 9]
    ref = TARGET.enc(SCRIPT)
    n_first = 0
    for i in range(len(ref) + 1):
        tree = td.draft(prompt + ref[:i], Cutoffs(p_accept=0.5, n_max=3))
        props = [n.token for n in tree]
        assert props == ref[i:i + len(props)], (i, texts([(t, 1) for t in props]))
        assert [n.parent for n in tree] == list(range(-1, len(tree) - 1))
        assert [n.depth for n in tree] == list(range(len(tree))) and all(n.branches == {0} for n in tree)
        assert all(0 < n.prob <= 1.0 for n in tree)     # products of draft probabilities (healed: conditional)
        n_first += bool(props)
    assert td.n_calls == len(ref) + 1 and td.n_proposed >= n_first and td.n_draft_tokens > 0
    assert n_first >= 0.65 * len(ref), n_first     # misses: inside the emoji (byte tokens), the end


def test_oracle_final_token_is_proposed_when_the_draft_ends_its_turn():
    td, _ = make_oracle_drafter()
    ref = TARGET.enc(SCRIPT)
    tree = td.draft([7, 8, 9] + ref[:-1], Cutoffs(p_accept=0.5, n_max=3))
    assert [n.token for n in tree] == ref[-1:]          # "\n", then the draft's end of turn: kept


def test_end_of_generation_in_context_and_cutoffs():
    td, _ = make_oracle_drafter()
    ref = TARGET.enc(SCRIPT)
    assert td.draft([7, 8, 9] + ref[:3] + [TARGET.special["<|im_end|>"]], Cutoffs(0.5, n_max=3)) == []
    assert td.draft([7, 8, 9] + ref[:3], Cutoffs(p_accept=0.95, n_max=3)) == []   # the oracle is only 90% sure
    with pytest.raises(ValueError):
        td.draft([7, 8], Cutoffs())


def test_off_script_context_proposes_nothing():
    td, _ = make_oracle_drafter()
    assert td.draft([7, 8, 9] + TARGET.enc("hello there"), Cutoffs(0.5, n_max=3)) == []


def test_continuing_its_own_chain_decodes_only_new_draft_tokens():
    """Drafting ahead: the next call's context is the last one's plus its proposals; the healed token and
    the rest of the previous chain are held in seq 0 already, so only tokens beyond it are decoded."""
    td, model = make_oracle_drafter()
    ctx = [7, 8, 9] + TARGET.enc(SCRIPT)[:4]
    n_calls = 0
    while n_calls < 6:
        held = len(model._kv)
        model.decoded_positions.clear()
        props = [n.token for n in td.draft(ctx, Cutoffs(0.5, n_max=4))]
        n_calls += 1
        if n_calls > 1:
            assert model.decoded_positions and min(model.decoded_positions) >= held, (held, model.decoded_positions)
        if not props:
            break
        ctx += props
    assert n_calls >= 4
    assert ctx[3:] == TARGET.enc(SCRIPT)[:len(ctx) - 3]


def test_prefix_reuse_decodes_only_the_changed_tail():
    td, model = make_oracle_drafter()
    ref = TARGET.enc(SCRIPT)
    td.draft([7, 8, 9] + ref[:10], Cutoffs(0.5, n_max=3))
    before = len(model._kv)
    model.decoded_positions.clear()
    td.draft([7, 8, 9] + ref[:11], Cutoffs(0.5, n_max=3))
    assert model.decoded_positions and min(model.decoded_positions) >= before - 3


# ------------------------------------------------------------------------------------ real vocabularies
def _real_path(name):
    from pipeinfer.engine.models import ModelError, resolve_model
    try:
        return str(resolve_model(name))
    except ModelError as e:
        if os.environ.get("PIPEINFER_REQUIRE_REAL"):
            raise
        pytest.skip(f"{name} GGUF not available: {e}")


@pytest.fixture(scope="module")
def qwen_tok():
    from pipeinfer.engine.tokenizer import Tokenizer
    tok = Tokenizer(_real_path("qwen2.5-coder-1.5b"))
    yield tok
    tok.close()


@pytest.fixture(scope="module")
def gemma_tok():
    from pipeinfer.engine.tokenizer import Tokenizer
    tok = Tokenizer(_real_path("gemma3-270m"))
    yield tok
    tok.close()


SNIPPET = ('from functools import wraps\n\n\ndef memo(fn):\n    """Cache é 日本 ' + EMOJI_SPLIT + '."""\n'
           '    cache: dict[int, str] = {}\n\n    @wraps(fn)\n    def inner(x):\n        if x not in cache:\n'
           '            cache[x] = fn(x)\n        return cache[x]\n    return inner\n')


def _enc(tok):
    return lambda text: tok.encode(text, add_special=False, parse_special=False)


@pytest.mark.real
def test_real_gemma_text_translates_to_qwen_tokens_of_the_same_text(qwen_tok, gemma_tok):
    g = _enc(gemma_tok)(SNIPPET)
    dt = chain_text(g, [0.9] * len(g), gemma_tok.piece, gemma_tok.is_eog)
    assert dt.data == SNIPPET.encode()
    props = translate([], dt.data, dt.spans, _enc(qwen_tok), qwen_tok.piece, ended=True, lookahead=None,
                      max_tokens=10_000)
    toks = [t for t, _ in props]
    assert toks == _enc(qwen_tok)(SNIPPET)
    assert qwen_tok.decode(toks) == SNIPPET


@pytest.mark.real
def test_real_translation_after_every_qwen_prefix(qwen_tok, gemma_tok):
    """Context = Qwen's tokens of a prefix, draft = Gemma's tokens of the rest, cut into 3-token drafts
    with the next Gemma token as look-ahead: the proposals are always Qwen's own next tokens."""
    q = _enc(qwen_tok)(SNIPPET)
    data = SNIPPET.encode()
    n_some = 0
    for i in range(len(q)):
        head, tail, window = target_side(q[:i], qwen_tok.piece, 4)
        done = len(head) + len(tail)
        rest = data[done:]
        g = _enc(gemma_tok)(utf8_split(data)[0][len(head):].decode())   # the draft's view: after the complete text
        dt = chain_text(g[:3], [0.9] * 3, gemma_tok.piece, gemma_tok.is_eog)
        assert dt.data.startswith(tail)
        look = gemma_tok.piece(g[3]) if len(g) > 3 else b""
        props = translate(window, dt.data[len(tail):], shift_spans(dt.spans, len(tail)), _enc(qwen_tok),
                          qwen_tok.piece, ended=False, lookahead=look, max_tokens=3)
        toks = [t for t, _ in props]
        assert toks == q[i:i + len(toks)], (i, rest[:20], [qwen_tok.piece(t) for t in toks])
        n_some += bool(toks)
    assert n_some >= 0.8 * len(q), (n_some, len(q))


@pytest.mark.real
def test_real_boundary_merges_back_off(qwen_tok):
    enc, piece = _enc(qwen_tok), qwen_tok.piece

    def go(ctx, new, **kw):
        kw.setdefault("ended", True)
        kw.setdefault("lookahead", None)
        return [piece(t) for t, _ in translate(enc(ctx), new.encode(), [(0, len(new.encode()), 1.0)], enc, piece,
                                               max_tokens=8, **kw)]
    assert enc("x = 1\n")[-1] == enc("\n")[0]
    assert go("x = 1\n", "\ny = 2") == []                 # Qwen would have emitted "\n\n"
    assert go("return", " ") == [b" "] and go("return ", "foo") == []   # " " + "foo" -> " foo"
    assert go("x = 1\n", "    y = 2") == [b"   ", b" y", b" =", b" ", b"2"]
    assert go("x = 1", "\n    y", ended=False) == [b"\n", b"   "]       # " y" might be " yield"
    assert go("x = 1\n", "    ", ended=False, lookahead=b"y") == [b"   "]       # "   " + " y", not "    "
    assert go("x = 1", ".", ended=False, lookahead=b"max") == []              # ".max" is one Qwen token
    assert go("from functools import wraps, l", "ru", ended=False, lookahead=b"_") == [b"ru"]
    assert go("print(\"caf", "é\")") == []            # Qwen's tokens of "café" are "ca" + "fé"
    assert go("print(\"", "café\")") == [piece(t) for t in enc("print(\"café\")")[len(enc("print(\"")):]]


@pytest.mark.real
def test_real_special_token_in_context(qwen_tok):
    im_end = qwen_tok.encode("<|im_end|>", add_special=False, parse_special=True)
    assert len(im_end) == 1 and qwen_tok.is_eog(im_end[0]) and qwen_tok.piece(im_end[0]) == b""
    gen = _enc(qwen_tok)("ok") + im_end + _enc(qwen_tok)("\ndef f")
    head, tail, window = target_side(gen, qwen_tok.piece, 8)
    assert head == b"ok\ndef f" and window == _enc(qwen_tok)("\ndef f")
    props = translate(window, b"(x):\n", [(0, 5, 0.5)], _enc(qwen_tok), qwen_tok.piece, ended=True, lookahead=None,
                      max_tokens=8)
    assert b"".join(qwen_tok.piece(t) for t, _ in props) == b"(x):\n"


@pytest.mark.real
def test_real_emoji_straddling_tokens(qwen_tok, gemma_tok):
    e = EMOJI_SPLIT.encode()
    q, g = _enc(qwen_tok)(" " + EMOJI_SPLIT + " x"), _enc(gemma_tok)(EMOJI_SPLIT + " x")
    assert len(qwen_tok.piece(q[0])) < len(b" " + e)       # the emoji straddles Qwen tokens
    head, tail, window = target_side(q[:1], qwen_tok.piece, 4)
    assert head == b" " and tail and e.startswith(tail)
    dt = chain_text(g, [0.9] * len(g), gemma_tok.piece, gemma_tok.is_eog)
    props = translate(window, dt.data[len(tail):], shift_spans(dt.spans, len(tail)), _enc(qwen_tok), qwen_tok.piece,
                      ended=True, lookahead=None, max_tokens=8)
    assert [t for t, _ in props] == q[1:]


def test_draft_prompt_formats():
    from pipeinfer.drafters.translating import draft_prompt_text
    assert draft_prompt_text(DRAFT, "Q?", chat=True) == "Q?"            # no template, none recognised
    assert draft_prompt_text(DRAFT, "Q?", chat=False) == "Q?"


@pytest.mark.real
def test_real_gemma_prompt_uses_its_builtin_template(gemma_tok):
    from pipeinfer.drafters.translating import draft_prompt_text
    assert gemma_tok.chat_template() is None                            # the GGUF carries none
    assert (draft_prompt_text(gemma_tok, "hi", chat=True)
            == "<start_of_turn>user\nhi<end_of_turn>\n<start_of_turn>model\n")
    assert draft_prompt_text(gemma_tok, "hi", chat=False) == "hi"


@pytest.mark.parametrize("step", [2, 3])
def test_pruned_draft_head_stops_a_chain_instead_of_breaking_it(step):
    """--draft-head: tokens outside the draft's pruned head get logit -inf. Where healing allows only such
    tokens the chain stops there: no NaN confidence, no warning, every proposal's confidence in (0, 1]."""
    td, model = make_oracle_drafter()
    pruned = np.arange(0, DRAFT.n_vocab, step)
    full = model.logits_for

    def logits_for(seq):
        x = full(seq)
        x[pruned] = -np.inf
        return x
    model.logits_for = logits_for
    ref = TARGET.enc(SCRIPT)
    with warnings.catch_warnings():
        warnings.simplefilter("error")    # a NaN from (-inf) - (-inf) warns
        for i in range(len(ref) + 1):
            tree = td.draft([7, 8, 9] + ref[:i], Cutoffs(p_accept=0.5, n_max=3))
            assert all(0 < n.prob <= 1.0 for n in tree)
