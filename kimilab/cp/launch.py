"""Run context-parallel KDA for real: P processes under ``mpiexec``, timed against one rank.

:func:`mpi_run` is what every rank executes for ``mpiexec -n P python -m kimilab cp``:
seeded inputs (the same on every rank; each keeps its slice), one single-rank
``chunk_kda`` on rank 0 while the others wait, then the P-rank run, both timed between
barriers in the same process group. :func:`mpi_prefill_run` does the same for the whole
reduced model (``cp --model tiny``): every KDA layer's state passing and every global
layer's ring attention across processes, checked against ``Model.prefill``. :func:`launch` starts ``mpiexec`` from Python (the
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
from kimilab.cp.prefill import cp_prefill_rank
from kimilab.cp.regimes import regime_inputs
from kimilab.cp.split import balanced_weights, slices, split_bounds
from kimilab.kda import chunk_kda
from kimilab.validate import check_int

__all__ = ["mpi_run", "mpi_prefill_run", "cp_input_bytes", "machine_memory_bytes", "MAX_CP_DIM", "launch",
           "mpiexec_path", "ONE_THREAD"]

MAX_CP_DIM = 1024  # K = V of one KDA head that ``cp`` accepts (Kimi's are 128; a chunk's work grows with K^2)

# One BLAS / OpenMP thread per rank: P ranks on P cores, no oversubscription.
ONE_THREAD = {name: "1" for name in ("OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS", "MKL_NUM_THREADS")}


def mpi_run(tokens: int, heads: int = 4, dim: int = 64, dtype: str = "float32", *, seed: int = 0,
            scheme: str = "allgather", method: str = "affine", inputs: str = "flushed",
            affine_cost: float | None = 1.25, timeout: float = 120.0, repeats: int = 1) -> dict | None:
    """Every rank calls this under mpiexec; rank 0 returns the result dict, the others None.

    ``inputs`` names the input regime (``cp.regimes.REGIMES``: "flushed", the Kimi-init gate
    on random keys, or "living"). Slices are weighted by
    :func:`~kimilab.cp.split.balanced_weights` with ``affine_cost`` (None: even). Errors
    (P > T, ...) are raised on every rank before anything blocks. With ``repeats`` > 1 the
    one-rank reference and the P-rank run alternate that many times after one untimed
    warm-up of each, and the speedup is the ratio of the medians (a shared machine's noise
    hits both alike). Bytes are per run: ``bytes_sent_per_rank`` the arrays' payload,
    ``wire_bytes_sent_per_rank`` the pickled buffers MPI carried.
    """
    repeats = check_int("repeats", repeats, 1)
    comm = MPIComm(timeout=timeout)
    P, r = comm.size, comm.rank
    weights = None if affine_cost is None or P == 1 else balanced_weights(P, affine_cost)
    bounds = split_bounds(tokens, P, weights)  # same on every rank; raises on every rank
    (q, k, v, g, beta), _ = regime_inputs(tokens, heads, dim, dim, seed=seed, regime=inputs, dtype=dtype)
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
        before = (comm.bytes_sent, comm.messages_sent, comm.wire_bytes_sent)
        t0 = time.perf_counter()
        o, S = cp_kda_rank(comm, *mine, scheme=scheme, method=method)
        mine_seconds = time.perf_counter() - t0
        comm.barrier()
        walls.append(time.perf_counter() - t0)
        sent = tuple(after - b for after, b in zip((comm.bytes_sent, comm.messages_sent, comm.wire_bytes_sent), before))
    if repeats > 1:
        ones, walls = ones[1:], walls[1:]
    one, wall = float(np.median(ones)) if r == 0 else 0.0, float(np.median(walls))
    gathered = comm.allgather((mine_seconds, sent))
    if r > 0:
        comm.send(o, 0)
        comm.send(S, 0) if r == P - 1 else None
        comm.flush()
        return None
    outs = [o] + [comm.recv(src) for src in range(1, P)]
    S_last = comm.recv(P - 1) if P > 1 else S
    err = max(float(np.abs(np.concatenate(outs) - ref[0]).max()), float(np.abs(S_last - ref[1]).max()))
    return {"ranks": P, "tokens": tokens, "heads": heads, "dim": dim, "dtype": str(np.dtype(dtype)),
            "scheme": scheme, "method": method, "inputs": inputs, "bounds": bounds, "max_abs_error": err,
            "seconds_p_ranks": wall, "seconds_one_rank": one, "speedup": one / wall, "repeats": repeats,
            "seconds_p_ranks_each": walls, "seconds_one_rank_each": ones,
            "seconds_per_rank": [s for s, _ in gathered],
            "bytes_sent_per_rank": [b for _, (b, _, _) in gathered],
            "messages_sent_per_rank": [m for _, (_, m, _) in gathered],
            "wire_bytes_sent_per_rank": [w for _, (_, _, w) in gathered]}


def machine_memory_bytes() -> int:
    """This machine's physical memory (bytes): what a rank's allocations are checked against."""
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def cp_input_bytes(tokens: int, heads: int, dim: int, dtype: str, model: str | None = None) -> int:
    """Bytes one rank allocates for a ``cp`` run before it starts: every rank draws the whole
    seeded input, and rank 0 keeps the one-rank reference output (a lower bound on its peak)."""
    if model is not None:
        from kimilab.config import preset

        config = preset(model)
        return 3 * tokens * (config.vocab_size + 4 * config.d_model) * np.dtype(config.dtype).itemsize
    item = np.dtype(dtype).itemsize
    per_token = heads * (4 * dim + dim + 1)  # q, k, g, v, one output, beta (each rank draws them all)
    states = 4 * heads * dim * dim  # a state S, a transition's M and C, and one in flight: K x V each
    return (2 * tokens * per_token + states) * item  # inputs, the reference and CP outputs, the states


def mpi_prefill_run(tokens: int, model: str = "tiny", *, seed: int = 0, timeout: float = 120.0,
                    layout: str = "contiguous") -> dict | None:
    """Every rank calls this under mpiexec: the whole model's CP prefill of a seeded prompt.

    Rank 0 returns the largest logit difference from ``Model.prefill`` on one rank, what
    each rank sent (payload bytes, messages, wire bytes) as the communicator counted it, and
    the attention scores each rank computed; the others None. ``layout`` is the global
    layers' (``cp.zigzag.LAYOUTS``).
    """
    from kimilab.config import preset
    from kimilab.model import HybridCache, Model

    config = preset(model)
    if config.shapes_only:
        raise ValueError(f"model={model!r}: expected a runnable preset (one with weights), such as 'tiny'")
    comm = MPIComm(timeout=timeout)
    P, r = comm.size, comm.rank
    bounds = split_bounds(tokens, P)  # raises on every rank if P > T
    net = Model(config, seed=seed)
    prompt = np.random.default_rng(seed).integers(0, config.vocab_size, tokens)
    part = slices(bounds)[r]
    stats: dict = {}
    logits, _ = cp_prefill_rank(comm, net, prompt[part], part.start, layout=layout, stats=stats)
    sent = comm.allgather((comm.bytes_sent, comm.messages_sent, comm.wire_bytes_sent, stats.get("score_entries", 0)))
    if r > 0:
        comm.send(logits, 0)
        comm.flush()
        return None
    every = np.concatenate([logits] + [comm.recv(src) for src in range(1, P)])
    ref = net.prefill(prompt, HybridCache(config))
    return {"ranks": P, "tokens": tokens, "model": model, "bounds": bounds, "layout": layout,
            "max_abs_error": float(np.abs(every - ref).max()),
            "bytes_sent_per_rank": [b for b, _, _, _ in sent], "messages_sent_per_rank": [m for _, m, _, _ in sent],
            "wire_bytes_sent_per_rank": [w for _, _, w, _ in sent],
            "score_entries_per_rank": [s for _, _, _, s in sent]}


def mpiexec_path() -> str | None:
    """The ``mpiexec`` next to this Python (the mpich wheel puts it there), else the one on PATH."""
    here = Path(sys.executable).parent / "mpiexec"
    return str(here) if here.exists() else shutil.which("mpiexec")


def launch(ranks: int, tokens: int, *, heads: int = 4, dim: int = 64, dtype: str = "float32",
           scheme: str = "allgather", method: str = "affine", inputs: str = "flushed",
           affine_cost: float | None = 1.25, extra: tuple = (), repeats: int = 1, timeout: float = 300.0) -> dict:
    """``mpiexec -n ranks python -m kimilab cp ...`` in a subprocess; the parsed JSON object.

    ``affine_cost`` None cuts even slices (``--even``). Raises RuntimeError with mpiexec's
    last stderr line if it fails or times out.
    """
    exe = mpiexec_path()
    if exe is None:
        raise RuntimeError("mpiexec not found: install the mpich wheel (pip install mpich)")
    split = ("--even",) if affine_cost is None else ("--affine-cost", repr(float(affine_cost)))
    cmd = [exe, "-n", str(ranks), sys.executable, "-m", "kimilab", "cp", "--tokens", str(tokens),
           "--heads", str(heads), "--dim", str(dim), "--dtype", dtype, "--repeats", str(repeats),
           "--scheme", scheme, "--method", method, "--inputs", inputs, *split, *map(str, extra)]
    env = {**os.environ, **ONE_THREAD}
    try:
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env)
    except subprocess.TimeoutExpired:
        raise RuntimeError(f"mpiexec -n {ranks} did not finish within {timeout} s") from None
    if done.returncode != 0:
        last = (done.stderr.strip().splitlines() or ["(no stderr)"])[-1]
        raise RuntimeError(f"mpiexec -n {ranks} exited {done.returncode}: {last}")
    return json.loads(done.stdout.strip().splitlines()[-1])
