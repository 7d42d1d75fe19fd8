"""Tensor-parallel groups priced: a pipeline stage run by G ranks (one per host) that split each of its layers.

A group's members hold a slice of every layer of the stage (engine/slices.py): attention by KV-head groups, the
feed-forward columns (a mixture of experts: each expert's columns, the router whole), and on the last stage the output
projection by vocabulary rows. A member's slice is its `share` of the stage's weights; the engine shares them by the
members' threads (ranks/group.py lead_group), which group_of does too. For a decode of r rows a group stage costs (ms):

    max over members of  stage_ms(share x the stage's bytes)    the host model (machines.Calibration.stage_ms), its
                                                                fixed per-rank overhead NOT divided
  + 2 x n_layers x exchange(r x n_embd + 1 values)              the attention's and the FFN's partial sums
  + input: the leader's run to each follower                    latency + (G - 1) x (r x n_embd x 4 bytes + metadata)
                                                                / bandwidth + half a polite wait's poll
  + (last stage) logits: each follower's slice to the leader    latency + r x n_vocab x (followers' shares) x 4 bytes
                                                                / bandwidth + half a poll

The partial sums' exchange is what the engine does (Wire.sums): "allgather", every member's f32[n + 1] to every
member (ranks/group.py exchange_over, then engine/group_sums.py adds them in member order); "allreduce" an all-reduce
of the same bytes (a peer's design, priced for its figure). Each is priced as MPICH runs it on G ranks linked by
`GroupLink` (one-way latency, bytes/s), a step of an algorithm one latency plus its bytes over the link (no
congestion, no overlap with compute); p below is the largest power of two <= G:

- MPI_Allgather (MPIR_Allgather_intra_auto) of n bytes a member, N = G x n in all: G a power of two and
  N < ALLGATHER_LONG_BYTES: recursive doubling, log2(G) latencies and (G - 1) x n bytes through each link; else
  N < ALLGATHER_SHORT_BYTES: Bruck's, ceil(log2 G) latencies and the same bytes; else a ring, G - 1 steps of n.
- MPI_Allreduce (MPIR_Allreduce_intra_auto) of n bytes: n <= ALLREDUCE_SHORT_BYTES, or fewer values than p:
  recursive doubling, log2(p) steps of the whole message; else Rabenseifner's reduce-scatter + allgather,
  2 log2(p) latencies and 2 (p - 1) / p of the bytes. G not a power of two: 2 more steps of the whole message (the
  ranks beyond p hand their part in, and get the sum back).

Members on one host decode at once: each streams at its share of the host's memory bandwidth. What is not priced:
the engine's own cost of an exchange beside MPI (llama.cpp's graph split at the hooked node, the
Python callback, copying the partial sums out and back; Wire.exchange_overhead_ms, 0 unless given: not measured yet),
attention's share when the KV heads do not divide as the shares do (every part of a layer is cut at the share), the
router of a mixture of experts (whole on every member; small).

Nothing here simulates: sim.py runs the real scheduler on stages, and a group is a stage whose cost is this one
(plan.py builds the profile of a pipeline of groups).
"""
from __future__ import annotations

import math
from collections import Counter
from dataclasses import dataclass, replace

from ..core.protocol import HEADER_LEN
from .machines import Calibration, Machine, Target, link_between

F32_BYTES = 4.0                 # bytes per value of pipeinfer's partial sums and activations (f32)
Q80_BYTES = 8.5 / 8             # distributed-llama's q80 buffers: blocks of 32 int8 and one f16 scale, 8.5 bits a value
ALLREDUCE_SHORT_BYTES = 2048    # MPICH's MPIR_CVAR_ALLREDUCE_SHORT_MSG_SIZE: recursive doubling up to this many bytes
ALLGATHER_LONG_BYTES = 524288   # MPICH's MPIR_CVAR_ALLGATHER_LONG_MSG_SIZE: recursive doubling below (G a power of 2)
ALLGATHER_SHORT_BYTES = 81920   # MPICH's MPIR_CVAR_ALLGATHER_SHORT_MSG_SIZE: Bruck's below, a ring above
META_BYTES_PER_ROW = 16         # a run's metadata per row (position, sequence, output flag), beside the header
POLL_S = 0.0005                 # core/config.WireOptions.poll_s: a polite wait's sleep between probes


@dataclass(frozen=True)
class Wire:
    """How a group's members talk, as priced: bytes per activation value, the partial sums' collective ("allgather":
    pipeinfer's engine; "allreduce"), the polite wait's poll interval on point-to-point messages (s; 0: busy waits),
    and the engine's own cost of one exchange beside MPI (ms; not measured: 0 unless given)."""
    value_bytes: float = F32_BYTES
    sums: str = "allgather"
    poll_s: float = POLL_S
    exchange_overhead_ms: float = 0.0


PIPEINFER = Wire()
# distributed-llama (the peer docs/twin.md compares with): q80 buffers, an all-reduce of the partial sums, its own
# sockets (no polite wait)
DISTRIBUTED_LLAMA = Wire(Q80_BYTES, "allreduce", 0.0)


