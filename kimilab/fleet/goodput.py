"""Goodput: the most traffic a fleet serves within a latency target, and what that costs.

A service-level objective (:class:`SLO`) bounds a percentile of time to first token and,
optionally, of time per output token. *Goodput* (DistServe's word; Mooncake's "effective
request capacity") is the highest load the fleet serves within it:

* :func:`max_rate_scale`: the highest arrival-rate scale of a trace (its timestamps divided
  by the scale) that N instances serve within the SLO;
* :func:`min_instances`: the fewest instances that serve a given scale within it;
* :func:`max_sessions`: for closed-loop agent sessions, the most concurrent sessions;
* :func:`scan_capacity`: the same question without assuming that pass/fail is monotone in
  the load (scan a grid, then confirm), for :func:`rate_grid` or :func:`session_grid`.

The searches live in :mod:`kimilab.fleet.search` (importable from here too). The first three
bisect: they assume that once a load fails every higher load fails. A closed-loop replay
breaks that, so a bisection's answer can hang on one replay; :func:`scan_capacity` scans the
grid upward and reports the loads below its answer that failed. An overloaded replay need
not run to its end: :class:`SloGuard` stops it as soon
as enough requests have missed the target that the percentile cannot come back under it.
:func:`priced` turns a passing run into requests/s per instance and dollars per million
output tokens for a fleet sized to that load.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np

from kimilab.engine.gaps import GapHistogram, bin_values
from kimilab.fleet.search import (Scan, max_rate_scale, max_sessions, min_instances, rate_grid,  # noqa: F401
                                  scan_capacity, session_grid)  # the searches, importable from here as before
from kimilab.validate import check_float, check_int

__all__ = ["SLO", "MOONCAKE_SLO", "MOONCAKE_SLO_200", "AGENT_SLO", "steady_window", "ttft_growth", "slo_ratio",
           "replay_convergence", "Pooled", "window", "meets", "SloGuard", "max_rate_scale",
           "min_instances", "max_sessions", "Scan", "rate_grid", "session_grid", "scan_capacity", "priced"]


@dataclass(frozen=True)
class SLO:
    """Percentile bounds on latency, judged over a steady-state window of one replay.

    TTFT at percentile ``ttft_q`` within ``ttft_s`` seconds. TBT (Mooncake's time between tokens:
    every gap between two consecutive output tokens of a request, counted token by token) at
    ``tbt_q`` within ``tbt_s`` (None: no bound). ``tpot_s`` bounds each request's *mean* time per
    output token at ``tpot_q`` (None: not judged; the named SLOs judge TBT, not the mean, which
    hides a long stall among fast tokens).

    The window (:func:`steady_window`) drops requests arriving before ``warmup_s`` seconds or in
    the first ``warmup_frac`` of the arrival span (the fleet filling up), and those arriving in
    its last ``cooldown_frac`` (the backlog that drains after the last arrival); TBT counts the
    gaps that came out between the same two times.

    ``max_ttft_growth`` (None: not judged) is the steady-state condition: percentiles over a replay
    shorter than the time a growing queue takes to breach them pass an overloaded fleet, so the
    window's median TTFT may grow by at most this many seconds per second of arrivals
    (:func:`ttft_growth`: its last third against its first)."""

    name: str
    ttft_s: float
    ttft_q: float
    tpot_s: float | None
    tpot_q: float
    source: str
    warmup_s: float = 0.0
    tbt_s: float | None = None
    tbt_q: float = 99.0
    warmup_frac: float = 0.0
    cooldown_frac: float = 0.0
    max_ttft_growth: float | None = None

    def __post_init__(self) -> None:
        check_float("SLO.ttft_s", self.ttft_s, minimum=0.0)
        check_float("SLO.warmup_s", self.warmup_s, minimum=0.0)
        for name in ("ttft_q", "tpot_q", "tbt_q"):
            q = check_float(f"SLO.{name}", getattr(self, name), minimum=0.0)
            if not 0.0 < q <= 100.0:
                raise ValueError(f"SLO.{name}={q!r}: expected a percentile in (0, 100]")
        for name in ("tpot_s", "tbt_s"):
            limit = getattr(self, name)
            if limit is not None and check_float(f"SLO.{name}", limit, minimum=0.0) <= 0:
                raise ValueError(f"SLO.{name}={limit!r}: expected seconds > 0, or None for no bound")
        for name in ("warmup_frac", "cooldown_frac"):
            f = check_float(f"SLO.{name}", getattr(self, name), minimum=0.0)
            if f >= 1.0:
                raise ValueError(f"SLO.{name}={f!r}: expected a fraction of the arrival span in [0, 1)")
        if self.max_ttft_growth is not None:
            check_float("SLO.max_ttft_growth", self.max_ttft_growth, minimum=0.0)
        if self.warmup_frac + self.cooldown_frac >= 1.0:
            raise ValueError(f"SLO.warmup_frac + cooldown_frac = {self.warmup_frac + self.cooldown_frac!r}: "
                             "expected < 1 (the window would be empty)")

    @property
    def windowed(self) -> bool:
        """Whether any request is left out of the judgement (a warm-up or a cool-down)."""
        return bool(self.warmup_s or self.warmup_frac or self.cooldown_frac)

    def describe(self) -> str:
        tbt = "" if self.tbt_s is None else f", TBT p{self.tbt_q:g} <= {1e3 * self.tbt_s:g} ms"
        tpot = "" if self.tpot_s is None else f", mean TPOT p{self.tpot_q:g} <= {1e3 * self.tpot_s:g} ms"
        cut = []
        if self.warmup_s:
            cut.append(f"from {self.warmup_s:g} s")
        if self.warmup_frac:
            cut.append(f"after the first {100 * self.warmup_frac:g}% of arrivals' span")
        if self.cooldown_frac:
            cut.append(f"before the last {100 * self.cooldown_frac:g}%")
        window = f" (requests arriving {', '.join(cut)})" if cut else ""
        growth = ("" if self.max_ttft_growth is None else
                  f", median TTFT growing <= {3600 * self.max_ttft_growth:g} s per hour of arrivals")
        return f"{self.name}: TTFT p{self.ttft_q:g} <= {self.ttft_s:g} s{tbt}{tpot}{growth}{window}"


_MOONCAKE = ("Mooncake (FAST'25) section 5.1: TTFT threshold 30 s; TBT thresholds of 100, 200 and 300 ms "
             "'depending on the scenario'. TBT is judged here as Mooncake defines it, per token: every gap "
             "between consecutive output tokens, not a request's mean time per output token. The percentile "
             "(p99, both bounds) is our choice, and so is the steady state: the first 10% of the arrivals' "
             "span is warm-up, and the median TTFT may grow by at most 30 s per hour of arrivals (a queue "
             "growing faster would breach the TTFT limit within an hour of serving at this load; a short "
             "replay of an overloaded instance would pass without it). ")
_STEADY = dict(warmup_frac=0.1, max_ttft_growth=30.0 / 3600.0)
MOONCAKE_SLO = SLO("mooncake", 30.0, 99, None, 99,
                   _MOONCAKE + "This is the strictest TBT threshold, 100 ms: a decode that shares a step with a "
                   "prefill chunk waits for the whole step, so the chunk budget (max_batched_tokens) decides "
                   "whether it can hold.", tbt_s=0.100, tbt_q=99, **_STEADY)
MOONCAKE_SLO_200 = SLO("mooncake-200", 30.0, 99, None, 99,
                       _MOONCAKE + "This is the middle TBT threshold, 200 ms, beside the strict one.",
                       tbt_s=0.200, tbt_q=99, **_STEADY)
AGENT_SLO = SLO("agent", 2.0, 95, None, 99,
                "kv-cache-tester trace_replay_tester.py (the Claude Code sessions' replay tool): --max-ttft 2.0 "
                "seconds, with the p95 TTFT metric its documentation gives as the default", warmup_s=120.0)


def steady_window(arrival_s, slo: SLO) -> tuple[float, float]:
    """[t0, t1): the arrival times (and token times) ``slo`` judges, from the replay's ``arrival_s``.

    t0 is ``warmup_s`` or the first arrival plus ``warmup_frac`` of the span, whichever is later
    (-inf: no warm-up); t1 is the last arrival less ``cooldown_frac`` of the span (inf: none)."""
    a = np.asarray(arrival_s, dtype=float)
    if not a.size:
        return -math.inf, math.inf
    first, last = float(a.min()), float(a.max())
    span = last - first
    t0 = max(slo.warmup_s, first + slo.warmup_frac * span) if (slo.warmup_s or slo.warmup_frac) else -math.inf
    t1 = last - slo.cooldown_frac * span if slo.cooldown_frac else math.inf
    return t0, t1


GROWTH_MIN_REQUESTS = 20  # per third of the window: fewer, and the medians are noise


def ttft_growth(arrival_s, ttft_s) -> float | None:
    """How fast the queue grows: the median TTFT of the last third of the requests (by arrival)
    less that of the first third, over the time between the two thirds' median arrivals (seconds
    of TTFT per second of arrivals; about 0 at a steady state, the overload's excess when a backlog
    builds). None with fewer than 3 x ``GROWTH_MIN_REQUESTS`` requests."""
    a, t = np.asarray(arrival_s, dtype=float), np.asarray(ttft_s, dtype=float)
    if a.shape != t.shape:
        raise ValueError(f"arrival_s and ttft_s: expected one TTFT per arrival, got {a.shape} and {t.shape}")
    m = a.size // 3
    if m < GROWTH_MIN_REQUESTS:
        return None
    o = np.argsort(a, kind="stable")
    first, last = o[:m], o[-m:]
    dt = float(np.median(a[last]) - np.median(a[first]))
    if dt <= 0:
        return None
    return float(np.median(t[last]) - np.median(t[first])) / dt


@dataclass
class Pooled:
    """Several replays' requests as one sample (seeds of a closed-loop replay): what :func:`meets`
    and :func:`priced` read, concatenated (their gap logs kept side by side)."""

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
    tbt_logs: list = field(default_factory=list)

    @classmethod
    def of(cls, results) -> "Pooled":
        if not isinstance(results, (list, tuple)):
            results = [results]
        cat = lambda name: np.concatenate([getattr(r, name) for r in results])  # noqa: E731
        r0 = results[0]
        logs = [r.tbt for r in results if getattr(r, "tbt", None) is not None]
        return cls(cat("arrival_s"), cat("ttft_s"), cat("tpot_s"), cat("e2e_s"), cat("output_tokens"),
                   sum(r.finished for r in results), sum(r.requests for r in results),
                   any(r.aborted for r in results), float(sum(r.busy_s.sum() for r in results)),
                   r0.n_instances, r0.n_deployed, r0.devices, len(results), logs)

    def tbt_histogram(self, t0_s: float = -math.inf, t1_s: float = math.inf) -> GapHistogram:
        """Every replay's gaps between tokens that came out in [t0_s, t1_s), in one histogram."""
        out = GapHistogram()
        for log in self.tbt_logs:
            out = out + log.histogram(t0_s, t1_s)
        return out


