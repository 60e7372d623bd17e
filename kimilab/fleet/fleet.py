"""N engine instances on one discrete-event clock: route arrivals, inject failures, collect results.

At each event (an arrival or a failure, in time order) every live instance is
advanced to that time, so routers see loads and caches as they are then. A
failed instance loses its pool, cache and requests; its running and waiting
requests are routed again at once and recompute (what they had streamed is
kept). With ``isolation="quota"`` every instance gives each tenant a reserved
share of its pool for cached prefixes and admits by virtual token counters.
"""

from __future__ import annotations

import time
from typing import Sequence

from kimilab.config import ModelConfig
from kimilab.costs import Deployment, StepTimer
from kimilab.engine import Engine, Live
from kimilab.fleet.result import FleetResult
from kimilab.fleet.routers import make_router
from kimilab.gcpause import gc_paused
from kimilab.validate import check_float, check_int

__all__ = ["Fleet", "ISOLATION", "run_fleet"]

ISOLATION = ("none", "quota")


class Fleet:
    """``n`` identical instances behind one router."""

    def __init__(self, config: ModelConfig, n: int, router: str, *, deployment: Deployment,
                 capacity_tokens: int | None, isolation: str = "none", tenants: Sequence[str] = (),
                 reserve: float = 0.5, **engine_kw):
        n = check_int("instances", n, 1)
        if isolation not in ISOLATION:
            raise ValueError(f"isolation={isolation!r}: expected one of {ISOLATION}")
        self.router = make_router(router)
        self.isolation = isolation
        quotas = None
        if isolation == "quota":
            tenants = list(dict.fromkeys(tenants)) or ["default"]
            quotas = {t: reserve / len(tenants) for t in tenants}
        # one timer (its memo of step times) shared by the instances, on their deployment
        timer = StepTimer(config, deployment)
        self.deployment = deployment
        self.instances = [Engine(config, deployment=deployment, capacity_tokens=capacity_tokens, quotas=quotas,
                                 fair=isolation == "quota", timer=timer, index=i, **engine_kw) for i in range(n)]
        self.failures: list[tuple[int, float]] = []

    def alive(self) -> list[Engine]:
        return [e for e in self.instances if e.alive]

    def _advance(self, t: float) -> None:
        for e in self.instances:
            if e.alive and e.clock < t:
                e.advance(t)

    def _route(self, live: Live, t: float) -> None:
        alive = self.alive()
        if not alive:
            raise RuntimeError(f"no live instance at t={t:.3f} s")
        self.router.choose(live.req, alive).submit(live)

    def fail(self, index: int, t: float) -> None:
        """Instance ``index`` dies at ``t``; its requests are routed again."""
        self._advance(t)
        inst = self.instances[index]
        if not inst.alive:
            return
        inst.clock = max(inst.clock, t)
        self.failures.append((index, t))
        for live in inst.fail():
            self._route(live, t)

    def run(self, requests: Sequence, *, rate_scale: float = 1.0, fails: Sequence[tuple[int, float]] = ()) -> FleetResult:
        """Serve ``requests`` at their arrival times divided by ``rate_scale``; ``fails`` = [(instance, seconds)]."""
        rate_scale = check_float("rate_scale", rate_scale, minimum=0.0)
        if rate_scale <= 0:
            raise ValueError(f"rate_scale={rate_scale}: expected > 0")
        for i, t in fails:
            if not 0 <= i < len(self.instances):
                raise ValueError(f"fail instance {i}: expected 0..{len(self.instances) - 1}")
        start = time.perf_counter()
        order = sorted(range(len(requests)), key=lambda i: (requests[i].arrival_ms, i))
        pending_fails = sorted(fails, key=lambda f: (f[1], f[0]))
        with gc_paused():  # the run frees everything by reference counting (see kimilab.gcpause)
            for i in order:
                req = requests[i]
                t = req.arrival_ms / 1000.0 / rate_scale
                while pending_fails and pending_fails[0][1] <= t:
                    self.fail(*pending_fails.pop(0))
                self._advance(t)
                self._route(Live(req, t), t)
            for index, t in pending_fails:
                self.fail(index, t)
            for e in self.alive():
                e.drain()
            return FleetResult.of(self, len(requests), time.perf_counter() - start)


def run_fleet(requests: Sequence, config: ModelConfig, *, deployment: Deployment, instances: int, router: str,
              capacity_tokens: int | None, isolation: str = "none", rate_scale: float = 1.0,
              fails: Sequence[tuple[int, float]] = (), **engine_kw) -> FleetResult:
    """One fleet run (the CLI's ``fleet`` command, and the chapter's experiments)."""
    tenants = [r.tenant for r in requests]
    fleet = Fleet(config, instances, router, deployment=deployment, capacity_tokens=capacity_tokens,
                  isolation=isolation, tenants=tenants, **engine_kw)
    return fleet.run(requests, rate_scale=rate_scale, fails=fails)