@dataclass(frozen=True)
class GroupLink:
    """The links between a group's members, as the slowest pair of them: one-way latency (s), bandwidth (bytes/s)."""
    latency_s: float
    bandwidth_Bps: float

    def step_s(self, n_bytes: float) -> float:
        """One step of a collective: a latency and n_bytes over the link (s)."""
        return self.latency_s + n_bytes / self.bandwidth_Bps


def _pof2(g: int) -> int:
    """The largest power of two <= g."""
    return 1 << (g.bit_length() - 1)


def allreduce_s(n_bytes: float, g: int, link: GroupLink, short_bytes: float = ALLREDUCE_SHORT_BYTES,
                value_bytes: float = F32_BYTES) -> float:
    """Seconds of one all-reduce of n_bytes over g ranks, as MPICH chooses its algorithm (the module docstring)."""
    if g <= 1:
        return 0.0
    p = _pof2(g)
    steps = int(math.log2(p))
    extra = 0.0 if p == g else 2 * link.step_s(n_bytes)   # the ranks beyond p: their part in, the sum back
    if n_bytes <= short_bytes or n_bytes / value_bytes < p:
        return extra + steps * link.step_s(n_bytes)                       # recursive doubling
    return extra + 2 * steps * link.latency_s + 2 * (p - 1) / p * n_bytes / link.bandwidth_Bps  # Rabenseifner


def allgather_s(n_bytes: float, g: int, link: GroupLink) -> float:
    """Seconds of one MPI_Allgather of n_bytes from each of g ranks to every rank, as MPICH chooses its algorithm."""
    if g <= 1:
        return 0.0
    total = g * n_bytes
    spread = (g - 1) * n_bytes / link.bandwidth_Bps           # every other member's part through each link
    if total < ALLGATHER_LONG_BYTES and g == _pof2(g):
        return math.log2(g) * link.latency_s + spread            # recursive doubling
    if total < ALLGATHER_SHORT_BYTES:
        return math.ceil(math.log2(g)) * link.latency_s + spread  # Bruck's
    return (g - 1) * link.latency_s + spread                     # ring


def exchange_s(n_values: int, g: int, link: GroupLink, wire: Wire = PIPEINFER,
               short_bytes: float = ALLREDUCE_SHORT_BYTES) -> float:
    """Seconds of one exchange of a member's n_values partial sums (the module docstring; wire.sums decides which
    collective), with the engine's own cost of it."""
    if g <= 1:
        return 0.0
    n_bytes = n_values * wire.value_bytes
    if wire.sums == "allgather":
        mpi = allgather_s(n_bytes, g, link)
    elif wire.sums == "allreduce":
        mpi = allreduce_s(n_bytes, g, link, short_bytes, wire.value_bytes)
    else:
        raise ValueError(f"a group's sums are exchanged by allgather or allreduce, not {wire.sums!r}")
    return mpi + wire.exchange_overhead_ms / 1e3


def input_s(n_bytes: float, g: int, link: GroupLink, poll_s: float = POLL_S) -> float:
    """Seconds until every follower has the leader's run of n_bytes: the leader sends it to each in turn through its
    link, a follower's polite wait wakes half a poll later on average."""
    return 0.0 if g <= 1 else link.latency_s + (g - 1) * n_bytes / link.bandwidth_Bps + poll_s / 2


def gather_s(followers_bytes: float, g: int, link: GroupLink, poll_s: float = POLL_S) -> float:
    """Seconds of the followers' logits slices (`followers_bytes` in all) reaching the leader through its link, which
    waits politely for them."""
    return 0.0 if g <= 1 else link.latency_s + followers_bytes / link.bandwidth_Bps + poll_s / 2


@dataclass(frozen=True)
class Member:
    """One rank of a group: its host, threads, and its share (0..1) of every layer's weights and work."""
    machine: Machine
    threads: int
    share: float


@dataclass(frozen=True)
class Group:
    """A stage's ranks (the leader first) and the links between them. A group of one is a plain stage."""
    members: tuple[Member, ...]
    link: GroupLink

    @property
    def size(self) -> int:
        return len(self.members)

    @property
    def leader(self) -> Member:
        return self.members[0]


@dataclass(frozen=True)
class GroupCost:
    """One decode of a group stage, in ms, by part."""
    compute_ms: float     # the slowest member's decode of its share, its fixed overhead included
    exchange_ms: float    # the 2 x n_layers exchanges of the partial sums
    input_ms: float       # the leader's run reaching its followers
    gather_ms: float      # the last stage's logits slices reaching the leader

    @property
    def total_ms(self) -> float:
        return self.compute_ms + self.exchange_ms + self.input_ms + self.gather_ms

    @property
    def comm_ms(self) -> float:
        return self.exchange_ms + self.input_ms + self.gather_ms


def thread_shares(threads: list[int]) -> list[float]:
    """Each member's share of a group's layers, as the engine deals them: in proportion to its threads
    (ranks/group.py lead_group)."""
    return [t / sum(threads) for t in threads]


