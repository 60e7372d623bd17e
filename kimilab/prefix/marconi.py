"""Marconi's eviction as published: FLOP efficiency against recency, normalised over the candidates,
with the weight alpha tuned online by replaying a recent window.

Read from the authors' artifact (github.com/ruipeterpan/marconi at ``08016617b1524e6bf6ac29b680641cc945bda7f0``):

* ``radix_cache_hybrid.py``, ``RadixCache.evict_v2``: the candidates are the nodes with at
  most one child. For a node whose segment runs from its parent's end ``p`` to its own end
  ``e`` (tokens), its FLOP efficiency is the prefill FLOPs it saves *relative to its parent*,
  ``F(e) - F(p)``, per byte of one state plus the KV of its whole prefix,
  ``S + kv * e``; its recency is ``1 / (now - last use)``. Both are min-max normalised over
  all candidates (``utils._normalize``: all ones when they are all equal), and the node of
  least ``alpha * eff + recency`` goes -- a leaf with its segment, an inner node's state alone
  (it merges into its child, which takes the later of the two last uses). A lookup stamps only
  the node it resumes from; the clock ticks at every lookup, insertion and eviction call.
* ``config_tuner.py``, ``ConfigTuner.tune_config``: at the first eviction the cache notes how
  many requests it has seen, N; when it has seen ``bootstrap_multiplier * N`` (5), it replays
  all of them from an empty cache once for each alpha in 0, 0.1, ..., 2.0 and keeps the alpha
  that saved the most prefill FLOPs over the window's last 500 requests. (The artifact tunes
  once; its code for periodic re-tuning is marked legacy. Its ties go to whichever replay
  finished first; ours to the smallest alpha.)

Admission is ``ends+branch``'s (:class:`~kimilab.prefix.policies.EndsBranch`): a state at each
request's end and at the branch point it creates. F is this book's prefill FLOP count
(:func:`kimilab.costs.prefill_flops`); the artifact counts FLOPs with its own formulas for a
Mamba model.
"""

from __future__ import annotations

import numpy as np

from kimilab.prefix.policies import EndsBranch
from kimilab.prefix.segments import SegmentCache
from kimilab.validate import check_float, check_int

__all__ = ["ALPHA_GRID", "normalise", "flops_by_depth", "MarconiScorer", "marconi_cache"]

ALPHA_GRID = tuple(round(0.1 * k, 1) for k in range(21))  # the artifact's grid, 0 to 2.0
_TABLES: dict = {}


def normalise(values: np.ndarray) -> np.ndarray:
    """Min-max scaling to [0, 1]; all ones when there is one value or all are equal (Marconi's ``_normalize``)."""
    lo, hi = values.min(), values.max()
    if lo != hi:
        return (values - lo) / (hi - lo)
    return np.ones_like(values)


def flops_by_depth(cache: SegmentCache, depth: int) -> np.ndarray:
    """Cold prefill FLOPs of the first d blocks, for d = 0..depth (shared by every cache of one model)."""
    table = cache.flops_table
    if len(table) > depth:
        return table
    key = (cache.costs.config, cache.block_size)
    table = _TABLES.get(key, np.zeros(1))
    if len(table) <= depth:
        size = max(depth + 1, 2 * len(table))
        extra = [float(cache.costs.prefill_flops(d * cache.block_size)) for d in range(len(table), size)]
        table = _TABLES[key] = np.concatenate([table, extra])
    cache.flops_table = table
    return table


def efficiency(cache: SegmentCache, idx: np.ndarray) -> np.ndarray:
    """FLOPs saved relative to the parent, per byte of one state plus its whole prefix's KV."""
    u = cache.units
    hi, start = u.hi[idx], u.start[idx]
    F = flops_by_depth(cache, int(hi.max()))
    return (F[hi] - F[start]) / (cache.checkpoint_bytes + cache.page_bytes * hi)


