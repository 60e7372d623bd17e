"""A radix tree over page-sized token blocks: the prefix cache of an attention model.

Each node is one block of at most ``block_size`` tokens and owns the pool pages
that hold that block's KV. A node's key names the block *given its parent*, so a
path from the root names a whole prefix. Two kinds of key work:

* Mooncake hash ids (``keys=hash_ids``): an id already stands for its whole
  prefix, so it is unique among siblings by construction;
* token blocks (``tokens=...``): the key is the block's token bytes, and the
  node remembers its tokens so matching can go token-exact inside a block
  (``partial_blocks=True``, what a per-token radix tree such as SGLang's allows).

Nodes used by running requests are pinned by a reference count; eviction frees
unpinned leaves only (a parent's prefix is needed by its children), oldest first.

The eviction order is total and needs no queue history: lowest rank first, then the
earliest request clock at last use (``touched``), then the shallowest ``end`` (nodes with
one ``touched`` lie on one request's path, so their ends differ). Any twin that ranks its
blocks by the same key evicts the same blocks, however it keeps its queue.
"""

from __future__ import annotations

import heapq
from typing import Callable, Iterable

import numpy as np

from kimilab.prefix.blocks import block_token_counts, split_prompt
from kimilab.prefix.nodes import Match, Node
from kimilab.validate import check_int

__all__ = ["Node", "Match", "RadixTree", "COMPACT_SLACK"]

# A lazy heap is rebuilt without its stale entries once it holds more than this + 4 x its live
# ones. This bounds its memory only: the order does not depend on when that happens.
COMPACT_SLACK = 64


