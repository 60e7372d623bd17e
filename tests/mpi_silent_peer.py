"""Run under ``mpiexec -n 2`` by tests/test_cp_mpi.py: rank 1 never answers; rank 0 must give up
within its timeout with one line on stderr, and the job must end (no rank left waiting)."""

import sys
import time

import numpy as np

from kimilab.cp.comm import MPIComm

mode, timeout = sys.argv[1], float(sys.argv[2])
comm = MPIComm(timeout=timeout)
try:
    if comm.rank == 1:
        time.sleep(20 * timeout)  # never sends, never receives
    elif mode == "recv":
        comm.recv(1)
    elif mode == "send":  # 800 KB: past any eager limit, so only a receive could complete it
        comm.send(np.zeros(100_000), 1)
        comm.flush()
    else:
        comm.barrier()
except TimeoutError as exc:
    print(f"mpi_silent_peer: error: {exc}", file=sys.stderr)
    MPIComm.abort(2)
