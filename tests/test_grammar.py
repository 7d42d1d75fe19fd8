"""Constraints as token masks (engine/grammar.py): compile errors before generation, masks of speculative paths
equal to masks after committing the same tokens, forbidden paths, EOS at the end, padding, apply_mask, and
greedy decoding over fake logits that always yields JSON valid for its schema.

Most tests run on a small byte-level tokenizer built in Python (token id b < 256 is byte b); the ones marked
`real` load only the vocabulary of the real Qwen2.5-Coder GGUF."""
from __future__ import annotations

import json

import jsonschema
import llguidance
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from helpers import real_model
from pipeinfer.core.decoding import Constraint
from pipeinfer.core.verify import apply_mask
from pipeinfer.engine.grammar import ConstraintError, RowMasker, compile_constraint, lltokenizer

# ---------------------------------------------------------------- a small byte-level tokenizer
MULTI = [b'{"', b'"}', b'":', b'": ', b'", "', b', ', b'\n  ', b'\n    ', b'  ', b'true', b'false', b'null',
         b'"name"', b'123', b'[]', b'{}', b'],', b'},', b'"]', b'\xc3\xa9']
TOKENS = [bytes([b]) for b in range(256)] + MULTI + [b"<|end|>", b"<|pad|>"]
EOS, PAD = len(TOKENS) - 2, len(TOKENS) - 1
N_VOCAB = len(TOKENS) + 37   # the model's logits are padded beyond the tokenizer's tokens (not to a multiple of 32)


class ByteTokenizer:
    """What llguidance.TokenizerWrapper reads: token bytes, EOS, specials, and a (greedy) encoder."""
    eos_token_id = EOS
    bos_token_id = None
    tokens = TOKENS
    special_token_ids = [EOS, PAD]

    def __call__(self, data: bytes) -> list[int]:
        out, i = [], 0
        while i < len(data):
            t = max((t for t, b in enumerate(TOKENS[:EOS]) if data.startswith(b, i)), key=lambda t: len(TOKENS[t]))
            out.append(t)
            i += len(TOKENS[t])
        return out


@pytest.fixture(scope="module")
def lt():
    return llguidance.LLTokenizer(llguidance.TokenizerWrapper(ByteTokenizer()))


def masker(lt, kind: str, text: str = "", strict: bool = False, n_vocab: int = N_VOCAB, eos=(EOS,)) -> RowMasker:
    return RowMasker(compile_constraint(Constraint(kind, text, strict), lt), lt, n_vocab, list(eos))


def allowed(row: np.ndarray, n_vocab: int = N_VOCAB) -> set[int]:
    bits = np.unpackbits(row.astype("<i4").view(np.uint8), bitorder="little")[:n_vocab]
    return set(np.nonzero(bits)[0].tolist())


def accepts(m: RowMasker, text: str) -> bool:
    """Does the constraint let `text` (one token per byte) through, each token allowed by its mask, then EOS?"""
    for t in text.encode():
        if t not in allowed(m.masks([[]])[0]):
            return False
        m.commit([t])
    return EOS in allowed(m.masks([[]])[0])


# ---------------------------------------------------------------- compile errors, before any generation
@pytest.mark.parametrize("kind, text, words", [
    ("json_schema", '{"type": "foo"}', "Invalid type: foo"),
    ("json_schema", '{"properties": {"a": {"$ref": "#/$defs/nope"}}}', "'/$defs/nope' does not exist"),
    ("json_schema", '{"type": "object", "properties": {', "not JSON"),
    ("json_schema", '[1, 2]', "a schema is a JSON object, not list"),
    ("json_schema", '{"type": "string", "format": "bogus"}', "Unknown format: bogus"),
    ("json_schema", '{"type": "array", "uniqueItems": true}', "uniqueItems"),
    ("gbnf", 'root ::= item\nother ::= "x"', "Rule 'item' not found"),
    ("gbnf", 'root ::= "a" (', "invalid GBNF grammar"),
    ("lark", "start: foo", 'unknown name: "foo"'),
    ("regex", "a(b", "unclosed group"),
])
def test_an_invalid_constraint_is_one_line_naming_field_and_problem(lt, kind, text, words):
    with pytest.raises(ConstraintError) as e:
        compile_constraint(Constraint(kind, text), lt, field=f"response_format.{kind}")
    msg = str(e.value)
    assert msg.startswith(f"response_format.{kind}: invalid ") and words in msg and "\n" not in msg, msg


