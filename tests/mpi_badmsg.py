"""Rank 0 sends rank 1 one crafted transaction through the real Transport; rank 1's StageWorker must refuse
it with a ProtocolError before receiving (or allocating) its payload. Prints REFUSED <message> on rank 1.

Usage: mpiexec -n 2 python -m mpi4py tests/mpi_badmsg.py huge|wrong-size|bad-kind|bad-meta [--as-cli]
With --as-cli, rank 1 ends the job as the CLI does on a ProtocolError (one line, MPI_Abort) instead.
"""
import sys

import numpy as np
from mpi4py import MPI

from pipeinfer.core.protocol import Batch, Flag, Header, Kind, Limits, ProtocolError, Tag, kv_ops
from pipeinfer.core.topology import LayerRange, Topology
from pipeinfer.wire.transport import Transport, polite_barrier
from pipeinfer.ranks.worker import StageWorker

comm = MPI.COMM_WORLD
rank = comm.Get_rank()
case = sys.argv[1]
lim = Limits(n_batch=64, n_embd=32, n_vocab=100, n_seq_max=4, n_ctx=256)
tx = Transport(comm.Dup(), comm.Dup())
from pipeinfer.wire.liveness import Liveness  # noqa: E402  (names the sender's host, as in a real run)
live = Liveness(comm, 30.0)
if rank == 0:
    if case == "huge":        # 2**30 x 2**30 floats announced: must be refused from the header alone
        tx.send(1, Header(Kind.DECODE, 1, 2**30, 2**31 - 1, Flag.NONE, -1, 1, 2**30))
    elif case == "wrong-size":  # a valid header, then an ACTIV payload of another size than announced
        b = Batch(np.array([5], np.int32), np.array([0], np.int32), [[0]], np.array([1], np.int32), kv_ops())
        meta = b.pack_meta()
        tx.send(1, Header(Kind.DECODE, 1, 1, len(meta), Flag.NONE, -1, 1, 32), (Tag.META, meta),
                (Tag.ACTIV, np.zeros((1, 16), np.float32)))
    elif case == "bad-kind":    # a RESULT travelling forwards
        tx.send(1, Header(Kind.RESULT, 1, 1, 0, Flag.NONE, -1, 1, 0))
    elif case == "bad-meta":    # a token id outside the vocabulary
        b = Batch(np.array([500], np.int32), np.array([0], np.int32), [[0]], np.array([1], np.int32), kv_ops())
        meta = b.pack_meta()
        tx.send(1, Header(Kind.DECODE, 1, 1, len(meta), Flag.NONE, -1, 1, 32), (Tag.META, meta),
                (Tag.ACTIV, np.zeros((1, 32), np.float32)))
    tx.flush()
else:
    topo = Topology(1, 2, (LayerRange(0, 1), LayerRange(1, 2)))
    try:
        StageWorker(topo, None, tx, lim).serve()  # no engine: nothing may reach a decode
        print("ACCEPTED", flush=True)
    except ProtocolError as e:
        if "--as-cli" in sys.argv:
            from pipeinfer.cli.guard import die
            die(str(e), 1)
        print(f"REFUSED {e}", flush=True)
polite_barrier(comm)
live.close()
