"""MPI ping-pong between two ranks: the latency and bandwidth that MPI messages really get.

    mpiexec -n 2 python -m mpi4py -m pipeinfer.wire.netprobe [--bytes 607744] [--seconds 1.5]

Rank 0 prints one line, e.g. `netprobe: rank 0 (h0) <-> rank 1 (h1): bandwidth 95.3 Mbit/s (607744-byte
messages), latency 142 us (one way, 8-byte messages)`, and, with --json, a JSON object. The default
message size is one row of Qwen2.5-Coder-1.5B logits (151,936 float32), which is what the last stage
sent back per output row before protocol 3 (it now sends one token id per row). launch/cluster/netns-cluster.sh runs it to prove that MPI traffic crosses the shaped links.
"""
from __future__ import annotations

import argparse
import json
import time
from dataclasses import asdict, dataclass

import numpy as np

from .hosts import host_name

DEFAULT_BYTES = 151_936 * 4


@dataclass
class PingPong:
    host_a: str
    host_b: str
    n_bytes: int
    bandwidth_bit_s: float   # message bits / one-way time, from round trips of n_bytes messages
    latency_s: float         # one-way time of an 8-byte message

    def line(self) -> str:
        return (f"netprobe: rank 0 ({self.host_a}) <-> rank 1 ({self.host_b}): bandwidth "
                f"{self.bandwidth_bit_s / 1e6:.1f} Mbit/s ({self.n_bytes}-byte messages), latency "
                f"{self.latency_s * 1e6:.0f} us (one way, 8-byte messages)")


def _one_way_s(comm, peer: int, buf: np.ndarray, min_s: float, min_rounds: int, max_rounds: int) -> float:
    """Median one-way time of `buf` between this rank and `peer` over timed round trips (rank 0 leads;
    both ranks run the same number of rounds: rank 0 decides and sends the count first)."""
    rank = comm.Get_rank()
    lead = rank < peer
    comm.Send(buf, dest=peer) if lead else comm.Recv(buf, source=peer)  # warm-up: connections open
    comm.Recv(buf, source=peer) if lead else comm.Send(buf, dest=peer)
    times = []
    t_end = time.perf_counter() + min_s
    n = np.zeros(1, dtype=np.int64)
    while True:
        if lead:
            n[0] = 1 if (len(times) < min_rounds or time.perf_counter() < t_end) and len(times) < max_rounds else 0
            comm.Send(n, dest=peer)
        else:
            comm.Recv(n, source=peer)
        if not n[0]:
            break
        t0 = time.perf_counter()
        if lead:
            comm.Send(buf, dest=peer)
            comm.Recv(buf, source=peer)
        else:
            comm.Recv(buf, source=peer)
            comm.Send(buf, dest=peer)
        times.append((time.perf_counter() - t0) / 2)
    return float(np.median(times))


def ping_pong(comm, peer: int, n_bytes: int = DEFAULT_BYTES, seconds: float = 1.5) -> PingPong | None:
    """Measure latency and bandwidth between this rank and `peer`; the lower rank gets the result."""
    small = np.zeros(8, dtype=np.uint8)
    big = np.zeros(n_bytes, dtype=np.uint8)
    latency = _one_way_s(comm, peer, small, seconds / 3, 20, 2000)
    one_way = _one_way_s(comm, peer, big, seconds * 2 / 3, 5, 200)
    hosts = comm.allgather(host_name())
    if comm.Get_rank() > peer:
        return None
    # bandwidth net of latency, so that a small message size on a fast link is not read as a slow link
    bandwidth = n_bytes * 8 / max(one_way - latency, one_way * 0.05)
    return PingPong(hosts[comm.Get_rank()], hosts[peer], n_bytes, bandwidth, latency)


def main() -> None:
    ap = argparse.ArgumentParser(prog="python -m pipeinfer.wire.netprobe", description=__doc__.split("\n\n")[0])
    ap.add_argument("--bytes", type=int, default=DEFAULT_BYTES, help="message size for the bandwidth")
    ap.add_argument("--seconds", type=float, default=1.5, help="time to spend measuring")
    ap.add_argument("--json", action="store_true", help="also print a JSON object")
    args = ap.parse_args()
    from mpi4py import MPI
    comm = MPI.COMM_WORLD
    if comm.Get_size() != 2:
        if comm.Get_rank() == 0:
            print(f"netprobe: error: run on exactly 2 ranks (got {comm.Get_size()})", flush=True)
        raise SystemExit(2)
    res = ping_pong(comm, 1 - comm.Get_rank(), args.bytes, args.seconds)
    if res is not None:
        print(res.line(), flush=True)
        if args.json:
            print(json.dumps(asdict(res)), flush=True)


if __name__ == "__main__":
    main()
