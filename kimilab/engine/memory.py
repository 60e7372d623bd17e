"""One instance's memory: ONE page pool holding running requests and the prefix cache, with quotas.

Without isolation every tenant shares one :class:`~kimilab.prefix.HybridPrefixCache`
(KV blocks + state checkpoints, the ``dual`` policy by default). With quotas each
tenant gets its own cache on the same pool (no prefix crosses tenants) and a
reserved share of the pool's pages: when a tenant needs memory, the caches of
tenants above their reserved share are evicted first (most over first), then its
own; another tenant's cache is never evicted below its share on its behalf. With
``host_bytes`` the shared cache is a :class:`~kimilab.prefix.host.TieredPrefixCache`: what
HBM evicts waits in host DRAM, and the engine charges the link time of each load. With
``store`` (one :class:`~kimilab.prefix.host.HostTier` a whole fleet shares, as Mooncake Store
pools the cluster's DRAM) the cache writes every block and state through to it as it is computed,
so a prefix computed on one instance is there for the others. A step that follows loads waits
for them (vLLM's KV connectors, LMCache and Mooncake's by default), or with ``overlap_loads``
overlaps them with its compute layer by layer (SGLang's HiCache): :meth:`InstanceMemory.step_seconds`.
``foreign_evictions`` records each page count taken from another tenant, and the
pages it was left with, so the isolation invariant can be checked.
"""

from __future__ import annotations

import weakref

from kimilab.config import ModelConfig
from kimilab.costs import Deployment
from kimilab.pool.pages import UNBOUNDED_PAGES, PagePool
from kimilab.prefix import HybridPrefixCache, make_policy
from kimilab.prefix.host import HostTier, TieredPrefixCache
from kimilab.prefix.hybrid import shared_costs
from kimilab.prefix.offload import HOST_DRAM, Tier

__all__ = ["InstanceMemory"]