def test_an_error_names_the_kind_when_no_field_is_given(lt):
    with pytest.raises(ConstraintError, match=r"^json_schema: invalid schema: Invalid type: foo$"):
        compile_constraint(Constraint("json_schema", '{"type": "foo"}'), lt)


@pytest.mark.parametrize("kind, text, good, bad", [
    ("json_object", "", '{"k": [1, {"z": null}], "s": "t"}', '[1]'),
    ("json_schema", '{"type": "integer", "minimum": 3}', "42", "2"),
    ("regex", "[0-9]{3}-[a-z]+", "123-abc", "12-abc"),
    ("lark", 'start: "yes" | "no"', "no", "nope"),
    ("gbnf", 'root ::= "(" digit+ ")"\ndigit ::= [0-9]', "(12)", "()"),
])
def test_each_kind_lets_its_language_through_and_nothing_else(lt, kind, text, good, bad):
    assert accepts(masker(lt, kind, text), good)
    assert not accepts(masker(lt, kind, text), bad)


# ---------------------------------------------------------------- strict and whitespace
OBJ = {"type": "object", "properties": {"a": {"type": "integer"},
                                        "rows": {"type": "array", "items": {"type": "object",
                                                                            "properties": {"b": {"type": "string"}}}}},
       "required": ["a"]}


def test_strict_forbids_properties_beyond_the_schemas_at_every_level(lt):
    schema = json.dumps(OBJ)
    for text, loose_ok, strict_ok in [('{"a": 1}', True, True),
                                      ('{"a": 1, "rows": [{"b": "x"}]}', True, True),
                                      ('{"a": 1, "extra": 2}', True, False),
                                      ('{"a": 1, "rows": [{"b": "x", "c": 3}]}', True, False)]:
        assert accepts(masker(lt, "json_schema", schema), text) is loose_ok, text
        assert accepts(masker(lt, "json_schema", schema, strict=True), text) is strict_ok, text


def test_strict_keeps_what_the_schema_says_and_leaves_intersections_satisfiable(lt):
    said = json.dumps({"type": "object", "properties": {"a": {"type": "integer"}}, "additionalProperties": True})
    assert accepts(masker(lt, "json_schema", said, strict=True), '{"a": 1, "z": 2}')
    both = {"type": "object", "allOf": [{"properties": {"a": {"type": "integer"}}, "required": ["a"]},
                                         {"properties": {"b": {"type": "integer"}}, "required": ["b"]}]}
    assert accepts(masker(lt, "json_schema", json.dumps(both), strict=True), '{"a": 1, "b": 2}')


def test_json_whitespace_is_pretty_or_compact_but_bounded(lt):
    value = {"a": 1, "rows": [{"b": "x"}]}
    schema = json.dumps(OBJ)
    assert accepts(masker(lt, "json_schema", schema), json.dumps(value, indent=2))
    assert accepts(masker(lt, "json_schema", schema), json.dumps(value, separators=(",", ":")))
    assert not accepts(masker(lt, "json_schema", schema), '{\n\n\n"a": 1}')
    assert not accepts(masker(lt, "json_schema", schema), '{' + " " * 41 + '"a": 1}')


# ---------------------------------------------------------------- masks of speculative paths
TEXT = '{"a": 7, "rows": [{"b": "hi"}, {}]}'


