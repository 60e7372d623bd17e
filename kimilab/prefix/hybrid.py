"""Dual-granularity prefix caching: KV pages per block, KDA state checkpoints where a policy says.

A hybrid model can reuse a cached prefix only where it has BOTH the KV of every
global layer for the whole prefix (cheap, cached per block in a
:class:`kimilab.prefix.radix.RadixTree`) AND a checkpoint of every KDA and conv
state at exactly that position (expensive: at 48B scale one checkpoint weighs as
much as ~10 KV pages of 512 tokens on one device, ~2.6 at TP4: every size is per device
of the deployment the cache is built for). The *usable hit* of a request is the deepest
position where both exist; the model recomputes everything after it.

Both kinds of memory come out of one :class:`kimilab.pool.PagePool`, so a
policy (:mod:`kimilab.prefix.policies`) that stores many states caches fewer blocks.
"""

from __future__ import annotations

import heapq
import weakref
from dataclasses import dataclass

from kimilab.config import ModelConfig
from kimilab.costs import CacheCosts, Deployment
from kimilab.pool.pages import UNBOUNDED_PAGES, PagePool
from kimilab.validate import check_int
from kimilab.prefix.policies import Placement, Policy, check_interval
from kimilab.prefix.nodes import Node
from kimilab.prefix.radix import COMPACT_SLACK, RadixTree

__all__ = ["Checkpoint", "Outcome", "HybridPrefixCache"]


_COSTS: dict = {}


def shared_costs(config: ModelConfig, deployment: Deployment) -> CacheCosts:
    """One CacheCosts per (config, deployment) for every budgeted cache, so its FLOP memo outlives
    one replay (a sweep replays the same prompt lengths at every capacity and policy)."""
    key = (config, deployment)
    costs = _COSTS.get(key)
    if costs is None:
        costs = _COSTS[key] = CacheCosts.of(config, deployment)
    return costs


