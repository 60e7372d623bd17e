"""The segment model behind every generator: prompts as lists of (uid, length) pieces.

A workload is built in two steps:

1. A *spec* per request: arrival time (simulated ms), output length, and the
   prompt as a list of *segments* ``(uid, length)``. A segment is a piece of
   text with its own identity (the shared system prompt, one user message,
   one reply, one tool output ...). Two prompts share a prefix exactly when
   their segment lists agree up to that point.
2. Either the tokens are materialised (segment ``uid`` -> seeded token ids,
   :func:`materialise`), or, for traces too large to hold as tokens, the
   Mooncake block ids are computed straight from the segments
   (:func:`specs_to_trace`). Both give the same block ids.

The helpers for drawing lengths and arrival times live here too, so every
generator draws its random numbers the same way.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Sequence

import numpy as np

from kimilab.traffic.request import Request
from kimilab.validate import check_int

__all__ = ["DEFAULT_VOCAB", "Spec", "Uids", "draw_lengths", "poisson_times_ms", "sorted_specs",
           "materialise", "specs_to_trace"]

DEFAULT_VOCAB = 50_000
_TOKEN_SALT = 0x6B696D69  # "kimi": separates segment-content streams from other seeds


@dataclass(frozen=True)
class Spec:
    """A request before tokens exist: its prompt as (segment uid, length) pairs."""

    arrival_ms: int
    segments: tuple[tuple[int, int], ...]
    output_length: int
    session: int

    @property
    def input_length(self) -> int:
        return sum(length for _, length in self.segments)


class Uids:
    """Hands out fresh segment identities 0, 1, 2, ..."""

    def __init__(self) -> None:
        self.next = 0

    def __call__(self) -> int:
        uid = self.next
        self.next += 1
        return uid


def draw_lengths(rng: np.random.Generator, mean: float, size, *, sigma: float = 0.6,
                 lo: int = 1, hi: int | None = None) -> np.ndarray:
    """Log-normal integer lengths with the given mean (before clipping to [lo, hi])."""
    if mean <= 0:
        raise ValueError(f"mean length={mean!r}: expected > 0")
    mu = math.log(mean) - 0.5 * sigma * sigma
    x = np.rint(rng.lognormal(mu, sigma, size)).astype(np.int64)
    return np.clip(x, lo, hi if hi is not None else np.iinfo(np.int64).max)


def poisson_times_ms(rng: np.random.Generator, n: int, rate_per_s: float) -> np.ndarray:
    """Arrival times (float ms) of a Poisson process with ``rate_per_s`` events per second."""
    if rate_per_s <= 0:
        raise ValueError(f"rate_per_s={rate_per_s!r}: expected > 0")
    gaps = rng.exponential(1000.0 / rate_per_s, n)
    return np.cumsum(gaps) - gaps[0]  # first arrival at t = 0


def sorted_specs(specs: list[tuple[float, int, Spec]]) -> list[Spec]:
    """Order by (arrival, creation order) and round arrivals to whole ms."""
    specs.sort(key=lambda item: (item[0], item[1]))
    out = []
    for t, _, spec in specs:
        out.append(Spec(int(t), spec.segments, spec.output_length, spec.session))
    return out


def _segment_tokens(uid: int, length: int, seed: int, vocab_size: int) -> np.ndarray:
    rng = np.random.default_rng([_TOKEN_SALT, seed, uid])
    return rng.integers(0, vocab_size, length, dtype=np.int32)


def materialise(specs: Sequence[Spec], seed: int, vocab_size: int) -> list[Request]:
    """Token-level requests: segment ``uid``'s tokens are a seeded function of (seed, uid)."""
    if vocab_size < 2:
        raise ValueError(f"vocab_size={vocab_size!r}: expected >= 2")
    store: dict[int, np.ndarray] = {}
    requests = []
    for i, spec in enumerate(specs):
        parts = []
        for uid, length in spec.segments:
            seg = store.get(uid)
            if seg is None or seg.size < length:
                seg = store[uid] = _segment_tokens(uid, length, seed, vocab_size)
            parts.append(seg[:length])
        tokens = np.concatenate(parts) if parts else np.zeros(0, np.int32)
        requests.append(Request(i, spec.arrival_ms, tokens.size, spec.output_length, tokens=tokens,
                                session=spec.session))
    return requests


def specs_to_trace(specs: Sequence[Spec], block_size: int) -> list[Request]:
    """Chained block ids straight from segments (no tokens): same answer as ``to_trace``."""
    block_size = check_int("block_size", block_size, 1)
    table: dict[tuple, int] = {}
    records = []
    for i, spec in enumerate(specs):
        ids: list[int] = []
        parent = -1
        pieces: list[tuple[int, int, int]] = []
        fill = 0
        for uid, length in spec.segments:
            offset = 0
            while offset < length:
                take = min(length - offset, block_size - fill)
                pieces.append((uid, offset, offset + take))
                offset += take
                fill += take
                if fill == block_size:
                    parent = table.setdefault((parent, tuple(pieces)), len(table))
                    ids.append(parent)
                    pieces, fill = [], 0
        if pieces:
            ids.append(table.setdefault((parent, tuple(pieces)), len(table)))
        records.append(Request(i, spec.arrival_ms, spec.input_length, spec.output_length,
                               hash_ids=tuple(ids)))
    return records
