"""The fast twin of :class:`HybridPrefixCache` for accounting-only replays: one node per *run* of blocks.

Replaying a real trace through :class:`~kimilab.prefix.hybrid.HybridPrefixCache`
creates and evicts one tree node per 512-token block -- about 240,000 of each for
the Mooncake conversation hour -- and that Python work, not the cache logic, is
what a replay costs. Most of those blocks sit in chains nobody branches from (a
request's new suffix, used once): :class:`RunPrefixCache` keeps such a chain as ONE
node (a *run*: blocks at depths ``lo..hi``, stamped and pinned together), splits a
run only where a later prompt stops or branches inside it, and evicts a run's tail
block by block with the block tree's ranks and tie-breaking.

It is a *twin*, not a second design: the same policies (:mod:`kimilab.prefix.policies`),
the same clock, the same heaps of checkpoints, and a test holds every request's
:class:`~kimilab.prefix.hybrid.Outcome` equal to the block tree's, under random
traces and on the real one. Scope: accounting only (page counts, no tensors),
one request at a time (:meth:`serve`), whole blocks keyed by hash ids.
"""

from __future__ import annotations

import bisect
import heapq

from kimilab.config import ModelConfig
from kimilab.costs import Deployment
from kimilab.pool.pages import UNBOUNDED_PAGES, PageCount
from kimilab.prefix.blocks import split_prompt
from kimilab.prefix.hybrid import Outcome, shared_costs
from kimilab.prefix.policies import Placement, Policy, check_interval
from kimilab.validate import check_int

__all__ = ["RunPrefixCache"]


class _Run:
    """Blocks at depths ``lo..hi`` of one path (block d ends at token d * block_size)."""

    __slots__ = ("key", "keys", "lo", "hi", "parent", "children", "refcount", "last_access", "priority",
                 "heap_serial", "checkpoints", "alive")

    def __init__(self, keys: list, lo: int, parent, last_access: float):
        self.key = keys[0] if keys else None
        self.keys = keys
        self.lo, self.hi = lo, lo + len(keys) - 1
        self.parent = parent
        self.children: dict = {}
        self.refcount = 0
        self.last_access = last_access
        self.priority = 0.0
        self.heap_serial = -1
        self.checkpoints: dict = {}  # depth -> _Checkpoint
        self.alive = True


class _Checkpoint:
    __slots__ = ("run", "depth", "last_access", "priority", "serial")

    def __init__(self, run: _Run, depth: int, last_access: float):
        self.run, self.depth, self.last_access = run, depth, last_access
        self.priority = 0.0
        self.serial = -1


