"""Where to cut one prompt into P slices: even, or weighted so every rank finishes together.

Rank 0 knows the state entering its slice (the prompt's initial state) and runs a plain
chunk pass; every later rank runs the affine pass (``kda.chunk_kda_affine``), which costs
more per token. :func:`balanced_weights` gives rank 0 a larger share so that the last
rank to finish -- the critical path -- finishes sooner.
"""

from __future__ import annotations

import numpy as np

from kimilab.validate import check_int

__all__ = ["split_bounds", "cut_points", "balanced_weights", "slices"]


def split_bounds(T: int, P: int, weights=None) -> list[int]:
    """P + 1 cut points ``0 = b0 < b1 < .. < bP = T`` with slice r ~ weights[r] of T (default even).

    Every slice has at least one token: P larger than T is an error.
    """
    T, P = check_int("T", T, 1), check_int("P", P, 1)
    if P > T:
        raise ValueError(f"P={P} ranks but only T={T} tokens: every rank needs at least one token")
    w = np.ones(P) if weights is None else np.asarray(weights, dtype=float)
    if w.shape != (P,) or not np.all(np.isfinite(w)) or np.any(w <= 0):
        raise ValueError(f"weights: expected {P} positive numbers, got {weights!r}")
    cuts = np.rint(np.cumsum(w) / w.sum() * T).astype(int)
    bounds = [0]
    for r in range(P):
        lo = bounds[-1] + 1  # at least one token per slice, and room for the rest
        hi = T - (P - 1 - r)
        bounds.append(int(min(max(cuts[r], lo), hi)))
    bounds[-1] = T
    return bounds


def cut_points(T: int, ranks: int | None = None, bounds=None) -> list[int]:
    """The cut points of an in-process CP run: ``bounds`` as given (checked), else ``ranks``
    even slices (default one rank)."""
    if bounds is None:
        return split_bounds(T, 1 if ranks is None else check_int("ranks", ranks, 1))
    bounds = [int(b) for b in bounds]
    if len(bounds) < 2 or bounds[0] != 0 or bounds[-1] != T or any(b1 <= b0 for b0, b1 in zip(bounds, bounds[1:])):
        raise ValueError(f"bounds={bounds}: expected strictly increasing cut points from 0 to T={T}")
    if ranks is not None and ranks != len(bounds) - 1:
        raise ValueError(f"ranks={ranks}: expected len(bounds) - 1 = {len(bounds) - 1}, or only one of the two")
    return bounds


def balanced_weights(P: int, affine_cost: float) -> list[float]:
    """Slice weights when rank 0's pass costs 1 per token and every other rank's ``affine_cost``.

    Equal finishing times: w0 = affine_cost * w_r for r >= 1.
    """
    P = check_int("P", P, 1)
    if not 0 < affine_cost < float("inf"):
        raise ValueError(f"affine_cost={affine_cost!r}: expected a positive finite number")
    return [float(affine_cost)] + [1.0] * (P - 1)


def slices(bounds) -> list[slice]:
    """The slices between consecutive cut points."""
    return [slice(a, b) for a, b in zip(bounds[:-1], bounds[1:])]
