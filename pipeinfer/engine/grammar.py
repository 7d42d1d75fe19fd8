"""A request's constraint as token masks: llguidance compiles it (its own JSON-schema, Lark, regex and GBNF front
ends), the head's RowMasker computes one bitmask per output row of a speculative run, and the last stage's
core/verify.apply_mask sets the target's logits of the tokens a row's mask forbids to -inf before it picks that row's token.

Masks follow llguidance.numpy's layout: int32[n_rows, (n_vocab + 31) // 32], token t allowed iff bit t % 32 of
word t // 32 is set (little-endian words). Padding tokens of the model's logits beyond the tokenizer's tokens
are never allowed. When the constraint is satisfied and nothing more may follow, a mask allows exactly the
generation's EOS tokens; while it is satisfied but could go on (`12` of a number), the EOS tokens join the rest.

Exactness: a row's mask depends only on the tokens before it (the accepted answer and the row's speculative
path), so the constrained target picks the same token there in every mode and verification stays exact.
"""
from __future__ import annotations

import json
import threading
import warnings
import weakref
from typing import Iterable

import llguidance
import numpy as np
from llguidance.gbnf_to_lark import gbnf_to_lark
from llguidance.llamacpp import lltokenizer_from_vocab

from ..core.decoding import Constraint

# JSON whitespace where JSON allows it: a run of spaces/tabs, or one or two line breaks and an indentation,
# as llama.cpp's own JSON-schema grammars bound it. A chat model keeps writing the pretty-printed JSON it was
# trained on (forcing compact JSON pushes it off its habits), while a small model cannot spin out newlines
# forever (which llguidance's default, unbounded whitespace allows, until max_tokens). A schema's own
# "x-guidance" options override this.
JSON_WHITESPACE = r"[\x20\x09]{1,40}|(?:\r?\n){1,2}[\x20\x09]{0,40}"
JSON_DEFAULTS = {"whitespace_pattern": JSON_WHITESPACE}
ANY_JSON_OBJECT = {"type": "object"}

# what a ConstraintError calls the text of each kind of constraint
NOUNS = {"json_object": "schema", "json_schema": "schema", "lark": "Lark grammar", "gbnf": "GBNF grammar",
         "regex": "regular expression"}


class ConstraintError(ValueError):
    """A constraint that cannot be compiled; its message is one line naming the field and the problem."""


# ---------------------------------------------------------------- llguidance's tokenizer, once per Tokenizer
_lltokenizers: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()
_lltokenizers_lock = threading.Lock()


def lltokenizer(tok) -> llguidance.LLTokenizer:
    """llguidance's tokenizer for an engine Tokenizer (its llama.cpp vocab; EOS = tok.eos), built once (~1 s)
    and kept as long as the Tokenizer lives. Thread-safe: the lock keeps two requests from building it twice
    (the warnings filter is process-wide for that second, which only hides llama-cpp-python's deprecations)."""
    with _lltokenizers_lock:
        lt = _lltokenizers.get(tok)
        if lt is None:
            # llguidance reads each token's attributes through a llama-cpp-python call deprecated in 0.3.36,
            # which would warn once per token (151,936 times for Qwen2.5) wherever warnings are shown
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", DeprecationWarning)
                lt = lltokenizer_from_vocab(tok.vocab, eos_token=sorted(tok.eos) or None)
            _lltokenizers[tok] = lt
        return lt


# ---------------------------------------------------------------- constraint -> llguidance grammar
def compile_constraint(constraint: Constraint, lltok: llguidance.LLTokenizer | None = None,
                       field: str | None = None) -> str:
    """The llguidance grammar (what LLMatcher takes) for a constraint, checked before any generation.
    `field`: the request field that carried it, for the message (default: the constraint's kind).
    Raises ConstraintError for an invalid schema, grammar or regex."""
    where = f"{field or constraint.kind}: invalid {NOUNS[constraint.kind]}"
    grammar = _grammar(constraint, where)
    is_error, messages = llguidance.LLMatcher.validate_grammar_with_warnings(grammar, lltok)
    if is_error:
        raise ConstraintError(f"{where}: {_one_line(messages[0])}")
    return grammar