def window(result, slo: SLO) -> dict:
    """The SLO's percentiles over its steady-state window (:func:`steady_window`; None: nothing there).

    ``ttft_s``, ``tpot_s`` (request means) and ``tbt_s`` (every gap between tokens) at the SLO's
    percentiles, their medians, the window ``t0_s``/``t1_s``, and the requests and gaps in it."""
    r = Pooled.of(result)
    t0, t1 = steady_window(r.arrival_s, slo)
    w = (r.arrival_s >= t0) & (r.arrival_s < t1)
    multi = w & (r.output_tokens > 1)
    pct = lambda x, q: float(np.percentile(x, q)) if x.size else None  # noqa: E731
    tbt = r.tbt_histogram(t0, t1)
    growth = None
    if r.replays == 1:  # pooled seeds of a closed loop have no one timeline to grow along
        growth = ttft_growth(r.arrival_s[w], r.ttft_s[w])
    return {"ttft_s": pct(r.ttft_s[w], slo.ttft_q), "tpot_s": pct(r.tpot_s[multi], slo.tpot_q),
            "tbt_s": tbt.percentile(slo.tbt_q), "ttft_p50_s": pct(r.ttft_s[w], 50),
            "tpot_p50_s": pct(r.tpot_s[multi], 50), "tbt_p50_s": tbt.percentile(50),
            "ttft_growth": growth, "requests": int(w.sum()), "tbt_gaps": tbt.count, "t0_s": t0, "t1_s": t1}


