"""Context-parallel KDA: P ranks each hold a slice of one prompt; outputs equal one rank's.

A KDA state does not add: after [A | B] it is ``M_B S(A) + C_B``, so slices compose in
rank order. Rank 0 knows its entering state (the prompt's initial state) and runs a
plain ``chunk_kda``. Every other rank works on its slice before it knows its entering
state, by one of two methods (:data:`METHODS`): the affine pass
``kda.chunk_kda_affine`` -> (o0, Qt, M_r, C_r), corrected later with
``o = o0 + Qt S_in``; or flash-linear-attention's KCP, which prepares the chunks once,
runs a transition pre-pass, and after the exchange a main pass from S_in
(``kda.prepared``). The ranks exchange transitions (bytes independent of T) by one of the
schemes of :data:`SCHEMES`; ``relay`` instead runs the slices one after another.
"""

from __future__ import annotations

import functools

import numpy as np

from kimilab.cp.comm import run_local
from kimilab.cp.split import cut_points, slices
from kimilab.kda import chunk_kda, compose_transitions
from kimilab.kda.affine import apply_affine_outputs, chunk_kda_affine
from kimilab.kda.prepared import prepare_kda, prepared_transition, run_prepared

__all__ = ["SCHEMES", "METHODS", "cp_kda_rank", "context_parallel_kda", "check_agreement", "fold_states",
           "worst_cp_difference"]

SCHEMES = {
    "sequential": "rank r waits for rank r-1's final state, then sends its own: P-1 steps in a chain",
    "allgather": "every rank all-gathers all (M, C) and folds the earlier ones itself (flash-linear-attention's)",
    "tree": "log-depth inclusive scan of transitions (recursive doubling), then one shift",
    "needed": "a flag per rank (is M alive?) all-gathered, then each rank sends its C to its neighbour, and "
              "its (M, C) further only while the ranks in between have M alive",
    "relay": "no pass before the state is known: rank r waits for rank r-1's final state, runs its slice "
             "from it, sends its own (LASP's ring; rtp-llm's relay): P ranks take as long as one",
}
METHODS = {
    "affine": "one pass on the augmented state [S | M] from [0 | I]; outputs corrected o = o0 + Qt S_in",
    "kcp": "flash-linear-attention's: the chunk preparation once, a transition pre-pass, then after the "
           "exchange the main pass from S_in (kda.prepared)",
}


def check_agreement(comm, shapes: tuple, error: str | None) -> None:
    """Collective check before any data moves: every rank raises the same error, or none does.

    ``shapes`` is (H, K, V, dtype name, local T). All ranks call this first, so a bad
    input on one rank is reported on every rank instead of leaving the others waiting.
    """
    everyone = comm.allgather((shapes, error))
    for r, (_, err) in enumerate(everyone):
        if err:
            raise ValueError(f"rank {r}: {err}")
    heads = {s[:4] for s, _ in everyone}
    if len(heads) != 1:
        raise ValueError(f"ranks disagree on (H, K, V, dtype): {[s[:4] for s, _ in everyone]}")
    empty = [r for r, (s, _) in enumerate(everyone) if s[4] < 1]
    if empty:
        raise ValueError(f"ranks {empty} hold no tokens: every rank needs at least one (P larger than T?)")


def fold_states(transitions, S0=None, dtype=None):
    """States entering each of the segments whose transitions are given, in order (from S0 or 0).

    Returns P states: before segment 0, 1, .., P-1. ``dtype`` is the precision of the fold
    (default: that of the transitions); flash-linear-attention keeps this chain in fp32.
    """
    M0, C0 = transitions[0]
    dtype = np.dtype(dtype or C0.dtype)
    S = np.zeros(C0.shape, dtype) if S0 is None else np.asarray(S0, dtype)
    out = []
    for M, C in transitions:
        out.append(S)
        S = np.matmul(M.astype(dtype), S) + C.astype(dtype)
    return out


