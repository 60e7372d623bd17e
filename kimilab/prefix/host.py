"""A host-memory tier under the hybrid prefix cache: what HBM evicts is kept in DRAM and loaded back.

Production caches do not throw an evicted block away. SGLang's HiCache keeps a host pool beside
the GPU pool (``--hicache-ratio``, ``--hicache-size``), and Mooncake Store and LMCache keep KV
in the DRAM of the cluster. For a hybrid model a hit needs both kinds of memory: the KV of every
block up to a position, and a state checkpoint exactly there (:mod:`kimilab.prefix.hybrid`).
So the tier keeps both.

:class:`HostTier` is the DRAM: copies of KV blocks and checkpoints, keyed by their place in
the prefix tree, bounded in bytes and evicted least recently used first. :class:`TieredPrefixCache`
is a :class:`~kimilab.prefix.hybrid.HybridPrefixCache` whose evictions are written to the tier
(a block or a checkpoint that was computed; one in flight has nothing to copy). When a request
arrives, every position where a state is cached, in HBM or in the tier, with the KV of every block
before it in one of the two, is a candidate, and the deepest one is priced: the prefill seconds
it saves beyond HBM's own hit (:func:`kimilab.costs.prefill_seconds`, the step model) against
the seconds to load what is only on the host (bytes over the link, plus the link's latency
once). If the load is faster, it is loaded into HBM, and the request then goes through the HBM
cache as usual and finds it there; if not, nothing is loaded. (Only the deepest is priced: a
block more on the host costs its bytes over the link, about 0.07 ms for 512 tokens at TP4 over
PCIe 5.0, and saves its prefill, milliseconds.) The tier is inclusive: a loaded copy stays on
the host too.

Two checks hold it exact (``tests/test_host_tier.py``). A tier of zero bytes, or on a link too
slow ever to pay, gives every request the same outcome as the cache without it. An unbounded tier
on a free link gives every request the usable hit of an HBM cache with no limit, for the
policies whose checkpoint positions depend only on the prompt and its usable hit.
"""

from __future__ import annotations

import math
from collections import OrderedDict

from kimilab.config import ModelConfig
from kimilab.costs import Deployment, prefill_seconds
from kimilab.prefix.hybrid import HybridPrefixCache, budget_pages, shared_costs
from kimilab.prefix.offload import HOST_DRAM, Tier
from kimilab.pool.pages import PagePool
from kimilab.prefix.policies import Policy
from kimilab.validate import check_float, check_int

__all__ = ["HostTier", "TieredPrefixCache"]

KV, STATE = 0, 1  # the two kinds of entry a host node holds


class _HostNode:
    """One block's place in the host's own prefix tree: which of its KV and its checkpoint are held."""

    __slots__ = ("key", "parent", "children", "held", "alive")

    def __init__(self, key, parent):
        self.key, self.parent, self.children = key, parent, {}
        self.held = [False, False]  # [KV, STATE]
        self.alive = True  # False once pruned from the tree