class MarconiScorer:
    """Marconi's eviction (see the module doc). ``alpha=None`` tunes it online from 0 (the artifact's
    start); a number fixes it (the artifact's static-alpha runs)."""

    name = "marconi"
    touch_path = False

    def __init__(self, alpha: float | None = None, *, bootstrap_multiplier: int = 5, tuning_interval: int = 500,
                 grid=ALPHA_GRID):
        self.tune = alpha is None
        self.alpha = 0.0 if alpha is None else check_float("alpha", alpha, minimum=0.0)
        self.bootstrap_multiplier = check_int("bootstrap_multiplier", bootstrap_multiplier, 1)
        self.tuning_interval = check_int("tuning_interval", tuning_interval, 1)
        self.grid = tuple(grid)
        self.first_eviction_at = None  # requests seen at the first eviction (N)
        self.tuned: dict | None = None  # {"at": request, "alpha": chosen, "flops_saved": {alpha: FLOPs}}
        self.history: list = []  # (keys, n_tokens) of every request, until the tuning is done

    def on_hit(self, cache: SegmentCache, node) -> None:
        node.last = cache.tick
        cache.units.last[node.slot] = node.last

    def merge(self, cache: SegmentCache, upper, child) -> None:
        child.last = max(upper.last, child.last)
        if child.slot >= 0:
            cache.units.last[child.slot] = child.last

    def victim(self, cache: SegmentCache, kind: str):
        if self.first_eviction_at is None:
            self.first_eviction_at = cache.clock
        u = cache.units
        top = u.top
        idx = (u.free[:top] & (u.nchild[:top] <= 1)).nonzero()[0]
        if not idx.size:
            return None
        recency = normalise(1.0 / np.maximum(cache.tick - u.last[idx], 1e-9))
        score = normalise(efficiency(cache, idx)) * self.alpha + recency if self.alpha else recency
        return u.pick(score, idx)

    def before_insert(self, cache: SegmentCache, keys: list, n_tokens: int) -> None:
        """Record the request; tune alpha when the bootstrap window closes (before this insertion)."""
        if not self.tune or self.tuned is not None:
            return
        self.history.append((keys, n_tokens))
        n = self.first_eviction_at
        if n is not None and cache.clock == self.bootstrap_multiplier * n:
            self._tune(cache)

    def _tune(self, cache: SegmentCache) -> None:
        saved, memo = {}, {}
        window = self.history
        scored = len(window) - self.tuning_interval  # the window's last requests are scored
        for alpha in self.grid:
            twin = marconi_cache_like(cache, alpha)
            total = 0
            for i, (keys, n) in enumerate(window):
                hit = twin.serve_whole(keys, n).usable_hit
                if i >= scored:
                    key = (n, hit)
                    if key not in memo:
                        memo[key] = cache.costs.flops_saved(n, hit)
                    total += memo[key]
            saved[alpha] = total
        best = max(saved.values())
        self.alpha = min(a for a, v in saved.items() if v == best)
        self.tuned = {"at": cache.clock, "alpha": self.alpha, "flops_saved": saved}
        self.history = []

    def describe(self) -> str:
        if self.tune:
            at = "not yet" if self.tuned is None else f"alpha {self.alpha:g} from request {self.tuned['at']}"
            return f"marconi(online alpha: {at})"
        return f"marconi(alpha={self.alpha:g})"


def marconi_cache(config, *, deployment, block_size: int, capacity_tokens: int | None, alpha: float | None = None,
                  precision: str = "native", **tuning) -> SegmentCache:
    """A :class:`SegmentCache` with Marconi's admission (ends + branch points) and eviction."""
    cache = SegmentCache(config, EndsBranch(), MarconiScorer(alpha, **tuning), deployment=deployment,
                         block_size=block_size, capacity_tokens=capacity_tokens, precision=precision)
    cache.policy_name = "marconi"
    return cache


def marconi_cache_like(cache: SegmentCache, alpha: float) -> SegmentCache:
    """An empty twin of ``cache`` at a fixed alpha (what the tuner replays the window on)."""
    twin = marconi_cache(cache.costs.config, deployment=cache.costs.deployment, block_size=cache.block_size,
                         capacity_tokens=cache.capacity_tokens, alpha=alpha, precision=cache.precision)
    return twin