class InstanceMemory:
    """A pool of ``capacity_tokens // block_size`` pages and the prefix cache(s) on it.

    Sizes are per device of ``deployment``: a page is one block of KV on one device, and a
    live request's states take ``state_pages`` of them (their share on one device).
    """

    def __init__(self, config: ModelConfig, *, deployment: Deployment, block_size: int = 512,
                 capacity_tokens: int | None, policy: str = "dual", quotas: dict[str, float] | None = None,
                 host_bytes: float | None = None, host_link: Tier | None = None, store: HostTier | None = None,
                 overlap_loads: bool = False):
        if (host_bytes is not None or store is not None) and quotas:
            raise ValueError("host_bytes, store: a host tier sits under the one shared cache; expected no quotas "
                             "with it")
        if host_bytes is not None and store is not None:
            raise ValueError("host_bytes, store: expected one tier under the cache, its own or a shared store")
        if store is not None and not isinstance(store, HostTier):
            raise ValueError(f"store: expected a kimilab.prefix.host.HostTier, got {type(store).__name__}")
        if not config.kda_layers and not make_policy(policy).free_states:
            raise ValueError(f"policy={policy!r} checkpoints KDA states, but config={config.name!r} has no KDA "
                             f"layer: use 'kv-only' (every cached token is usable)")
        self.config, self.block_size, self.policy_name = config, block_size, policy
        costs = shared_costs(config, deployment)
        n_pages = UNBOUNDED_PAGES if capacity_tokens is None else max(1, capacity_tokens // block_size)
        self.pool = PagePool(n_pages, block_size * costs.kv_bytes_per_token, backed=False, name="instance")
        self.costs = costs
        self.state_pages = -(-costs.checkpoint_bytes // self.pool.page_bytes)  # a live request's KDA + conv states
        self.quotas = dict(quotas) if quotas else None
        self.host = store if host_bytes is None else HostTier(host_bytes, host_link or HOST_DRAM)  # checks them
        self.write_through, self.overlap_loads = store is not None, bool(overlap_loads)
        self._link_charged = 0.0
        self.caches: dict[str, HybridPrefixCache] = {}
        self.reserved: dict[str, int] = {}
        self.foreign_evictions: list[tuple[str, str, int, int]] = []  # (for, from, pages before, after)
        if self.quotas is None:
            self._shared = self._new_cache()
        else:
            for tenant, share in self.quotas.items():
                self.reserved[tenant] = int(share * min(n_pages, UNBOUNDED_PAGES))

    def _new_cache(self) -> HybridPrefixCache:
        if self.host is not None:
            return TieredPrefixCache(self.pool, self.block_size, make_policy(self.policy_name), self.costs, self.host,
                                     write_through=self.write_through)
        return HybridPrefixCache(self.pool, self.block_size, make_policy(self.policy_name), self.costs)

    def take_link_seconds(self) -> float:
        """Seconds of host-tier loads since the last call (0 without a tier): what the next step waits for."""
        if self.host is None:
            return 0.0
        total = self._shared.load_seconds
        new, self._link_charged = total - self._link_charged, total
        return new

    def step_seconds(self, compute_s: float, load_s: float) -> float:
        """A step's seconds when ``load_s`` of loads must land before it uses them. Serial: the sum.
        Overlapped layer by layer over the model's n layers (layer j computes once its load is in and
        layer j - 1 is done; the loads run back to back): max(load + compute/n, compute + load/n)."""
        if not self.overlap_loads:
            return compute_s + load_s
        n = self.config.n_layers
        return max(load_s + compute_s / n, compute_s + load_s / n)

    def cache(self, tenant: str) -> HybridPrefixCache:
        """The prefix cache a tenant's requests read and fill."""
        if self.quotas is None:
            return self._shared
        cache = self.caches.get(tenant)
        if cache is None:
            cache = self.caches[tenant] = self._new_cache()
            me = weakref.ref(self)  # not self: the tree would hold this memory in a cycle (see HybridPrefixCache)
            cache.tree.reclaim = lambda n, t=tenant: me().reclaim(t, n)
            self.reserved.setdefault(tenant, 0)
        return cache

    @staticmethod
    def _pages(cache: HybridPrefixCache) -> int:
        return cache.kv_pages + cache.checkpoint_pages_used

    def reclaim(self, tenant: str, n_pages: int) -> bool:
        """Evict cached pages until ``n_pages`` are free, on behalf of ``tenant``."""
        pool = self.pool
        if self.quotas is None:
            return self._shared.reclaim(n_pages)
        own = self.cache(tenant)
        if pool.n_free + own.tree._spare_pages >= n_pages:
            return True
        over = sorted(((self._pages(c) - self.reserved[t], t) for t, c in self.caches.items()
                       if t != tenant), reverse=True)
        for excess, other in over:
            deficit = n_pages - pool.n_free - own.tree._spare_pages
            if deficit <= 0:
                return True
            if excess <= 0:
                break
            cache = self.caches[other]
            before = self._pages(cache)
            floor = self.reserved[other]
            target = pool.n_free + min(deficit, excess)
            tree = cache.tree
            # one unit at a time, never below the share
            while pool.n_free < target and self._pages(cache) > floor:
                leaf, ck = tree.peek_evictable(), cache._peek_checkpoint()
                if leaf is None and ck is None:
                    break
                if ck is not None and (leaf is None or ck.payload.priority < leaf.priority):
                    if self._pages(cache) - cache.checkpoint_pages < floor:
                        break
                    cache._drop_checkpoint(ck)
                    tree.requeue(ck)
                else:
                    ck_pages = cache.checkpoint_pages if leaf.payload is not None else 0
                    cost = tree.allocs_per_node + ck_pages
                    if self._pages(cache) - cost < floor:
                        break
                    tree._evict(leaf)
            after = self._pages(cache)
            if after < before:
                self.foreign_evictions.append((tenant, other, before, after))
        return own.reclaim(n_pages)

    def make_room(self, tenant: str, n_pages: int) -> bool:
        """Free ``n_pages`` pool pages for a request of ``tenant`` (evicting unpinned cache)."""
        return n_pages <= self.pool.n_free or self.reclaim(tenant, n_pages) or n_pages <= self.pool.n_free

    def cached_pages(self) -> dict[str, int]:
        """Pages each tenant's cache holds (one entry "*" when tenants share the cache)."""
        if self.quotas is None:
            return {"*": self._pages(self._shared)}
        return {t: self._pages(c) for t, c in self.caches.items()}

    def close(self) -> None:
        """Done with this memory: close its caches (freed at once when dropped, see ``HybridPrefixCache.close``)."""
        for cache in self.all_caches():
            cache.close()

    def all_caches(self) -> list[HybridPrefixCache]:
        return [self._shared] if self.quotas is None else list(self.caches.values())

    def check_no_leak(self) -> None:
        """With no request running or queued: no path pinned, every used page belongs to a cache."""
        for cache in self.all_caches():
            cache.check_invariants() if self.quotas is None else cache.tree.check_invariants()
            assert all(n.refcount == 0 for n in cache.tree.nodes()), "a finished request left its path pinned"
        assert self.pool.n_used == sum(self.cached_pages().values()), (self.pool.n_used, self.cached_pages())
