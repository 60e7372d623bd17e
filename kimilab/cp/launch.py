"""Run context-parallel KDA for real: P processes under ``mpiexec``, timed against one rank.

:func:`mpi_run` is what every rank executes for ``mpiexec -n P python -m kimilab cp``:
seeded inputs (the same on every rank; each keeps its slice), one single-rank
``chunk_kda`` on rank 0 while the others wait, then the P-rank run, both timed between
barriers in the same process group. :func:`launch` starts ``mpiexec`` from Python (the
book and the benchmark do) with one BLAS thread per rank, and parses the JSON line.
On several machines the only change is the launch: ``mpiexec -f hostfile -n P ...``.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

from kimilab.cp.comm import MPIComm
from kimilab.cp.kda_cp import cp_kda_rank
from kimilab.cp.split import balanced_weights, slices, split_bounds
from kimilab.kda import chunk_kda
from kimilab.kda.testing import random_inputs
from kimilab.validate import check_int

__all__ = ["mpi_run", "launch", "mpiexec_path", "ONE_THREAD"]

# One BLAS / OpenMP thread per rank: P ranks on P cores, no oversubscription.
ONE_THREAD = {name: "1" for name in ("OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS", "MKL_NUM_THREADS")}


def mpi_run(tokens: int, heads: int = 4, dim: int = 64, dtype: str = "float32", *, seed: int = 0,
            scheme: str = "allgather", affine_cost: float | None = 1.25, timeout: float = 120.0,
            repeats: int = 1) -> dict | None:
    """Every rank calls this under mpiexec; rank 0 returns the result dict, the others None.

    Slices are weighted by :func:`~kimilab.cp.split.balanced_weights` with ``affine_cost``
    (None: even). Errors (P > T, ...) are raised on every rank before anything blocks.
    With ``repeats`` > 1 the one-rank reference and the P-rank run alternate that many
    times after one untimed warm-up of each, and the speedup is the ratio of the medians
    (a shared machine's noise hits both alike).
    """
    repeats = check_int("repeats", repeats, 1)
    comm = MPIComm(timeout=timeout)
    P, r = comm.size, comm.rank
    weights = None if affine_cost is None or P == 1 else balanced_weights(P, affine_cost)
    bounds = split_bounds(tokens, P, weights)  # same on every rank; raises on every rank
    (q, k, v, g, beta), _ = random_inputs(tokens, heads, dim, dim, seed=seed, dtype=dtype)
    part = slices(bounds)[r]
    mine = tuple(np.ascontiguousarray(x[part]) for x in (q, k, v, g, beta))
    ones, walls, ref = [], [], None
    runs = repeats + (repeats > 1)  # the first of several is a warm-up
    for _ in range(runs):
        comm.barrier()
        if r == 0:
            t0 = time.perf_counter()
            ref = chunk_kda(q, k, v, g, beta)
            ones.append(time.perf_counter() - t0)
        comm.barrier()
        t0 = time.perf_counter()
        o, S = cp_kda_rank(comm, *mine, scheme=scheme)
        mine_seconds = time.perf_counter() - t0
        comm.barrier()
        walls.append(time.perf_counter() - t0)
    if repeats > 1:
        ones, walls = ones[1:], walls[1:]
    one, wall = float(np.median(ones)) if r == 0 else 0.0, float(np.median(walls))
    sent = (comm.bytes_sent // runs, comm.messages_sent // runs)  # every run sends the same
    gathered = comm.allgather((mine_seconds, sent))
    if r > 0:
        comm.send(o, 0)
        comm.send(S, 0) if r == P - 1 else None
        return None
    outs = [o] + [comm.recv(src) for src in range(1, P)]
    S_last = comm.recv(P - 1) if P > 1 else S
    err = max(float(np.abs(np.concatenate(outs) - ref[0]).max()), float(np.abs(S_last - ref[1]).max()))
    return {"ranks": P, "tokens": tokens, "heads": heads, "dim": dim, "dtype": str(np.dtype(dtype)),
            "scheme": scheme, "bounds": bounds, "max_abs_error": err,
            "seconds_p_ranks": wall, "seconds_one_rank": one, "speedup": one / wall, "repeats": repeats,
            "seconds_p_ranks_each": walls, "seconds_one_rank_each": ones,
            "seconds_per_rank": [s for s, _ in gathered],
            "bytes_sent_per_rank": [b for _, (b, _) in gathered],
            "messages_sent_per_rank": [m for _, (_, m) in gathered]}


def mpiexec_path() -> str | None:
    """The ``mpiexec`` next to this Python (the mpich wheel puts it there), else the one on PATH."""
    here = Path(sys.executable).parent / "mpiexec"
    return str(here) if here.exists() else shutil.which("mpiexec")


def launch(ranks: int, tokens: int, *, heads: int = 4, dim: int = 64, dtype: str = "float32",
           extra: tuple = (), repeats: int = 1, timeout: float = 300.0) -> dict:
    """``mpiexec -n ranks python -m kimilab cp ...`` in a subprocess; the parsed JSON object.

    Raises RuntimeError with mpiexec's last stderr line if it fails or times out.
    """
    exe = mpiexec_path()
    if exe is None:
        raise RuntimeError("mpiexec not found: install the mpich wheel (pip install mpich)")
    cmd = [exe, "-n", str(ranks), sys.executable, "-m", "kimilab", "cp", "--tokens", str(tokens),
           "--heads", str(heads), "--dim", str(dim), "--dtype", dtype, "--repeats", str(repeats), *map(str, extra)]
    env = {**os.environ, **ONE_THREAD}
    try:
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env)
    except subprocess.TimeoutExpired:
        raise RuntimeError(f"mpiexec -n {ranks} did not finish within {timeout} s") from None
    if done.returncode != 0:
        last = (done.stderr.strip().splitlines() or ["(no stderr)"])[-1]
        raise RuntimeError(f"mpiexec -n {ranks} exited {done.returncode}: {last}")
    return json.loads(done.stdout.strip().splitlines()[-1])
