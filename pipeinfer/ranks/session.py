"""Rank 0's end of a loaded pipeline, the API every front end uses: requests go into the one generation loop
(scheduler.py), one at a time (`generate`) or several at once (`scheduler()` + `request`), `poll_stages` and
`stages` give every stage's live counters (pipeline.py: the stages' STAGE_STATS reports), and `close` shuts the
pipeline down and gathers every rank's statistics. startup.open_session makes it."""
from __future__ import annotations

import resource
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Callable

from ..core.config import Config, Resolved
from ..core.decoding import Decoding
from ..core.kvplan import PartitionPool, garbage_seq
from ..core.metrics import Stats
from ..core.topology import LayerRange
from ..wire.hosts import host_name
from ..wire.transport import polite_barrier
from ..decide.genconfig import GenConfig
from ..decide.rules import RunRules
from ..decide.scheduler import Request, Scheduler, generate

if TYPE_CHECKING:  # MPI and llama.cpp stay unimported where only the interface is read
    from mpi4py import MPI

    from ..drafters.draftahead import DraftClient, ThreadDrafter
    from ..drafters.drafter import Drafter
    from ..engine.stage import StageEngine
    from ..engine.tokenizer import Tokenizer
    from ..wire.liveness import Liveness
    from ..wire.transport import Transport
    from .pipeline import Pipeline


@dataclass
class RunResult:
    tokens: list[int]
    stats: Stats
    ranges: list[LayerRange]
    peak_rss_mb: list[float]
    probe_ms_per_layer: list[float] | None = None  # --layer-split auto's measurements, one per rank
    p_recovery: float = 0.0                         # the recovery factor used (-pr auto resolved)
    threads: list[int] | None = None                # each target rank's threads, as start-up resolved them


def peak_rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0