def _grammar(c: Constraint, where: str) -> str:
    M = llguidance.LLMatcher
    if c.kind == "json_object":
        return M.grammar_from_json_schema(ANY_JSON_OBJECT, defaults=JSON_DEFAULTS)
    if c.kind == "json_schema":
        schema = _schema(c.text, where)
        return M.grammar_from_json_schema(_closed(schema) if c.strict else schema, defaults=JSON_DEFAULTS)
    if c.kind == "regex":
        return M.grammar_from_regex(c.text)
    if c.kind == "lark":
        return M.grammar_from_lark(c.text)
    try:
        return M.grammar_from_lark(gbnf_to_lark(c.text))
    except Exception as e:  # the converter raises bare Exception ("Rule 'x' not found") as well as its own
        raise ConstraintError(f"{where}: {_one_line(str(e))}") from None


def _schema(text: str, where: str) -> dict:
    try:
        schema = json.loads(text)
    except json.JSONDecodeError as e:
        raise ConstraintError(f"{where}: not JSON ({e})") from None
    if not isinstance(schema, dict):
        raise ConstraintError(f"{where}: a schema is a JSON object, not {type(schema).__name__}")
    return schema


def _one_line(message: str) -> str:
    """An llguidance message on one line, without its echo of the grammar source ("  1 | ...", "    ^")."""
    lines = [ln.strip() for ln in message.splitlines()]
    kept = [ln for ln in lines if ln.strip("^ ") and not ln.split("|")[0].strip().isdigit()]
    return " ".join(kept)


# ---------------------------------------------------------------- strict: no properties beyond the schema's
# llguidance follows JSON Schema (a missing "additionalProperties" allows any extra property) and has no option
# for OpenAI's strict mode, so strict writes "additionalProperties": false into every object schema that says
# nothing about extra properties. A subschema combined with others stays open, since closing it would forbid the
# properties the others add (and make a required one unsatisfiable): an allOf's branches, anyOf/oneOf branches
# whose parent has properties of its own, and a schema with allOf/anyOf/oneOf/$ref (its branches, or the $ref's
# target, are closed where they stand alone). OpenAI's strict mode refuses most of these shapes anyway.
SCHEMA_MAPS = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")
SCHEMA_LISTS = ("allOf", "anyOf", "oneOf", "prefixItems")
SCHEMA_ONES = ("items", "additionalProperties", "additionalItems", "contains", "propertyNames", "not", "if",
               "then", "else", "unevaluatedProperties", "unevaluatedItems")
OPEN_KEYS = ("additionalProperties", "patternProperties", "unevaluatedProperties")
MIXED_KEYS = ("allOf", "anyOf", "oneOf", "$ref")


def _closed(schema, intersected: bool = False):
    """A copy of a JSON schema with its object schemas closed (see above); `intersected`: the schema is an allOf
    branch or sits beside properties of its parent."""
    if not isinstance(schema, dict):
        return schema
    out = dict(schema)
    own_properties = "properties" in out or "patternProperties" in out
    for k in SCHEMA_MAPS:
        if isinstance(out.get(k), dict):
            out[k] = {name: _closed(sub) for name, sub in out[k].items()}
    for k in SCHEMA_LISTS:
        if isinstance(out.get(k), list):
            out[k] = [_closed(sub, k == "allOf" or own_properties) for sub in out[k]]
    for k in SCHEMA_ONES:
        if isinstance(out.get(k), list):  # draft-4 tuple "items"
            out[k] = [_closed(sub) for sub in out[k]]
        elif k in out:
            out[k] = _closed(out[k])
    types = out.get("type") if isinstance(out.get("type"), list) else [out.get("type")]
    is_object = "properties" in out or "object" in types
    if is_object and not intersected and not any(k in out for k in OPEN_KEYS + MIXED_KEYS):
        out["additionalProperties"] = False
    return out