def test_the_mask_of_a_path_is_the_mask_after_committing_it(lt):
    seq = list(TEXT.encode())
    ref = masker(lt, "json_schema", json.dumps(OBJ))
    after = []
    for t in seq + [EOS]:
        after.append(ref.masks([[]])[0])
        ref.commit([t])
    # a tree: every prefix, in a shuffled order, and a few side branches with allowed next tokens
    paths = [seq[:k] for k in range(len(seq) + 1)] + [seq[:5] + [ord("1")], seq[:5] + [ord("1"), ord("2")]]
    order = np.random.default_rng(3).permutation(len(paths))
    m = masker(lt, "json_schema", json.dumps(OBJ))
    got = m.masks([paths[i] for i in order])
    for row, i in enumerate(order):
        path = paths[i]
        if path == seq[:len(path)]:
            assert np.array_equal(got[row], after[len(path)]), path
    side = masker(lt, "json_schema", json.dumps(OBJ))
    side.commit(seq[:5] + [ord("1")])
    assert np.array_equal(got[list(order).index(len(seq) + 1)], side.masks([[]])[0])


def test_masks_leave_the_committed_state_as_it_was(lt):
    seq = list(TEXT.encode())
    m = masker(lt, "json_schema", json.dumps(OBJ))
    m.commit(seq[:4])
    before = m.masks([[]])[0]
    m.masks([seq[4:9], seq[4:], [ord("x")] * 3, seq[4:] + [EOS], [], seq[4:6] + [EOS]])
    assert np.array_equal(m.masks([[]])[0], before)
    m.commit(seq[4:])
    assert m.done and m.is_accepting


def test_a_path_the_grammar_forbids_gets_an_all_ones_mask(lt):
    m = masker(lt, "json_schema", json.dumps(OBJ))
    good = list(b'{"a": ')
    got = m.masks([good + [ord("x")], good, list(b'[') + good, good + [ord("1")], good + [EOS]])
    assert (got[0] == -1).all() and (got[2] == -1).all()
    assert (got[4] == -1).all()   # past an EOS (here a refused one) the answer has ended
    assert allowed(got[1]) >= {ord(c) for c in "-0123456789"} and ord("x") not in allowed(got[1])


def test_a_finished_grammar_allows_only_eos(lt):
    m = masker(lt, "json_schema", json.dumps(OBJ), eos=(EOS, 7))
    m.commit(list(b'{"a": 1}'))
    assert m.done and m.is_accepting
    assert allowed(m.masks([[]])[0]) == {EOS, 7}
    m.commit([7])
    assert m.done and (m.masks([[]]) == -1).all()   # past the end: no row is ever used
    with pytest.raises(RuntimeError, match="breaks the constraint"):
        m.commit([EOS])
    regex = masker(lt, "regex", "abc")
    assert allowed(regex.masks([list(b"abc")])[0]) == {EOS}
    assert allowed(regex.masks([list(b"ab")])[0]) == {ord("c")}


def test_eos_joins_while_the_grammar_could_go_on(lt):
    m = masker(lt, "regex", "[0-9]+")
    m.commit(list(b"12"))
    assert m.is_accepting and not m.done
    assert allowed(m.masks([[]])[0]) == {ord(c) for c in "0123456789"} | {TOKENS.index(b"123"), EOS}


