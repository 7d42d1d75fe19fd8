"""The one drafter factory: which drafter a generation gets, and whether a draft model drafts in the
target's vocabulary or through text (translating.py).

`pipeinfer generate`/`serve` (ranks/draft_rank.drafter_of) and `pipeinfer profile` (twin/profile.py) both build their
drafters here, so the same draft model is never run one way by the one and another way by the other.
"""
from __future__ import annotations

import functools
from pathlib import Path

from ..core.config import NGRAM_LEVEL, DraftOptions
from ..core.errors import UserError
from ..engine.kernels import draft_kernels


def make_drafter(draft: DraftOptions, *, target: str, mode: str, n_ctx: int, kernels: str, max_branches: int,
                 seed: int, n_vocab: int, n_threads: int, n_threads_batch: int):
    """The drafter the run's draft options ask for: a callable (prompt tokens, prompt text, chat) -> Drafter.
    Models are loaded once; a drafter that depends on the prompt (through text translation) is wrapped per prompt.
    What it shares with the run: the target's path (its vocabulary), the mode (for the error of a missing draft),
    the stages' context and kernels, the tree's branches, the sampling seed (replay's draws); n_vocab: the target's
    vocabulary (replay's wrong proposals stay below it); the threads: where it runs. With draft.below, a hierarchy
    (stack.py): draft.model drafts for the target, each level of draft.below for the one before it."""
    from .drafter import ModelDrafter, ReplayDrafter

    def model(branches: int, path: str | None = None) -> ModelDrafter:  # 1: chains only (a translating drafter's
        # inner model, replay's burner, a level of a hierarchy)
        return ModelDrafter(path or draft.model, n_ctx=n_ctx, max_branches=branches, n_threads=n_threads,
                            n_threads_batch=n_threads_batch, kernels=draft_kernels(kernels),
                            head_tokens=draft.head_tokens)
    if draft.drafter == "ngram":
        return _bottom_level(NGRAM_LEVEL, target=target, vocab=draft.vocab, model=model, branches=1)
    if draft.drafter == "mtp":  # the target's own MTP head, on the last stage: its proposals come with results
        from .mtpdraft import MtpDrafter
        mtp = MtpDrafter()
        return lambda prompt, text, chat: mtp
    if draft.drafter == "replay":
        replay = ReplayDrafter(_replay_reference(draft.replay_ref), draft.replay_accuracy, n_vocab, seed=seed,
                               burner=model(1) if draft.model else None)
        replay.runner_up = draft.replay_runner_up
        return lambda prompt, text, chat: replay
    if draft.drafter != "model":
        raise UserError(f"unknown drafter {draft.drafter!r} (choose model, ngram, mtp or replay)")
    if not draft.model:
        raise UserError(f"mode {mode} needs --draft MODEL.gguf or --drafter ngram")
    levels = (draft.model, *draft.below)  # from the level that drafts for the target down
    for path in levels[:-1]:
        if path == NGRAM_LEVEL or translates(target, path, draft.vocab):
            raise UserError(f"--draft {path}: a level with another level below it verifies that level's tokens, so it "
                            f"needs the target's vocabulary (the n-gram drafter and a model of another vocabulary "
                            f"can only be the last --draft)")
    bottom = _bottom_level(levels[-1], target=target, vocab=draft.vocab, model=model,
                           branches=max_branches if len(levels) == 1 else 1)
    if len(levels) == 1:
        return bottom
    from .stack import StackedDrafter
    uppers = [model(1, path) for path in levels[:-1]]
    names = [Path(path).name for path in levels]  # the statistics' labels (ngram is its own name)

    def level_for(k: int):
        """Level k's (prompt, text, chat) -> Drafter: a stack over the levels below it, the last level as it is;
        with --draft-below-at thread a level below the first drafts ahead in a thread of its own."""
        if k == len(levels) - 1:
            made = bottom
        else:
            lower_for = level_for(k + 1)
            made = lambda prompt, text, chat: StackedDrafter(uppers[k], lower_for(prompt, text, chat),  # noqa: E731
                                                             names[k:])
        if k == 0 or draft.below_at != "thread":
            return made
        from .draftahead import ThreadDrafter
        beside = ThreadDrafter(made, n_ctx, n_vocab)

        def client(prompt, text, chat):
            beside.client.begin(prompt, text or "", chat)
            return beside.client
        return client
    return level_for(0)


def _bottom_level(path: str, *, target: str, vocab: str, model, branches: int):
    """The drafter of the last (or only) level: the n-gram drafter, a model of the target's vocabulary, or one of
    another vocabulary drafting through text (a drafter per prompt). As make_drafter: (prompt, text, chat) -> Drafter."""
    from .drafter import NgramDrafter
    if path == NGRAM_LEVEL:
        ngram = NgramDrafter()
        return lambda prompt, text, chat: ngram
    if translates(target, path, vocab):
        from ..engine.tokenizer import Tokenizer
        from .translating import TranslatingDrafter
        inner = model(1, path)
        tok_tgt, tok_dft = Tokenizer(target), Tokenizer(path)
        return lambda prompt, text, chat: TranslatingDrafter(inner, tok_tgt, tok_dft, n_prompt=len(prompt),
                                                             prompt_text=text or "", chat=chat)
    same = model(branches, path)
    return lambda prompt, text, chat: same


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


@functools.lru_cache(maxsize=8)  # (a run asks at start and again for its report; both vocabularies are read)
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