# ---------------------------------------------------------------- per-row masks for one generation
class RowMasker:
    """One generation's constraint state: the matcher advanced over the accepted answer (`commit`), and the
    masks of a speculative run's output rows (`masks`), computed without moving the committed state.
    Not thread-safe: one thread at a time (llguidance's matcher is mutable and drops the GIL while it works)."""

    def __init__(self, grammar: str, lltok: llguidance.LLTokenizer, n_vocab: int, eos_ids: Iterable[int]):
        if n_vocab < lltok.vocab_size:
            raise ValueError(f"the logits' {n_vocab} tokens are fewer than the tokenizer's {lltok.vocab_size}")
        self._m = llguidance.LLMatcher(lltok, grammar, log_level=0)
        if self._m.is_error():
            raise ConstraintError(f"invalid grammar: {_one_line(self._m.get_error())}")
        self.n_vocab = n_vocab
        self.width = (n_vocab + 31) // 32
        self._ll_width = (lltok.vocab_size + 31) // 32   # llguidance writes exactly this many words
        self._tail = lltok.vocab_size % 32               # valid bits of its last word (0: all 32)
        self.eos_ids = sorted(set(eos_ids))
        self._eos_clear = sorted(set(self.eos_ids) | set(lltok.eos_tokens))
        self._eos = frozenset(self.eos_ids)
        self._n_committed = 0
        self._ended = False   # an EOS has been committed

    @property
    def warnings(self) -> list[str]:
        return self._m.get_grammar_warnings()

    @property
    def is_accepting(self) -> bool:
        """The committed answer satisfies the constraint (EOS may come next)."""
        return self._m.is_accepting()

    @property
    def done(self) -> bool:
        """Nothing but EOS may follow the committed answer (or EOS has been committed)."""
        return self._ended or self._m.is_stopped()

    def commit(self, tokens: list[int]) -> None:
        """Advance over newly accepted answer tokens (an EOS ends the answer). The constrained target only ever
        picks allowed tokens, so a refused one is a bug upstream (a row decoded without its mask), not a user's
        mistake."""
        tokens = list(tokens)
        end = _eos_at(tokens, self._eos)
        n = 0 if self._ended else self._m.try_consume_tokens(tokens[:end])
        self._n_committed += n
        if not self._ended and n == end < len(tokens) and self._m.is_accepting():
            self._ended = True   # the EOS itself stays out of the matcher (see masks())
            n += 1
        if n < len(tokens):
            raise RuntimeError(f"answer token {tokens[n]} (answer position {self._n_committed}) breaks the "
                               f"constraint: was its row decoded without its mask?")

    def masks(self, paths: list[list[int]]) -> np.ndarray:
        """int32[len(paths), width]: row i's mask for the token after committed + paths[i].
        Paths are visited in sorted order so a tree's shared prefixes are consumed once; the matcher is rolled
        back to the committed state before returning.

        A row whose path holds an EOS gets all ones: the answer ends at that EOS, so its token is never used
        (and llguidance's matcher takes an EOS only in some states, so it never sees one)."""
        out = np.zeros((len(paths), self.width), np.int32)
        stack: list[int] = []   # tokens consumed beyond the committed state
        try:
            for i in sorted(range(len(paths)), key=lambda i: paths[i]):
                path = list(paths[i])
                if self._ended or _eos_at(path, self._eos) < len(path):
                    out[i] = -1
                    continue
                keep = _common_prefix(stack, path)
                if keep < len(stack):
                    self._m.rollback(len(stack) - keep)
                    del stack[keep:]
                rest = path[keep:]
                n = self._m.try_consume_tokens(rest) if rest else 0
                stack += rest[:n]
                if n < len(rest):
                    # the path holds a token the grammar forbids: the row's own mask forbade it, so the
                    # constrained target never picks it and verification never reaches this row; any mask will do
                    out[i] = -1
                else:
                    self._fill(out[i])
        finally:
            if stack:
                self._m.rollback(len(stack))
        if self._m.is_error():
            raise RuntimeError(f"llguidance matcher failed: {self._m.get_error()}")
        return out

    def _fill(self, row: np.ndarray) -> None:
        """The current state's mask into row (int32[width]), EOS set by acceptance, padding clear."""
        self._m.unsafe_compute_mask_ptr(row.ctypes.data, self._ll_width * 4)
        words = row.view(np.uint32)
        if self._tail:
            words[self._ll_width - 1] &= np.uint32((1 << self._tail) - 1)
        for t in self._eos_clear:
            words[t >> 5] &= ~np.uint32(1 << (t & 31))
        if self._m.is_accepting():
            for t in self.eos_ids:
                words[t >> 5] |= np.uint32(1 << (t & 31))


def _eos_at(tokens: list[int], eos: frozenset) -> int:
    """Index of the first EOS in tokens (len(tokens) when none)."""
    return next((i for i, t in enumerate(tokens) if t in eos), len(tokens))


def _common_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n
