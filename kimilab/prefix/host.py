"""A host-memory tier under the hybrid prefix cache: what HBM evicts is kept in DRAM and loaded back.

Production caches do not throw an evicted block away. SGLang's HiCache keeps a host pool beside
the GPU pool (``--hicache-ratio``, 2 by default), and for hybrid models (``HiMambaRadixCache``,
SGLang 0.5.10) it keeps the Mamba states there too. Mooncake Store pools the DRAM of a whole
cluster and shares it among instances. For a hybrid model a hit needs both kinds of memory: the KV
of every block up to a position, and a state checkpoint exactly there (:mod:`kimilab.prefix.hybrid`).
So the tier keeps both.

:class:`HostTier` is the DRAM: copies of KV blocks and checkpoints, keyed by their place in
the prefix tree, bounded in bytes and evicted least recently used first. :class:`TieredPrefixCache`
is a :class:`~kimilab.prefix.hybrid.HybridPrefixCache` over one. It writes what HBM evicts (a block
or a checkpoint that was computed; one in flight has nothing to copy): HiCache's ``write_back``.
With ``write_through`` it also writes each block and checkpoint as soon as it is computed (HiCache's
default), which a tier shared by several caches needs: what one instance computed is then there
for the others before it leaves that instance's HBM.

When a request arrives, every position where a state is cached, in HBM or in the tier, with the KV
of every block before it in one of the two, is a candidate, and the deepest one is priced: the
prefill seconds it saves beyond HBM's own hit (:func:`kimilab.costs.prefill_seconds`, the step
model) against the seconds to load what is only on the host (bytes over the link, plus the link's
latency once). If the load is faster, it is loaded into HBM, and the request then goes through the
HBM cache as usual and finds it there; if not, nothing is loaded. (HiCache loads any host hit of
10 tokens or more; here a load always pays on the links of :mod:`kimilab.prefix.offload` except for
tiny hits.) The tier is inclusive: a loaded copy stays on the host too.

Two checks hold it exact (``tests/test_host_tier.py``). A tier of zero bytes, or on a link too
slow ever to pay, gives every request the same outcome as the cache without it. An unbounded tier
on a free link gives every request the usable hit of an HBM cache with no limit, for the
policies whose checkpoint positions depend only on the prompt and its usable hit; shared by several
write-through caches, the usable hit of one HBM cache with no limit serving them all.
"""

from __future__ import annotations

import math
from collections import OrderedDict

from kimilab.config import ModelConfig
from kimilab.costs import Deployment, prefill_seconds
from kimilab.prefix.blocks import split_prompt
from kimilab.prefix.hybrid import HybridPrefixCache, budget_pages, shared_costs
from kimilab.prefix.offload import HOST_DRAM, Tier
from kimilab.pool.pages import PagePool
from kimilab.prefix.policies import Policy
from kimilab.validate import check_float, check_int

__all__ = ["HostTier", "TieredPrefixCache"]

KV, STATE = 0, 1  # the two kinds of entry a host node holds


