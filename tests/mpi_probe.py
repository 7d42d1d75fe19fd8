"""Run under mpiexec -n 2 (tests/test_transport_wait.py): does a rank notice a message that arrived while it slept
at its first look? After a barrier rank 1 waits 5 ms and sends a header-sized message, while rank 0 sleeps 30 ms
without any MPI call (the message is there by then, but no progress has pulled it in) and looks once: odd trials
with one Iprobe, even ones with transport.arrived. Prints one JSON line on rank 0: how many first looks found
the message, per way of looking."""
import json
import time

import numpy as np
from mpi4py import MPI

from pipeinfer.wire.transport import arrived, polite_barrier

TRIALS = 40


def main() -> None:
    comm = MPI.COMM_WORLD
    found = {"iprobe": 0, "arrived": 0}
    buf = np.zeros(8, np.int32)
    for trial in range(TRIALS):
        way = "arrived" if trial % 2 == 0 else "iprobe"
        polite_barrier(comm)
        if comm.Get_rank() == 1:
            time.sleep(0.005)
            comm.Isend(buf, dest=0, tag=7).Wait()
        else:
            time.sleep(0.03)
            seen = arrived(comm, 1, 7) if way == "arrived" else comm.Iprobe(source=1, tag=7)
            found[way] += bool(seen)
            while not comm.Iprobe(source=1, tag=7):
                time.sleep(0.0005)
            comm.Recv(buf, source=1, tag=7)
        polite_barrier(comm)
    if comm.Get_rank() == 0:
        print(json.dumps({"trials_each": TRIALS // 2, **found}), flush=True)


if __name__ == "__main__":
    main()
