"""Where a request goes: four routers behind one interface, ``choose(req, instances) -> instance``.

* ``round-robin``: the next live instance in turn.
* ``least-loaded``: the live instance with the fewest requests running or waiting (ties rotate).
* ``prefix-affinity``: SGLang's cache-aware rule. If the fleet is imbalanced
  (max load - min load > ``balance_abs`` AND max > ``balance_rel`` x min) go to
  the least loaded; otherwise to the instance with the longest cached prefix if
  it covers more than ``cache_threshold`` of the prompt, else to the instance
  holding the fewest cached pages (queued prompts included). It scores KV blocks, as SGLang's and
  Dynamo's routers do. Defaults are SGLang's router arguments.
* ``state-aware``: the same rule scoring only the *usable* hit (KV plus a state
  checkpoint at the same position) — what a hybrid model can actually skip.

Routers read the instances' real caches (Dynamo's KV router learns them from KV
events; SGLang's keeps an approximate tree of what it routed), ties go to the
lower load, then the lower index: deterministic.
"""

from __future__ import annotations

__all__ = ["ROUTERS", "Router", "RoundRobin", "LeastLoaded", "PrefixAffinity", "StateAware", "make_router"]


class Router:
    name = ""

    def choose(self, req, instances: list):
        raise NotImplementedError


class RoundRobin(Router):
    name = "round-robin"

    def __init__(self):
        self.turn = 0

    def choose(self, req, instances):
        inst = instances[self.turn % len(instances)]
        self.turn += 1
        return inst


class LeastLoaded(Router):
    """Fewest requests running or waiting; ties rotate (a fixed tie-break would pile an idle
    fleet's traffic onto instance 0)."""

    name = "least-loaded"

    def __init__(self):
        self.turn = 0

    def choose(self, req, instances):
        n = len(instances)
        self.turn = turn = self.turn + 1
        loads = [e.load for e in instances]
        low = min(loads)
        tied = [e for e, load in zip(instances, loads) if load == low]
        return tied[0] if len(tied) == 1 else min(tied, key=lambda e: (e.index - turn) % n)


class PrefixAffinity(Router):
    name = "prefix-affinity"
    usable = False  # score KV hits

    def __init__(self, cache_threshold: float = 0.3, balance_abs: int = 64, balance_rel: float = 1.5):
        self.cache_threshold, self.balance_abs, self.balance_rel = cache_threshold, balance_abs, balance_rel

    def choose(self, req, instances):
        loads = [e.load for e in instances]
        lo, hi = min(loads), max(loads)
        if hi - lo > self.balance_abs and hi > self.balance_rel * lo:
            return min(instances, key=lambda e: (e.load, e.index))
        best, best_key = None, None
        for e, load in zip(instances, loads):
            kv, usable = e.match(req)
            key = (-(usable if self.usable else kv), load, e.index)
            if best_key is None or key < best_key:
                best, best_key = e, key
        if -best_key[0] > self.cache_threshold * req.input_length:
            return best
        return min(instances, key=lambda e: (e.cache_pages, e.load, e.index))


class StateAware(PrefixAffinity):
    name = "state-aware"
    usable = True  # score KV + a state checkpoint at the same position


ROUTERS = {r.name: r for r in (RoundRobin, LeastLoaded, PrefixAffinity, StateAware)}


def make_router(name: str, **kwargs) -> Router:
    """A fresh router by name."""
    if name not in ROUTERS:
        raise ValueError(f"router={name!r}: expected one of {sorted(ROUTERS)}")
    return ROUTERS[name](**kwargs)
