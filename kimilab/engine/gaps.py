"""Time between tokens (TBT), token by token, in memory that does not grow with the tokens.

Mooncake's SLO bounds the time between consecutive output tokens of a request (TBT), each
gap on its own: one 300 ms stall among fast tokens is a miss even when the request's mean
time per output token is 40 ms. An engine makes millions of tokens, so gaps are counted in a
fixed histogram: :data:`N_BINS` log-spaced bins from 1 us to 1,000 s, :data:`PER_DECADE` to a
decade, each bin 0.96% wide. A gap is read back as its bin's geometric middle (within 0.48% of
it), so a percentile read from the counts is within 0.48% of numpy's (the linear rule between
two order statistics, each within 0.48%); gaps outside the range are clamped to its ends.

* :class:`GapHistogram`: counts over the bins; percentiles, mean, merging.
* :class:`GapLog`: what one engine records: the same counts per time bucket (when the token
  came out), so a steady-state window can drop the warm-up and the drain at the end. O(1) per
  step; memory grows with the simulated time and the distinct step times, never with tokens.
"""

from __future__ import annotations

import math

import numpy as np

from kimilab.validate import check_float

__all__ = ["LOW_S", "HIGH_S", "PER_DECADE", "N_BINS", "bin_of", "bin_values", "GapHistogram", "GapLog"]

LOW_S, HIGH_S = 1e-6, 1e3
PER_DECADE = 240
N_BINS = PER_DECADE * round(math.log10(HIGH_S / LOW_S))
_EDGES = LOW_S * 10.0 ** (np.arange(N_BINS + 1) / PER_DECADE)
_MIDS = LOW_S * 10.0 ** ((np.arange(N_BINS) + 0.5) / PER_DECADE)


def bin_of(gap_s: float) -> int:
    """The bin of one gap (seconds); out-of-range gaps go to the first or last bin."""
    if gap_s <= LOW_S:
        return 0
    return min(int(math.log10(gap_s / LOW_S) * PER_DECADE), N_BINS - 1)


def bin_values() -> np.ndarray:
    """Each bin's representative gap (its geometric middle, seconds)."""
    return _MIDS.copy()


class GapHistogram:
    """Counts of gaps over the fixed log bins: a fixed :data:`N_BINS` int64 array, whatever the count."""

    __slots__ = ("counts",)

    def __init__(self, counts: np.ndarray | None = None):
        if counts is None:
            counts = np.zeros(N_BINS, dtype=np.int64)
        counts = np.asarray(counts)
        if counts.shape != (N_BINS,) or (counts.size and counts.min() < 0):
            raise ValueError(f"counts: expected {N_BINS} non-negative counts")
        self.counts = counts.astype(np.int64, copy=False)

    @classmethod
    def of(cls, gaps_s, weights=None) -> "GapHistogram":
        """The histogram of an array of gaps (vectorised), each counted ``weights`` times (default once)."""
        gaps = np.asarray(gaps_s, dtype=float).ravel()
        if not np.all(np.isfinite(gaps)):
            raise ValueError("gaps_s: expected finite seconds")
        idx = np.floor(np.log10(np.maximum(gaps, LOW_S) / LOW_S) * PER_DECADE)
        idx = np.clip(idx, 0, N_BINS - 1).astype(np.int64)
        w = None if weights is None else np.asarray(weights, dtype=np.int64).ravel()
        if w is not None and (w.shape != gaps.shape or (w.size and w.min() < 0)):
            raise ValueError("weights: expected one non-negative count per gap")
        return cls(np.bincount(idx, weights=w, minlength=N_BINS).astype(np.int64))

    def add(self, gap_s: float, count: int = 1) -> None:
        self.counts[bin_of(gap_s)] += count

    def __add__(self, other: "GapHistogram") -> "GapHistogram":
        return GapHistogram(self.counts + other.counts)

    @property
    def count(self) -> int:
        """Gaps counted."""
        return int(self.counts.sum())

    @property
    def nbytes(self) -> int:
        return int(self.counts.nbytes)

    def mean(self) -> float | None:
        """Mean gap (seconds, from the bins' middles); None if empty."""
        n = self.count
        return float(self.counts @ _MIDS / n) if n else None

    def max(self) -> float | None:
        """The largest gap, as its bin's upper edge (at most 0.96% above it); None if empty."""
        nz = np.flatnonzero(self.counts)
        return float(_EDGES[nz[-1] + 1]) if nz.size else None

    def percentile(self, q: float) -> float | None:
        """The ``q``-th percentile (0-100, numpy's linear rule on the bins' middles); None if empty."""
        q = check_float("q", q, minimum=0.0)
        if q > 100:
            raise ValueError(f"q={q!r}: expected a percentile in [0, 100]")
        n = self.count
        if not n:
            return None
        h = q / 100.0 * (n - 1)
        lo = math.floor(h)
        cum = np.cumsum(self.counts)
        i_lo, i_hi = np.searchsorted(cum, [lo, min(lo + 1, n - 1)], side="right")
        return float(_MIDS[i_lo] + (h - lo) * (_MIDS[i_hi] - _MIDS[i_lo]))

    def above(self, limit_s: float) -> int:
        """Gaps whose representative value exceeds ``limit_s`` (what a percentile of this histogram sees)."""
        return int(self.counts[_MIDS > limit_s].sum())