class HostTier:
    """Host DRAM copies of KV blocks and state checkpoints: ``capacity_bytes`` per device, least
    recently used out first, reached over ``link`` (:class:`kimilab.prefix.offload.Tier`)."""

    def __init__(self, capacity_bytes: float, link: Tier = HOST_DRAM):
        self.capacity_bytes = check_float("capacity_bytes", capacity_bytes, minimum=0.0, finite=False)
        if not isinstance(link, Tier):
            raise ValueError(f"link: expected a kimilab.prefix.offload.Tier, got {type(link).__name__}")
        self.link = link
        self.root = _HostNode(None, None)
        self._lru: OrderedDict = OrderedDict()  # (node, kind) -> bytes, oldest first
        self._pinned: set = set()  # entries a load in progress reads
        self.used_bytes = 0
        self.written_bytes = self.evicted_bytes = 0
        self.writes = self.evictions = 0

    def refresh(self, node, kind: int) -> None:
        """A copy already held was written again: it becomes the most recently used."""
        self._lru.move_to_end((node, kind))

    def make_room(self, nbytes: int) -> bool:
        """Evict least recently used entries until ``nbytes`` fit; False if they cannot (larger than the
        tier, or all that is left is being loaded). Evicting may prune empty nodes from the tree."""
        if nbytes > self.capacity_bytes:
            return False
        while self.used_bytes + nbytes > self.capacity_bytes:
            if not self._drop_oldest():
                return False
        return True

    def add(self, node, kind: int, nbytes: int) -> None:
        """Hold a copy (room made first, :meth:`make_room`) at ``node``, a live node of the tree."""
        node.held[kind] = True
        self._lru[(node, kind)] = nbytes
        self.used_bytes += nbytes
        self.written_bytes += nbytes
        self.writes += 1

    def pin(self, entries) -> None:
        """Entries ``(node, kind)`` about to be loaded: the most recently used, and kept until :meth:`unpin`
        (the room a load makes in HBM is written here, and must not push out what is being loaded)."""
        for entry in entries:
            self._lru.move_to_end(entry)
        self._pinned.update(entries)

    def unpin(self) -> None:
        self._pinned.clear()

    def _drop_oldest(self) -> bool:
        """Evict the least recently used entry not being loaded; False if there is none."""
        entry = next((e for e in self._lru if e not in self._pinned), None)
        if entry is None:
            return False
        node, kind = entry
        nbytes = self._lru.pop(entry)
        node.held[kind] = False
        self.used_bytes -= nbytes
        self.evicted_bytes += nbytes
        self.evictions += 1
        while node.parent is not None and not node.children and not any(node.held):  # prune empty leaves
            del node.parent.children[node.key]
            node.alive = False
            node = node.parent
        return True

    def check_invariants(self) -> None:
        """Bytes held == the sum of the LRU's entries <= capacity; every flag set has its entry."""
        assert self.used_bytes == sum(self._lru.values()) <= self.capacity_bytes
        stack, flagged = [self.root], 0
        while stack:
            node = stack.pop()
            stack.extend(node.children.values())
            for kind in (KV, STATE):
                if node.held[kind]:
                    flagged += 1
                    assert (node, kind) in self._lru
            assert node is self.root or node.children or any(node.held), "an empty host node was kept"
        assert flagged == len(self._lru)