class _HostNode:
    """One block's place in the host's own prefix tree: which of its KV and its checkpoint are held."""

    __slots__ = ("key", "parent", "children", "held", "alive", "tensors")

    def __init__(self, key, parent):
        self.key, self.parent, self.children = key, parent, {}
        self.held = [False, False]  # [KV, STATE]
        self.alive = True  # False once pruned from the tree
        self.tensors = None  # what a caller keeps with the state's copy (the engine's tensor mode), if anything


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
        self.written_bytes = self.evicted_bytes = self.evictions = 0
        # what the caches reading this tier loaded from it (one tier may sit under several, kimilab.fleet)
        self.loads = self.loaded_bytes = self.hit_tokens = 0
        self.load_seconds = self.saved_seconds = 0.0

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
        if kind == STATE:
            node.tensors = None
        self.used_bytes -= nbytes
        self.evicted_bytes += nbytes
        self.evictions += 1
        while node.parent is not None and not node.children and not any(node.held):  # prune empty leaves
            del node.parent.children[node.key]
            node.alive = False
            node = node.parent
        return True

    def summary(self) -> dict:
        """The tier's counters, over every cache that reads it, as one JSON-ready dict (bytes per device;
        an unbounded capacity is None; ``saved_seconds``: prefill seconds the loads saved, net of them)."""
        cap = self.capacity_bytes if math.isfinite(self.capacity_bytes) else None
        return {"capacity_bytes": cap, "link": self.link.name, "used_bytes": self.used_bytes,
                "written_bytes": self.written_bytes, "evicted_bytes": self.evicted_bytes, "loads": self.loads,
                "loaded_bytes": self.loaded_bytes, "load_seconds": round(self.load_seconds, 6),
                "hit_tokens": self.hit_tokens, "saved_seconds": round(self.saved_seconds, 6)}

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

    Two hooks let a caller that holds real tensors for each checkpoint (the engine's tensor mode,
    :class:`kimilab.engine.tensor.TensorExecutor`) move them with the copies: ``state_tensors(node)``
    gives what to keep when a checkpoint is written to the host, ``load_state(node, tensors)`` hears
    that a checkpoint was loaded back at ``node``.
    """

    def __init__(self, pool: PagePool, block_size: int, policy: Policy, costs, host: HostTier, *,
                 write_through: bool = False, **kwargs):
        if not isinstance(host, HostTier):
            raise ValueError(f"host: expected a kimilab.prefix.host.HostTier, got {type(host).__name__}")
        if kwargs.get("partial_blocks") or kwargs.get("allocs_per_node", 1) != 1:
            raise ValueError("partial_blocks, allocs_per_node: the host tier keeps whole blocks, one page each")
        super().__init__(pool, block_size, policy, costs, **kwargs)
        self.host, self.write_through = host, bool(write_through)
        self.loads = self.loaded_blocks = self.loaded_checkpoints = self.loaded_bytes = self.host_tokens = 0
        self.load_seconds = self.saved_seconds = 0.0
        self._prefill_memo: dict = {}
        self._host_map: dict = {}  # HBM tree node -> its host tree node (dropped when it is evicted)
        self.state_tensors = self.load_state = None  # the hooks (see the class docstring)

    @classmethod
    def for_budget(cls, config: ModelConfig, policy: Policy, *, deployment: Deployment, block_size: int,
                   capacity_tokens: int | None, host_bytes: float = math.inf, link: Tier = HOST_DRAM,
                   partial_blocks: bool = False, write_through: bool = False) -> "TieredPrefixCache":
        """As :meth:`HybridPrefixCache.for_budget`, over a host tier of ``host_bytes`` per device on ``link``."""
        block_size = check_int("block_size", block_size, 1, unit="tokens")
        capacity_tokens, n_pages = budget_pages(capacity_tokens, block_size)
        costs = shared_costs(config, deployment)
        pool = PagePool(n_pages, block_size * costs.kv_bytes_per_token, backed=False, name=f"hbm-{policy.name}")
        cache = cls(pool, block_size, policy, costs, HostTier(host_bytes, link), partial_blocks=partial_blocks,
                    write_through=write_through)
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

    def _write(self, node, kind: int, nbytes: int, refresh: bool = True) -> None:
        """Copy ``node``'s KV or state to the host; a copy already there is refreshed (if ``refresh``)."""
        held = self._host_node(node, create=False)
        if held is not None and held.held[kind]:
            if refresh:
                self.host.refresh(held, kind)
        elif self.host.make_room(nbytes):  # before the node is created: making room may prune its path
            held = self._host_node(node, create=True)
            self.host.add(held, kind, nbytes)
            if kind == STATE and self.state_tensors is not None:
                held.tensors = self.state_tensors(node)

    def _on_evict(self, node) -> None:
        if node.computed:  # write-back; under write-through only a copy the host has lost is written again
            self._write(node, KV, self.page_bytes, refresh=not self.write_through)
        super()._on_evict(node)  # the node's checkpoint first (_drop_checkpoint), then its parent's rank
        self._host_map.pop(node, None)

    def _drop_checkpoint(self, node) -> None:
        if node.payload.computed and self.checkpoint_pages:
            self._write(node, STATE, self.costs.checkpoint_bytes, refresh=not self.write_through)
        super()._drop_checkpoint(node)

    def mark_computed(self, path, done: int, start: int = 0) -> int:
        """As :meth:`HybridPrefixCache.mark_computed`; under write-through each block and checkpoint is
        copied to the host as soon as it is computed (what a cache shared across instances needs: a
        prefix still in one instance's HBM is then in the store for the others)."""
        end = HybridPrefixCache.mark_computed(path, done, start)
        if self.write_through:
            for node in path[start:end]:
                self._write(node, KV, self.page_bytes)
                if node.payload is not None and self.checkpoint_pages:
                    self._write(node, STATE, self.costs.checkpoint_bytes)
        return end

    def close(self) -> None:
        super().close()
        self._host_map.clear()

    # ----- reads: load before the HBM cache sees the request ------------------
    def begin(self, keys=None, n_tokens=None, *, tokens=None):
        """Load the deepest host hit into HBM if that beats recomputing it, then :meth:`HybridPrefixCache.begin`."""
        if tokens is not None:
            if keys is not None or n_tokens is not None:
                raise ValueError("tokens: expected tokens alone, or keys with n_tokens")
            self._load(split_prompt(None, None, tokens, self.block_size, False)[0], len(tokens))
            return super().begin(tokens=tokens)
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
            if self.load_state is not None:
                self.load_state(tip, host_node.tensors)
        self.host.unpin()
        self.tree.unpin(path)
        self._requeue_checkpoints(path)
        blocks = len(path) - len(m.nodes)
        nbytes = blocks * self.page_bytes + (self.costs.checkpoint_bytes if loaded_state else 0)
        seconds, host = link.latency_s + nbytes / link.bandwidth, self.host
        self.loads += 1
        self.loaded_blocks += blocks
        self.loaded_bytes += nbytes
        self.load_seconds += seconds
        host.loads, host.loaded_bytes, host.load_seconds = host.loads + 1, host.loaded_bytes + nbytes, \
            host.load_seconds + seconds
        if complete and (self.policy.free_states or (tip.payload is not None and tip.payload.computed)):
            self.host_tokens += end - hbm_usable
            self.saved_seconds += net
            host.hit_tokens += end - hbm_usable
            host.saved_seconds += net

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