def budget_pages(capacity_tokens: int | None, block_size: int) -> tuple:
    """``(capacity_tokens, pages)`` of a budget checked to hold at least one block (None: no limit)."""
    if capacity_tokens is None:
        return None, UNBOUNDED_PAGES
    capacity_tokens = check_int("capacity_tokens", capacity_tokens, 1, unit="tokens")
    if capacity_tokens < block_size:
        raise ValueError(f"capacity_tokens={capacity_tokens}: expected at least one block (block_size={block_size})")
    return capacity_tokens, min(capacity_tokens // block_size, UNBOUNDED_PAGES)


class Checkpoint:
    """A cached state at the end of a tree node: its pages and its rank for eviction.

    ``computed`` is False from admission until a prefill has passed its position: a
    request that arrives meanwhile cannot start from it (it finds the pages reserved,
    not the state). With real tensors (:mod:`kimilab.prefix.tensors`) the pages hold the
    states' bytes.
    """

    __slots__ = ("alloc", "priority", "serial", "last_access", "touched", "computed")

    def __init__(self, alloc, last_access: float, touched: int):
        self.alloc = alloc
        self.priority = 0.0
        self.serial = -1  # its entry in the heap; -1: none (queued again when it can be evicted)
        self.last_access = last_access
        self.touched = touched  # the request clock at its last use (the tie-break, as a node's)
        self.computed = False


@dataclass(frozen=True)
class Outcome:
    """What one request got from the cache (tokens)."""

    n_tokens: int
    kv_hit: int  # deepest position with KV cached and computed (what an attention model would reuse)
    usable_hit: int  # deepest position with KV AND a state checkpoint: where prefill resumes
    checkpoints_added: int
    checkpoint_positions: tuple = ()
    matched_blocks: int = 0  # whole blocks of the prompt that were cached before it arrived

    @property
    def recomputed(self) -> int:
        return self.n_tokens - self.usable_hit


class HybridPrefixCache:
    """KV blocks in a radix tree plus state checkpoints on its nodes, in one page pool.

    A pool page holds one block of KV (``block_size`` tokens); a checkpoint takes
    ``ceil(checkpoint_bytes / page_bytes)`` pages (0 under ``kv-only``). A hit
    always leaves at least one prompt token to compute (its logits start decoding).
    """

    def __init__(self, pool: PagePool, block_size: int, policy: Policy, costs: CacheCosts, *,
                 partial_blocks: bool = False, allocs_per_node: int = 1):
        if not isinstance(policy, Policy):
            raise ValueError(f"policy: expected a kimilab.prefix.Policy, got {type(policy).__name__}")
        expected = block_size * costs.kv_bytes_per_token
        if pool.page_bytes * allocs_per_node != expected:
            raise ValueError(
                f"pool.page_bytes={pool.page_bytes}: expected block_size * kv_bytes_per_token / "
                f"allocs_per_node = {block_size} * {costs.kv_bytes_per_token} / {allocs_per_node} "
                f"(one block of KV per page, or per page and global layer)"
            )
        check_interval(getattr(policy, "interval", None), block_size, policy.name)
        self.pool = pool
        self.capacity_tokens = None if pool.n_pages >= UNBOUNDED_PAGES else pool.n_pages * block_size
        self.block_size = block_size
        self.page_bytes = pool.page_bytes
        self.policy = policy
        self.costs = costs
        self.checkpoint_pages = 0 if policy.free_states else -(-costs.checkpoint_bytes // pool.page_bytes)
        # The tree's hooks reach this cache through a weak reference. A strong one would be a reference
        # cycle, and a dropped cache (its whole tree) would wait for the cyclic collector, which finds it
        # only by walking every live object: seconds per fleet run (kimilab.gcpause).
        me = weakref.ref(self)
        self.tree = RadixTree(pool, block_size, partial_blocks=partial_blocks, allocs_per_node=allocs_per_node,
                              on_evict=lambda node: me()._on_evict(node), reclaim=lambda need: me().reclaim(need))
        self.tree.priority_of = lambda node: policy.kv_priority(me(), node.last_access, node.end,
                                                                node.payload is not None)
        self.tree.now = lambda: policy.now(me())
        self._checkpoint_key = ("checkpoint", self.checkpoint_pages, costs.checkpoint_bytes)
        self._heap: list = []
        self._serial = 0
        self.n_checkpoints = 0
        self.pages_admitted = 0  # KV + checkpoint pages ever taken: the cache's own clock
        self.checkpoints_admitted = 0
        self.checkpoints_evicted = 0

    @classmethod
    def for_budget(cls, config: ModelConfig, policy: Policy, *, deployment: Deployment, block_size: int,
                   capacity_tokens: int | None, partial_blocks: bool = False) -> "HybridPrefixCache":
        """A cache over an accounting-only pool of ``capacity_tokens // block_size`` pages, sized in
        bytes per device of ``deployment`` (a page: one block of KV on one device).

        ``capacity_tokens=None`` means no limit: nothing is ever evicted, and memory
        grows only with what is cached.
        """
        block_size = check_int("block_size", block_size, 1, unit="tokens")
        capacity_tokens, n_pages = budget_pages(capacity_tokens, block_size)
        costs = shared_costs(config, deployment)
        pool = PagePool(n_pages, block_size * costs.kv_bytes_per_token,
                        backed=False, name=f"prefix-{policy.name}")
        cache = cls(pool, block_size, policy, costs, partial_blocks=partial_blocks)
        cache.capacity_tokens = capacity_tokens
        return cache

    # ----- checkpoints ------------------------------------------------------
    def _push_checkpoint(self, node: Node) -> None:
        ck = node.payload
        self._serial += 1
        ck.serial = self._serial
        ck.priority = priority = self.policy.checkpoint_priority(self, ck.last_access, node.end)
        if len(self._heap) >= COMPACT_SLACK + 4 * max(self.n_checkpoints, 1):
            # before the push: the entry being pushed may be valid only once its caller is done
            # (_on_evict runs while the evicted child is still linked), so it is never swept
            keep = []
            for entry in self._heap:
                if self._valid(entry):
                    keep.append(entry)
                else:
                    self._forget(entry)
            heapq.heapify(keep)
            self._heap = keep
        heapq.heappush(self._heap, (priority, ck.touched, node.end, self._serial, node))

    @staticmethod
    def _forget(entry) -> None:
        """An entry leaves the heap: if it was its checkpoint's only one, mark it for re-queueing."""
        ck = entry[4].payload
        if ck is not None and ck.serial == entry[3]:
            ck.serial = -1

    def _valid(self, entry) -> bool:
        serial, node = entry[3], entry[4]
        ck = node.payload
        if not node.alive or ck is None or ck.serial != serial or node.refcount:
            return False
        if self.policy.protect_branch_points and len(node.children) != 1:
            return False  # branch points stay; a leaf's checkpoint goes with the leaf
        return True

    def _peek_checkpoint(self) -> Node | None:
        """The node of the next checkpoint to evict alone (lowest ``(priority, touched, end)``)."""
        heap, protect = self._heap, self.policy.protect_branch_points
        while heap:
            entry = heap[0]
            serial, node = entry[3], entry[4]  # _valid(), inlined
            ck = node.payload
            if (node.alive and ck is not None and ck.serial == serial and not node.refcount
                    and not (protect and len(node.children) != 1)):
                return node
            heapq.heappop(heap)
            self._forget(entry)  # re-queued when it is evictable again
        return None

    def _drop_checkpoint(self, node: Node) -> None:
        ck = node.payload
        node.payload = None
        self.tree.release(ck.alloc, self._checkpoint_key)
        self.n_checkpoints -= 1
        self.checkpoints_evicted += 1

    def _on_evict(self, node: Node) -> None:
        if node.payload is not None:
            self._drop_checkpoint(node)
        parent = node.parent
        if parent.payload is not None and parent.refcount == 0 and parent.payload.serial == -1:
            self._push_checkpoint(parent)  # it may have become evictable (one child left)

    def reclaim(self, n_pages: int) -> bool:
        """Evict until ``n_pages`` pool pages are free: each time, the lower-ranked of the next
        KV leaf (with its checkpoint) and the next checkpoint alone; False if all is pinned."""
        tree, pool = self.tree, self.pool
        peek_leaf, peek_checkpoint, evict = tree.peek_evictable, self._peek_checkpoint, tree._evict
        while pool.n_free + tree._spare_pages < n_pages:
            leaf = peek_leaf()
            ck_node = peek_checkpoint()
            if ck_node is None:
                if leaf is None:
                    return False
                evict(leaf)
            elif leaf is not None and leaf.priority <= ck_node.payload.priority:
                evict(leaf)
            else:
                self._drop_checkpoint(ck_node)
                tree.requeue(ck_node)  # its rank as a leaf no longer includes the checkpoint
        return True

    def _admit(self, nodes: list) -> list:
        """Give checkpoints to ``nodes`` (root-side first), reclaiming once for all of them.

        If memory runs out (everything else pinned) the deepest ones go without.
        """
        allocs = self.tree.allocate_many("checkpoint", self.checkpoint_pages, len(nodes),
                                         nbytes=self.costs.checkpoint_bytes)
        for node, alloc in zip(nodes, allocs):
            node.payload = Checkpoint(alloc, node.last_access, node.touched)
        self.n_checkpoints += len(allocs)
        self.checkpoints_admitted += len(allocs)
        self.pages_admitted += len(allocs) * self.checkpoint_pages
        return nodes[: len(allocs)]

    # ----- serving ----------------------------------------------------------
    def hits(self, matched: list, matched_tokens: int, n: int) -> tuple:
        """``(kv_hit, usable_hit, usable_node)`` of a prompt of ``n`` tokens whose cached blocks are
        ``matched`` (root-side first, ``matched_tokens`` tokens in all).

        The KV hit stops at the first block whose KV is not computed yet; the usable hit is the end
        of the deepest matched node with a computed checkpoint (``usable_node``; 0 and None when there
        is none). Both stop at ``n - 1``: the last prompt token is always computed, since its logits
        start the decode. A policy with free states (pure attention) uses every KV hit.
        """
        limit = n - 1
        kv = matched_tokens
        for node in matched:
            if not node.computed:  # inserted by a request whose prefill has not reached it yet
                kv = node.end - node.n_tokens
                break
        kv_hit = min(kv, limit)
        if self.policy.free_states:
            return kv_hit, kv_hit, None
        for node in reversed(matched):  # deepest first
            ck = node.payload
            if ck is not None and ck.computed and node.end <= limit:
                return kv_hit, node.end, node
        return kv_hit, 0, None

    def begin(self, keys=None, n_tokens=None, *, tokens=None):
        """Look a prompt up, cache its blocks, admit checkpoints; the path stays pinned.

        Returns ``(outcome, path, usable_node, new_checkpoint_nodes)``; call
        :meth:`finish` with the path when the request no longer needs it.
        """
        tree, policy = self.tree, self.policy
        tree.tick()
        n = len(tokens) if tokens is not None else int(n_tokens)
        if n <= 0:
            raise ValueError(f"n_tokens={n}: expected a prompt of at least one token")
        m, path, _ = tree.insert(keys, n_tokens, tokens=tokens, pin=True)
        self.pages_admitted += (len(path) - len(m.nodes)) * self.tree.allocs_per_node
        for node in path[len(m.nodes):]:
            node.computed = False  # its KV exists once this request's prefill passes it
        kv_hit, usable, usable_node = self.hits(m.nodes, m.hit_tokens, n)
        added = []
        if not policy.free_states:
            j = len(m.nodes) - 1
            branch = 0 <= j < len(path) - 1 and len(path[j].children) >= 2
            placement = Placement([node.end for node in path], len(m.nodes), usable, n, branch)
            wanted = [path[i] for i in policy.positions(placement)]
            wanted = [node for node in wanted if node.payload is None and node.end > usable]
            if wanted:
                added = self._admit(wanted)
            if usable_node is not None:
                ck = usable_node.payload
                ck.last_access, ck.touched = usable_node.last_access, usable_node.touched
                ck.serial = -1  # re-queue at the new rank in finish()
        added_at = tuple(node.end for node in added)
        outcome = Outcome(n, kv_hit, usable, len(added), added_at, len(m.nodes))
        return outcome, path, usable_node, added

    def make_room(self, n_pages: int) -> bool:
        """Evict unpinned blocks and checkpoints until ``n_pages`` pool pages are free (a request's
        own memory comes out of the same pool); False if everything left is pinned."""
        return self.reclaim(check_int("n_pages", n_pages, 0))

    def abandon(self, path, computed: int, start: int = 0) -> None:
        """Unpin a request's path when it stops before its prefill is done (refused or preempted).

        :meth:`begin` put the prompt's blocks and checkpoints in the cache before they
        were computed, and later requests may have shared them while they were in
        flight. An uncomputed block or checkpoint belongs to whoever still holds it: when
        the last holder leaves without computing it, it leaves the cache and its pages
        return to the pool, whichever request put it there. So nobody later hits work
        that was never done. Blocks and checkpoints from ``path[start]`` up to
        ``computed`` are marked computed first (``start``: where this request's own
        prefill began, as in :meth:`mark_computed`); computed ones stay.
        """
        computed = check_int("computed", computed, 0, unit="tokens")
        self.mark_computed(path, computed, start)
        tree = self.tree
        tree.unpin(path)
        for node in path:
            ck = node.payload
            if ck is not None and not ck.computed and node.refcount == 0:
                self.withdraw(node)
        for node in reversed(path):
            if node.computed or node.refcount or node.children or not node.alive:
                break  # an ancestor of a block that stays, stays too
            tree.evict_node(node)
            tree.n_evicted -= 1  # taken back, not evicted
            self.pages_admitted -= tree.allocs_per_node
        self._requeue_checkpoints(path)

    def withdraw(self, node) -> None:
        """Take back the checkpoint :meth:`begin` admitted at ``node`` before anything computed it (its
        request leaves, or needs the room for its own pages): its pages return to the pool."""
        ck = node.payload
        if ck is None or ck.computed:
            raise ValueError(f"node ending at {node.end}: expected an uncomputed checkpoint to withdraw")
        node.payload = None
        self.tree.release(ck.alloc, self._checkpoint_key)
        self.n_checkpoints -= 1
        self.checkpoints_admitted -= 1
        self.pages_admitted -= self.checkpoint_pages

    def finish(self, path, start: int = 0) -> None:
        """Unpin a request's path after its whole prompt was computed from ``path[start]`` on
        (default: all of it, as in a replay); those blocks and checkpoints are computed, and all of the
        path's become evictable again."""
        self.mark_computed(path, path[-1].end if path else 0, start)
        self.tree.unpin(path)
        self._requeue_checkpoints(path)

    @staticmethod
    def mark_computed(path, done: int, start: int = 0) -> int:
        """A prefill that began at ``path[start]`` has reached token ``done``: the blocks and
        checkpoints it passed hold real KV and states now (those before ``start`` are someone
        else's). Returns the index of the first node past ``done``: the next call's ``start``."""
        i, n = start, len(path)
        while i < n and path[i].end <= done:
            path[i].computed = True
            ck = path[i].payload
            if ck is not None:
                ck.computed = True
            i += 1
        return i

    def _requeue_checkpoints(self, path) -> None:
        if self.policy.free_states:
            return
        for node in path:
            ck = node.payload
            if ck is not None and ck.serial == -1 and node.alive and node.refcount == 0:
                self._push_checkpoint(node)

    def serve(self, keys=None, n_tokens=None, *, tokens=None) -> Outcome:
        """One request, start to end (accounting only)."""
        outcome, path, _, _ = self.begin(keys, n_tokens, tokens=tokens)
        self.finish(path)
        return outcome

    def close(self) -> None:
        """Done with this cache: unlink its tree so it is freed at once when dropped (:meth:`RadixTree.close`)."""
        self.tree.close()
        self._heap = []

    def evict_all(self) -> None:
        """Drop every unpinned checkpoint and block (what is pinned stays)."""
        for node in self.tree.nodes():
            if node.payload is not None and node.refcount == 0:
                self._drop_checkpoint(node)
                self.checkpoints_evicted -= 1  # a clear-out, not an eviction decision
        self.tree.evict_all()

    # ----- accounting -------------------------------------------------------
    @property
    def clock(self) -> int:
        """Requests served so far (the request clock of LRU policies)."""
        return self.tree.clock

    @property
    def turnover(self) -> float:
        """Pages admitted so far / pool pages: how many times the cache has been refilled."""
        return self.pages_admitted / self.pool.n_pages

    @property
    def kv_pages(self) -> int:
        return self.tree.n_pages

    @property
    def checkpoint_pages_used(self) -> int:
        return self.n_checkpoints * self.checkpoint_pages

    def check_invariants(self) -> None:
        """Pool pages == KV pages in the tree + checkpoint pages; every checkpoint on a live node."""
        self.tree.check_invariants()
        nodes = self.tree.nodes()
        assert all(n.computed or n.refcount for n in nodes), "an unpinned block was never computed"
        with_ck = [n for n in nodes if n.payload is not None]
        assert len(with_ck) == self.n_checkpoints, (len(with_ck), self.n_checkpoints)
        queued = {id(e[4]): e for e in self._heap if self._valid(e)}
        protect = self.policy.protect_branch_points
        for node in with_ck:  # every checkpoint that may go alone is queued at its current rank
            if node.refcount or (protect and len(node.children) != 1) or self.policy.free_states:
                continue
            ck = node.payload
            rank = self.policy.checkpoint_priority(self, ck.last_access, node.end)
            assert queued.get(id(node), (None,))[:3] == (rank, ck.touched, node.end), \
                f"the checkpoint at {node.end} is evictable but not queued at its rank"
        stats = self.pool.stats()
        assert stats.pages_by_kind["kv"] == self.kv_pages
        assert stats.pages_by_kind["checkpoint"] == self.checkpoint_pages_used
        assert self.pool.n_used == self.kv_pages + self.checkpoint_pages_used


