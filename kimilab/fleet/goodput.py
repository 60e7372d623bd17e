"""Goodput: the most traffic a fleet serves within a latency target, and what that costs.

A service-level objective (:class:`SLO`) bounds a percentile of time to first token and,
optionally, of time per output token. *Goodput* (DistServe's word; Mooncake's "effective
request capacity") is the highest load the fleet serves within it:

* :func:`max_rate_scale`: the highest arrival-rate scale of a trace (its timestamps divided
  by the scale) that N instances serve within the SLO;
* :func:`min_instances`: the fewest instances that serve a given scale within it;
* :func:`max_sessions`: for closed-loop agent sessions, the most concurrent sessions.

Each search is a bisection on a load the latencies are monotone in (up to the noise of one
replay). An overloaded replay need not run to its end: :class:`SloGuard` stops it as soon
as enough requests have missed the target that the percentile cannot come back under it.
:func:`priced` turns a passing run into requests/s per instance and dollars per million
output tokens for a fleet sized to that load.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from kimilab.validate import check_float, check_int

__all__ = ["SLO", "MOONCAKE_SLO", "AGENT_SLO", "Pooled", "window", "meets", "SloGuard", "max_rate_scale",
           "min_instances", "max_sessions", "priced"]


@dataclass(frozen=True)
class SLO:
    """TTFT at percentile ``ttft_q`` within ``ttft_s`` seconds; TPOT at ``tpot_q`` within ``tpot_s``
    (None: no TPOT bound), over requests arriving from ``warmup_s`` on."""

    name: str
    ttft_s: float
    ttft_q: float
    tpot_s: float | None
    tpot_q: float
    source: str
    warmup_s: float = 0.0

    def describe(self) -> str:
        tpot = "" if self.tpot_s is None else f", TPOT p{self.tpot_q:g} <= {1e3 * self.tpot_s:g} ms"
        return f"{self.name}: TTFT p{self.ttft_q:g} <= {self.ttft_s:g} s{tpot}"


MOONCAKE_SLO = SLO("mooncake", 30.0, 99, 0.200, 99,
                   "Mooncake (FAST'25) section 5.1: TTFT threshold 30 s; TBT thresholds of 100, 200 and 300 ms "
                   "'depending on the scenario'. Here the middle one (200 ms) bounds each request's mean TPOT: "
                   "one step carrying a full 8,192-token prefill chunk takes longer than 100 ms on the default "
                   "deployment, so any decode sharing such a step would miss the strictest. Both hold at p99")
AGENT_SLO = SLO("agent", 2.0, 95, None, 99,
                "kv-cache-tester trace_replay_tester.py (the Claude Code sessions' replay tool): --max-ttft 2.0 "
                "seconds, with the p95 TTFT metric its documentation gives as the default", warmup_s=120.0)


@dataclass
class Pooled:
    """Several replays' requests as one sample (seeds of a closed-loop replay): what :func:`meets`
    and :func:`priced` read, concatenated."""

    arrival_s: np.ndarray
    ttft_s: np.ndarray
    tpot_s: np.ndarray
    e2e_s: np.ndarray
    output_tokens: np.ndarray
    finished: int
    requests: int
    aborted: bool
    busy_seconds: float
    n_instances: int
    n_deployed: int
    devices: int
    replays: int

    @classmethod
    def of(cls, results) -> "Pooled":
        if not isinstance(results, (list, tuple)):
            results = [results]
        cat = lambda name: np.concatenate([getattr(r, name) for r in results])  # noqa: E731
        r0 = results[0]
        return cls(cat("arrival_s"), cat("ttft_s"), cat("tpot_s"), cat("e2e_s"), cat("output_tokens"),
                   sum(r.finished for r in results), sum(r.requests for r in results),
                   any(r.aborted for r in results), float(sum(r.busy_s.sum() for r in results)),
                   r0.n_instances, r0.n_deployed, r0.devices, len(results))


def window(result, slo: SLO) -> dict:
    """The SLO's percentiles over the requests arriving after its warm-up (None: no such request)."""
    r = Pooled.of(result)
    w = r.arrival_s >= slo.warmup_s
    multi = w & (r.output_tokens > 1)
    pct = lambda x, q: float(np.percentile(x, q)) if x.size else None  # noqa: E731
    return {"ttft_s": pct(r.ttft_s[w], slo.ttft_q), "tpot_s": pct(r.tpot_s[multi], slo.tpot_q),
            "ttft_p50_s": pct(r.ttft_s[w], 50), "tpot_p50_s": pct(r.tpot_s[multi], 50), "requests": int(w.sum())}


