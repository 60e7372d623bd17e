"""Run under ``mpiexec -n P`` by tests/test_cp_mpi.py: every KDA scheme and method in one job.

Each rank draws the same seeded inputs (both regimes), runs its slice with every
(regime, scheme, method), and measures what its MPIComm handed to MPI during that call
(pickled buffers, counted in the communicator). Rank 0 also runs the whole prompt alone,
compares, and prints one JSON list: per run, the largest error and every rank's wire and
payload bytes. The test holds those against cp.scheme_costs.
"""

import json
import sys

import numpy as np

from kimilab.cp import slices, split_bounds
from kimilab.cp.comm import MPIComm
from kimilab.cp.kda_cp import cp_kda_rank
from kimilab.cp.regimes import regime_inputs
from kimilab.kda import chunk_kda

RUNS = [("flushed", "allgather", "affine"), ("flushed", "allgather", "kcp"), ("flushed", "sequential", "affine"),
        ("flushed", "tree", "affine"), ("flushed", "needed", "affine"), ("flushed", "relay", "affine"),
        ("living", "needed", "affine"), ("living", "allgather", "kcp")]

T = int(sys.argv[1])
comm = MPIComm(timeout=30)
part = slices(split_bounds(T, comm.size))[comm.rank]
inputs = {regime: regime_inputs(T, 4, 64, 64, seed=0, regime=regime, dtype=np.float32)[0]
          for regime in ("flushed", "living")}
reference = {regime: chunk_kda(*x) for regime, x in inputs.items()} if comm.rank == 0 else {}
report = []
for regime, scheme, method in RUNS:
    mine = tuple(np.ascontiguousarray(a[part]) for a in inputs[regime])
    comm.barrier()
    wire, payload = comm.wire_bytes_sent, comm.bytes_sent
    o, S = cp_kda_rank(comm, *mine, scheme=scheme, method=method)
    sent = (comm.wire_bytes_sent - wire, comm.bytes_sent - payload)
    everyone = comm.allgather((o, S, sent))
    if comm.rank == 0:
        ref_o, ref_S = reference[regime]
        err = max(float(np.abs(np.concatenate([e[0] for e in everyone]) - ref_o).max()),
                  float(np.abs(everyone[-1][1] - ref_S).max()))
        report.append({"regime": regime, "scheme": scheme, "method": method, "max_abs_error": err,
                       "wire": [e[2][0] for e in everyone], "payload": [e[2][1] for e in everyone]})
comm.barrier()
if comm.rank == 0:
    print(json.dumps(report))