def meets(result, slo: SLO) -> bool:
    """Every request finished and the SLO's percentiles over its window are within their limits (a
    list of results is pooled: its requests, and its gaps, judged as one sample)."""
    r = Pooled.of(result)
    if r.aborted or r.finished < r.requests:
        return False
    got = window(result, slo)
    for key, limit in (("ttft_s", slo.ttft_s), ("tpot_s", slo.tpot_s), ("tbt_s", slo.tbt_s),
                       ("ttft_growth", slo.max_ttft_growth)):
        if limit is not None and got[key] is not None and got[key] > limit:
            return False
    return True


def slo_ratio(result, slo: SLO) -> float | None:
    """How close ``result`` is to ``slo``: the largest of (percentile / its limit) over the bounds,
    the TTFT growth's included (<= 1 within every bound); None if nothing was measured in the window."""
    got = window(result, slo)
    ratios = [got[key] / limit for key, limit in (("ttft_s", slo.ttft_s), ("tpot_s", slo.tpot_s),
                                                  ("tbt_s", slo.tbt_s))
              if limit is not None and got[key] is not None]
    if slo.max_ttft_growth and got["ttft_growth"] is not None:
        ratios.append(max(got["ttft_growth"], 0.0) / slo.max_ttft_growth)
    return max(ratios) if ratios else None


