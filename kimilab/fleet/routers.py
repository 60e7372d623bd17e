"""Where a request goes: routers behind one interface, ``choose(req, instances) -> instance``.

Load only:

* ``round-robin``: the next live instance in turn.
* ``least-loaded``: the fewest requests running or waiting (ties rotate).
* ``least-work``: the fewest prompt tokens still to prefill (queued and running), ties
  by requests: a 100k-token prompt weighs a hundred 1k ones.

Cache-aware:

* ``prefix-affinity``: SGLang's cache-aware rule. If the fleet is imbalanced (max load -
  min load > ``balance_abs`` AND max > ``balance_rel`` x min) go to the least loaded;
  otherwise to the instance with the longest cached prefix if it covers more than
  ``cache_threshold`` of the prompt, else to the instance holding the fewest cached pages
  (queued prompts included). It scores KV blocks. Defaults are SGLang's router arguments.
* ``cost``: in the spirit of Dynamo's KV router (a cost per worker: prefill still to do
  there, this request's after its cached overlap included, plus decode load; lowest
  wins). Here the cost is a predicted TTFT in seconds: the instance's prefill backlog
  (tokens x seconds per token of a full prefill chunk) plus this request's prefill after
  its *usable* hit there -- the hit a hybrid model can resume from, not the KV overlap.
* ``state-aware``: SGLang's rule scored in prefill *seconds* saved by the usable hit, counting
  the checkpoint the request will leave behind: where KV of its prefix is cached but no
  state (KV hit > usable hit), its prefill passes that KV anyway, and if the cache's policy
  keeps a checkpoint there, the next request sharing the prefix resumes from it; that
  future saving (``reuse`` x its prefill seconds) is added. Below the threshold (in seconds
  of this prompt's cold prefill) it goes to the least prefill backlog.

Routers read the instances' real caches (Dynamo's KV router learns them from KV events),
unless ``approximate=True``: then each instance is represented by the router's own record
of what it routed there (SGLang's router keeps such a tree), which never sees an eviction
and guesses a state at the end of every routed prompt. Ties go to the lower load, then
the lower index: deterministic.
"""

from __future__ import annotations

__all__ = ["ROUTERS", "Router", "RoundRobin", "LeastLoaded", "LeastWork", "PrefixAffinity", "CostRouter",
           "StateAware", "ApproximateTree", "make_router"]


class ApproximateTree:
    """What a router routed to one instance: block ids seen there, and where routed prompts ended.

    Hash ids are chained (an id names its whole prefix), so a set of ids is the tree. Nothing
    is ever removed: like SGLang's router tree between its periodic trims, it does not see the
    instance evict. A routed prompt is assumed to leave a state at its last whole block (what
    the ``ends`` policy keeps).
    """

    def __init__(self, block: int):
        self.block = block
        self.ids: set = set()
        self.ends: set = set()

    def view(self, req) -> tuple[int, int, int]:
        """(KV hit, usable hit, 0) as this record predicts them."""
        keys = req.hash_ids
        if keys is None:
            raise ValueError(f"request {req.request_id}: an approximate router tree needs hash ids")
        full = req.input_length // self.block
        m = 0
        usable = 0
        while m < full and keys[m] in self.ids:
            m += 1
            if keys[m - 1] in self.ends:
                usable = m * self.block
        limit = req.input_length - 1
        return min(m * self.block, limit), (usable if usable <= limit else 0), 0

    def record(self, req) -> None:
        full = req.input_length // self.block
        self.ids.update(req.hash_ids[:full])
        if full:
            self.ends.add(req.hash_ids[full - 1])

    @property
    def n_pages(self) -> int:
        return len(self.ids)


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

    def _load(self, e):
        return e.load

    def choose(self, req, instances):
        n = len(instances)
        self.turn = turn = self.turn + 1
        loads = [self._load(e) for e in instances]
        low = min(loads)
        tied = [e for e, load in zip(instances, loads) if load == low]
        return tied[0] if len(tied) == 1 else min(tied, key=lambda e: (e.index - turn) % n)


class LeastWork(LeastLoaded):
    """Fewest prompt tokens still to prefill, then fewest requests; ties rotate."""

    name = "least-work"

    def _load(self, e):
        return (e.prefill_backlog, e.load)


class _CacheAware(Router):
    """A router that reads each instance's cache, or its own approximate record of it."""

    def __init__(self, approximate: bool = False):
        self.approximate = bool(approximate)
        self._trees: dict = {}

    def _tree(self, e) -> ApproximateTree:
        tree = self._trees.get(e.index)
        if tree is None:
            tree = self._trees[e.index] = ApproximateTree(e.block)
        return tree

    def _view(self, e, req) -> tuple[int, int, int]:
        return self._tree(e).view(req) if self.approximate else e.route_view(req)

    def _routed(self, e, req):
        if self.approximate:
            self._tree(e).record(req)
        return e

    def _pages(self, e) -> int:
        return self._tree(e).n_pages if self.approximate else e.cache_pages


