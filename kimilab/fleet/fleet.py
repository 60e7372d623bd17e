"""N engine instances on one discrete-event clock: route arrivals, inject failures, collect results.

At each event (an arrival or a failure, in time order) every live instance is
advanced to that time, so routers see loads and caches as they are then. A
failed instance loses its pool, cache and requests; its running and waiting
requests are routed again at once and recompute (what they had streamed is
kept). With ``store_bytes`` the instances share one store of cached blocks and states
(:class:`~kimilab.prefix.host.HostTier`, as Mooncake Store pools the cluster's DRAM): each
cache writes through to it, loads a hit from it when that beats recomputing, and it outlives
a failed instance. With ``isolation="quota"`` every instance gives each tenant a reserved
share of its pool for cached prefixes and admits by virtual token counters.
"""

from __future__ import annotations

import time
from typing import Sequence

from kimilab.config import ModelConfig
from kimilab.costs import Deployment, StepTimer
from kimilab.engine import Engine, Live
from kimilab.engine.dp import DpDeviceTimer
from kimilab.fleet.result import FleetResult
from kimilab.fleet.routers import make_router
from kimilab.gcpause import gc_paused
from kimilab.prefix.host import HostTier
from kimilab.prefix.offload import CLUSTER_RDMA, Tier
from kimilab.validate import check_float, check_int

__all__ = ["Fleet", "ISOLATION", "MAX_INSTANCES", "MAX_SIMULATED_S", "open_fleet", "run_fleet", "shared_timer"]

ISOLATION = ("none", "quota")


_TIMERS: dict = {}


def shared_timer(config: ModelConfig, deployment: Deployment) -> StepTimer:
    """One step timer per (model, deployment) in this process: its memo of step times outlives one
    run (a goodput search replays the same trace a dozen times). DP-attention: one device's timer."""
    key = (config, deployment)
    timer = _TIMERS.get(key)
    if timer is None:
        dp = deployment.attention == "dp" and deployment.n_devices > 1
        timer = _TIMERS[key] = DpDeviceTimer(config, deployment) if dp else StepTimer(config, deployment)
    return timer