def replay_convergence(run, lengths, slo: SLO, *, rel_tol: float = 0.05) -> list[dict]:
    """Does the answer stop moving as the replay gets longer? One row per length n (increasing).

    ``run(n)`` replays the trace's first ``n`` requests and returns a number (e.g. the goodput a
    search found on them) or a fleet result at a fixed load, read as :func:`slo_ratio` (its
    margin to ``slo``; <= 1 passes). Each row: ``n``, ``value``, ``change`` (relative to the
    previous length), and ``settled``: this and every longer replay are within ``rel_tol`` of
    the longest one's value (a chapter shows where that starts)."""
    lengths = [check_int("lengths", n, 1) for n in lengths]
    if not lengths or any(b <= a for a, b in zip(lengths, lengths[1:])):
        raise ValueError(f"lengths={lengths!r}: expected request counts, increasing")
    rel_tol = check_float("rel_tol", rel_tol, minimum=0.0)
    rows = []
    for n in lengths:
        out = run(n)
        value = float(out) if isinstance(out, (int, float, np.integer, np.floating)) else slo_ratio(out, slo)
        prev = rows[-1]["value"] if rows else None
        change = None if prev in (None, 0) or value is None else (value - prev) / abs(prev)
        row = {"n": n, "value": value, "change": change}
        if not isinstance(out, (int, float, np.integer, np.floating)):
            row["meets"] = meets(out, slo)
        rows.append(row)
    last = rows[-1]["value"]
    settled = True
    for row in reversed(rows):
        v = row["value"]
        close = v is not None and last is not None and abs(v - last) <= rel_tol * abs(last)
        settled = settled and close
        row["settled"] = settled
    return rows


def _certain(violations: int, n: int, q: float) -> bool:
    """The q-th percentile (numpy's linear rule) of n values exceeds the limit once this many do:
    then the value at index floor(q/100 (n-1)) of the sorted n is over it."""
    return n > 0 and violations >= n - math.floor(q / 100.0 * (n - 1))


class SloGuard:
    """Stops an open-loop replay once it cannot meet ``slo``, whatever the requests still to come do.

    TTFT (and a mean-TPOT bound): enough of the window's requests have finished over the limit
    that the percentile over all of them is over it (a refused request never finishes: it stops
    the run at once). TBT: enough gaps over the limit came out in the window, in time buckets
    the engines have closed, that the percentile is over it even if the window held the most
    gaps it can (every request's ``output_length - 1``); certain, though late. A windowed SLO
    needs the replay's ``rate_scale`` to place its window in simulated time (requests arrive
    at ``arrival_ms / 1000 / rate_scale``)."""

    def __init__(self, slo: SLO, requests, *, rate_scale: float | None = None):
        if slo.windowed and rate_scale is None:
            raise ValueError(f"slo={slo.name!r}: a windowed SLO needs the replay's rate_scale")
        scale = 1.0 if rate_scale is None else check_float("rate_scale", rate_scale, minimum=0.0)
        if scale <= 0:
            raise ValueError(f"rate_scale={rate_scale!r}: expected > 0")
        self.slo = slo
        arrival = np.array([r.arrival_ms / 1000.0 / scale for r in requests], dtype=float)
        self.t0, self.t1 = steady_window(arrival, slo)
        inside = (arrival >= self.t0) & (arrival < self.t1)
        out = np.array([r.output_length for r in requests], dtype=np.int64)
        self.n = int(inside.sum())
        self.n_multi = int((inside & (out > 1)).sum())
        self.max_gaps = int(np.maximum(out - 1, 0).sum())  # every gap of every request, a bound on the window's
        self._seen: dict = {}
        self._chunks: dict = {}
        self._mids = bin_values()
        self.ttft_misses = self.tpot_misses = self.tbt_misses = 0

    def _inside(self, t: float) -> bool:
        return self.t0 <= t < self.t1

    def check(self, fleet) -> bool:
        slo = self.slo
        for e in fleet.instances:
            fin = e.finished
            k = self._seen.get(e.index, 0)
            for f in fin[k:]:
                if not self._inside(f.arrival_s):
                    continue
                if f.ttft > slo.ttft_s:
                    self.ttft_misses += 1
                if slo.tpot_s is not None and f.output_length > 1 and f.tpot > slo.tpot_s:
                    self.tpot_misses += 1
            self._seen[e.index] = len(fin)
            if e.refused:  # it will never finish, so the run cannot meet any SLO
                return True
            if slo.tbt_s is not None:  # closed time buckets only: the one being filled may still grow
                chunks = e.gaps.chunks
                for bucket, bins, counts in chunks[self._chunks.get(e.index, 0):]:
                    mid = (bucket + 0.5) * e.gaps.bucket_s
                    over = (mid >= self.t0) & (mid < self.t1) & (self._mids[bins] > slo.tbt_s)
                    self.tbt_misses += int(counts[over].sum())
                self._chunks[e.index] = len(chunks)
        if _certain(self.ttft_misses, self.n, slo.ttft_q):
            return True
        if slo.tpot_s is not None and _certain(self.tpot_misses, self.n_multi, slo.tpot_q):
            return True
        return slo.tbt_s is not None and _certain(self.tbt_misses, self.max_gaps, slo.tbt_q)


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