def group_of(hosts: list[tuple[Machine, int]], latency_us: float, shares: list[float] | None = None) -> Group:
    """The group of these (machine, threads) ranks, the first the leader: shares as the engine deals them
    (thread_shares) unless given; the link the slowest pair's (machines.link_between: the described link= and
    latency, shared memory between ranks of one host)."""
    shares = shares or thread_shares([t for _, t in hosts])
    latency, bandwidth = 0.0, math.inf
    for i, (a, _) in enumerate(hosts):
        for b, _ in hosts[i + 1:]:
            lk = link_between(a, b, latency_us)
            latency = max(latency, lk["latency_s"])
            bandwidth = min(bandwidth, lk["bandwidth_bps"] / 8)
    link = GroupLink(latency, bandwidth if bandwidth < math.inf else 1e18)
    return Group(tuple(Member(m, t, s) for (m, t), s in zip(hosts, shares)), link)


def group_stage_cost(group: Group, target: Target, cal: Calibration, n_layers: int, last: bool, rows: int = 1,
                     wire: Wire = PIPEINFER, short_bytes: float = ALLREDUCE_SHORT_BYTES) -> GroupCost:
    """One decode of `rows` rows of a stage of n_layers (the output projection too if `last`) by `group`, its members
    talking as `wire` says (the module docstring); short_bytes: the all-reduce's short-message threshold."""
    on_host = Counter(m.machine.name for m in group.members)
    compute = max(cal.stage_ms(_sharing(m.machine, on_host[m.machine.name]), m.threads,
                               m.share * target.active_stage_bytes(n_layers, last), rows,
                               m.share * target.read_stage_bytes(n_layers, last, rows))
                  for m in group.members)
    g = group.size
    if g == 1:
        return GroupCost(compute, 0.0, 0.0, 0.0)
    sums = 2 * n_layers * exchange_s(rows * target.n_embd + 1, g, group.link, wire, short_bytes)
    run = rows * target.n_embd * wire.value_bytes + 4 * HEADER_LEN + META_BYTES_PER_ROW * rows
    send = input_s(run, g, group.link, wire.poll_s)
    gather = 0.0
    if last:
        followers = sum(m.share for m in group.members[1:])
        gather = gather_s(rows * target.n_vocab * followers * F32_BYTES, g, group.link, wire.poll_s)
    return GroupCost(compute, sums * 1e3, send * 1e3, gather * 1e3)


def _sharing(m: Machine, k: int) -> Machine:
    """Machine m as each of k members of a group on it sees it: they decode at once, so each streams at 1/k of its
    memory bandwidth (its threads are already its share of the cores)."""
    return m if k == 1 or not m.mem_bw_gbps else replace(m, mem_bw_gbps=m.mem_bw_gbps / k)


def group_stage_ms(group: Group, target: Target, cal: Calibration, n_layers: int, last: bool, rows: int = 1,
                   wire: Wire = PIPEINFER) -> float:
    """group_stage_cost's total (ms)."""
    return group_stage_cost(group, target, cal, n_layers, last, rows, wire).total_ms


def one_group_cost(hosts: list[tuple[Machine, int]], target: Target, cal: Calibration, latency_us: float,
                   wire: Wire = PIPEINFER, short_bytes: float = ALLREDUCE_SHORT_BYTES, rows: int = 1) -> GroupCost:
    """The whole model on one group of these (machine, threads) ranks: pure tensor parallelism, as a peer runs it
    (wire: its bytes and collective) or pipeinfer's --tensor-parallel N on N ranks; a decode of `rows` rows."""
    return group_stage_cost(group_of(hosts, latency_us), target, cal, target.n_layer, True, rows, wire, short_bytes)


def layout_option(sizes: list[int]) -> str:
    """The engine's option for stages of these group sizes (in rank order): --tensor-parallel G where every stage is
    a group of G (one group of all included), else --groups A,B,..."""
    if len(set(sizes)) == 1:
        return f"--tensor-parallel {sizes[0]}"
    return "--groups " + ",".join(map(str, sizes))


def layouts(n_ranks: int) -> list[tuple[int, ...]]:
    """Group sizes of the stages (in rank order) plan tries on n_ranks stage ranks: every composition of them for
    up to 4 ranks (2 of 2, 2 + 1 + 1, ...), beyond: every stage a group of G for each G > 1 dividing n_ranks; never
    the plain pipeline (all 1s), which plan prices anyway. One group of all first."""
    if n_ranks < 2:
        return []
    if n_ranks <= 4:
        out = []
        for cuts in range(1 << (n_ranks - 1)):
            sizes, run = [], 1
            for i in range(n_ranks - 1):
                if cuts >> i & 1:
                    sizes.append(run)
                    run = 1
                else:
                    run += 1
            sizes.append(run)
            out.append(tuple(sizes))
    else:
        out = [tuple([g] * (n_ranks // g)) for g in range(2, n_ranks + 1) if n_ranks % g == 0]
    out = [s for s in out if max(s) > 1]
    return sorted(set(out), key=lambda s: (len(s), s))