def _prefill_memo(timer, n: int):
    """This request's prefill seconds after a usable hit (memoised: most instances share a hit of 0)."""
    memo: dict = {}

    def prefill(hit: int) -> float:
        t = memo.get(hit)
        if t is None:
            t = memo[hit] = timer.prefill(n - hit, hit)
        return t
    return prefill


class PrefixAffinity(_CacheAware):
    """SGLang's rule on KV hits (``usable=False``) in tokens."""

    name = "prefix-affinity"

    def __init__(self, cache_threshold: float = 0.3, balance_abs: int = 64, balance_rel: float = 1.5,
                 approximate: bool = False):
        super().__init__(approximate)
        self.cache_threshold, self.balance_abs, self.balance_rel = cache_threshold, balance_abs, balance_rel

    def _imbalanced(self, loads) -> bool:
        lo, hi = min(loads), max(loads)
        return hi - lo > self.balance_abs and hi > self.balance_rel * lo

    def choose(self, req, instances):
        loads = [e.load for e in instances]
        if self._imbalanced(loads):
            return self._routed(min(instances, key=lambda e: (e.load, e.index)), req)
        best, best_key = None, None
        for e, load in zip(instances, loads):
            kv, _, _ = self._view(e, req)
            key = (-kv, load, e.index)
            if best_key is None or key < best_key:
                best, best_key = e, key
        if -best_key[0] > self.cache_threshold * req.input_length:
            return self._routed(best, req)
        return self._routed(min(instances, key=lambda e: (self._pages(e), e.load, e.index)), req)


class StateAware(PrefixAffinity):
    """SGLang's rule re-scored in prefill seconds saved by the *usable* hit, plus ``reuse`` x the
    seconds the checkpoint it leaves behind on KV already there will save the next request; below
    ``cache_threshold`` of its cold prefill seconds, the least prefill backlog (not the smallest tree)."""

    name = "state-aware"

    def __init__(self, cache_threshold: float = 0.3, balance_abs: int = 64, balance_rel: float = 1.5,
                 approximate: bool = False, reuse: float = 1.0):
        super().__init__(cache_threshold, balance_abs, balance_rel, approximate)
        self.reuse = float(reuse)

    def choose(self, req, instances):
        loads = [e.load for e in instances]
        if self._imbalanced(loads):
            return self._routed(min(instances, key=lambda e: (e.load, e.index)), req)
        prefill = _prefill_memo(instances[0].timer, req.input_length)
        cold = prefill(0)
        best, best_key = None, None
        for e, load in zip(instances, loads):
            _, usable, left = self._view(e, req)
            saved = cold - prefill(usable)
            if left and self.reuse:  # the next request sharing this prefix resumes at `left`
                saved += self.reuse * (prefill(usable) - prefill(left))
            key = (-saved, load, e.index)
            if best_key is None or key < best_key:
                best, best_key = e, key
        if -best_key[0] > self.cache_threshold * cold:
            return self._routed(best, req)
        return self._routed(min(instances, key=lambda e: (e.prefill_backlog, e.load, e.index)), req)


class CostRouter(_CacheAware):
    """Lowest predicted TTFT: backlog seconds + this request's prefill after its usable hit."""

    name = "cost"

    def __init__(self, approximate: bool = False):
        super().__init__(approximate)
        self._per_token = None

    def choose(self, req, instances):
        timer = instances[0].timer
        if self._per_token is None:
            b = instances[0].deployment.max_batched_tokens
            self._per_token = timer.prefill(b) / b  # seconds per prompt token of a full chunk, no context
        prefill = _prefill_memo(timer, req.input_length)
        best, best_key = None, None
        for e in instances:
            _, usable, _ = self._view(e, req)
            key = (self._per_token * e.prefill_backlog + prefill(usable), e.prefill_backlog, e.load, e.index)
            if best_key is None or key < best_key:
                best, best_key = e, key
        return self._routed(best, req)


ROUTERS = {r.name: r for r in (RoundRobin, LeastLoaded, LeastWork, PrefixAffinity, StateAware, CostRouter)}


def make_router(name: str, **kwargs) -> Router:
    """A fresh router by name (``approximate=True`` for a cache-aware router's own tree)."""
    if name not in ROUTERS:
        raise ValueError(f"router={name!r}: expected one of {sorted(ROUTERS)}")
    try:
        return ROUTERS[name](**kwargs)
    except TypeError:
        raise ValueError(f"router={name!r}: unexpected options {sorted(kwargs)}") from None
