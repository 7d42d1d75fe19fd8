"""The one drafter factory: which drafter a generation gets, and whether a draft model drafts in the
target's vocabulary or through text (translating.py).

`pipeinfer generate`/`serve` (ranks/startup.py) and `pipeinfer profile` (twin/profile.py) both build their
drafters here, so the same draft model is never run one way by the one and another way by the other.
"""
from __future__ import annotations

from dataclasses import dataclass

from ..core.errors import UserError
from ..engine.kernels import DEFAULT_KERNELS
from .drafter import DRAFT_HEAD_AUTO


@dataclass(frozen=True)
class DraftSpec:
    """What the factory needs to build a generation's drafter (the ranks fill it from their run options)."""
    target: str                            # the target's GGUF: its vocabulary decides same or translate
    draft: str | None = None               # the draft model's GGUF (model drafter; replay's burner)
    kind: str = "model"                    # model | ngram | replay
    vocab: str = "auto"                    # auto | same | translate: how the draft's vocabulary maps (translates)
    mode: str = "pipeinfer"                # the generation mode, named when a draft model is missing
    n_ctx: int = 4096
    max_branches: int = 1                  # tree branches of a same-vocabulary draft (translating: chains only)
    n_threads: int = 1
    n_threads_batch: int = 1
    kernels: str = DEFAULT_KERNELS         # engine/kernels.py: repack | no-repack | fast
    head_tokens: int | None = DRAFT_HEAD_AUTO  # tokens the draft's output head keeps (None: all)
    n_vocab: int = 0                       # replay: the target's vocabulary (wrong proposals stay below it)
    replay_ref: str | None = None          # replay: JSON of an earlier `pipeinfer generate --json` run
    replay_accuracy: float = 0.8           # replay: probability each proposal is right
    seed: int = 0                          # replay: the sampling seed its right/wrong draws are keyed by


def make_drafter(spec: DraftSpec):
    """The drafter for a generation: a callable (prompt tokens, prompt text, chat) -> Drafter. Models are
    loaded once; a drafter that depends on the prompt (through text translation) is wrapped per prompt."""
    from .drafter import ModelDrafter, NgramDrafter, ReplayDrafter
    if spec.kind == "ngram":
        ngram = NgramDrafter()
        return lambda prompt, text, chat: ngram
    if spec.kind == "replay":
        replay = ReplayDrafter(_replay_reference(spec.replay_ref), spec.replay_accuracy, spec.n_vocab,
                               seed=spec.seed, burner=_chain_model(spec) if spec.draft else None)
        return lambda prompt, text, chat: replay
    if spec.kind != "model":
        raise UserError(f"unknown drafter {spec.kind!r} (choose model, ngram or replay)")
    if not spec.draft:
        raise UserError(f"mode {spec.mode} needs --draft MODEL.gguf or --drafter ngram")
    if translates(spec.target, spec.draft, spec.vocab):
        from ..engine.tokenizer import Tokenizer
        from .translating import TranslatingDrafter
        inner = _chain_model(spec)
        tok_tgt, tok_dft = Tokenizer(spec.target), Tokenizer(spec.draft)
        return lambda prompt, text, chat: TranslatingDrafter(inner, tok_tgt, tok_dft, n_prompt=len(prompt),
                                                             prompt_text=text or "", chat=chat)
    same = ModelDrafter(spec.draft, n_ctx=spec.n_ctx, max_branches=spec.max_branches, n_threads=spec.n_threads,
                        n_threads_batch=spec.n_threads_batch, kernels=spec.kernels, head_tokens=spec.head_tokens)
    return lambda prompt, text, chat: same


def _chain_model(spec: DraftSpec):
    """The draft model drafting chains only (one branch): a translating drafter's inner model, replay's burner."""
    from .drafter import ModelDrafter
    return ModelDrafter(spec.draft, n_ctx=spec.n_ctx, max_branches=1, n_threads=spec.n_threads,
                        n_threads_batch=spec.n_threads_batch, kernels=spec.kernels, head_tokens=spec.head_tokens)


def _replay_reference(path: str | None) -> list[int]:
    """The replay drafter's reference: prompt and output tokens of an earlier `generate --json` run."""
    import json
    try:
        with open(path) as f:
            ref = json.load(f)
        return list(ref["prompt_tokens"]) + list(ref["tokens"])
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise UserError(f"--replay-ref {path!r}: need the JSON of an earlier "
                        f"'pipeinfer generate --json' run ({e})") from None


def translates(target: str, draft: str, policy: str = "auto") -> bool:
    """Whether the draft drafts through text (translating.py) rather than in the target's token ids: always
    with `translate`; with `auto`, when check_vocab finds another vocabulary; `same` raises its UserError."""
    if policy == "translate":
        return True
    try:
        check_vocab(target, draft)
    except UserError:
        if policy == "same":
            raise
        return True  # auto: a draft with another vocabulary drafts through text
    return False


def check_vocab(target: str, draft: str) -> None:
    """The draft must give every token id the same text as the target."""
    from ..engine.ggufheader import read_header
    toks = []
    for path in (target, draft):
        key = "tokenizer.ggml.tokens"
        t = read_header(path, keep_arrays=(key,)).fields.get(key)
        if not isinstance(t, list):
            raise UserError(f"{path}: no tokenizer vocabulary in the GGUF")
        toks.append(t)
    t_tgt, t_dft = toks
    for i, (a, b) in enumerate(zip(t_tgt, t_dft)):
        if a != b:
            raise UserError(f"draft vocabulary differs from the target's: first mismatch at token id {i} "
                            f"(target {a.decode(errors='replace')!r}, draft {b.decode(errors='replace')!r})")
    if len(t_dft) > len(t_tgt):
        raise UserError(f"draft vocabulary has {len(t_dft)} tokens, more than the target's {len(t_tgt)}: "
                        f"first extra id {len(t_tgt)}")
