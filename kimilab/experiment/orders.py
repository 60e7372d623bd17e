"""The traffic a Part B run replays: its arrival orders, and the control in which no prefix can hit."""

from __future__ import annotations

import dataclasses

import numpy as np

from kimilab.validate import check_int

__all__ = ["BLOCK", "no_reuse", "no_reuse_turns", "arrival_order"]

BLOCK = 512  # the traces' block size (tokens per hash id)


def no_reuse(requests) -> list:
    """The same requests with every block given an id no other request uses: no prefix can hit."""
    out, nxt = [], 1 << 50
    for r in requests:
        n = len(r.hash_ids) if r.hash_ids is not None else -(-r.input_length // BLOCK)
        out.append(dataclasses.replace(r, hash_ids=tuple(range(nxt, nxt + n))))
        nxt += n
    return out


def no_reuse_turns(sessions) -> list:
    nxt = 0
    out = []
    for s in sessions:
        turns = []
        for t in s:
            turns.append(dataclasses.replace(t, hash_ids=tuple(range(nxt, nxt + len(t.hash_ids)))))
            nxt += len(t.hash_ids)
        out.append(turns)
    return out


def arrival_order(requests, order: int) -> list:
    """The requests in arrival order ``order``: 0 keeps the trace's timestamps; k > 0 shuffles the gaps
    between consecutive arrivals (seed k), so the same requests come in the same sequence over the same
    span at the same mean rate, bunched differently."""
    order = check_int("order", order, 0)
    if order == 0 or len(requests) < 3:
        return list(requests)
    t = np.array([r.arrival_ms for r in requests], dtype=np.int64)
    gaps = np.random.default_rng(order).permutation(np.diff(t))
    new = t[0] + np.concatenate([[0], np.cumsum(gaps)])
    return [dataclasses.replace(r, arrival_ms=int(a)) for r, a in zip(requests, new)]