def _local(comm, q, k, v, g, beta, scale, initial_state, chunk_size, method):
    """This rank's pass before it knows its entering state: (transition, finish(S_in) -> (o, S_out))."""
    if comm.rank == 0:
        o, S = chunk_kda(q, k, v, g, beta, scale=scale, initial_state=initial_state,
                         chunk_size=chunk_size)
        return (np.zeros(S.shape[:-1] + (S.shape[-2],), S.dtype), S), (lambda _S_in: (o, S))
    if method == "kcp":
        prepared = prepare_kda(q, k, v, g, beta, scale=scale, chunk_size=chunk_size)
        return prepared_transition(prepared), (lambda S_in: run_prepared(prepared, S_in))
    o0, Qt, M, C = chunk_kda_affine(q, k, v, g, beta, scale=scale, chunk_size=chunk_size)
    return (M, C), (lambda S_in: (apply_affine_outputs(o0, Qt, S_in), np.matmul(M, S_in) + C))


def _relay(comm, q, k, v, g, beta, scale, initial_state, chunk_size):
    """The relay: wait for the state, run the slice from it, pass the final state on."""
    r, P = comm.rank, comm.size
    S_in = comm.recv(r - 1) if r > 0 else initial_state
    o, S = chunk_kda(q, k, v, g, beta, scale=scale, initial_state=S_in, chunk_size=chunk_size)
    if r + 1 < P:
        comm.send(S, r + 1)
    return o, S


def _needed(comm, trans):
    """The state entering this rank, from only what it needs (the "needed" scheme).

    Rank j's final state is M_j S_in + C_j; once M_j is all zero (flushed) it is C_j
    whatever entered, so ranks after j need nothing before j.
    """
    r, P = comm.rank, comm.size
    alive = r > 0 and bool(trans[0].any())  # rank 0's M is 0: its state is known
    flags = comm.allgather(alive)
    message = (trans[0] if alive else None, trans[1])
    d = r + 1
    while d < P:  # to the neighbour, and on while the ranks in between pass an entering state through
        comm.send(message, d)
        if not flags[d]:
            break
        d += 1
    sources, j = [], r - 1
    while j >= 0:
        sources.append(j)
        if not flags[j]:
            break
        j -= 1
    S = None
    for M, C in (comm.recv(j) for j in reversed(sources)):
        S = C if M is None else np.matmul(M, S) + C  # the earliest source has M None (flushed, or rank 0)
    return S if S is not None else np.zeros_like(trans[1])


def _entering_state(comm, trans, scheme: str):
    """The state entering this rank's slice, by ``scheme`` (rank 0's transition has M = 0)."""
    r, P = comm.rank, comm.size
    if scheme == "allgather":
        everyone = comm.allgather(trans)
        return fold_states(everyone)[r]
    if scheme == "needed":
        return _needed(comm, trans)
    if scheme == "sequential":
        S_in = comm.recv(r - 1) if r > 0 else np.zeros_like(trans[1])
        if r + 1 < P:
            comm.send(np.matmul(trans[0], S_in) + trans[1], r + 1)
        return S_in
    # tree: after round d, rank r holds the composite of ranks max(0, r - 2d + 1)..r
    acc, d = trans, 1
    while d < P:
        if r + d < P:
            comm.send(acc, r + d)
        if r - d >= 0:
            acc = compose_transitions(comm.recv(r - d), acc)
        d *= 2
    # the composite of 0..r has M = 0 (rank 0's), so its C is the state after rank r
    if r + 1 < P:
        comm.send(acc[1], r + 1)
    return comm.recv(r - 1) if r > 0 else np.zeros_like(trans[1])


