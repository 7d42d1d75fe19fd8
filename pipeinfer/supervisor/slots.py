"""The slots a supervised job runs on, and the ones it lost: a lost rank's slot leaves the job (kept under its place
in the first job, for --rejoin to put it back in order), and a lost draft host sends the draft beside rank 0.
"""
from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import NamedTuple

from ..core.config import Config
from ..core.errors import UserError
from .placement import DraftHost, Footprint, split_fractions

DRAFT_PLACE = -1  # the draft host's place among the lost slots (Slots.lost_slots)


class LostSlot(NamedTuple):
    """A lost slot, a pair as the live page unpacks it (frontend/state.py)."""
    host: str    # as the hostfile names it
    label: str   # its entry in Slots.lost


@dataclass
class Slots:
    """The job's hosts, one per target rank, rank 0 first, and each one's place (its rank in the first job); the
    hostfile's draft host, serving or lost; what the model asks of them (the draft's bytes beside rank 0 once its
    host is lost). A lost slot goes to `lost_slots` under its place, and its label to `lost`, until --rejoin takes it
    back."""
    hosts: list[str]
    footprint: Footprint | None = None
    draft_host: DraftHost | None = None
    places: list[int] = field(init=False)
    lost: list[str] = field(default_factory=list)                 # "rank R (host H)" of each slot lost, not back
    lost_slots: dict[int, LostSlot] = field(default_factory=dict)  # place -> the slot lost there

    def __post_init__(self):
        self.hosts = list(self.hosts)
        self.places = list(range(len(self.hosts)))

    @property
    def draft_host_serving(self) -> DraftHost | None:
        """The hostfile's draft host while it runs the draft on the job's last rank; None without one, or once it
        is lost (the draft then runs beside rank 0)."""
        return None if DRAFT_PLACE in self.lost_slots else self.draft_host

    def job_hosts(self) -> list[str]:
        """One host per rank of the job: the target's slots, then the draft host's while it serves."""
        serving = self.draft_host_serving
        return self.hosts + ([serving.name] if serving else [])

    def job_config(self, config: Config) -> Config:
        """`config` (the first job's) for a job on the slots left (per-rank values of theirs; where the draft runs)."""
        n_places = len(self.places) + len([p for p in self.lost_slots if p != DRAFT_PLACE])
        config = config.for_places(self.places, n_places)
        if self.draft_host is not None:  # the draft on its host (the last rank), or, that host lost, beside rank 0
            config = config.with_options(**self.draft_host.settings) if self.draft_host_serving else \
                config.with_options(draft_at="thread")
        return config

    def check_room(self, config: Config, host_mem: dict[str, int]) -> None:
        """UserError where the slots left cannot run the pipeline: none left, or too little memory on them
        (`host_mem`: host -> bytes its ranks reported available when a job last started)."""
        if not self.hosts:
            raise UserError(f"no slot left to run the pipeline on (lost: {'; '.join(self.lost)})")
        short = (self.footprint.shortfall(self.hosts, split_fractions(self.job_config(config).stage, len(self.hosts)),
                                          host_mem) if self.footprint else None)
        if short:
            raise UserError(f"the {len(self.hosts)} slot(s) left cannot hold the model: {short}" if self.lost else
                            f"the {len(self.hosts)} slot(s) cannot hold the model: {short}")

    def drop(self, rank: int, host: str, label: str | None = None) -> int:
        """Take the failed rank's slot out (kept with its first job's place for --rejoin); its place. The draft's
        rank (after the target's): the draft goes beside rank 0 (its memory there from now on)."""
        if self.draft_host_serving is not None and rank == len(self.hosts):
            self.lost.append(f"the draft's rank {rank} (host {host})")
            self.lost_slots[DRAFT_PLACE] = LostSlot(self.draft_host.name, self.lost[-1])
            if self.footprint:
                self.footprint = replace(self.footprint, head_bytes=self.draft_host.n_bytes)
            return DRAFT_PLACE
        self.lost.append(label or f"rank {rank} (host {host})")
        slot = self.hosts.pop(rank)  # the host as the hostfile names it (liveness names it by its hostname)
        place = self.places.pop(rank)
        self.lost_slots[place] = LostSlot(slot, self.lost[-1])
        return place

    def restore(self, places) -> list[str]:
        """The lost slots at these places go back into the slots, in their first job's rank order; their hosts."""
        hosts = []
        for p in places:
            host, label = self.lost_slots.pop(p)
            self.lost.remove(label)
            hosts.append(host)
            if p == DRAFT_PLACE:  # the draft goes back to its host
                if self.footprint:
                    self.footprint = replace(self.footprint, head_bytes=0)
                continue
            self.places.append(p)
            self.hosts.append(host)
        order = sorted(range(len(self.hosts)), key=self.places.__getitem__)
        self.places, self.hosts = [self.places[i] for i in order], [self.hosts[i] for i in order]
        return hosts