def test_padding_and_other_special_tokens_are_never_allowed(lt):
    m = masker(lt, "json_object")
    rows = m.masks([[], list(b'{"k": "'), list(b'{"k": 1'), list(b'{"k": 1}')])
    assert rows.shape == (4, (N_VOCAB + 31) // 32)
    for row in rows:
        assert not allowed(row) & ({PAD} | set(range(len(TOKENS), N_VOCAB)))
    assert len(allowed(rows[1])) > 150   # inside a string: printable ASCII, UTF-8 lead bytes, most MULTI


def test_the_logits_may_not_have_fewer_tokens_than_the_tokenizer(lt):
    with pytest.raises(ValueError, match="fewer than"):
        masker(lt, "json_object", n_vocab=len(TOKENS) - 1)


def test_committing_a_refused_token_is_a_bug_reported_loudly(lt):
    m = masker(lt, "json_object")
    with pytest.raises(RuntimeError, match=r"answer token 120 \(answer position 1\) breaks the constraint"):
        m.commit([ord("{"), ord("x")])


# ---------------------------------------------------------------- apply_mask
@pytest.mark.parametrize("n_rows, n_vocab", [(1, 64), (3, 100), (5, 1000)])
def test_apply_mask_matches_a_naive_loop(n_rows, n_vocab):
    rng = np.random.default_rng(n_vocab)
    width = (n_vocab + 31) // 32 + 1   # wider than needed, as a mask of a padded vocabulary may be
    mask = rng.integers(-2**31, 2**31, size=(n_rows, width)).astype(np.int32)
    mask[0, 0] = -1
    logits = rng.normal(size=(n_rows, n_vocab)).astype(np.float32)
    want = logits.copy()
    for r in range(n_rows):
        for t in range(n_vocab):
            if not (int(mask[r, t // 32]) >> (t % 32)) & 1:
                want[r, t] = -np.inf
    apply_mask(logits, mask)
    assert np.array_equal(logits, want)


def test_apply_mask_refuses_a_mask_too_narrow():
    with pytest.raises(ValueError, match="does not cover"):
        apply_mask(np.zeros((1, 65), np.float32), np.zeros((1, 2), np.int32))


# ---------------------------------------------------------------- greedy decoding over fake logits
def greedy_decode(m: RowMasker, n_vocab: int, closers: np.ndarray, seed: int, max_steps: int = 3000) -> list[int]:
    """argmax of random logits (a fixed seed) after the mask, committed one token at a time until EOS. Closing
    tokens (`closers`, a 0/1 float array) get a growing bonus so strings, arrays and objects end."""
    rng = np.random.default_rng(seed)
    out: list[int] = []
    for step in range(max_steps):
        logits = rng.normal(size=(1, n_vocab)).astype(np.float32) + closers * (2.5 + 0.02 * step)
        apply_mask(logits, m.masks([[]]))
        t = int(np.argmax(logits))
        if t in m.eos_ids:
            return out
        m.commit([t])
        out.append(t)
    raise AssertionError(f"no EOS after {max_steps} tokens")


def closer_bonus(pieces: list[bytes], n_vocab: int, eos: list[int]) -> np.ndarray:
    bonus = np.zeros(n_vocab, np.float32)
    bonus[[t for t, p in enumerate(pieces) if p[:1] in (b'"', b"}", b"]")] + eos] = 1
    return bonus


# Schemas drawn with plain hypothesis strategies: hypothesis-jsonschema 0.23.1 cannot draw objects under the
# hypothesis this project pins (its object strategy calls a removed internal, `many.more()`), and a schema is one.
NAMES = ["id", "name", "tags", "kind", "x", "y"]
LEAVES = st.one_of(
    st.builds(lambda lo, hi: {"type": "integer", "minimum": lo, "maximum": hi}, st.integers(-50, 0),
              st.integers(1, 500)),
    st.sampled_from([{"type": "number"}, {"type": "boolean"}, {"type": "null"}]),
    st.builds(lambda n: {"type": "string", "maxLength": n}, st.integers(0, 10)),
    st.lists(st.sampled_from(["red", "a b", 0, 2.5, None, True]), min_size=1, max_size=4,
             unique_by=json.dumps).map(lambda values: {"enum": values}))


def containers(sub: st.SearchStrategy) -> st.SearchStrategy:
    """Objects (some required names among their properties, some not) and arrays of `sub` schemas."""
    objects = st.builds(lambda props, req: {"type": "object", "properties": props, "required": req},
                        st.dictionaries(st.sampled_from(NAMES), sub, max_size=4),
                        st.lists(st.sampled_from(NAMES), unique=True, max_size=3))
    arrays = st.builds(lambda items, lo, hi: {"type": "array", "items": items, "minItems": lo, "maxItems": hi},
                       sub, st.integers(0, 2), st.integers(3, 5))
    return st.one_of(objects, arrays)


SCHEMAS = containers(st.recursive(LEAVES, containers, max_leaves=6))


def strict_required(schema):
    """Under strict a required property must be one of the schema's properties (as OpenAI asks)."""
    if isinstance(schema, dict):
        schema = {k: strict_required(v) for k, v in schema.items()}
        if "required" in schema:
            schema["required"] = [n for n in schema["required"] if n in schema.get("properties", {})]
    elif isinstance(schema, list):
        schema = [strict_required(v) for v in schema]
    return schema


def closed(schema):
    """The schema with every object closed: what a strict answer must also satisfy."""
    if isinstance(schema, dict):
        schema = {k: (closed(v) if k != "properties" else {n: closed(s) for n, s in v.items()})
                  for k, v in schema.items()}
        if schema.get("type") == "object":
            schema["additionalProperties"] = False
    return schema


@settings(max_examples=24, derandomize=True, database=None, deadline=None,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(schema=SCHEMAS, strict=st.booleans(), seed=st.integers(0, 2**16))
def test_greedy_decoding_under_a_schema_gives_json_valid_for_it(lt, schema, strict, seed):
    if strict:
        schema = strict_required(schema)
    m = masker(lt, "json_schema", json.dumps(schema), strict=strict)
    tokens = greedy_decode(m, N_VOCAB, closer_bonus(TOKENS, N_VOCAB, [EOS]), seed)
    value = json.loads(b"".join(TOKENS[t] for t in tokens).decode())
    jsonschema.validate(value, closed(schema) if strict else schema)


# ---------------------------------------------------------------- the real Qwen vocabulary
@pytest.fixture(scope="module")
def qwen():
    from pipeinfer.engine.tokenizer import Tokenizer
    tok = Tokenizer(real_model("qwen2.5-coder-1.5b"))
    yield tok
    tok.close()


PERSON = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 20},
                                           "age": {"type": "integer", "minimum": 0, "maximum": 150},
                                           "tags": {"type": "array", "items": {"enum": ["a", "b", "c"]}},
                                           "address": {"type": "object", "properties": {"city": {"type": "string"}},
                                                       "required": ["city"]}},
          "required": ["name", "age"]}


@pytest.mark.real
def test_the_llguidance_tokenizer_is_built_once_per_tokenizer(qwen):
    lt = lltokenizer(qwen)
    assert lltokenizer(qwen) is lt
    assert lt.eos_tokens == sorted(qwen.eos) and lt.vocab_size == qwen.n_vocab


@pytest.mark.real
def test_masks_on_the_real_vocabulary(qwen):
    lt = lltokenizer(qwen)
    n_vocab = qwen.n_vocab + 64   # a padded logits row
    m = RowMasker(compile_constraint(Constraint("json_schema", json.dumps(PERSON), True), lt), lt, n_vocab,
                  sorted(qwen.eos))
    seq = qwen.encode('{"name": "Ann", "age": 31, "tags": ["a", "c"], "address": {"city": "Oslo"}}',
                      add_special=False)
    along = m.masks([seq[:k] for k in range(len(seq) + 1)])
    for k, t in enumerate(seq):
        assert t in allowed(along[k], n_vocab)
        assert np.array_equal(m.masks([[]])[0], along[k])
        m.commit([t])
    assert m.done and allowed(along[-1], n_vocab) == set(qwen.eos)
    assert not allowed(along[0], n_vocab) & set(range(qwen.n_vocab, n_vocab))


@pytest.mark.real
@pytest.mark.parametrize("schema", [PERSON, {"type": "array", "items": {"type": "integer"}, "maxItems": 4},
                                    {"enum": ["north", "south", 3]}])
def test_greedy_decoding_on_the_real_vocabulary_gives_valid_json(qwen, schema):
    lt = lltokenizer(qwen)
    eos = sorted(qwen.eos)
    m = RowMasker(compile_constraint(Constraint("json_schema", json.dumps(schema)), lt), lt, qwen.n_vocab, eos)
    pieces = [qwen.piece(t) for t in range(qwen.n_vocab)]
    tokens = greedy_decode(m, qwen.n_vocab, closer_bonus(pieces, qwen.n_vocab, eos) * 3, seed=5)
    jsonschema.validate(json.loads(qwen.decode(tokens)), schema)