class GapLog:
    """One engine's gaps per ``bucket_s`` time bucket of the token's time: O(1) per step.

    The bucket being filled is a small dict (bin -> count); when time moves past it, it is
    stored as arrays of its non-empty bins. :meth:`histogram` sums the buckets of a time window.
    """

    def __init__(self, bucket_s: float = 10.0):
        self.bucket_s = check_float("bucket_s", bucket_s, minimum=0.0)
        if self.bucket_s <= 0:
            raise ValueError(f"bucket_s={bucket_s!r}: expected seconds > 0")
        self._cur_b = -1
        self._cur: dict[int, int] = {}
        self.chunks: list[tuple[np.ndarray, np.ndarray, np.ndarray]] = []  # (bucket, bin, count) stored

    def _flush(self) -> None:
        if self._cur:
            bins = np.fromiter(self._cur.keys(), dtype=np.int32, count=len(self._cur))
            counts = np.fromiter(self._cur.values(), dtype=np.int64, count=len(self._cur))
            self.chunks.append((np.full(bins.size, self._cur_b, dtype=np.int64), bins, counts))
            self._cur = {}

    def _put(self, bucket: int, b: int, count: int) -> None:
        if bucket != self._cur_b:
            self._flush()
            self._cur_b = bucket
        cur = self._cur
        cur[b] = cur.get(b, 0) + count

    def add(self, t_s: float, gap_s: float, count: int = 1) -> None:
        """``count`` gaps of ``gap_s``, their tokens out at ``t_s``."""
        self._put(int(t_s // self.bucket_s), bin_of(gap_s), count)

    def add_run(self, start_s: float, dt_s: float, k: int, n: int) -> None:
        """A run of ``k`` steps of ``dt_s`` from ``start_s``, each giving ``n`` decoders a token: ``n x k``
        gaps of ``dt_s``, the j-th step's at ``start_s + j dt_s`` (split over the buckets they fall in)."""
        b, w = bin_of(dt_s), self.bucket_s
        first, last = int((start_s + dt_s) // w), int((start_s + k * dt_s) // w)
        if first == last:
            self._put(first, b, n * k)
            return
        done = 0
        for bucket in range(first, last + 1):
            upto = k if bucket == last else min(k, max(done, math.floor(((bucket + 1) * w - start_s) / dt_s)))
            if upto > done:
                self._put(bucket, b, n * (upto - done))
                done = upto

    def columns(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Every (time bucket, bin, count) recorded so far, the bucket being filled included."""
        parts = list(self.chunks)
        if self._cur:
            parts.append((np.full(len(self._cur), self._cur_b, dtype=np.int64),
                          np.fromiter(self._cur.keys(), dtype=np.int32, count=len(self._cur)),
                          np.fromiter(self._cur.values(), dtype=np.int64, count=len(self._cur))))
        if not parts:
            return np.zeros(0, np.int64), np.zeros(0, np.int32), np.zeros(0, np.int64)
        return tuple(np.concatenate([p[i] for p in parts]) for i in range(3))

    @classmethod
    def merged(cls, logs) -> "GapLog":
        """One log holding every log's records (e.g. a fleet's instances); they must share ``bucket_s``."""
        logs = list(logs)
        widths = {log.bucket_s for log in logs}
        if len(widths) > 1:
            raise ValueError(f"logs: expected one bucket_s, got {sorted(widths)}")
        out = cls(widths.pop() if widths else 10.0)
        cols = [log.columns() for log in logs]
        if cols and any(c[0].size for c in cols):
            out.chunks = [tuple(np.concatenate([c[i] for c in cols]) for i in range(3))]
        return out

    @property
    def nbytes(self) -> int:
        """Bytes held (the stored arrays and the bucket being filled, about 100 bytes per dict entry)."""
        return sum(a.nbytes for chunk in self.chunks for a in chunk) + 100 * len(self._cur)

    def histogram(self, t0_s: float = -math.inf, t1_s: float = math.inf) -> GapHistogram:
        """The gaps whose time bucket has its middle in [t0_s, t1_s) (all of them by default)."""
        bucket, b, count = self.columns()
        if t0_s != -math.inf or t1_s != math.inf:
            mid = (bucket + 0.5) * self.bucket_s
            keep = (mid >= t0_s) & (mid < t1_s)
            b, count = b[keep], count[keep]
        return GapHistogram(np.bincount(b, weights=count, minlength=N_BINS).astype(np.int64))