def meets(result, slo: SLO) -> bool:
    """Every request finished and the SLO's percentiles are within their limits (a list of results is
    pooled: its requests judged as one sample)."""
    r = Pooled.of(result)
    if r.aborted or r.finished < r.requests:
        return False
    got = window(result, slo)
    if got["ttft_s"] is not None and got["ttft_s"] > slo.ttft_s:
        return False
    return slo.tpot_s is None or got["tpot_s"] is None or got["tpot_s"] <= slo.tpot_s


def _certain(violations: int, n: int, q: float) -> bool:
    """The q-th percentile (numpy's linear rule) of n values exceeds the limit once this many do:
    then the value at index floor(q/100 (n-1)) of the sorted n is over it."""
    return n > 0 and violations >= n - math.floor(q / 100.0 * (n - 1))


class SloGuard:
    """Stops an open-loop replay once it cannot meet ``slo``: enough finished requests have missed
    the TTFT (or TPOT) limit that the percentile over all ``requests`` is over it, whatever the
    rest do. A refused request counts as a miss. Warm-up windows are not used here."""

    def __init__(self, slo: SLO, requests):
        if slo.warmup_s:
            raise ValueError(f"slo={slo.name!r}: a guard needs an SLO without a warm-up window")
        self.slo = slo
        self.n = len(requests)
        self.n_multi = sum(1 for r in requests if r.output_length > 1)
        self._seen: dict = {}
        self.ttft_misses = self.tpot_misses = 0

    def check(self, fleet) -> bool:
        slo = self.slo
        refused = 0
        for e in fleet.instances:
            fin = e.finished
            k = self._seen.get(e.index, 0)
            for f in fin[k:]:
                if f.ttft > slo.ttft_s:
                    self.ttft_misses += 1
                if slo.tpot_s is not None and f.output_length > 1 and f.tpot > slo.tpot_s:
                    self.tpot_misses += 1
            self._seen[e.index] = len(fin)
            refused += len(e.refused)
        if _certain(self.ttft_misses + refused, self.n, slo.ttft_q):
            return True
        return slo.tpot_s is not None and _certain(self.tpot_misses + refused, self.n_multi, slo.tpot_q)


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


def max_rate_scale(run, slo: SLO, *, start: float = 1.0, rel_tol: float = 0.05, ceiling: float = 4096.0):
    """(highest passing scale, its result, every (scale, passed) tried). ``run(scale, guard)`` replays the
    trace at ``scale`` x its rate and returns a FleetResult (``guard`` may stop it early)."""
    passes, tried, best = _recorded(run, slo)
    check_float("rel_tol", rel_tol, minimum=1e-6)
    scale = _bisect_up(passes, None, None, start, rel_tol, ceiling)
    return scale, best.get(scale), tried


def _recorded(run, slo: SLO):
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


def min_instances(run, slo: SLO, *, start: int = 1, limit: int = 1024):
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


def max_sessions(run, slo: SLO, *, start: int = 8, limit: int = 4096, rel_tol: float = 0.0):
    """(most concurrent sessions n with ``run(n)`` meeting ``slo``, its result, every (n, passed) tried);
    the bisection stops once the bracket is within ``rel_tol`` of its low end (0: exact)."""
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


def priced(result, *, span_s: float, price_per_hour: float) -> dict:
    """What a passing run costs when the fleet is sized to it: its accelerators rented for the load's
    duration ``span_s`` (the arrivals' span, or the closed-loop window), per replay pooled.

    Returns requests/s and output tokens/s per instance, dollars per million output tokens,
    and the busy fraction (time the engines were stepping / time they were up)."""
    span_s = check_float("span_s", span_s, minimum=0.0)
    if span_s <= 0:
        raise ValueError("span_s: expected a positive duration")
    r = Pooled.of(result)
    span = span_s * r.replays
    instances = r.n_deployed
    out_tokens = float(r.output_tokens.sum())
    device_hours = r.devices * span / 3600.0
    makespan = float((r.arrival_s + r.e2e_s).max()) if r.finished else span_s
    busy = r.busy_seconds / (r.n_instances * max(makespan, span_s) * r.replays)
    return {"instances": instances, "requests_per_s_per_instance": r.finished / span / instances,
            "output_tokens_per_s_per_instance": out_tokens / span / instances,
            "usd_per_m_output": device_hours * price_per_hour / max(out_tokens, 1.0) * 1e6,
            "busy_fraction": busy}
