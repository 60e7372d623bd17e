"""The fleet simulator's speed: 100,000 requests over 16 instances, idle and overloaded.

The Mooncake conversation trace is replayed back to back (each copy's hash ids in their
own range) until 100,000 requests, on 16 instances of Kimi-Linear-48B on the default
deployment, each with its devices' whole cache budget as the pool, routed state-aware
(it asks every instance's tree about every request). Three loads: the trace's own rate
(idle), 64x and 128x (overloaded: the queues grow for the whole run). Goal: under 60 s
wall at every load.

First, one goodput bisection on the whole conversation trace (goal: under 2 minutes).
Side by side, on the first 5,000 requests at each load: the engine against its slow twin
(:class:`kimilab.engine.reference.ReferenceEngine`, which sums the queue on every routing
decision and walks the batch every step), with the check that both give the same result.
Wall seconds on a shared machine are noisy; CPU seconds are printed beside them.
"""

from __future__ import annotations

import dataclasses
import time
from pathlib import Path

import numpy as np

from kimilab import costs
from kimilab.config import kimi_linear_48b
from kimilab.engine.reference import ReferenceEngine
from kimilab.fleet import run_fleet
from kimilab.fleet.tenants import label_tenant
from kimilab.traffic import MOONCAKE_CONVERSATION, load_trace

N_REQUESTS = 100_000
N_SIDE = 5_000
INSTANCES = 16
LOADS = (1.0, 64.0, 128.0)
GOAL_S = 60.0
ROUTER = "state-aware"
DATA = Path(__file__).resolve().parent.parent / "data"


def requests(n: int = N_REQUESTS) -> list:
    base = load_trace(DATA / MOONCAKE_CONVERSATION)
    span = base[-1].arrival_ms + 1
    out = []
    copy = 0
    while len(out) < n:
        for r in label_tenant(base[: n - len(out)], "default", copy):
            out.append(dataclasses.replace(r, request_id=len(out), arrival_ms=r.arrival_ms + copy * span))
        copy += 1
    return out


def _run(reqs, scale, **kw):
    dep = costs.DEFAULT_DEPLOYMENT
    wall, cpu = time.perf_counter(), time.process_time()
    res = run_fleet(reqs, kimi_linear_48b, deployment=dep, instances=INSTANCES, router=ROUTER,
                    capacity_tokens=costs.capacity_tokens(kimi_linear_48b, dep), rate_scale=scale, **kw)
    return res, time.perf_counter() - wall, time.process_time() - cpu


def _same(a, b) -> bool:
    cols = ("request_ids", "ttft_s", "tpot_s", "usable_hit", "computed", "busy_s", "busy_buckets")
    return all(np.array_equal(getattr(a, c), getattr(b, c)) for c in cols) and a.preemptions == b.preemptions


def bisection() -> None:
    """One goodput search on the whole conversation trace (8 instances, ends + prefix affinity, the
    trace's own arrival order): the scan-then-confirm search the experiment runs per order."""
    from kimilab.experiment import conversation_goodput, variant

    wall, cpu = time.perf_counter(), time.process_time()
    row = conversation_goodput(variant("ends + prefix-affinity"), instances=8, rel_tol=0.05, start=8.0, orders=1)
    wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
    print(f"fleet_goodput_search: the whole trace on 8 instances, {len(row['tried'])} replays, {wall:.1f} s wall "
          f"({cpu:.1f} s CPU; {'meets' if wall < 120 else 'misses'} the 120 s goal): {row['max_rate_scale']:.2f}x "
          f"= {row['goodput']:.2f} requests/s per instance")


def main() -> None:
    bisection()
    reqs = requests()
    for scale in LOADS:
        fast, fw, fc = _run(reqs[:N_SIDE], scale)
        slow, sw, sc = _run(reqs[:N_SIDE], scale, engine_class=ReferenceEngine)
        print(f"fleet_side_by_side_{scale:g}x: {N_SIDE:,} requests, reference {sw:.1f} s wall ({sc:.1f} s CPU) vs "
              f"engine {fw:.1f} s ({fc:.1f} s CPU) = {sw / fw:.1f}x faster; same result: {_same(fast, slow)}")
        res, wall, cpu = _run(reqs, scale)
        s = res.summary()
        print(f"fleet_{scale:g}x: {len(reqs):,} requests on {INSTANCES} instances in {wall:.1f} s wall ({cpu:.1f} s "
              f"CPU) = {len(reqs) / wall:,.0f} requests/s ({'meets' if wall < GOAL_S else 'misses'} the "
              f"{GOAL_S:.0f} s goal); simulated TTFT p99 {s['ttft_p99_s']:.3f} s, usable hit "
              f"{s['usable_hit_rate']:.3f}, preemptions {s['preemptions']}", flush=True)


if __name__ == "__main__":
    main()
