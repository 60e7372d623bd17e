"""The fleet simulator's throughput: 100,000 requests over 16 engine instances (accounting mode).

The Mooncake conversation trace is replayed back to back (each copy's hash ids in
their own range) until 100,000 requests, at twice its rate, on 16 instances of
Kimi-Linear-48B. Goal: under 30 s wall. Prints requests per second of wall time
for the cheapest router and for state-aware routing (it queries every
instance's radix tree for every request), and the ratio between them.
"""

from __future__ import annotations

import dataclasses
import time
from pathlib import Path

from kimilab.config import kimi_linear_48b
from kimilab.costs import DEFAULT_DEPLOYMENT
from kimilab.fleet import run_fleet
from kimilab.fleet.tenants import label_tenant
from kimilab.traffic import MOONCAKE_CONVERSATION, load_trace

N_REQUESTS = 100_000
INSTANCES = 16
GOAL_S = 30.0
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


def main() -> None:
    reqs = requests()
    walls = {}
    for router in ("least-loaded", "state-aware"):
        start = time.perf_counter()
        res = run_fleet(reqs, kimi_linear_48b, deployment=DEFAULT_DEPLOYMENT, instances=INSTANCES, router=router,
                        capacity_tokens=4_000_000,
                        rate_scale=2.0)
        wall = walls[router] = time.perf_counter() - start
        s = res.summary()
        print(f"fleet_{router}: {len(reqs):,} requests on {INSTANCES} instances in {wall:.1f} s wall = "
              f"{len(reqs) / wall:,.0f} requests/s ({'meets' if wall < GOAL_S else 'misses'} the {GOAL_S:.0f} s goal); "
              f"simulated TTFT p99 {s['ttft_p99_s']:.3f} s, usable hit {s['usable_hit_rate']:.3f}")
    print(f"fleet_affinity_cost: state-aware / least-loaded wall = "
          f"{walls['state-aware'] / walls['least-loaded']:.2f}x")


if __name__ == "__main__":
    main()
