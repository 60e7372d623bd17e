"""What a rank's pass costs, measured: the plain pass against what a rank runs before it knows its state.

Rank 0 runs the plain ``chunk_kda``. Every other rank runs one of:

- ``affine``: ``kda.chunk_kda_affine``, one pass on ``[S | M]``, then the correction
  ``o = o0 + Qt S_in`` (only rows before M flushed read S_in);
- ``kcp``: flash-linear-attention's scheme with the preparation shared: ``kda.prepare_kda``,
  the transition pre-pass, then the main pass (the exchange between them is not timed here);
- ``kcp-recompute``: the same two passes with the preparation done twice
  (``segment_transition`` then ``chunk_kda``), what this book timed before.

:func:`pass_seconds` times them in interleaved rounds (every pass once per round, after a
warm-up round), so a shared machine's slow moments hit all of them alike; :func:`cost_ratios`
gives each pass's cost per round relative to the plain pass of the same round.
:func:`pass_flops` counts the same four passes (``kda.chunk_kda_flops``' terms, split into
the shared preparation, the state pass and the output product), for a slice whose M
lives for its first ``alive`` tokens: the machine-independent side of the comparison.
"""

from __future__ import annotations

import time

import numpy as np

from kimilab.kda import chunk_kda, chunk_kda_flops, segment_transition
from kimilab.kda.affine import apply_affine_outputs, chunk_kda_affine
from kimilab.kda.prepared import prepare_kda, prepared_transition, run_prepared
from kimilab.validate import check_int

__all__ = ["PASSES", "pass_seconds", "cost_ratios", "pass_flops"]


def _affine(q, k, v, g, beta):
    o0, Qt, M, C = chunk_kda_affine(q, k, v, g, beta)
    return apply_affine_outputs(o0, Qt, C), np.matmul(M, C) + C  # any entering state costs the same


def _kcp(q, k, v, g, beta):
    prepared = prepare_kda(q, k, v, g, beta)
    M, C = prepared_transition(prepared)
    return run_prepared(prepared, C)  # any entering state costs the same; C has the right shape


def _kcp_recompute(q, k, v, g, beta):
    M, C = segment_transition(k, v, g, beta)
    return chunk_kda(q, k, v, g, beta, initial_state=C)


PASSES = {
    "plain": lambda q, k, v, g, beta: chunk_kda(q, k, v, g, beta),
    "affine": _affine,
    "kcp": _kcp,
    "kcp-recompute": _kcp_recompute,
}


def pass_seconds(inputs, rounds: int = 5, passes=tuple(PASSES)) -> dict[str, list[float]]:
    """Seconds of each pass over ``inputs`` (q, k, v, g, beta), ``rounds`` interleaved rounds after
    one untimed warm-up round: ``{name: [seconds per round]}``."""
    rounds = check_int("rounds", rounds, 1)
    unknown = sorted(set(passes) - set(PASSES))
    if unknown:
        raise ValueError(f"passes: {unknown} unknown; expected some of {sorted(PASSES)}")
    out = {name: [] for name in passes}
    for r in range(rounds + 1):
        for name in passes:
            t0 = time.perf_counter()
            PASSES[name](*inputs)
            if r:
                out[name].append(time.perf_counter() - t0)
    return out


def cost_ratios(seconds: dict[str, list[float]]) -> dict[str, tuple[float, float, float]]:
    """Per pass: (median, min, max) over rounds of its time / the plain pass's time in that round."""
    plain = np.asarray(seconds["plain"])
    return {name: tuple(float(f(np.asarray(s) / plain)) for f in (np.median, np.min, np.max))
            for name, s in seconds.items()}


def pass_flops(T: int, H: int, K: int, V: int, alive: int | None = None, chunk: int = 64) -> dict[str, int]:
    """FLOPs of each pass of :data:`PASSES` over T tokens whose M lives for the first ``alive``
    tokens (default all: the living regime; the flushed regime's is M's lifetime).

    Per chunk of c tokens and head, a state pass over D columns costs 4cKD + cD + 2KD
    (V' = U - W S, then the state update) and the output product 2c(K + c)D; the
    preparation is ``chunk_kda_flops`` minus the plain pass's state pass and output (V
    columns). While M lives the affine pass carries D = V + K and corrects the rows
    (2KV per row); KCP's pre-pass carries V + K columns (then V), its main pass V.
    ``kcp-recompute`` prepares twice (the queries' share of the preparation included:
    an upper bound).
    """
    T, H, K, V, chunk = (check_int(n, x, 1) for n, x in (("T", T), ("H", H), ("K", K), ("V", V), ("chunk", chunk)))
    alive = T if alive is None else min(T, check_int("alive", alive, 0))
    full, rest = divmod(T, chunk)
    sizes = [chunk] * full + ([rest] if rest else [])

    def state(c, D):
        return 4 * c * K * D + c * D + 2 * K * D

    def out(c, D):
        return 2 * c * (K + c) * D

    starts = np.cumsum([0] + sizes[:-1])
    live = [start < alive for start in starts]  # chunks that start while M lives carry its columns
    plain_passes = sum(state(c, V) + out(c, V) for c in sizes)
    prep = chunk_kda_flops(T, 1, K, V, chunk) - plain_passes
    affine = prep + sum(state(c, V + K) + out(c, V + K) if on else state(c, V) + out(c, V)
                        for c, on in zip(sizes, live)) + 2 * K * V * min(T, sum(c for c, on in zip(sizes, live) if on))
    pre = sum(state(c, V + K) if on else state(c, V) for c, on in zip(sizes, live))
    kcp = prep + pre + plain_passes
    return {name: int(H * x) for name, x in (("plain", prep + plain_passes), ("affine", affine), ("kcp", kcp),
                                              ("kcp-recompute", kcp + prep))}
