"""A clairvoyant reference: the cache that knows every request still to come.

Caching with sizes and values is NP-hard to do optimally offline, so no replay can print
the true optimum. What this module gives is the standard reference for such problems: a
Belady-style policy that reads the future (the trace) and spends memory where the next use
is soonest and worth most per byte. Every online policy's curve reads against it; it is a
strong target, not a proven upper bound (chapter 6 says which policy, if any, beats it).

* Admission (:class:`OraclePolicy`): a state only where a later request will resume -- at
  depth d of this prompt when the next request to reach block d leaves the prompt's path
  there (it does not also reach block d + 1), and at the prompt's end when anyone comes
  back to it. Nothing is stored that no one will read.
* Eviction (:class:`OracleScorer`): among the same candidates as Marconi's (nodes with at
  most one child), the one with the least value per byte per request until its next use goes
  first, value per byte being Marconi's FLOP efficiency (FLOPs saved relative to the parent
  per byte of state plus prefix KV). A unit nobody will reach again scores 0.

"Reaches" means: the prompt holds that block's hash id (ids name whole prefixes).
"""

from __future__ import annotations

import bisect

import numpy as np

from kimilab.prefix.marconi import efficiency
from kimilab.prefix.policies import Placement, Policy
from kimilab.prefix.segments import SegmentCache

__all__ = ["FutureIndex", "OraclePolicy", "OracleScorer", "oracle_cache"]

_NEVER = float("inf")


class FutureIndex:
    """For every block id, the indices of the requests whose prompts hold it (whole blocks)."""

    def __init__(self, prompts):
        where: dict = {}
        for i, keys in enumerate(prompts):
            for k in keys:
                where.setdefault(k, []).append(i)
        self._where = where

    def next_after(self, key, index: int) -> float:
        """The first request after ``index`` that holds ``key`` (inf: none)."""
        seq = self._where.get(key)
        if not seq:
            return _NEVER
        j = bisect.bisect_right(seq, index)
        return seq[j] if j < len(seq) else _NEVER


class OraclePolicy(Policy):
    """States only where the future will resume (see the module doc)."""

    name = "oracle"

    def __init__(self, future: FutureIndex):
        self.future = future
        self._index, self._keys = -1, []

    def begin(self, index: int, keys: list) -> None:
        self._index, self._keys = index, keys

    def positions(self, p: Placement) -> list[int]:
        # v(d) = the next request to reach block d never decreases with d (a request that reaches
        # block d + 1 reaches block d), so its change points are found by bisection.
        keys, index = self._keys, self._index
        n = len(p.ends)
        if not n:
            return []
        memo: dict = {}

        def v(d):
            if d not in memo:
                memo[d] = self.future.next_after(keys[d], index)
            return memo[d]

        out = [n - 1] if v(n - 1) != _NEVER else []
        stack = [(0, n - 1)]
        while stack:
            lo, hi = stack.pop()
            if v(lo) == v(hi):
                continue
            if hi == lo + 1:
                if v(lo) != _NEVER:
                    out.append(lo)
                continue
            mid = (lo + hi) // 2
            stack += [(lo, mid), (mid, hi)]
        return sorted(i for i in out if p.ends[i] > p.usable_end)


class OracleScorer:
    """Evict the unit of least (value per byte) / (requests until its next use)."""

    name = "oracle"
    touch_path = False

    def __init__(self, future: FutureIndex):
        self.future = future

    def on_request(self, cache: SegmentCache, path: list) -> None:
        now = cache.clock - 1
        for node in path:
            if node.slot >= 0:
                cache.units.next_use[node.slot] = self.future.next_after(node.keys[-1], now)

    def victim(self, cache: SegmentCache, kind: str):
        u = cache.units
        idx = np.flatnonzero(u.free[: u.top] & (u.nchild[: u.top] <= 1))
        if not idx.size:
            return None
        wait = u.next_use[idx] - (cache.clock - 1)
        score = np.where(np.isinf(wait), 0.0, efficiency(cache, idx) / np.maximum(wait, 1.0))
        return u.pick(score, idx)


def oracle_cache(config, prompts, *, deployment, block_size: int, capacity_tokens: int | None,
                 precision: str = "native") -> SegmentCache:
    """A :class:`SegmentCache` that reads the future of ``prompts`` (each a list of whole-block ids,
    in the order they will be served)."""
    future = FutureIndex(prompts)
    cache = SegmentCache(config, OraclePolicy(future), OracleScorer(future), deployment=deployment,
                         block_size=block_size, capacity_tokens=capacity_tokens, precision=precision)
    return cache
