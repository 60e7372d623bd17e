"""The eviction order of :class:`~kimilab.prefix.runs.RunPrefixCache`: the block tree's, over runs.

Two heaps, as :class:`~kimilab.prefix.hybrid.HybridPrefixCache` keeps them: evictable leaf
runs by the policy's rank of their last block, and checkpoints by the policy's rank.
:meth:`RunEviction.reclaim` takes the lower of the two tops, block by block, with the block
tree's tie-breaking; where the next blocks provably go in the same order -- a leaf run that
stays first while its tail is trimmed -- :meth:`RunEviction._trim` takes them in one step.
"""

from __future__ import annotations

import heapq
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # the run tree's node types, for the annotations only (runs.py imports this mixin)
    from kimilab.prefix.runs import _Checkpoint, _Run

__all__ = ["RunEviction"]


class _Batch:
    """Checkpoints queued together, in order: one rank and increasing serials that no other entry
    can fall between, so the heap holds them as one entry (key: rank, first serial) and hands
    them out one by one from ``i`` -- as the block tree's heap would, one entry each."""

    __slots__ = ("cks", "serials", "i")

    def __init__(self, cks: list, serials):
        self.cks, self.serials, self.i = cks, serials, 0


class RunEviction:
    """Mixin: the heaps, the reclaim loop and the tail trimming of a run tree (see the module doc)."""

    HEAP_SLACK = 64  # a heap is compacted past HEAP_SLACK + 4 x its live entries (HybridPrefixCache's rule)
    BATCH = 4  # checkpoints of one rank queued together go in as one heap entry from this many on

    def _push_leaf(self, run: _Run) -> None:
        self._leaf_serial += 1
        run.heap_serial = serial = self._leaf_serial
        run.priority = priority = self.policy.kv_priority(self, run.last_access, run.hi * self.block_size,
                                                          run.hi in run.checkpoints)
        heapq.heappush(self._leaf_heap, (priority, serial, run))
        if len(self._leaf_heap) > self.HEAP_SLACK + 4 * self.n_runs:
            self._leaf_heap = [e for e in self._leaf_heap if self._leaf_valid(e)]
            heapq.heapify(self._leaf_heap)

    @staticmethod
    def _leaf_valid(entry) -> bool:
        _, serial, run = entry
        return run.alive and run.heap_serial == serial and run.refcount == 0 and not run.children

    def _peek_leaf(self) -> _Run | None:
        heap = self._leaf_heap
        while heap:
            if self._leaf_valid(heap[0]):
                return heap[0][2]
            heapq.heappop(heap)
        return None

    def _ck_valid(self, ck, serial: int) -> bool:
        run = ck.run
        if run is None or ck.serial != serial or run.refcount:
            return False
        if self.policy.protect_branch_points:
            children = 1 if ck.depth < run.hi else len(run.children)
            if children != 1:
                return False
        return True

    def _forget(self, ck, serial: int) -> None:
        """An entry leaves the heap: if it was its checkpoint's only one, the checkpoint waits unqueued
        until a request's path passes its run again (``_finish`` requeues it)."""
        if ck.run is not None and ck.serial == serial:
            ck.serial = -1
            self._unqueued.add(ck)

    def _push_checkpoint(self, ck: _Checkpoint) -> None:
        self._push_checkpoints((ck,))

    def _push_checkpoints(self, cks) -> None:
        """Queue checkpoints in order, each with the next serial, as the block tree pushes them one by
        one. An entry is ``(rank, serial, checkpoint)``, or, for a stretch of at least ``BATCH``
        checkpoints of equal rank, ``(rank, first serial, _Batch)``. The heap is compacted exactly
        where the block tree's would be: after the push that takes the number of queued
        checkpoints past ``HEAP_SLACK + 4 * n_checkpoints``."""
        n = len(cks)
        if not n:
            return
        policy, block = self.policy, self.block_size
        if policy.lru_checkpoints:  # then a checkpoint's rank is its last use
            ranks = [ck.last_access for ck in cks]
        else:
            ranks = [policy.checkpoint_priority(self, ck.last_access, ck.depth * block) for ck in cks]
        limit = self.HEAP_SLACK + 4 * max(self.n_checkpoints, 1)
        heap, push = self._heap, heapq.heappush
        if n < self.BATCH:  # a few: one entry each
            for ck, rank in zip(cks, ranks):
                self._serial += 1
                ck.serial = serial = self._serial
                push(heap, (rank, serial, ck))
                self._queued += 1
                if self._queued > limit:
                    self._compact()
                    heap = self._heap
            return
        one_rank = ranks.count(ranks[0]) == n  # the common case, in one pass
        start = 0
        while start < n:
            rank = ranks[start]
            stop = n if one_rank else start + 1
            if n - start >= self.BATCH:
                while stop < n and ranks[stop] == rank:
                    stop += 1
            stop = min(stop, start + max(1, limit - self._queued + 1))  # the push that passes the limit ends it
            if stop - start < self.BATCH:
                for ck in cks[start:stop]:
                    self._serial += 1
                    ck.serial = self._serial
                    push(heap, (rank, self._serial, ck))
            else:
                batch = cks[start:stop] if start or stop < n else list(cks)
                base = self._serial + 1
                self._serial += len(batch)
                for serial, ck in enumerate(batch, base):  # (a checkpoint's rank is set when it is next)
                    ck.serial = serial
                push(heap, (rank, base, _Batch(batch, range(base, self._serial + 1))))
            self._queued += stop - start
            if self._queued > limit:
                self._compact()
                heap = self._heap
            start = stop

    def _compact(self) -> None:
        """Drop every entry that is no longer its checkpoint's evictable one (forgetting the pinned)."""
        keep, queued, valid = [], 0, self._ck_valid
        for entry in self._heap:
            rank, serial, x = entry
            if x.__class__ is not _Batch:
                if valid(x, serial):
                    keep.append(entry)
                    queued += 1
                else:
                    self._forget(x, serial)
                continue
            cks, serials = [], []
            for ck, serial in zip(x.cks[x.i:], x.serials[x.i:]):
                if valid(ck, serial):
                    cks.append(ck)
                    serials.append(serial)
                else:
                    self._forget(ck, serial)
            if cks:
                keep.append((rank, serials[0], _Batch(cks, serials)))
                queued += len(cks)
        heapq.heapify(keep)
        self._heap, self._queued = keep, queued

    def _peek_checkpoint(self):
        """The next valid checkpoint (``_ck_valid``, inlined: this runs once per eviction decision);
        the entries passed over leave the queue."""
        heap, protect = self._heap, self.policy.protect_branch_points
        while heap:
            rank, serial, x = heap[0]
            if x.__class__ is not _Batch:
                run = x.run
                if run is not None and x.serial == serial:
                    if not run.refcount and (not protect or (1 if x.depth < run.hi else len(run.children)) == 1):
                        x.priority = rank
                        return x
                    x.serial = -1  # _forget, inlined
                    self._unqueued.add(x)
                self._queued -= 1
                heapq.heappop(heap)
                continue
            cks, serials, i = x.cks, x.serials, x.i
            n = len(cks)
            while i < n:
                ck = cks[i]
                run = ck.run
                if run is not None and ck.serial == serials[i]:
                    if not run.refcount and (not protect or (1 if ck.depth < run.hi else len(run.children)) == 1):
                        self._queued -= i - x.i
                        x.i = i
                        ck.priority = rank
                        return ck
                    ck.serial = -1  # _forget, inlined
                    self._unqueued.add(ck)
                i += 1
            self._queued -= n - x.i
            heapq.heappop(heap)
        return None

    # ----- eviction ---------------------------------------------------------------
    def _drop_checkpoint(self, ck: _Checkpoint) -> None:
        del ck.run.checkpoints[ck.depth]
        ck.run = None
        self.n_checkpoints -= 1
        self.checkpoints_evicted += 1
        self.pool.n_free += self.checkpoint_pages

    def _evict_block(self, run: _Run) -> bool:
        """Evict the last block of an evictable leaf run (the block tree's ``_evict`` of one leaf).

        Returns True if the run still has blocks: its new last block is then an
        unpinned leaf, which the caller must queue (``_push_leaf``) before anything
        else enters the leaf queue -- :meth:`reclaim` may first trim it further.
        """
        hi = run.hi
        ck = run.checkpoints.get(hi)
        if ck is not None:
            self._drop_checkpoint(ck)
        owner, depth = (run, hi - 1) if run.lo < hi else (run.parent, run.lo - 1)
        parent_ck = owner.checkpoints.get(depth)
        if parent_ck is not None and owner.refcount == 0 and parent_ck.serial == -1:
            self._push_checkpoint(parent_ck)
        run.keys.pop()
        run.hi = hi - 1
        self.n_blocks -= 1
        self.n_evicted += 1
        self.pool.n_free += 1
        if run.lo <= run.hi:
            return True
        parent = run.parent
        del parent.children[run.key]
        run.alive = False
        self.n_runs -= 1
        if parent.refcount == 0 and not parent.children and parent is not self.root:
            self._push_leaf(parent)
        return False

    def reclaim(self, n_pages: int) -> bool:
        """Evict until ``n_pages`` are free, in exactly the block tree's order.

        A leaf run whose tail was just evicted stays *pending* instead of going back
        into the leaf queue: the block tree would queue its new last block with the
        newest serial, so it comes out next only if its rank is strictly below every
        queued leaf's -- which is checked directly, and the run trimmed again in place.
        """
        pool, policy, block = self.pool, self.policy, self.block_size
        pending = None
        try:
            while pool.n_free < n_pages:
                leaf = top = self._peek_leaf()
                if pending is not None:
                    if top is None or pending.priority < top.priority:
                        leaf = pending
                    else:
                        self._push_leaf(pending)
                        pending = None
                ck = self._peek_checkpoint()
                if ck is not None and (leaf is None or leaf.priority > ck.priority):
                    if pending is not None:
                        self._push_leaf(pending)
                        pending = None
                    run = ck.run
                    self._drop_checkpoint(ck)
                    if ck.depth == run.hi and run.refcount == 0 and not run.children:
                        self._push_leaf(run)  # requeue: its rank no longer includes the checkpoint
                    continue
                if leaf is None:
                    return False
                if leaf is pending and not self._trim(leaf, n_pages, top, ck):
                    continue
                if self._evict_block(leaf):
                    pending = leaf
                    leaf.heap_serial = -1  # any queued entry of it is stale now
                    leaf.priority = policy.kv_priority(self, leaf.last_access, leaf.hi * block,
                                                       leaf.hi in leaf.checkpoints)
                else:
                    pending = None
        finally:
            if pending is not None:
                self._push_leaf(pending)
        return True

    def _trim(self, run, n_pages: int, rival, ck) -> bool:
        """Evict the pending ``run``'s tail blocks in a tight loop while that changes no queue's order.

        The run is first (reclaim just chose it at its rank ``run.priority``), so its last block
        goes. Under a policy that ranks a leaf without a checkpoint by its last use alone
        (``lru_leaves``) -- and, with ``lru_checkpoints``, a leaf with one too -- the next block
        has the same rank; a tail block's checkpoint goes with it, as in the block tree, which only
        raises the top of the checkpoint queue; so the run stays first while its rank is below the
        next queued leaf's (``rival``) and at most the top checkpoint's (``ck``). It stops when the
        next block's rank differs (returning False: reclaim compares again), before a block whose
        predecessor holds an unqueued checkpoint (the block tree would queue it: the general path),
        at the run's last block, or when enough pages are free. Returns True when the next block
        needs the general path (:meth:`_evict_block`), False otherwise.
        """
        pool, policy, cks = self.pool, self.policy, run.checkpoints
        rank = run.priority
        if not policy.lru_leaves or (rival is not None and rank >= rival.priority) or (
                ck is not None and rank > ck.priority):
            return True
        lru_ck, block = policy.lru_checkpoints, self.block_size
        hi, k, dropped, per_ck = run.hi, 0, 0, self.checkpoint_pages
        free, changed = pool.n_free, False
        steady = lru_ck and rank == run.last_access  # then no block's rank can differ from the run's
        while free < n_pages and hi > run.lo:
            below = cks.get(hi - 1)
            if below is not None and below.serial == -1:
                break  # evicting this block queues the checkpoint below it: the general path
            if hi in cks:
                cks.pop(hi).run = None  # _drop_checkpoint, inlined: the block tree drops it with the block
                dropped += 1
                free += per_ck
            hi, k = hi - 1, k + 1
            free += 1
            if steady:
                continue
            nxt = (policy.kv_priority(self, run.last_access, hi * block, True) if hi in cks and not lru_ck
                   else run.last_access)
            if nxt != rank:  # the next block ranks differently: let reclaim compare again
                rank, changed = nxt, True
                break
        pool.n_free = free
        if dropped:
            self.n_checkpoints -= dropped
            self.checkpoints_evicted += dropped
        if k:
            del run.keys[-k:]
            run.hi = hi
            self.n_blocks -= k
            self.n_evicted += k
        run.priority = rank
        return not changed and pool.n_free < n_pages
