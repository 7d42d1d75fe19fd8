"""What a supervised server says of its pipeline (/health, the live page): the phase it is in, why it failed, how
long it had no job serving, the current job's rank 0 as it attached, rank 0's prompt cache and each stage's counters
over every job.
"""
from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field

from ..core.protocol import STAGE_COUNTERS
from ..serving import link
from .slots import Slots


class StageTotals:
    """Each stage's counters over every job of a supervised server, by (rank, host): a new job's stages count from
    zero, so the totals of the jobs before it are added; a (rank, host) that the new job lacks keeps its last total.
    So no counter goes backwards across a re-form (what a job's last Stages missed of its last second is lost).
    Thread-safe: rank 0's reader writes, the HTTP side reads."""

    def __init__(self):
        self._lock = threading.Lock()
        self._earlier: dict[tuple[int, str], dict] = {}  # (rank, host) -> counters of the jobs before this one
        self._current: list[dict] = []                    # this job's stages, as its rank 0 last sent them
        self._job: link.Link | None = None                # this job's link: a late Stages of the last job is ignored

    def new_job(self, job) -> None:
        with self._lock:
            self._earlier = self._merged()
            self._current, self._job = [], job

    def take(self, job, stages: list[dict]) -> None:
        with self._lock:
            if job is self._job:
                self._current = stages

    def totals(self) -> list[dict]:
        """[{rank, host, counter: value, ...}] in (rank, host) order (HeadSession.stages()'s shape, n_reports left
        out)."""
        with self._lock:
            merged = self._merged()
        return [{"rank": rank, "host": host, **counters} for (rank, host), counters in sorted(merged.items())]

    def _merged(self) -> dict[tuple[int, str], dict]:
        merged = {key: dict(counters) for key, counters in self._earlier.items()}
        for st in self._current:
            total = merged.setdefault((int(st["rank"]), str(st["host"])), dict.fromkeys(STAGE_COUNTERS, 0))
            for name in STAGE_COUNTERS:
                total[name] += st.get(name, 0)
        return merged


@dataclass
class Health:
    """The supervisor's state as it reports it. `phase`: starting, serving, re-forming (the job failed), re-planning
    (--rejoin: a lost host is back), failed (`fatal` says why) or stopping."""
    phase: str = "starting"
    fatal: str | None = None
    ready: link.Ready | None = None     # the current (or last) job's rank 0 said so when it attached
    parallel: int = 0                   # generations at once, as the current job's rank 0 said
    prompt_cache: dict | None = None    # rank 0's prompt cache, as its Ready or its last Done said it
    stage_totals: StageTotals = field(default_factory=StageTotals)  # the stages' counters over every job
    t_down_s: float = 0.0               # seconds without a serving job since the first one served
    down_since: float | None = None     # monotonic time the current job ended (re-forming, re-planning)

    def went_down(self, phase: str) -> None:
        """The job ended (`phase`: re-forming, re-planning): the time without one counts from now."""
        self.phase, self.down_since = phase, time.monotonic()

    def attached(self, ready: link.Ready, rank0: link.Link) -> None:
        """A new job's rank 0 attached (`rank0`, its link): its own settings, its (empty) cache, stages from zero."""
        self.parallel, self.ready = ready.parallel, ready
        self.prompt_cache = ready.prompt_cache
        self.stage_totals.new_job(rank0)

    def serving(self) -> None:
        self.phase = "serving"
        if self.down_since is not None:
            self.t_down_s += time.monotonic() - self.down_since
            self.down_since = None

    def report(self, n_generating: int, slots: Slots, n_reforms: int, host_mem: dict[str, int]) -> dict:
        """/health's load: the requests at rank 0 (`n_generating`), the slots and the lost ones, re-forms, the time
        without a serving job, what each host had available, the draft host's state, the prompt cache, the stages."""
        down_s = self.t_down_s + (time.monotonic() - self.down_since if self.down_since else 0.0)
        out = {"queued": 0, "generating": n_generating, "ranks": len(slots.hosts), "degraded": bool(slots.lost),
               "lost": list(slots.lost), "reforms": n_reforms, "phase": self.phase, "down_s": round(down_s, 3),
               "available_gib": {h: round(b / 2**30, 2) for h, b in host_mem.items()}}
        if slots.draft_host is not None:  # serving the draft, or lost (the draft beside rank 0)
            serving = slots.draft_host_serving
            out["draft_host"] = serving.name if serving else None
        if self.prompt_cache is not None:  # rank 0's, as of its last Done (or its Ready)
            out["prompt_cache"] = dict(self.prompt_cache)
        out["stages"] = self.stage_totals.totals()
        return out