class Fleet:
    """``n`` identical instances behind one router (under DP-attention, ``n`` x devices engines, one a
    device: ``capacity_tokens`` is still per instance, split evenly over its devices). Each engine's
    step budget and batch cap are the deployment's (``max_batched_tokens``, ``max_num_seqs``) unless
    ``engine_kw`` names ``token_budget`` or ``max_batch``. ``store_bytes`` (per device) on ``store_link``:
    a store the instances share (see the module's docstring)."""

    def __init__(self, config: ModelConfig, n: int, router: str, *, deployment: Deployment,
                 capacity_tokens: int | None, isolation: str = "none", tenants: Sequence[str] = (),
                 reserve: float = 0.5, engine_class: type = Engine, router_options: dict | None = None,
                 store_bytes: float | None = None, store_link: Tier = CLUSTER_RDMA, **engine_kw):
        n = check_int("instances", n, 1)
        if n > MAX_INSTANCES:
            raise ValueError(f"instances={n}: expected at most {MAX_INSTANCES:,} (one simulated engine each)")
        if isolation not in ISOLATION:
            raise ValueError(f"isolation={isolation!r}: expected one of {ISOLATION}")
        self.router = make_router(router, **(router_options or {}))
        self.isolation = isolation
        quotas = None
        if isolation == "quota":
            tenants = list(dict.fromkeys(tenants)) or ["default"]
            quotas = {t: reserve / len(tenants) for t in tenants}
        # one timer (its memo of step times) shared by the engines, on their deployment. Under
        # DP-attention each device is an engine with its own pool (kimilab.engine.dp).
        dp = deployment.attention == "dp" and deployment.n_devices > 1
        timer = shared_timer(config, deployment)
        self.deployment = deployment
        self.n_deployed = n  # instances as deployed (under DP-attention each is n_devices engines)
        self.devices_per_engine = 1 if dp else deployment.n_devices
        n_engines = n * deployment.n_devices // self.devices_per_engine
        if dp and capacity_tokens is not None:
            capacity_tokens = max(1, capacity_tokens // deployment.n_devices)  # each device's share
        if store_bytes is not None and (isolation == "quota" or engine_kw.get("host_bytes") is not None):
            raise ValueError("store_bytes: a shared store sits under each instance's one shared cache; expected "
                             "isolation='none' and no host_bytes with it")
        self.store = None if store_bytes is None else HostTier(store_bytes, store_link)
        if self.store is not None:
            engine_kw["store"] = self.store
        self.instances = [self._new_engine(engine_class, config, deployment=deployment,
                                           capacity_tokens=capacity_tokens, quotas=quotas, fair=isolation == "quota",
                                           timer=timer, index=i, dp_device=dp, **engine_kw)
                          for i in range(n_engines)]
        self.failures: list[tuple[int, float]] = []

    def _new_engine(self, engine_class: type, config: ModelConfig, **kw) -> Engine:
        """Instance ``kw["index"]`` (a subclass may build a different kind per index)."""
        return engine_class(config, **kw)

    def close(self) -> None:
        """Done with the fleet: free every engine's pool and caches now, not at the cyclic collector's
        next full walk (``Engine.close``). Its results stay readable; it serves nothing more."""
        for e in self.instances:
            e.close()

    def __enter__(self) -> "Fleet":
        """``with Fleet(...) as fleet:`` pauses the cyclic collector until the fleet is closed at the end:
        a run makes no cycles but its caches, which ``close`` unlinks (see kimilab.gcpause)."""
        self._paused = gc_paused()
        self._paused.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        try:
            self.close()
        finally:
            self._paused.__exit__(None, None, None)

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

    def run(self, requests: Sequence, *, rate_scale: float = 1.0, fails: Sequence[tuple[int, float]] = (),
            guard=None) -> FleetResult:
        """Serve ``requests`` at their arrival times divided by ``rate_scale``; ``fails`` = [(instance, seconds)].

        ``guard`` (optional, e.g. :class:`kimilab.fleet.goodput.SloGuard`) is asked after every
        arrival whether the outcome is already certain; if so the run stops there and the
        result says ``aborted``."""
        rate_scale = check_float("rate_scale", rate_scale, minimum=0.0)
        if rate_scale <= 0:
            raise ValueError(f"rate_scale={rate_scale}: expected > 0")
        for i, t in fails:
            if not 0 <= i < len(self.instances):
                raise ValueError(f"fail instance {i}: expected 0..{len(self.instances) - 1}")
        failed = [i for i, _ in fails]
        if len(set(failed)) != len(failed):
            raise ValueError(f"fails={list(fails)!r}: an instance fails once; expected each instance at most once")
        last = max((r.arrival_ms for r in requests), default=0) / 1000.0 / rate_scale
        if not last <= MAX_SIMULATED_S:
            raise ValueError(f"rate_scale={rate_scale:g}: the last arrival would be at {last:.3g} s of simulated "
                             f"time; expected at most {MAX_SIMULATED_S:.0e} s (beyond it a float clock cannot "
                             "resolve a step, and the run would not advance)")
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
                if guard is not None and guard.check(self):
                    res = FleetResult.of(self, len(requests), time.perf_counter() - start)
                    res.aborted = True
                    return res
            for index, t in pending_fails:
                self.fail(index, t)
            self._drain()
            return FleetResult.of(self, len(requests), time.perf_counter() - start)

    def _drain(self) -> None:
        """After the last arrival: every live instance runs until nothing is left."""
        for e in self.alive():
            e.drain()


MAX_INSTANCES = 10_000  # simulated engines in one fleet: each is a Python object stepping on its own
MAX_SIMULATED_S = 1e10  # seconds: a float clock there still resolves 2 microseconds, far below a step


def open_fleet(config: ModelConfig, instances: int, router: str, *, prefill: int | None = None, **kw) -> Fleet:
    """A :class:`Fleet` of ``instances``; with ``prefill`` (1 .. instances - 1) a disaggregated one, that many
    of them prefill instances and the rest decode instances (:class:`~kimilab.fleet.disagg.DisaggregatedFleet`)."""
    if prefill is None:
        return Fleet(config, instances, router, **kw)
    from kimilab.fleet.disagg import DisaggregatedFleet

    instances, prefill = check_int("instances", instances, 2), check_int("prefill", prefill, 1)
    if prefill >= instances:
        raise ValueError(f"prefill={prefill}: expected 1 .. instances - 1 = {instances - 1} (the rest decode)")
    return DisaggregatedFleet(config, prefill, instances - prefill, router, **kw)


def run_fleet(requests: Sequence, config: ModelConfig, *, deployment: Deployment, instances: int, router: str,
              capacity_tokens: int | None, isolation: str = "none", rate_scale: float = 1.0,
              fails: Sequence[tuple[int, float]] = (), guard=None, prefill: int | None = None,
              **engine_kw) -> FleetResult:
    """One fleet run (the CLI's ``fleet`` command, and the chapter's experiments); ``prefill``: see
    :func:`open_fleet`."""
    tenants = [r.tenant for r in requests]
    with open_fleet(config, instances, router, prefill=prefill, deployment=deployment,
                    capacity_tokens=capacity_tokens, isolation=isolation, tenants=tenants, **engine_kw) as fleet:
        return fleet.run(requests, rate_scale=rate_scale, fails=fails, guard=guard)
