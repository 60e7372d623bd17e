"""Searches for the most load a fleet serves within an SLO: bisections, and a scan that needs no monotonicity.

* :func:`max_rate_scale`, :func:`min_instances`, :func:`max_sessions`: bisections. They assume
  that once a load fails every higher load fails (and, for instances, every smaller count).
* :func:`scan_capacity` on a :func:`rate_grid` or :func:`session_grid`: scan the grid upward,
  then confirm the answer by failures in a row above it. A closed-loop agent replay is not
  monotone in its load (which heavy session lands in the window moves the tail more than one
  more session does), so there a bisection's answer can hang on one replay.

Each takes ``run(load) -> result`` and an :class:`~kimilab.fleet.goodput.SLO`; a result passes
when :func:`kimilab.fleet.goodput.meets` says so (they are re-exported there).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from kimilab.validate import check_float, check_int

__all__ = ["max_rate_scale", "min_instances", "max_sessions", "Scan", "rate_grid", "session_grid", "scan_capacity"]


def meets(result, slo) -> bool:
    """:func:`kimilab.fleet.goodput.meets` (imported when called: goodput re-exports this module)."""
    from kimilab.fleet.goodput import meets as judge

    return judge(result, slo)


def _bisect_up(passes, lo: float | None, hi: float | None, start: float, rel_tol: float, ceiling: float):
    """The largest x with passes(x), to within a factor 1 + rel_tol, by doubling then geometric bisection."""
    x = start
    if lo is None and hi is None:
        if passes(x):
            lo = x
        else:
            hi = x
    while lo is None:
        hi /= 2.0
        if hi < start / 1024:
            return 0.0
        if passes(hi):
            lo = hi
            hi = hi * 2.0
    while hi is None:
        if lo * 2.0 > ceiling:
            return lo
        if passes(lo * 2.0):
            lo *= 2.0
        else:
            hi = lo * 2.0
    while hi / lo > 1.0 + rel_tol:
        mid = math.sqrt(lo * hi)
        if passes(mid):
            lo = mid
        else:
            hi = mid
    return lo


def max_rate_scale(run, slo, *, start: float = 1.0, rel_tol: float = 0.05, ceiling: float = 4096.0):
    """(highest passing scale, its result, every (scale, passed) tried). ``run(scale, guard)`` replays the
    trace at ``scale`` x its rate and returns a FleetResult (``guard`` may stop it early). A bisection: it
    assumes every scale above a failing one fails (:func:`scan_capacity` does not)."""
    passes, tried, best = _recorded(run, slo)
    check_float("rel_tol", rel_tol, minimum=1e-6)
    scale = _bisect_up(passes, None, None, start, rel_tol, ceiling)
    return scale, best.get(scale), tried


def _recorded(run, slo):
    """(a test ``passes(n)`` that runs ``run(n)`` against ``slo``, the (n, passed) list it fills, and
    the results of the n that passed)."""
    tried, results = [], {}

    def passes(n):
        result = run(n)
        ok = meets(result, slo)
        tried.append((n, ok))
        if ok:
            results[n] = result
        return ok

    return passes, tried, results


def min_instances(run, slo, *, start: int = 1, limit: int = 1024):
    """(fewest instances n with ``run(n)`` meeting ``slo``, its result, every (n, passed) tried)."""
    start = check_int("start", start, 1)
    passes, tried, results = _recorded(run, slo)

    lo, hi = 0, start  # lo fails (or is 0), hi is the candidate
    while not passes(hi):
        lo, hi = hi, hi * 2
        if hi > limit:
            return None, None, tried
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if mid and passes(mid):
            hi = mid
        else:
            lo = mid
    return hi, results[hi], tried


def max_sessions(run, slo, *, start: int = 8, limit: int = 4096, rel_tol: float = 0.0):
    """(most concurrent sessions n with ``run(n)`` meeting ``slo``, its result, every (n, passed) tried);
    the bisection stops once the bracket is within ``rel_tol`` of its low end (0: exact). It assumes every
    count above a failing one fails, which closed-loop replays need not obey: :func:`scan_capacity`."""
    start = check_int("start", start, 1)
    passes, tried, results = _recorded(run, slo)

    lo, hi = 0, start  # lo passes (or is 0), hi fails
    while passes(hi):
        lo, hi = hi, hi * 2
        if hi > limit:
            return lo, results[lo], tried
    while hi - lo > max(1, int(rel_tol * lo)):
        mid = (lo + hi) // 2
        if passes(mid):
            lo = mid
        else:
            hi = mid
    return lo, results.get(lo), tried


@dataclass(frozen=True)
class Scan:
    """What :func:`scan_capacity` found.

    ``capacity``: the largest grid load that passed, the ``confirm`` grid loads above it run and
    failed (0: none passed); ``result``: its run. ``tried``: every (load, passed) in the order run.
    ``non_monotone``: the loads below ``capacity`` that failed (empty: what was run is monotone).
    ``lowest_fail``: the smallest load that failed (None: none did). ``at_ceiling``: the grid's
    top passed, so ``capacity`` is only a lower bound."""

    capacity: float
    result: object
    tried: tuple
    non_monotone: tuple
    lowest_fail: float | None
    at_ceiling: bool

    @property
    def monotone(self) -> bool:
        return not self.non_monotone


def rate_grid(start: float, step: float, *, floor: float | None = None, ceiling: float = 4096.0) -> list[float]:
    """Rate scales ``start * (1 + step)**k`` (k any integer) from ``floor`` (default ``start / 1024``)
    to ``ceiling``: a geometric grid, so every load is ``step`` apart in relative terms."""
    start = check_float("start", start, minimum=0.0)
    step = check_float("step", step, minimum=1e-6)
    floor = start / 1024 if floor is None else check_float("floor", floor, minimum=0.0)
    ceiling = check_float("ceiling", ceiling, minimum=start)
    if start <= 0 or floor <= 0:
        raise ValueError(f"start={start!r}, floor={floor!r}: expected positive rate scales")
    r = 1.0 + step
    k0, k1 = math.ceil(math.log(floor / start, r) - 1e-9), math.floor(math.log(ceiling / start, r) + 1e-9)
    return [start * r ** k for k in range(k0, k1 + 1)]


def session_grid(start: int, step: float, *, limit: int = 4096) -> list[int]:
    """Whole session counts nearest ``start * (1 + step)**k`` (k any integer), from 1 to ``limit``:
    geometric, so consecutive where ``step`` times the count is under one; ``step=0``: every count."""
    start = check_int("start", start, 1)
    limit = check_int("limit", limit, start)
    step = check_float("step", step, minimum=0.0)
    if step == 0:
        return list(range(1, limit + 1))
    r = 1.0 + step
    k0, k1 = math.floor(-math.log(start, r)) - 1, math.ceil(math.log(limit / start, r)) + 1
    return sorted({n for k in range(k0, k1 + 1) if 1 <= (n := math.floor(start * r ** k + 0.5)) <= limit})


def scan_capacity(run, slo, grid, *, start=None, confirm: int = 2, judge=None) -> Scan:
    """The largest load on ``grid`` that ``run(load)`` serves within ``slo`` before ``confirm``
    loads in a row fail, without assuming that pass/fail is monotone in the load.

    1. Bracket: from ``start`` (default: the grid's middle), double the load while it passes,
       or, if ``start`` fails, halve it until one passes: that pass is where the scan starts.
    2. Scan: run the grid's loads upward from there, one by one, until ``confirm`` in a row
       fail (the confirmation that the answer, the last load that passed, is the edge). A
       shorter run of failures is a non-monotone point: the scan steps over it.
    3. Below: the ``confirm`` grid loads under the answer are run too.

    Every load seen to fail below the answer is reported in :attr:`Scan.non_monotone`; loads
    under the bracket that were not run, and loads past the confirming failures, are not seen.
    ``judge(result, slo)`` decides a pass (default :func:`meets`)."""
    grid = sorted(set(grid))
    if not grid:
        raise ValueError("grid: expected at least one load")
    confirm = check_int("confirm", confirm, 1)
    n = len(grid)
    i = n // 2 if start is None else next((j for j, x in enumerate(grid) if x >= start), n - 1)
    seen: dict = {}
    tried, results = [], {}

    def passes(j: int) -> bool:
        if j not in seen:
            result = run(grid[j])
            seen[j] = ok = bool((judge or meets)(result, slo))
            tried.append((grid[j], ok))
            if ok:
                results[j] = result
        return seen[j]

    best = -1
    if passes(i):  # double while it passes
        best = i
        while (j := next((k for k in range(best + 1, n) if grid[k] >= 2 * grid[best]), n - 1)) > best \
                and passes(j):
            best = j
    else:  # halve until one passes (or the grid's bottom fails)
        j = i
        while j > 0:
            j = next((k for k in range(j - 1, -1, -1) if grid[k] <= grid[j] / 2), 0)
            if passes(j):
                best = j
                break
    j, failed = best + 1, 0
    while j < n and failed < confirm:
        if passes(j):
            best, failed = j, 0
        else:
            failed += 1
        j += 1
    for j in range(max(0, best - confirm), best):
        passes(j)
    fails = [grid[j] for j, ok in seen.items() if not ok]
    cap = grid[best] if best >= 0 else 0
    return Scan(cap, results.get(best), tuple(tried), tuple(sorted(x for x in fails if x < cap)),
                min(fails, default=None), best == n - 1)