def cp_kda_rank(comm, q, k, v, g, beta, *, scale=None, initial_state=None, chunk_size: int = 64,
                scheme: str = "allgather", method: str = "affine"):
    """One rank's part of context-parallel KDA over its slice ``[T_r, H, ..]``: returns (o, S_after).

    ``initial_state`` is the prompt's (used by rank 0 only). ``S_after`` is the state
    after this rank's slice; the last rank's is the prompt's final state. ``method``
    (:data:`METHODS`) is how ranks r > 0 work before they know their entering state.
    """
    error, shapes = None, (0, 0, 0, "?", 0)
    try:
        if scheme not in SCHEMES:
            raise ValueError(f"scheme={scheme!r}: expected one of {sorted(SCHEMES)}")
        if method not in METHODS:
            raise ValueError(f"method={method!r}: expected one of {sorted(METHODS)}")
        q, k, v, g, beta = (np.asarray(x) for x in (q, k, v, g, beta))
        if (k.ndim != 3 or v.ndim != 3 or q.shape != k.shape or g.shape != k.shape
                or beta.shape != k.shape[:2]):
            raise ValueError("expected q, k, g [T, H, K], v [T, H, V], beta [T, H]; "
                             f"got q {q.shape}, k {k.shape}, v {v.shape}, g {g.shape}, "
                             f"beta {beta.shape}")
        shapes = (k.shape[1], k.shape[2], v.shape[2], k.dtype.name, k.shape[0])
    except (ValueError, TypeError) as exc:
        error = str(exc)
    check_agreement(comm, shapes, error)
    if scheme == "relay":
        return _relay(comm, q, k, v, g, beta, scale, initial_state, chunk_size)
    trans, finish = _local(comm, q, k, v, g, beta, scale, initial_state, chunk_size, method)
    return finish(_entering_state(comm, trans, scheme))


def context_parallel_kda(q, k, v, g, beta, *, ranks: int | None = None, bounds=None, scale=None,
                         initial_state=None, chunk_size: int = 64, scheme: str = "allgather",
                         method: str = "affine"):
    """Context-parallel KDA on P in-process ranks: ``(o, final_state, comms)`` for one prompt ``[T, H, ..]``.

    Cut at ``bounds`` (P + 1 cut points) or evenly into ``ranks`` slices. ``comms`` hold
    each rank's bytes and messages sent.
    """
    bounds = cut_points(np.asarray(k).shape[0], ranks, bounds)
    parts = [tuple(np.asarray(x)[s] for x in (q, k, v, g, beta)) for s in slices(bounds)]

    def rank_fn(comm):
        return cp_kda_rank(comm, *parts[comm.rank], scale=scale, initial_state=initial_state,
                           chunk_size=chunk_size, scheme=scheme, method=method)

    results, comms = run_local(len(parts), rank_fn)
    o = np.concatenate([o for o, _ in results], axis=0)
    return o, results[-1][1], comms


@functools.lru_cache(maxsize=8)
def worst_cp_difference(T: int, H: int, K: int, V: int, *, seed: int, ranks: tuple = (1, 2, 3, 5, 8),
                        ragged: tuple = (0, 1, 40, 41)) -> float:
    """Largest |difference| from one rank, over every scheme, method and cut (float64, seeded inputs).

    Seeded ``random_inputs`` of ``T`` tokens with an initial state; for each of :data:`SCHEMES`
    and :data:`METHODS`, :func:`context_parallel_kda` cut evenly into each P of ``ranks`` and at
    the cut points ``ragged + (T,)`` (a slice of one token, one shorter than a chunk), compared
    with ``chunk_kda`` on one rank: outputs and final state. Memoised (chapter 9's key results
    and its exactness check share one computation).
    """
    from kimilab.kda.testing import random_inputs

    (q, k, v, g, beta), S0 = random_inputs(T, H, K, V, seed=seed)
    o_ref, S_ref = chunk_kda(q, k, v, g, beta, initial_state=S0)
    cuts = [{"ranks": P} for P in ranks] + [{"bounds": list(ragged) + [T]}]
    worst = 0.0
    for scheme in SCHEMES:
        for method in METHODS:
            for cut in cuts:
                o, S, _ = context_parallel_kda(q, k, v, g, beta, **cut, initial_state=S0, scheme=scheme,
                                               method=method)
                worst = max(worst, float(np.abs(o - o_ref).max()), float(np.abs(S - S_ref).max()))
    return worst
