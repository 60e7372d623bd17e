"""What a fleet run measured: per-request latencies and hits, per-instance busy time, and summaries.

Two per-token views of decode speed: ``tpot_s`` is each request's mean time per output token
(one number a request), and :meth:`FleetResult.tbt_percentile` reads every gap between
consecutive output tokens (Mooncake's TBT), from the instances' gap logs merged.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import math

import numpy as np

from kimilab.engine.gaps import GapHistogram, GapLog

__all__ = ["FleetResult"]


def _pct(x: np.ndarray, q: float) -> float | None:
    """A percentile rounded to the microsecond; None (JSON null) when no request finished."""
    return round(float(np.percentile(x, q)), 6) if x.size else None


def _round(x: float | None) -> float | None:
    return None if x is None else round(x, 6)


@dataclass
class FleetResult:
    """Columns over finished requests (simulated seconds), in finishing order per instance."""

    router: str
    isolation: str
    deployment: str
    requests: int
    n_instances: int
    tenant: np.ndarray
    instance: np.ndarray
    arrival_s: np.ndarray
    ttft_s: np.ndarray
    tpot_s: np.ndarray
    e2e_s: np.ndarray
    input_tokens: np.ndarray
    output_tokens: np.ndarray
    usable_hit: np.ndarray  # tokens, at each request's first admission
    kv_hit: np.ndarray
    served: np.ndarray  # cached tokens, all admissions
    computed: np.ndarray  # prefilled tokens, all admissions
    preemptions: int
    restarts: int
    refused: int
    bucket_s: float
    busy_s: np.ndarray  # [instance, k] busy seconds in time bucket busy_buckets[k] (only buckets with work)
    failures: list = field(default_factory=list)
    wall_seconds: float = 0.0
    request_ids: np.ndarray = field(default=None, repr=False)
    devices: int = 0  # accelerators in the fleet (instances x devices each)
    n_deployed: int = 0  # instances as deployed (n_instances counts engines: one per device under DP-attention)
    aborted: bool = False  # stopped early: a guard found the outcome certain (kimilab.fleet.goodput)
    tbt: GapLog = field(default=None, repr=False)  # every gap between output tokens, by time bucket
    busy_buckets: np.ndarray = field(default=None, repr=False)  # the time buckets busy_s's columns are
    store: dict | None = None  # the shared store's counters (kimilab.prefix.host.HostTier.summary), if any
    transfer: dict | None = None  # prefill-to-decode hand-overs (kimilab.fleet.disagg), if disaggregated

    @classmethod
    def of(cls, fleet, n_requests: int, wall: float) -> "FleetResult":
        done = sorted((f for e in fleet.instances for f in e.finished), key=lambda f: (f.arrival_s, f.request_id))
        col = lambda fn, dt=float: np.array([fn(f) for f in done], dtype=dt)  # noqa: E731
        # sparse in time: only the buckets some engine worked in (a trace's timestamps may start at
        # the Unix epoch's 1e12 ms, or span years; memory must follow the work, not the clock)
        buckets = np.array(sorted({b for e in fleet.instances for b in e.busy}), dtype=np.int64)
        col_of = {int(b): k for k, b in enumerate(buckets)}
        busy = np.zeros((len(fleet.instances), buckets.size))
        for e in fleet.instances:
            for b, s in e.busy.items():
                busy[e.index, col_of[b]] = s
        return cls(fleet.router.name, fleet.isolation, fleet.deployment.name, n_requests, len(fleet.instances),
                   np.array([f.tenant for f in done], dtype=object), col(lambda f: f.instance, int),
                   col(lambda f: f.arrival_s), col(lambda f: f.ttft), col(lambda f: f.tpot), col(lambda f: f.e2e),
                   col(lambda f: f.input_length, int), col(lambda f: f.output_length, int),
                   col(lambda f: f.usable_hit, int), col(lambda f: f.kv_hit, int), col(lambda f: f.served, int),
                   col(lambda f: f.computed, int), sum(f.preemptions for f in done),
                   sum(f.restarts for f in done), sum(len(e.refused) for e in fleet.instances),
                   fleet.instances[0].bucket_s, busy, list(fleet.failures), wall,
                   col(lambda f: f.request_id, int), len(fleet.instances) * fleet.devices_per_engine,
                   fleet.n_deployed, tbt=GapLog.merged(e.gaps for e in fleet.instances), busy_buckets=buckets,
                   store=None if fleet.store is None else fleet.store.summary(),
                   transfer=fleet.transfer_summary() if hasattr(fleet, "transfer_summary") else None)

    @property
    def finished(self) -> int:
        return int(self.ttft_s.size)

    def tbt_histogram(self, t0_s: float = -math.inf, t1_s: float = math.inf) -> GapHistogram:
        """Gaps between output tokens that came out in [t0_s, t1_s) (to the instances' time bucket)."""
        return GapHistogram() if self.tbt is None else self.tbt.histogram(t0_s, t1_s)

    def tbt_percentile(self, q: float, t0_s: float = -math.inf, t1_s: float = math.inf) -> float | None:
        """The ``q``-th percentile (0-100) of the time between tokens, every gap counted once (within
        0.5% of numpy's on the raw gaps); None when no request made a second token."""
        return self.tbt_histogram(t0_s, t1_s).percentile(q)

    def usable_hit_rate(self, mask=None) -> float:
        m = slice(None) if mask is None else mask
        total = self.input_tokens[m].sum()
        return float(self.usable_hit[m].sum() / total) if total else 0.0

    def _latency(self, m) -> dict:
        multi = self.output_tokens[m] > 1
        return {"requests": int(np.count_nonzero(m) if not isinstance(m, slice) else self.finished),
                "ttft_p50_s": _pct(self.ttft_s[m], 50), "ttft_p99_s": _pct(self.ttft_s[m], 99),
                "tpot_p50_s": _pct(self.tpot_s[m][multi], 50), "tpot_p99_s": _pct(self.tpot_s[m][multi], 99),
                "e2e_p99_s": _pct(self.e2e_s[m], 99),
                "usable_hit_rate": round(self.usable_hit_rate(m), 6) if self.input_tokens[m].size else None}

    def utilisation(self) -> tuple[np.ndarray, np.ndarray]:
        """Busy fraction per instance in each time bucket that saw work: (bucket start times in
        seconds, [instance, bucket] fractions); buckets left out were idle on every instance."""
        return self.busy_buckets * self.bucket_s, self.busy_s / self.bucket_s

    def window(self, width_s: float) -> dict:
        """TTFT p99 and usable hit rate of the requests arriving in each ``width_s`` window, and the TBT
        p99 of the tokens that came out in it (to the instances' time bucket; NaN: no gap there)."""
        if not self.finished:
            return {"t_s": np.zeros(0), "ttft_p99_s": np.zeros(0), "usable_hit_rate": np.zeros(0),
                    "tbt_p99_s": np.zeros(0)}
        idx = (self.arrival_s // width_s).astype(int)
        ts, p99, hit, tbt = [], [], [], []
        for b in range(idx.max() + 1):
            m = idx == b
            if m.any():
                ts.append((b + 0.5) * width_s)
                p99.append(float(np.percentile(self.ttft_s[m], 99)))
                hit.append(self.usable_hit_rate(m))
                got = self.tbt_percentile(99, b * width_s, (b + 1) * width_s)
                tbt.append(math.nan if got is None else got)
        return {"t_s": np.array(ts), "ttft_p99_s": np.array(p99), "usable_hit_rate": np.array(hit),
                "tbt_p99_s": np.array(tbt)}

    def summary(self) -> dict:
        """The fleet CLI's JSON object (fixed key order)."""
        out = {"router": self.router, "isolation": self.isolation, "deployment": self.deployment,
               "requests": self.requests,
               "finished": self.finished, "refused": self.refused}
        lat = self._latency(slice(None))
        del lat["requests"]
        out.update(lat)
        tbt = self.tbt_histogram()
        out.update({"tbt_p50_s": _round(tbt.percentile(50)), "tbt_p99_s": _round(tbt.percentile(99))})
        out.update({"prompt_tokens": int(self.input_tokens.sum()), "usable_hit_tokens": int(self.usable_hit.sum()),
                    "kv_hit_rate": round(float(self.kv_hit.sum() / max(self.input_tokens.sum(), 1)), 6),
                    "preemptions": self.preemptions, "restarts": self.restarts,
                    "failures": [{"instance": i, "at_s": t} for i, t in self.failures]})
        out["tenants"] = {t: self._latency(self.tenant == t) for t in dict.fromkeys(self.tenant.tolist())}
        _, util = self.utilisation()
        # buckets from the first arrival's to the last one worked in (idle ones included)
        first = int(self.arrival_s.min() // self.bucket_s) if self.finished else 0
        span = max(int(self.busy_buckets[-1]) + 1 - first, 1) if self.busy_buckets.size else 1
        out["instances"] = [{"instance": i, "requests": int(np.count_nonzero(self.instance == i)),
                             "usable_hit_rate": round(self.usable_hit_rate(self.instance == i), 6),
                             "busy_fraction": round(float(util[i].sum() / span), 6)} for i in range(self.n_instances)]
        if self.store is not None:
            out["store"] = self.store
        if self.transfer is not None:
            out["transfer"] = self.transfer
        out["run_wall_s"] = round(self.wall_seconds, 3)
        return out
