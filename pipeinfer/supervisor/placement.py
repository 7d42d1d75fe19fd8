"""Where a supervised job runs, as the command line asks it (--np N on this machine, or --hostfile HOSTS): one slot per
target rank, the draft's host if the hostfile has one, and what the model asks of the hosts (Footprint), checked
before every start of the job.
"""
from __future__ import annotations

import socket
from dataclasses import dataclass, field

from ..core.config import Config, StageOptions
from ..core.errors import UserError
from ..engine.drafts import draft_hint
from ..engine.ggufheader import model_size

_LOCAL_NAMES = ("localhost", "127.0.0.1")


def on_this_machine(host: str) -> bool:
    return host in (*_LOCAL_NAMES, socket.gethostname())


@dataclass(frozen=True)
class Footprint:
    """What the model asks of the hosts, checked before every start of the job (a re-form on fewer hosts above
    all): the target's weights split over the ranks as --layer-split says (evenly by default), the draft's beside
    rank 0; what a host has is its hostfile `mem=` (GiB) and, on this machine, MemAvailable."""
    weights_bytes: int
    head_bytes: int = 0
    declared_gib: dict = field(default_factory=dict)   # host -> GiB (hostfile mem=)

    def shortfall(self, slots: list[str], fractions: list[float] | None = None,
                  measured: dict | None = None) -> str | None:
        """`fractions`: the job's --layer-split (None: even); `measured`: host -> bytes its ranks found available
        when the last job started (before it loaded the model), the lesser of that and mem= counts."""
        from ..core.topology import memory_shortfall
        from ..wire.liveness import available_memory
        available = {h: int(g * 2**30) for h, g in self.declared_gib.items()}
        here = available_memory()
        for host, n in [*(measured or {}).items(), *((h, here) for h in set(slots) if on_this_machine(h))]:
            available[host] = min(available.get(host, n), n)
        return memory_shortfall(slots, self.weights_bytes, self.head_bytes, available, fractions)


def split_fractions(stage: StageOptions, n_ranks: int) -> list[float] | None:
    """A job's --layer-split fractions, or None (absent or balanced: about even in weight bytes, the output
    projection counted; even; auto: not known before the job measures; or not valid: the job itself says why)."""
    from ..core.topology import SPLIT_NAMES, SplitError, parse_split
    value = stage.layer_split
    if value is None or value.strip() in SPLIT_NAMES:
        return None
    try:
        return parse_split(value, n_ranks)
    except SplitError:
        return None


@dataclass(frozen=True)
class DraftHost:
    """The hostfile's draft host (role=draft): the job's last rank runs the draft there (`settings`: draft_at rank,
    draft_threads, by their command-line names: Config.with_options); when it is lost, the draft (`n_bytes` of it)
    moves beside rank 0."""
    name: str
    settings: dict
    n_bytes: int


@dataclass(frozen=True)
class Placement:
    """Where a supervised job runs: one host per target rank (rank 0 first), the draft's host if the hostfile has
    one, what the model asks of them, and the configuration with what the hostfile's per-host settings give
    (threads=, threads_batch=, weight=)."""
    slots: list[str]
    footprint: Footprint
    config: Config
    draft: DraftHost | None = None


def placement(np: int | None, hostfile: str | None, config: Config) -> Placement:
    """--hostfile's slots (--np of them), or --np on this machine; the options the user set (config.set_by_user) win
    over the hostfile's settings."""
    from ..wire.launcher import host_settings, mpi_size, parse_hostfile, rank_hosts, with_draft_last
    if mpi_size() > 1:
        raise UserError("--np/--hostfile start the pipeline's MPI job themselves: run pipeinfer without mpiexec")
    hosts, settings, draft = [], {}, None
    draft_bytes = model_size(config.draft.model) if config.draft.model else 0
    if hostfile:
        try:
            hosts = parse_hostfile(hostfile)
            n = np or sum(h.slots for h in hosts)
            ordered, draft_settings = with_draft_last(hosts, n, config.set_by_user)
            if ordered and ordered[-1].role == "draft":
                if not config.draft.model:
                    raise ValueError(f"{ordered[-1].name} has role=draft but this run has no draft model: give "
                                     f"{draft_hint(config.model)}, or drop role=draft")
                draft, ordered, n = DraftHost(ordered[-1].name, draft_settings, draft_bytes), ordered[:-1], n - 1
            slots = [h.name for h in rank_hosts(ordered, n)]
            settings = host_settings(ordered, n, config.set_by_user)
            config = config.with_options(**settings)
        except (ValueError, OSError) as e:
            raise UserError(f"--hostfile {hostfile}: {e}") from None
    else:
        slots = ["localhost"] * np
    beside = draft is None and config.draft.at != "rank"
    return Placement(slots, Footprint(model_size(config.model), draft_bytes if beside else 0,
                                      {h.name: h.mem for h in hosts if h.mem}), config, draft)
