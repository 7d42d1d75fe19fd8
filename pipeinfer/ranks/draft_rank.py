"""The draft rank (`--draft-at rank`: the world's last rank): it loads the draft model and drafts ahead for the
head until the head ends the session; and what the draft needs from the run's options, wherever it runs."""
from __future__ import annotations

import os

from ..core.config import Config, DraftOptions
from ..drafters.factory import make_drafter
from ..engine.stagefile import read_info, vocab_bound


def draft_thread_count(draft: DraftOptions, threads_rank0: int, n_world: int) -> int:
    """--draft-threads, else rank 0's threads beside its stage (head, thread), or the cores shared by the ranks
    on its own rank (the target's default: cores / ranks)."""
    if draft.threads:
        return draft.threads
    return threads_rank0 if draft.at != "rank" else max(1, (os.cpu_count() or 2) // n_world)


def drafter_of(config: Config, *, n_vocab: int, n_threads: int, n_threads_batch: int):
    """The run's drafter_for (drafters/factory.make_drafter): its draft section, beside the target and the stage,
    speculation and serving options the drafter shares with the run."""
    return make_drafter(config.draft, target=config.model, mode=config.mode, n_ctx=config.stage.n_ctx,
                        kernels=config.stage.kernels, max_branches=config.speculation.max_branches,
                        seed=config.serving.sampling.seed, n_vocab=n_vocab, n_threads=n_threads,
                        n_threads_batch=n_threads_batch)


def serve_draft_rank(config: Config, draft_comm, n_world: int) -> None:
    """The draft rank (--draft-at rank): load the draft, then draft ahead for the head until it ends the session."""
    from ..core.protocol import Tag
    from ..drafters.draftahead import DraftService, MpiEnd, lower_priority
    lower_priority()  # this thread: the draft's decodes; the liveness thread keeps its priority
    info = read_info(config.model)  # the target's vocabulary: token ids, and a translating drafter's tokenizer
    drafter_for = None
    if config.mode != "iterative":
        n = draft_thread_count(config.draft, 0, n_world)
        drafter_for = drafter_of(config, n_vocab=info.n_vocab, n_threads=n, n_threads_batch=n)
    from ..wire.transport import Transport
    end = MpiEnd(Transport(draft_comm, draft_comm, config.wire.poll_s), 0, Tag.PROPOSAL, Tag.DRAFT_CTRL)
    DraftService(drafter_for, end, config.stage.n_ctx, vocab_bound(config.model, info)).serve()
    end.flush()