class RunPrefixCache:
    """Accounting-only hybrid prefix cache over runs of blocks; results equal :class:`HybridPrefixCache`'s."""

    def __init__(self, config: ModelConfig, policy: Policy, *, deployment: Deployment, block_size: int,
                 capacity_tokens: int | None):
        if not isinstance(policy, Policy):
            raise ValueError(f"policy: expected a kimilab.prefix.Policy, got {type(policy).__name__}")
        self.block_size = block_size = check_int("block_size", block_size, 1, unit="tokens")
        check_interval(getattr(policy, "interval", None), block_size, policy.name)
        if capacity_tokens is None:
            n_pages = UNBOUNDED_PAGES
        else:
            capacity_tokens = check_int("capacity_tokens", capacity_tokens, 1, unit="tokens")
            if capacity_tokens < block_size:
                raise ValueError(f"capacity_tokens={capacity_tokens}: expected at least one block "
                                 f"(block_size={block_size})")
            n_pages = min(capacity_tokens // block_size, UNBOUNDED_PAGES)
        self.capacity_tokens = capacity_tokens
        self.costs = costs = shared_costs(config, deployment)
        self.pool = PageCount(n_pages, block_size * costs.kv_bytes_per_token)
        self.policy = policy
        self.checkpoint_pages = 0 if policy.free_states else -(-costs.checkpoint_bytes // self.pool.page_bytes)
        self.root = _Run([], 1, None, 0.0)
        self.root.hi = 0
        self.root.refcount = 1
        self.clock = 0
        self.n_runs = self.n_blocks = self.n_evicted = 0
        self._leaf_heap: list = []
        self._leaf_serial = 0
        self._heap: list = []
        self._serial = 0
        self.n_checkpoints = self.checkpoints_admitted = self.checkpoints_evicted = 0
        self.pages_admitted = 0

    # ----- the clock and the ranks (as HybridPrefixCache) ------------------------
    @property
    def turnover(self) -> float:
        return self.pages_admitted / self.pool.n_pages

    @property
    def kv_pages(self) -> int:
        return self.n_blocks

    @property
    def checkpoint_pages_used(self) -> int:
        return self.n_checkpoints * self.checkpoint_pages

    def _push_leaf(self, run: _Run) -> None:
        self._leaf_serial += 1
        run.heap_serial = serial = self._leaf_serial
        run.priority = priority = self.policy.kv_priority(self, run.last_access, run.hi * self.block_size,
                                                          run.hi in run.checkpoints)
        heapq.heappush(self._leaf_heap, (priority, serial, run))
        if len(self._leaf_heap) > 64 + 4 * self.n_runs:
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

    def _ck_valid(self, entry) -> bool:
        _, serial, ck = entry
        run = ck.run
        if run is None or ck.serial != serial or run.refcount:
            return False
        if self.policy.protect_branch_points:
            children = 1 if ck.depth < run.hi else len(run.children)
            if children != 1:
                return False
        return True

    @staticmethod
    def _forget(entry) -> None:
        ck = entry[2]
        if ck.run is not None and ck.serial == entry[1]:
            ck.serial = -1

    def _push_checkpoint(self, ck: _Checkpoint) -> None:
        self._serial += 1
        ck.serial = serial = self._serial
        ck.priority = priority = self.policy.checkpoint_priority(self, ck.last_access, ck.depth * self.block_size)
        heapq.heappush(self._heap, (priority, serial, ck))
        if len(self._heap) > 64 + 4 * max(self.n_checkpoints, 1):
            keep = []
            for entry in self._heap:
                if self._ck_valid(entry):
                    keep.append(entry)
                else:
                    self._forget(entry)
            heapq.heapify(keep)
            self._heap = keep

    def _peek_checkpoint(self) -> _Checkpoint | None:
        heap = self._heap
        while heap:
            if self._ck_valid(heap[0]):
                return heap[0][2]
            self._forget(heapq.heappop(heap))
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

    def _trim(self, run: _Run, n_pages: int, rival: _Run | None, ck: _Checkpoint | None) -> bool:
        """Evict the pending ``run``'s tail blocks in a tight loop while that touches no queue.

        A block goes this way when neither it nor the block before it holds a
        checkpoint and the run keeps a block: then no checkpoint is dropped or queued,
        the next queued leaf (``rival``) and checkpoint (``ck``) stay the same, and the
        run stays first while its new rank is below both (as :meth:`reclaim` decides).
        Returns True when the next block needs the general path (:meth:`_evict_block`),
        False when enough pages are free or the run is no longer first.
        """
        pool, policy, cks = self.pool, self.policy, run.checkpoints
        if not policy.lru_leaves:  # the rank may change with every block: the general path, block by block
            return True
        # A leaf without a checkpoint ranks by its last use alone: the same rank after every
        # block, so the whole stretch down to the next checkpoint goes in one step.
        if run.hi in cks:
            return True
        below = max([d for d in cks if d < run.hi], default=0)
        room = run.hi - max(run.lo + 1, below + 2) + 1  # blocks that may go this way
        if room <= 0:
            return True
        rank = run.last_access
        stuck = (rival is not None and rank >= rival.priority) or (ck is not None and rank > ck.priority)
        k = 1 if stuck else min(room, n_pages - pool.n_free)
        del run.keys[-k:]
        run.hi -= k
        self.n_blocks -= k
        self.n_evicted += k
        pool.n_free += k
        run.priority = rank
        return k == room and not stuck and pool.n_free < n_pages

    def _allocate(self, n_pages: int, count: int) -> int:
        """How many of ``count`` allocations of ``n_pages`` pages fit, reclaiming once for all."""
        if count <= 0:
            return 0
        if self.pool.n_free < n_pages * count:
            self.reclaim(n_pages * count)
        got = min(count, self.pool.n_free // n_pages)
        self.pool.n_free -= got * n_pages
        return got

    # ----- the tree -----------------------------------------------------------------
    def _split(self, run: _Run, n: int) -> _Run:
        """Cut ``run`` after its first ``n`` blocks; the tail keeps the run object (and its heap entry)."""
        head = _Run(run.keys[:n], run.lo, run.parent, run.last_access)
        head.refcount = run.refcount
        run.parent.children[run.key] = head
        run.keys = run.keys[n:]
        run.key = run.keys[0]
        run.lo += n
        run.parent = head
        head.children[run.key] = run
        for depth in [d for d in run.checkpoints if d < run.lo]:
            ck = head.checkpoints[depth] = run.checkpoints.pop(depth)
            ck.run = head
        self.n_runs += 1
        return head

    def _match(self, keys: list) -> tuple[list, int]:
        """(runs of the longest cached prefix, split so the last ends where the match does; blocks)."""
        run, i, path = self.root, 0, []
        while i < len(keys):
            child = run.children.get(keys[i])
            if child is None:
                break
            own = child.keys
            j = len(own)
            seg = keys[i:i + j]
            if seg != own:
                j = 1
                while j < len(seg) and seg[j] == own[j]:
                    j += 1
                if j < len(own):  # the prompt stops or branches inside this run
                    path.append(self._split(child, j))
                    i += j
                    break
            path.append(child)
            i += j
            run = child
        return path, i

    # ----- serving ------------------------------------------------------------------
    def serve(self, keys=None, n_tokens=None, *, tokens=None) -> Outcome:
        """One request, start to end: the same :class:`Outcome` as ``HybridPrefixCache.serve``."""
        if tokens is not None:
            raise ValueError("tokens: RunPrefixCache replays hash-id traces only (give keys= and n_tokens=)")
        policy, block = self.policy, self.block_size
        self.clock += 1
        n = int(n_tokens)
        if n <= 0:
            raise ValueError(f"n_tokens={n}: expected a prompt of at least one token")
        keys, _, _ = split_prompt(keys, n, None, block, False)
        path, matched = self._match(keys)
        now = policy.now(self)
        for run in path:
            run.refcount += 1
            run.last_access = now
        last = path[-1] if path else self.root
        new = len(keys) - matched
        if new:
            if keys[matched] in last.children:
                raise ValueError(f"keys[{matched}]={keys[matched]!r}: already cached with a different length")
            got = self._allocate(1, new)
            if got:
                extend = keys[matched:matched + got]
                if last is not self.root and not last.children:  # a leaf extended: the run grows
                    last.keys.extend(extend)
                    last.hi += got
                    last.heap_serial = -1
                else:
                    run = _Run(extend, last.hi + 1, last, now)
                    run.refcount = 1
                    last.children[run.key] = run
                    path.append(run)
                    self.n_runs += 1
                self.n_blocks += got
                self.pages_admitted += got
            new = got
        n_path = matched + new
        limit = n - 1
        kv_hit = min(matched * block, limit)
        added = []
        if policy.free_states:
            usable = kv_hit
        else:
            usable, usable_ck = 0, None
            bound = min(matched, limit // block)
            for run in reversed(path):
                if run.lo > bound:
                    continue
                found = [d for d in run.checkpoints if d <= bound]
                if found:
                    usable_ck = run.checkpoints[max(found)]
                    usable = usable_ck.depth * block
                    break
            j = matched - 1
            # a branch: new blocks hang from the last matched block as a second (or later) child run
            branch = (0 <= j < n_path - 1 and len(path) >= 2 and path[-2].hi == matched
                      and len(path[-2].children) >= 2)
            ends = range(block, (n_path + 1) * block, block)  # every block is whole: ends are multiples
            wanted = [i + 1 for i in policy.positions(Placement(ends, matched, usable, n, branch))
                      if (i + 1) * block > usable]
            if wanted:
                los = [run.lo for run in path]
                wanted = [(path[bisect.bisect_right(los, d) - 1], d) for d in wanted]
                wanted = [(run, d) for run, d in wanted if d not in run.checkpoints]
            got = self._allocate(self.checkpoint_pages, len(wanted))
            for run, d in wanted[:got]:
                run.checkpoints[d] = _Checkpoint(run, d, run.last_access)
                added.append(d * block)
            self.n_checkpoints += got
            self.checkpoints_admitted += got
            self.pages_admitted += got * self.checkpoint_pages
            if usable_ck is not None:
                usable_ck.last_access = usable_ck.run.last_access
                usable_ck.serial = -1
        outcome = Outcome(n, kv_hit, usable, len(added), tuple(added), matched)
        self._finish(path)
        return outcome

    def _finish(self, path: list) -> None:
        for run in path:
            run.refcount -= 1
            if run.refcount == 0 and not run.children:
                self._push_leaf(run)
        if self.policy.free_states:
            return
        for run in path:
            cks = run.checkpoints
            if run.refcount or not cks:
                continue
            for depth in sorted(cks) if len(cks) > 1 else cks:
                ck = cks[depth]
                if ck.serial == -1:
                    self._push_checkpoint(ck)

    def check_invariants(self) -> None:
        """Pages used == blocks + checkpoint pages; runs are consistent chains."""
        blocks = checkpoints = runs = 0
        stack = list(self.root.children.values())
        while stack:
            run = stack.pop()
            runs += 1
            assert run.alive and run.lo <= run.hi and len(run.keys) == run.hi - run.lo + 1
            assert run.parent.children.get(run.key) is run and run.lo == run.parent.hi + 1
            assert run.refcount >= 0
            blocks += len(run.keys)
            for d, ck in run.checkpoints.items():
                assert ck.run is run and ck.depth == d and run.lo <= d <= run.hi
            checkpoints += len(run.checkpoints)
            stack.extend(run.children.values())
        assert (runs, blocks, checkpoints) == (self.n_runs, self.n_blocks, self.n_checkpoints)
        assert self.pool.n_used == blocks + checkpoints * self.checkpoint_pages
