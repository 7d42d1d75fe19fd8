"""The draft rank (`--draft-at rank`: the world's last rank): it loads the draft model and drafts ahead for the
head until the head ends the session; and what the draft needs from the run's options, wherever it runs."""
from __future__ import annotations

from ..core.config import Config, DraftOptions
from ..drafters.factory import make_drafter
from ..engine.stagefile import read_info, vocab_bound


def draft_thread_count(draft: DraftOptions, threads_rank0: int, own_cores: int) -> int:
    """--draft-threads, else rank 0's threads beside its stage (head, thread), or on its own rank the cores that rank
    may use (core/cpus.default_threads, as for a stage)."""
    if draft.threads:
        return draft.threads
    return threads_rank0 if draft.at != "rank" else own_cores


def drafter_of(config: Config, *, n_vocab: int, n_threads: int, n_threads_batch: int):
    """The run's drafter_for (drafters/factory.make_drafter): its draft section, beside the target and the stage,
    speculation and serving options the drafter shares with the run."""
    return make_drafter(config.draft, target=config.model, mode=config.mode, n_ctx=config.stage.n_ctx,
                        kernels=config.stage.kernels, max_branches=config.speculation.max_branches,
                        seed=config.serving.sampling.seed, n_vocab=n_vocab, n_threads=n_threads,
                        n_threads_batch=n_threads_batch)


def serve_draft_rank(config: Config, draft_comm, cores: int) -> None:
    """The draft rank (--draft-at rank): load the draft, then draft ahead for the head until it ends the session."""
    from ..core.protocol import Tag
    from ..drafters.draftahead import DraftService, MpiEnd, lower_priority
    lower_priority()  # this thread: the draft's decodes; the liveness thread keeps its priority
    info = read_info(config.model)  # the target's vocabulary: token ids, and a translating drafter's tokenizer
    drafter_for = None
    if config.mode != "iterative":
        n = draft_thread_count(config.draft, 0, cores)
        drafter_for = drafter_of(config, n_vocab=info.n_vocab, n_threads=n, n_threads_batch=n)
    from ..wire.transport import Transport
    end = MpiEnd(Transport(draft_comm, draft_comm, config.wire.poll_s), 0, Tag.PROPOSAL, Tag.DRAFT_CTRL)
    DraftService(drafter_for, end, config.stage.n_ctx, vocab_bound(config.model, info)).serve()
    end.flush()
