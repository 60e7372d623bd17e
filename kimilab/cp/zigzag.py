"""Two ways to lay one prompt over P ranks, and the all-to-all between them.

KDA needs each rank's tokens to be one contiguous run in rank order (states flow from
rank r - 1 into rank r). Causal attention over a contiguous split is unbalanced: the
last rank's queries see every key, the first rank's only its own, so the last rank does
about 2P - 1 times the first's work. Megatron's zigzag split cuts the prompt into 2P
chunks and gives rank r chunks r and 2P - 1 - r: an early chunk paired with a late one,
the same work on every rank. The two layouts conflict, so the model keeps the
contiguous one (3 of every 4 layers are KDA) and each global-attention layer moves its
input to zigzag and its output back (:func:`relayout`, one all-to-all each way), as
``megatron/core/context_parallel_layout.py`` does.

A layout is, per rank, the list of ``(start, end)`` runs of global positions it holds, in
order; a rank's rows are those runs concatenated.
"""

from __future__ import annotations

import numpy as np

from kimilab.cp.split import split_bounds
from kimilab.validate import check_int

__all__ = ["LAYOUTS", "contiguous_layout", "zigzag_layout", "layout_positions", "relayout", "causal_work"]

LAYOUTS = {"contiguous": "rank r holds one run, the r-th slice in order (what KDA needs)",
           "zigzag": "2P chunks; rank r holds chunks r and 2P - 1 - r (balanced causal attention)"}


def contiguous_layout(bounds) -> list[list[tuple[int, int]]]:
    """Rank r holds ``[bounds[r], bounds[r + 1])``."""
    return [[(int(a), int(b))] for a, b in zip(bounds[:-1], bounds[1:])]


def zigzag_layout(T: int, P: int) -> list[list[tuple[int, int]]]:
    """2P near-equal chunks; rank r holds chunk r then chunk 2P - 1 - r (every rank >= 1 token).

    With T < 2P some chunks would be empty: then each rank holds its one contiguous slice.
    """
    T, P = check_int("T", T, 1), check_int("P", P, 1)
    if T < 2 * P:
        return contiguous_layout(split_bounds(T, P))
    c = split_bounds(T, 2 * P)
    return [[(c[r], c[r + 1]), (c[2 * P - 1 - r], c[2 * P - r])] for r in range(P)]


def layout_positions(runs) -> np.ndarray:
    """The global positions of one rank's rows, in row order."""
    return np.concatenate([np.arange(a, b) for a, b in runs]) if runs else np.zeros(0, np.int64)


def _overlap(mine, theirs) -> list[tuple[int, int]]:
    """Runs of positions in both lists (each sorted by start within a rank's row order)."""
    out = []
    for a, b in mine:
        for c, d in theirs:
            lo, hi = max(a, c), min(b, d)
            if lo < hi:
                out.append((lo, hi))
    return sorted(out)


def relayout(comm, x, source, target):
    """This rank's rows ``x`` (in ``source[rank]`` order) re-dealt into ``target[rank]`` order.

    One all-to-all over point-to-point messages: to every other rank the rows it will
    hold that this rank holds now (sends never wait, so any order is safe).
    """
    r, P = comm.rank, comm.size
    x = np.asarray(x)
    mine = layout_positions(source[r])
    index = {int(p): i for i, p in enumerate(mine)}
    for d in range(P):
        if d != r:
            rows = [index[p] for a, b in _overlap(source[r], target[d]) for p in range(a, b)]
            comm.send(x[rows] if rows else None, d)
    want = layout_positions(target[r])
    out = np.empty((len(want),) + x.shape[1:], x.dtype)
    slot = {int(p): i for i, p in enumerate(want)}
    for s in range(P):
        runs_ = _overlap(source[s], target[r])
        got = x[[index[p] for a, b in runs_ for p in range(a, b)]] if s == r else comm.recv(s)
        positions = [p for a, b in runs_ for p in range(a, b)]
        if positions:
            out[[slot[p] for p in positions]] = got
    return out


def _merged(runs) -> list[tuple[int, int]]:
    """A rank's runs with touching neighbours joined (rank P - 1's two zigzag chunks are one run)."""
    out = []
    for a, b in runs:
        if out and out[-1][1] == a:
            out[-1] = (out[-1][0], b)
        else:
            out.append((a, b))
    return out


def causal_work(layout) -> list[int]:
    """Per rank, the (query, key) scores blockwise causal attention computes over its rows: every
    pair of (query run, key run) not entirely masked counts in full, as ``ring_attention_rank``
    counts them (runs per rank, touching ones joined)."""
    key_runs = [run for rank in layout for run in _merged(rank)]
    return [sum((qb - qa) * (kb - ka) for qa, qb in _merged(rank) for ka, kb in key_runs if ka <= qb - 1)
            for rank in layout]