class TieredPrefixCache(HybridPrefixCache):
    """A hybrid prefix cache over HBM with a :class:`HostTier` below it (whole blocks keyed by hash ids).

    Counters: ``loads`` (requests that loaded something), ``loaded_blocks``, ``loaded_checkpoints``,
    ``loaded_bytes``, ``load_seconds`` (their link time), ``host_tokens`` (usable tokens gained over
    what HBM alone held) and ``saved_seconds`` (prefill seconds those tokens saved, less the loads).
    """

    def __init__(self, pool: PagePool, block_size: int, policy: Policy, costs, host: HostTier, **kwargs):
        if not isinstance(host, HostTier):
            raise ValueError(f"host: expected a kimilab.prefix.host.HostTier, got {type(host).__name__}")
        if kwargs.get("partial_blocks") or kwargs.get("allocs_per_node", 1) != 1:
            raise ValueError("partial_blocks, allocs_per_node: the host tier keeps whole blocks, one page each")
        super().__init__(pool, block_size, policy, costs, **kwargs)
        self.host = host
        self.loads = self.loaded_blocks = self.loaded_checkpoints = self.loaded_bytes = self.host_tokens = 0
        self.load_seconds = self.saved_seconds = 0.0
        self._prefill_memo: dict = {}
        self._host_map: dict = {}  # HBM tree node -> its host tree node (dropped when it is evicted)

    @classmethod
    def for_budget(cls, config: ModelConfig, policy: Policy, *, deployment: Deployment, block_size: int,
                   capacity_tokens: int | None, host_bytes: float = math.inf, link: Tier = HOST_DRAM,
                   partial_blocks: bool = False) -> "TieredPrefixCache":
        """As :meth:`HybridPrefixCache.for_budget`, over a host tier of ``host_bytes`` per device on ``link``."""
        block_size = check_int("block_size", block_size, 1, unit="tokens")
        capacity_tokens, n_pages = budget_pages(capacity_tokens, block_size)
        costs = shared_costs(config, deployment)
        pool = PagePool(n_pages, block_size * costs.kv_bytes_per_token, backed=False, name=f"hbm-{policy.name}")
        cache = cls(pool, block_size, policy, costs, HostTier(host_bytes, link), partial_blocks=partial_blocks)
        cache.capacity_tokens = capacity_tokens
        return cache

    # ----- writes: what HBM evicts ------------------------------------------
    def _host_node(self, node, create: bool):
        """The host tree's node for HBM tree ``node`` (None if absent and not ``create``). Found through
        a map from HBM nodes, so an eviction does not walk its whole prefix; a pruned one is found again."""
        chain, found = [], self.host.root
        while node is not self.tree.root:
            got = self._host_map.get(node)
            if got is not None and got.alive:
                found = got
                break
            chain.append(node)
            node = node.parent
        for hbm in reversed(chain):
            child = found.children.get(hbm.key)
            if child is None:
                if not create:
                    return None
                child = found.children[hbm.key] = _HostNode(hbm.key, found)
            self._host_map[hbm] = found = child
        return found

    def _write(self, node, kind: int, nbytes: int) -> None:
        """Copy what HBM evicts at ``node`` (its KV or its state) to the host; a copy there is refreshed."""
        held = self._host_node(node, create=False)
        if held is not None and held.held[kind]:
            self.host.refresh(held, kind)
        elif self.host.make_room(nbytes):  # before the node is created: making room may prune its path
            self.host.add(self._host_node(node, create=True), kind, nbytes)

    def _on_evict(self, node) -> None:
        if node.computed:
            self._write(node, KV, self.page_bytes)
        super()._on_evict(node)  # the node's checkpoint first (_drop_checkpoint), then its parent's rank
        self._host_map.pop(node, None)

    def _drop_checkpoint(self, node) -> None:
        if node.payload.computed and self.checkpoint_pages:
            self._write(node, STATE, self.costs.checkpoint_bytes)
        super()._drop_checkpoint(node)

    def close(self) -> None:
        super().close()
        self._host_map.clear()

    # ----- reads: load before the HBM cache sees the request ------------------
    def begin(self, keys=None, n_tokens=None, *, tokens=None):
        """Load the deepest host hit into HBM if that beats recomputing it, then :meth:`HybridPrefixCache.begin`."""
        if tokens is not None:
            raise ValueError("tokens: the host tier keys blocks by hash ids; pass keys and n_tokens")
        if keys is not None and n_tokens is not None:
            self._load(keys, int(n_tokens))
        return super().begin(keys, n_tokens)

    def _deepest(self, keys, n: int) -> tuple:
        """``(hbm_usable, candidate)`` over the prompt's whole blocks: HBM's own usable hit, and the deepest
        position past it where a state and all the KV before it are cached in HBM or on the host, as
        ``(usable end, blocks to it, blocks only on the host, state only on the host, host node)`` (None if
        there is none). Under a policy with free states (pure attention) every block end has a state, and
        as in :meth:`HybridPrefixCache.hits` a block past the last token is used up to it."""
        bs, limit, free = self.block_size, n - 1, self.policy.free_states
        hbm, host = self.tree.root, self.host.root
        hbm_usable, only_host, best = 0, 0, None
        for j in range(min(n // bs, len(keys))):
            key = keys[j]
            hbm = None if hbm is None else hbm.children.get(key)
            host = None if host is None else host.children.get(key)
            if hbm is not None and not hbm.computed:
                break  # in flight: its KV is not there yet, in HBM or anywhere
            if hbm is None and (host is None or not host.held[KV]):
                break  # the KV stops here: nothing deeper can be used
            only_host += hbm is None
            end = (j + 1) * bs
            if end > limit and not free:
                break  # a state past the last token is no use: that token is always computed
            ck = None if hbm is None else hbm.payload
            if free or (ck is not None and ck.computed):
                if only_host == 0:
                    hbm_usable = min(end, limit)  # HBM alone has it all
                else:
                    best = (min(end, limit), j + 1, only_host, False, host)
            elif host is not None and host.held[STATE]:
                best = (end, j + 1, only_host, True, host)
            if end > limit:
                break
        return hbm_usable, best

    def _recompute_s(self, n_new: int, n_cached: int) -> float:
        """Prefill seconds of ``n_new`` tokens after ``n_cached`` (the step model, memoised per cache)."""
        key = (n_new, n_cached)
        got = self._prefill_memo.get(key)
        if got is None:
            got = self._prefill_memo[key] = prefill_seconds(self.costs.config, self.costs.deployment, n_new, n_cached)
        return got

    def _load(self, keys, n: int) -> None:
        hbm_usable, best = self._deepest(keys, n)
        if best is None:
            return
        end, depth, blocks, state, host_node = best  # the deepest: a block more saves far more than it costs
        link = self.host.link
        nbytes = blocks * self.page_bytes + (self.costs.checkpoint_bytes if state else 0)
        net = (self._recompute_s(n - hbm_usable, hbm_usable) - self._recompute_s(n - end, end)
               - link.latency_s - nbytes / link.bandwidth)
        if net < 0:
            return  # recomputing from HBM's own hit is faster than the load
        reads, node = [(host_node, STATE)] if state else [], self.host.root
        for key in keys[:depth]:  # what is read from the host: refreshed there, and pinned while read
            node = None if node is None else node.children.get(key)
            if node is not None and node.held[KV]:
                reads.append((node, KV))
        self.host.pin(reads)
        m, path, complete = self.tree.insert(keys[:depth], depth * self.block_size, pin=True)
        self.pages_admitted += len(path) - len(m.nodes)
        tip, loaded_state = path[-1] if complete else None, False
        if state and tip is not None and tip.payload is None and self._admit([tip]):
            tip.payload.computed = True
            self.loaded_checkpoints += 1
            loaded_state = True
        self.host.unpin()
        self.tree.unpin(path)
        self._requeue_checkpoints(path)
        blocks = len(path) - len(m.nodes)
        nbytes = blocks * self.page_bytes + (self.costs.checkpoint_bytes if loaded_state else 0)
        self.loads += 1
        self.loaded_blocks += blocks
        self.loaded_bytes += nbytes
        self.load_seconds += link.latency_s + nbytes / link.bandwidth
        if complete and (self.policy.free_states or (tip.payload is not None and tip.payload.computed)):
            self.host_tokens += end - hbm_usable
            self.saved_seconds += net

    def host_summary(self) -> dict:
        """The tier's counters as one JSON-ready dict (bytes per device; an unbounded capacity is None)."""
        h = self.host
        cap = h.capacity_bytes if math.isfinite(h.capacity_bytes) else None
        return {"host_capacity_bytes": cap, "host_link": h.link.name, "host_used_bytes": h.used_bytes,
                "host_written_bytes": h.written_bytes, "host_evicted_bytes": h.evicted_bytes,
                "loads": self.loads, "loaded_blocks": self.loaded_blocks,
                "loaded_checkpoints": self.loaded_checkpoints, "loaded_bytes": self.loaded_bytes,
                "load_seconds": self.load_seconds, "host_tokens": self.host_tokens,
                "saved_seconds": self.saved_seconds}

    def check_invariants(self) -> None:
        super().check_invariants()
        self.host.check_invariants()