class RadixTree:
    """Block radix tree with refcount pinning and leaf-first LRU eviction.

    ``pool`` is a :class:`kimilab.pool.PagePool`; each node holds one ``"kv"`` page, or
    a tuple of ``allocs_per_node`` one-page allocations (one per global layer, when the
    tree keeps a paged model's real KV blocks). ``partial_blocks=False`` caches and
    matches whole blocks only (vLLM); ``True`` also caches a prompt's trailing
    partial block and, when tokens are known, matches token-exactly inside a block.
    ``reclaim`` (optional) replaces the default LRU reclaimer: it receives the
    number of free pages wanted and returns whether it got them.
    ``on_evict(node)`` runs before an evicted node's pages go back to the pool.
    """

    def __init__(
        self,
        pool,
        block_size: int,
        *,
        allocs_per_node: int = 1,
        partial_blocks: bool = False,
        on_evict: Callable[[Node], None] | None = None,
        reclaim: Callable[[int], bool] | None = None,
    ):
        block_size = check_int("block_size", block_size, 1, unit="tokens per block")
        self.allocs_per_node = check_int("allocs_per_node", allocs_per_node, 1)
        self.pool = pool
        self.block_size = block_size
        self.partial_blocks = bool(partial_blocks)
        self.on_evict = on_evict
        self.reclaim = reclaim  # None: evict from this tree (not self.evict: a bound method here is a cycle)
        self.root = Node(None, None, 0, 0, None, 0)
        self.root.refcount = 1  # the root is never evicted
        self.clock = 0
        self._next_id = 1
        self._serial = 0
        self._leaf_heap: list = []
        self.n_nodes = 0
        self.n_evicted = 0
        self._collecting = False
        self._spares: dict = {}  # (kind, n_pages, nbytes) -> allocations parked while reclaiming
        self._spares_kv: list = []  # parked one-page KV allocations (the common case, kept apart)
        self._spare_pages = 0
        self._own_key = ("kv", 1, pool.page_bytes)

    # ----- keys ------------------------------------------------------------
    def _split(self, keys, n_tokens, tokens):
        return split_prompt(keys, n_tokens, tokens, self.block_size, self.partial_blocks)

    # ----- lookup ----------------------------------------------------------
    def match(self, keys=None, n_tokens=None, *, tokens=None) -> Match:
        """Longest cached prefix of a prompt. No side effects (no touch, no pin)."""
        if tokens is None and keys is not None and n_tokens is not None:
            return Match(self.match_keys(keys, int(n_tokens)), 0)
        keys, counts, blocks = self._split(keys, n_tokens, tokens)
        return self.match_blocks(keys, counts, blocks)

    def match_keys(self, keys, n_tokens: int) -> list:
        """The cached whole blocks of a prompt given by hash ids: what ``_split`` then
        ``match_blocks`` find, without building the per-block lists first (a router
        looks every request up in every instance). A test holds the two equal."""
        bs, n_keys = self.block_size, len(keys)
        if n_tokens < 0 or n_keys != -(-n_tokens // bs):
            block_token_counts(n_tokens, n_keys, bs)  # raises the error that names the argument
        full = n_tokens // bs
        last = n_tokens - full * bs  # tokens of a trailing partial block (0: none)
        path = []
        node = self.root
        for j in range(n_keys if self.partial_blocks else full):
            child = node.children.get(keys[j])
            if child is None or child.n_tokens != (bs if j < full else last):
                break
            path.append(child)
            node = child
        return path

    def match_blocks(self, keys, counts, blocks=None) -> Match:
        """Longest cached prefix of a prompt already cut into block keys (see prefix.blocks)."""
        node = self.root
        path = []
        j = 0
        for j, key in enumerate(keys):
            child = node.children.get(key)
            if child is None or child.n_tokens != counts[j]:
                break
            path.append(child)
            node = child
        else:
            return Match(path, 0)
        partial = 0
        if self.partial_blocks and blocks is not None and node.children:
            want = blocks[j]
            for child in node.children.values():
                if child.tokens is None:
                    continue
                n = min(len(want), len(child.tokens))
                diff = np.flatnonzero(want[:n] != child.tokens[:n])
                common = int(diff[0]) if diff.size else n
                if common > partial:
                    partial = common
        return Match(path, partial)

    # ----- pinning and recency ---------------------------------------------
    def tick(self) -> int:
        """Advance the logical clock (one per request) and return it."""
        self.clock += 1
        return self.clock

    def touch(self, nodes: Iterable[Node]) -> None:
        """Mark nodes as used now; an evictable one is re-queued at its new rank."""
        now, clock = self.now(), self.clock
        for node in nodes:
            node.last_access, node.touched = now, clock
            if node.refcount == 0 and not node.children:
                self._push_leaf(node)

    def now(self) -> float:
        """The time stamped on a touched node: the request clock (LRU).

        Higher layers may replace this (an instance attribute) with their own clock.
        """
        return float(self.clock)

    def priority_of(self, node: Node) -> float:
        """Eviction rank of a node (lower goes first), computed when it is queued: last use.

        Higher layers may replace this (an instance attribute) to weigh other things.
        """
        return node.last_access

    def requeue(self, node: Node) -> None:
        """Re-rank a node after something :meth:`priority_of` reads has changed."""
        if node.refcount == 0 and not node.children and node.alive:
            self._push_leaf(node)

    def pin(self, nodes: Iterable[Node]) -> None:
        """Reference the nodes: pinned nodes are never evicted."""
        for node in nodes:
            if not node.alive:
                raise ValueError(f"pin: {node!r} was evicted; match again before pinning")
            node.refcount += 1

    def unpin(self, nodes: Iterable[Node]) -> None:
        """Drop one reference from each node; unreferenced leaves become evictable."""
        for node in nodes:
            refcount = node.refcount - 1
            if refcount < 0:
                raise ValueError(f"unpin: {node!r} is not pinned")
            node.refcount = refcount
            if refcount == 0 and not node.children:
                self._push_leaf(node)

    def _push_leaf(self, node: Node) -> None:
        self._serial += 1
        node.heap_serial = self._serial
        node.priority = priority = self.priority_of(node)
        heapq.heappush(self._leaf_heap, (priority, node.touched, node.end, self._serial, node))
        if len(self._leaf_heap) > COMPACT_SLACK + 4 * self.n_nodes:
            self._compact_heap()

    def _compact_heap(self) -> None:
        self._leaf_heap = [e for e in self._leaf_heap if self._valid(e)]
        heapq.heapify(self._leaf_heap)

    @staticmethod
    def _valid(entry) -> bool:
        node = entry[4]
        return node.alive and node.heap_serial == entry[3] and node.refcount == 0 and not node.children

    def peek_evictable(self) -> Node | None:
        """The next leaf eviction would take (lowest ``(priority, touched, end)``), or None if every
        leaf is pinned."""
        heap = self._leaf_heap
        while heap:
            entry = heap[0]
            node = entry[4]  # _valid(), inlined
            if node.alive and node.heap_serial == entry[3] and node.refcount == 0 and not node.children:
                return node
            heapq.heappop(heap)
        return None

    # ----- insertion -------------------------------------------------------
    def insert(self, keys=None, n_tokens=None, *, tokens=None, pin: bool = False):
        """Cache a prompt's blocks. Returns ``(match, path, complete)``.

        ``match`` is what was already cached, ``path`` every node of the prompt now
        in the tree (matched + new), ``complete`` False if memory ran out (all
        other leaves pinned) before every block fit. With ``pin=True`` the caller
        owns one reference on every node of ``path`` and must :meth:`unpin` it.
        """
        keys, counts, blocks = self._split(keys, n_tokens, tokens)
        m = self.match_blocks(keys, counts, blocks)
        path = m.nodes.copy()
        # Pin and stamp in one pass (what pin() then touch() do): nothing reads a pinned
        # node's stamp while the blocks below are allocated, and the clock stands still.
        now, clock = self.now(), self.clock
        for node in path:
            node.refcount += 1
            node.last_access, node.touched = now, clock
        node = path[-1] if path else self.root
        first = len(path)
        complete = True
        if first < len(keys):
            children = node.children
            if keys[first] in children:  # same key but a different token count: a malformed trace
                raise ValueError(f"keys[{first}]={keys[first]!r}: already cached with "
                                 f"{children[keys[first]].n_tokens} tokens, now {counts[first]}")
            allocs = self._node_allocs(len(keys) - first)
            complete = len(allocs) == len(keys) - first
            next_id, end = self._next_id, node.end
            for j, alloc in zip(range(first, len(keys)), allocs):
                n = counts[j]
                end += n
                child = Node(keys[j], node, n, end, alloc, next_id,
                             None if blocks is None else np.array(blocks[j]))
                child.refcount = 1
                child.last_access, child.touched = now, clock
                node.children[keys[j]] = child
                path.append(child)
                node = child
                next_id += 1
            self.n_nodes += next_id - self._next_id
            self._next_id = next_id
        if not pin:
            self.unpin(path)
        return m, path, complete

    def _node_allocs(self, count: int) -> list:
        """KV allocations for ``count`` new nodes (tuples when a node holds several), fewer if full."""
        group = self.allocs_per_node
        flat = self.allocate_many("kv", 1, count * group)
        if group == 1:
            return flat
        n = len(flat) // group
        for alloc in flat[n * group:]:  # an incomplete group is of no use
            self.pool.free(alloc)
        return [tuple(flat[j * group:(j + 1) * group]) for j in range(n)]

    def allocate(self, kind: str, n_pages: int, nbytes: int | None = None):
        """One allocation from the pool, reclaiming cache space if needed; None if impossible."""
        got = self.allocate_many(kind, n_pages, 1, nbytes)
        return got[0] if got else None

    def allocate_many(self, kind: str, n_pages: int, count: int, nbytes: int | None = None) -> list:
        """Up to ``count`` allocations of ``n_pages`` pages, reclaiming once for all of them.

        While reclaiming, evicted allocations are parked instead of freed; those of
        the same kind and size are handed straight to the caller (the pages change
        owner without a pool round trip), the rest go back to the pool. Returns
        fewer than ``count`` only if everything else evictable is gone.
        """
        pool = self.pool
        if count <= 0:
            return []
        need = n_pages * count
        if pool.n_free >= need:
            return self._take(kind, n_pages, count, nbytes)
        self._collecting = True
        try:
            (self.evict if self.reclaim is None else self.reclaim)(need)
        finally:
            self._collecting = False
        spares = self._spares
        if self._spares_kv:  # KV leaves parked by _evict (one page each)
            spares.setdefault(self._own_key, []).extend(self._spares_kv)
            self._spares_kv.clear()
        parked = spares.pop((kind, n_pages, n_pages * pool.page_bytes if nbytes is None else nbytes), [])
        for others in spares.values():
            for a in others:
                pool.free(a)
        spares.clear()
        self._spare_pages = 0
        out = parked[:count]
        for a in parked[count:]:
            pool.free(a)
        out += self._take(kind, n_pages, min(count - len(out), pool.n_free // n_pages), nbytes)
        return out

    def _take(self, kind: str, n_pages: int, count: int, nbytes: int | None) -> list:
        """``count`` fresh allocations from the pool (one call for single pages)."""
        if n_pages == 1 and nbytes is None:
            return self.pool.allocate_each(kind, count)
        return [self.pool.allocate(kind, n_pages, nbytes=nbytes) for _ in range(count)]

    @property
    def n_available(self) -> int:
        """Free pool pages plus pages reclaimed during the current allocation."""
        return self.pool.n_free + self._spare_pages

    def release(self, alloc, key=None) -> None:
        """Give an evicted allocation back (parked while reclaiming, else to the pool).

        ``key`` = (kind, n_pages, nbytes) of ``alloc`` if the caller knows it (saves lookups).
        """
        if self._collecting and alloc.refcount == 1:  # parked only if nobody else holds its pages
            if key is None:
                key = (alloc.kind, alloc.n_pages, alloc.nbytes)
            self._spares.setdefault(key, []).append(alloc)
            self._spare_pages += key[1]
        else:  # a running request may still read these pages: drop our reference, free nothing
            self.pool.free(alloc)

    # ----- eviction ---------------------------------------------------------
    def evict_node(self, node: Node) -> int:
        """Remove one unpinned leaf; returns the pages it freed (its own)."""
        if node.children or node.refcount or not node.alive or node is self.root:
            raise ValueError(f"evict_node: {node!r} is not an unpinned leaf")
        self._evict(node)
        return self.allocs_per_node

    def _evict(self, node: Node) -> None:
        """evict_node without the checks, for a leaf the eviction queue just vouched for."""
        if self.on_evict is not None:
            self.on_evict(node)
        parent = node.parent
        del parent.children[node.key]
        node.alive = False
        alloc = node.alloc
        if self._collecting and self.allocs_per_node == 1 and alloc.refcount == 1:  # release(), inlined
            self._spares_kv.append(alloc)
            self._spare_pages += 1
        else:
            for a in (alloc if self.allocs_per_node > 1 else (alloc,)):
                self.release(a, self._own_key)
        node.alloc = None
        self.n_nodes -= 1
        self.n_evicted += 1
        if parent.refcount == 0 and not parent.children and parent is not self.root:
            self._push_leaf(parent)

    def evict(self, n_pages: int) -> bool:
        """Evict unpinned leaves, lowest priority (oldest) first, until ``n_pages`` are free."""
        pool = self.pool
        while pool.n_free + self._spare_pages < n_pages:
            node = self.peek_evictable()
            if node is None:
                return False
            self._evict(node)
        return True

    def evict_all(self) -> int:
        """Evict every unpinned node (leaves first); returns how many went."""
        count = 0
        while True:
            node = self.peek_evictable()
            if node is None:
                return count
            self.evict_node(node)
            count += 1

    # ----- serving step and accounting ---------------------------------------
    def serve(self, keys=None, n_tokens=None, *, tokens=None) -> Match:
        """One request: look up, count the hit, cache the rest. Returns the match."""
        self.tick()
        m, _, _ = self.insert(keys, n_tokens, tokens=tokens)
        return m

    def close(self) -> None:
        """Unlink every node from its parent; the tree is unusable after. Call it when dropping the tree.

        Parent and child links are reference cycles, so a dropped tree waits for Python's cyclic
        collector, which finds it only by walking every live object: about a second after each
        fleet run. Unlinked, the tree is freed by reference counting as soon as it is dropped.
        """
        stack = [self.root]
        while stack:
            node = stack.pop()
            stack.extend(node.children.values())
            node.parent = None
        self._leaf_heap = []

    def nodes(self) -> list[Node]:
        """Every cached node, parents before children (deterministic order)."""
        out, stack = [], list(reversed(list(self.root.children.values())))
        while stack:
            node = stack.pop()
            out.append(node)
            stack.extend(reversed(list(node.children.values())))
        return out

    @property
    def n_pages(self) -> int:
        """Pages held by the tree."""
        return self.n_nodes * self.allocs_per_node

    kv_pages = n_pages
    checkpoint_pages_used = 0  # an attention model's cache holds no states

    @property
    def cached_tokens(self) -> int:
        return sum(n.n_tokens for n in self.nodes())

    def check_invariants(self) -> None:
        """Raise AssertionError if the tree's structure or accounting is inconsistent, or an evictable
        leaf is not queued at its current rank (then the queue's lowest would not be the order's first)."""
        nodes = self.nodes()
        assert len(nodes) == self.n_nodes, (len(nodes), self.n_nodes)
        queued = {id(e[4]): e for e in self._leaf_heap if self._valid(e)}
        for node in nodes:
            if node.refcount == 0 and not node.children:
                entry = queued.get(id(node))
                assert entry is not None and entry[:3] == (self.priority_of(node), node.touched, node.end), \
                    f"{node!r} is evictable but not queued at its rank"
            assert node.alive and node.alloc is not None
            assert node.parent.children.get(node.key) is node
            assert node.end == node.parent.end + node.n_tokens
            assert 0 < node.n_tokens <= self.block_size
            assert node.refcount >= 0
            if node.children:
                assert node.n_tokens == self.block_size, "only a full block can have children"
