"""The draft rank (`--draft-at rank`: the world's last rank): it loads the draft model and drafts ahead for the
head until the head ends the session; and what the draft needs from the run's options, wherever it runs."""
from __future__ import annotations

import os

from ..core.config import Config
from ..drafters.factory import make_drafter
from ..engine.stagefile import read_info, vocab_bound


def draft_thread_count(opts: Config, threads_rank0: int, n_world: int) -> int:
    """--draft-threads, else rank 0's threads beside its stage (head, thread), or the cores shared by the ranks
    on its own rank (the target's default: cores / ranks)."""
    if opts.draft_threads:
        return opts.draft_threads
    return threads_rank0 if opts.draft_at != "rank" else max(1, (os.cpu_count() or 2) // n_world)


def serve_draft_rank(opts: Config, draft_comm, n_world: int) -> None:
    """The draft rank (--draft-at rank): load the draft, then draft ahead for the head until it ends the session."""
    from ..core.protocol import Tag
    from ..drafters.draftahead import DraftService, MpiEnd, lower_priority
    lower_priority()  # this thread: the draft's decodes; the liveness thread keeps its priority
    info = read_info(opts.model)  # the target's vocabulary: token ids, and a translating drafter's tokenizer
    drafter_for = None
    if opts.mode != "iterative":
        n = draft_thread_count(opts, 0, n_world)
        drafter_for = make_drafter(opts, n_vocab=info.n_vocab, n_threads=n, n_threads_batch=n)
    from ..wire.transport import Transport
    end = MpiEnd(Transport(draft_comm, draft_comm, opts.poll_s), 0, Tag.PROPOSAL, Tag.DRAFT_CTRL)
    DraftService(drafter_for, end, opts.n_ctx, vocab_bound(opts.model, info)).serve()
    end.flush()