@dataclass
class HeadSession:
    """Rank 0's end of a loaded pipeline: the scheduler of every generation on it, then the pipeline's shutdown."""
    config: Config                      # the run's options as given (their Nones decided in `resolved`)
    resolved: Resolved                  # what start-up decided of the options left to it (parallel, draft max, ...)
    cfg: GenConfig                      # the head's parameters: the options with `resolved` in place
    comm: MPI.Comm
    engine: StageEngine
    transport: Transport | None         # None on one rank
    pipe: Pipeline
    pool: PartitionPool | None
    drafter_for: Callable[[list[int], str | None, bool], Drafter] | None
    tok: Tokenizer
    eos: set[int]
    ranges: list[LayerRange]
    exact_per_rank: list[int | None]
    n_seq_max: int
    probe_ms: list[float] | None = None
    live: Liveness | None = None        # several ranks
    beside: ThreadDrafter | DraftClient | None = None  # the drafter beside the pipeline (a thread, or the draft rank's)
    threads: list[int] | None = None    # each target rank's --threads, as start-up planned them (the web page)
    last_tokens: list[int] = field(default_factory=list)
    n_generations: int = 0
    _n_runs: int = 0
    _sched: Scheduler | None = None

    @property
    def parallel(self) -> int:
        """Generations at once on this pipeline."""
        return self.resolved.parallel

    def scheduler(self) -> Scheduler:
        """The one loop of every generation on this pipeline: submit Requests made by `request` and step it."""
        if self._sched is None:
            self._sched = Scheduler(self.pipe, self.cfg, n_stages=self.pipe.topo.n_ranks,
                                    n_parallel=self.resolved.parallel, pool=self.pool, drafter_for=self.drafter_for,
                                    eos=self.eos, rules_for=self.rules_for)
        return self._sched

    def rules_for(self, decoding: Decoding, answer_at: int) -> RunRules:
        """A request's rules for its runs' rows: its constraint compiled for this model's vocabulary (a
        grammar.ConstraintError, a ValueError, where it cannot be), its biases."""
        masker = None
        if decoding.constraint is not None:
            from ..engine.grammar import RowMasker, compile_constraint, lltokenizer
            lltok = lltokenizer(self.tok)
            masker = RowMasker(compile_constraint(decoding.constraint, lltok), lltok, self.tok.n_vocab, self.eos)
        return RunRules(decoding, answer_at, self.tok.n_vocab, masker)

    def load(self) -> dict:
        """What the pipeline holds now, for /health (read from another thread: a snapshot, not a lock)."""
        sched = self._sched
        return {"generating": len(sched.gens) if sched else None, "waiting": len(sched.waiting) if sched else 0,
                "most_generating": sched.stats.max_active if sched else None,
                "runs_in_flight": len(self.pipe.in_flight),
                "partitions_free": self.pool.n_free if self.pool else 0,
                "partitions": self.pool.n_partitions if self.pool else 0,
                "prompt_cache": sched.cache_load() if sched else None, "stages": self.stages(),
                "batching": {"batch_rows": self.cfg.batch_rows,
                             "shared_decodes": sched.executor.n_merged_runs if sched else 0,
                             "shared_rows": sched.executor.n_merged_rows if sched else 0,
                             "draft_rides": sched.executor.n_rides if sched else 0,
                             "riders_dropped": sched.executor.n_riders_dropped if sched else 0}}

    def poll_stages(self, waited_s: float = 0.0) -> None:
        """On the generation thread, between steps (feeders/pump.py): take the stages' reports that came, and count
        waited_s (the front end's wait for a request) as rank 0's idle time."""
        self.pipe.poll_reports(waited_s)

    def stages(self) -> list[dict]:
        """Every stage's counters as last taken (read from any thread), rank order: protocol.StageReport's fields
        and the rank's host; a stage not heard from yet is left out."""
        hosts = [h for h, _pid in self.live.hosts] if self.live is not None else [host_name()]
        return [{**vars(rep), "host": hosts[r] if r < len(hosts) else ""}
                for r, rep in sorted(self.pipe.reports.items())]

    def request(self, prompt: list[int], *, n_predict: int | None = None, sampling=None, prompt_text: str | None = None,
                chat: bool = False, on_tokens=None, on_progress=None, should_stop=None, on_done=None,
                replay=(), decoding=None, on_logprobs=None, cache_prompt: bool = True) -> Request:
        """A Request for `scheduler()`; on_done(tokens, stats) gets the statistics `generate` reports."""
        def done(tokens: list[int], stats: Stats) -> None:
            self._n_runs += stats.n_runs
            self.n_generations += 1
            stats.kernels, stats.exact_batch = self.config.stage.kernels, self.exact_per_rank
            stats.draft_at = self.config.draft.at
            if on_done is not None:
                on_done(tokens, stats)
        return Request(list(prompt), self.cfg.n_predict if n_predict is None else n_predict,
                       self.cfg.sampling if sampling is None else sampling, prompt_text, chat, on_tokens, should_stop,
                       done, on_progress=on_progress, replay=list(replay), decoding=decoding or Decoding(),
                       on_logprobs=on_logprobs, cache_prompt=cache_prompt)

    def generate(self, prompt: list[int], **request) -> Stats:
        """One generation to its end (keyword arguments as `request`); its tokens are in `last_tokens`."""
        self.last_tokens, stats = generate(self.scheduler(), self.request(prompt, **request))
        return stats

    def close(self) -> tuple[list[dict], list[float]]:
        """Shut the pipeline down; every rank's stage statistics (worker.StageStats as dicts, rank 0 first)
        and peak RSS (MiB)."""
        from .worker import StageStats
        head_stage = StageStats(rank=0, n_decoded=self._n_runs, t_idle_s=self.transport.t_wait_s if self.transport else 0.0,
                                kv=self.engine.kv_summary(exclude=garbage_seq(self.n_seq_max)),
                                bytes_sent=self.transport.bytes_sent if self.transport else 0,
                                n_tokens=self.pipe.n_tokens, t_busy_s=self.pipe.t_busy_s)
        self.pipe.shutdown()
        if self.beside is not None:
            self.beside.close()
        poll_s = self.config.wire.poll_s
        polite_barrier(self.comm, poll_s)
        stage_stats = self.comm.gather(None, root=0)[1:]
        # every report a stage sent while serving is received before any stage goes on to end (and finalize MPI)
        self.pipe.drain_reports({s["rank"]: s["n_reports"] for s in stage_stats}, poll_s)
        polite_barrier(self.comm, poll_s)
        rss = self.comm.gather(peak_rss_mb(), root=0)
        self.engine.close()  # a tensor group's leader: its members stop
        if self.live is not None:
            self.live.close()
        self.tok.close()
        return [vars(head_stage)] + stage_stats, rss
