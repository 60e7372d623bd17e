"""The fast twin of :class:`HybridPrefixCache` for accounting-only replays: one node per *run* of blocks.

Replaying a real trace through the block tree creates and evicts one node per 512-token block
(about 240,000 of each for the Mooncake conversation hour), and that Python work, not the
cache logic, is what a replay costs. Most blocks sit in chains nobody branches from (a
request's new suffix, used once): :class:`RunPrefixCache` keeps such a chain as ONE node (a
*run*: blocks ``lo..hi`` stamped and pinned together), splits it only where a later prompt stops
or branches inside it, and trims its tail while that tail stays first in the eviction order.

A *twin*, not a second design: the same policies, the same clock, and the same total eviction
order (:mod:`kimilab.prefix.radix`), so a test holds every request's outcome, page count and
eviction count equal to the block tree's though the two keep their queues differently. Scope:
accounting only, one request at a time (:meth:`serve`), whole blocks keyed by hash ids.
"""

from __future__ import annotations

import bisect
import heapq

from kimilab.config import ModelConfig
from kimilab.costs import Deployment
from kimilab.pool.pages import PageCount
from kimilab.prefix.blocks import split_prompt
from kimilab.prefix.hybrid import Outcome, budget_pages, shared_costs
from kimilab.prefix.nodes import Run, RunCheckpoint
from kimilab.prefix.policies import Placement, Policy, check_interval
from kimilab.prefix.precision import checkpoint_bytes as precision_bytes
from kimilab.prefix.radix import COMPACT_SLACK
from kimilab.validate import check_int

__all__ = ["RunPrefixCache"]



class RunPrefixCache:
    """Accounting-only hybrid prefix cache over runs of blocks; results equal :class:`HybridPrefixCache`'s.

    Two lazy queues hold what may be evicted: leaf runs, keyed by their last block, and
    checkpoints alone. An entry is ``(rank, touched, depth, version, item)``; it is stale once
    its item's ``version`` moved on, and a checkpoint that turns out not evictable (pinned, or a
    protected branch point) is *parked* on its run until a request passes the run again or the
    run loses a child.
    """

    def __init__(self, config: ModelConfig, policy: Policy, *, deployment: Deployment, block_size: int,
                 capacity_tokens: int | None, precision: str = "native"):
        if not isinstance(policy, Policy):
            raise ValueError(f"policy: expected a kimilab.prefix.Policy, got {type(policy).__name__}")
        self.block_size = block_size = check_int("block_size", block_size, 1, unit="tokens")
        check_interval(getattr(policy, "interval", None), block_size, policy.name)
        self.capacity_tokens, n_pages = budget_pages(capacity_tokens, block_size)
        self.costs = costs = shared_costs(config, deployment)
        self.pool = PageCount(n_pages, block_size * costs.kv_bytes_per_token)
        self.policy = policy
        self.precision = precision  # the checkpoints' (kimilab.prefix.precision): sets their pages
        self.checkpoint_bytes = precision_bytes(config, deployment, precision)
        self.checkpoint_pages = 0 if policy.free_states else -(-self.checkpoint_bytes // self.pool.page_bytes)
        self.root = Run([], 1, None, 0.0, 0)
        self.root.hi = 0
        self.root.refcount = 1
        self.clock = 0
        self.n_runs = self.n_blocks = self.n_evicted = 0
        self._leaves: list = []
        self._checkpoints: list = []
        self._version = 0
        self.n_checkpoints = self.checkpoints_admitted = self.checkpoints_evicted = 0
        self.pages_admitted = 0

    @property
    def turnover(self) -> float:
        return self.pages_admitted / self.pool.n_pages

    @property
    def kv_pages(self) -> int:
        return self.n_blocks

    @property
    def checkpoint_pages_used(self) -> int:
        return self.n_checkpoints * self.checkpoint_pages

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
    def _split(self, run: Run, n: int) -> Run:
        """Cut ``run`` after its first ``n`` blocks; the tail keeps the run object (and its queue entry)."""
        head = Run(run.keys[:n], run.lo, run.parent, run.last_access, run.touched)
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
        if run.parked:
            head.parked = [ck for ck in run.parked if ck.run is head]
            run.parked = [ck for ck in run.parked if ck.run is run]
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
        now, clock = policy.now(self), self.clock
        for run in path:
            run.refcount += 1
            run.last_access, run.touched = now, clock
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
                    last.version = -1
                else:
                    run = Run(extend, last.hi + 1, last, now, clock)
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
        added, requeue = [], []
        if policy.free_states:
            usable = kv_hit
        else:
            usable, usable_ck = 0, None
            bound = min(matched, limit // block)
            for run in reversed(path):
                if run.lo > bound:
                    continue
                cks, top = run.checkpoints, min(bound, run.hi)
                if 4 * len(cks) >= top - run.lo + 1:  # dense (every-block): walk down from the bound
                    best = next((d for d in range(top, run.lo - 1, -1) if d in cks), None)
                else:
                    best = max((d for d in cks if d <= bound), default=None)
                if best is not None:
                    usable_ck = cks[best]
                    usable = usable_ck.depth * block
                    break
            j = matched - 1
            # a branch: new blocks hang from the last matched block as a second (or later) child run
            branch = (0 <= j < n_path - 1 and len(path) >= 2 and path[-2].hi == matched
                      and len(path[-2].children) >= 2)
            ends = range(block, (n_path + 1) * block, block)  # every block is whole: ends are multiples
            first = usable // block  # positions are depths - 1; only those past the usable hit count
            positions = policy.positions(Placement(ends, matched, usable, n, branch))
            if isinstance(positions, range):  # every block past the hit: cut run by run
                wanted = self._wanted_runs(path, positions, first, matched)
            else:
                wanted = self._wanted_at(path, positions, first)
            got = left = self._allocate(self.checkpoint_pages, sum(len(ds) for _, ds in wanted))
            for run, ds in wanted:  # the first ``got``, in tree order
                if not left:
                    break
                ds = ds[:left]
                left -= len(ds)
                stamp, touched = run.last_access, run.touched
                cks = [RunCheckpoint(run, d, stamp, touched) for d in ds]
                run.checkpoints.update(zip(ds, cks))
                requeue += cks
                added += [d * block for d in ds]
            self.n_checkpoints += got
            self.checkpoints_admitted += got
            self.pages_admitted += got * self.checkpoint_pages
            if usable_ck is not None:
                usable_ck.last_access, usable_ck.touched = usable_ck.run.last_access, usable_ck.run.touched
                usable_ck.version = -1  # queued again at its new rank
                requeue.append(usable_ck)
        outcome = Outcome(n, kv_hit, usable, len(added), tuple(added), matched)
        self._finish(path, requeue)
        return outcome

    @staticmethod
    def _wanted_runs(path: list, positions: range, first: int, matched: int) -> list:
        """``[(run, depths)]``: the new checkpoints' depths for a ``range`` of positions (position
        + 1, past ``first`` and not yet held), cut by the path runs holding them, in tree order.
        Only depths up to ``matched`` (blocks cached before this request) can hold one already."""
        start, stop = max(positions.start + 1, first + 1), positions.stop + 1
        out = []
        for run in path:
            lo, hi = max(run.lo, start), min(run.hi + 1, stop)
            if lo < hi:
                cks, old = run.checkpoints, min(hi, matched + 1)
                if cks and lo < old:
                    ds = [d for d in range(lo, old) if d not in cks]
                    ds += range(old, hi)
                else:
                    ds = range(lo, hi)
                out.append((run, ds))
        return out

    @staticmethod
    def _wanted_at(path: list, positions, first: int) -> list:
        """``[(run, depths)]`` for a few positions (depth - 1), past ``first`` and not yet held."""
        out, los = [], [r.lo for r in path]
        for i in positions:
            d = i + 1
            if d > first:
                run = path[bisect.bisect_right(los, d) - 1]  # path runs are in depth order
                if d not in run.checkpoints:
                    if out and out[-1][0] is run:
                        out[-1][1].append(d)
                    else:
                        out.append((run, [d]))
        return out

    def _finish(self, path: list, requeue: list) -> None:
        """Unpin the path; queue its leaf, the new and reused checkpoints, and those parked on it."""
        for run in path:
            run.refcount -= 1
            if run.refcount == 0 and not run.children:
                self._push_leaf(run)
        if self.policy.free_states:
            return
        for run in path:
            if run.parked:
                requeue += self._unpark(run)
        self._push_checkpoints([ck for ck in requeue if ck.version == -1])  # (a reused one may be parked too)

    # ----- the queues -----------------------------------------------------------------
    def _push_leaf(self, run: Run) -> None:
        self._version += 1
        run.version = v = self._version
        rank = self.policy.kv_priority(self, run.last_access, run.hi * self.block_size, run.hi in run.checkpoints)
        heapq.heappush(self._leaves, (rank, run.touched, run.hi, v, run))
        if len(self._leaves) > COMPACT_SLACK + 4 * self.n_runs:
            self._leaves = [e for e in self._leaves if self._leaf_valid(e)]
            heapq.heapify(self._leaves)

    @staticmethod
    def _leaf_valid(entry) -> bool:
        run = entry[4]
        return run.version == entry[3] and run.alive and run.refcount == 0 and not run.children

    def _peek_leaf(self):
        """The entry of the next leaf run to trim, or None if every leaf is pinned."""
        heap, valid = self._leaves, self._leaf_valid
        while heap:
            if valid(heap[0]):
                return heap[0]
            heapq.heappop(heap)
        return None

    def _push_checkpoints(self, cks) -> None:
        """Queue checkpoints that have no entry (a request may add hundreds: one pass, one sweep check)."""
        policy, block, heap, push = self.policy, self.block_size, self._checkpoints, heapq.heappush
        lru, v = policy.lru_checkpoints, self._version
        for ck in cks:
            v += 1
            ck.version = v
            rank = ck.last_access if lru else policy.checkpoint_priority(self, ck.last_access, ck.depth * block)
            push(heap, (rank, ck.touched, ck.depth, v, ck))
        self._version = v
        if len(heap) > COMPACT_SLACK + 4 * max(self.n_checkpoints, 1):
            keep = [entry for entry in heap if self._checkpoint_state(entry) == "ok"]
            heapq.heapify(keep)
            self._checkpoints = keep

    def _checkpoint_state(self, entry) -> str:
        """``ok`` (evictable alone), ``stale`` (dropped or queued again) or ``parked`` (parked now)."""
        ck = entry[4]
        run = ck.run
        if run is None or ck.version != entry[3]:
            return "stale"
        if run.refcount or (self.policy.protect_branch_points
                            and (1 if ck.depth < run.hi else len(run.children)) != 1):
            ck.version = -1
            run.parked.append(ck)
            return "parked"
        return "ok"

    def _peek_checkpoint(self):
        """The entry of the next checkpoint to evict alone, or None."""
        heap, state = self._checkpoints, self._checkpoint_state
        while heap:
            if state(heap[0]) == "ok":
                return heap[0]
            heapq.heappop(heap)
        return None

    @staticmethod
    def _unpark(run: Run) -> list:
        back = [ck for ck in run.parked if ck.run is run and ck.version == -1]
        run.parked = []
        return back

    # ----- eviction ---------------------------------------------------------------
    def reclaim(self, n_pages: int) -> bool:
        """Evict until ``n_pages`` are free, lowest first in the order the block tree uses: a leaf
        block (with its checkpoint) before a checkpoint alone of equal rank. False if all is pinned."""
        pool = self.pool
        while pool.n_free < n_pages:
            leaf, ck = self._peek_leaf(), self._peek_checkpoint()
            if ck is not None and (leaf is None or leaf[0] > ck[0]):
                heapq.heappop(self._checkpoints)
                self._drop_alone(ck[4])
            elif leaf is None:
                return False
            else:
                heapq.heappop(self._leaves)
                self._trim(leaf[4], leaf[0], n_pages, ck)
        return True

    def _drop(self, ck: RunCheckpoint) -> None:
        del ck.run.checkpoints[ck.depth]
        ck.run = None
        self.n_checkpoints -= 1
        self.checkpoints_evicted += 1
        self.pool.n_free += self.checkpoint_pages

    def _drop_alone(self, ck: RunCheckpoint) -> None:
        run = ck.run
        self._drop(ck)
        if ck.depth == run.hi and run.refcount == 0 and not run.children:
            self._push_leaf(run)  # its rank as a leaf no longer includes the checkpoint

    def _trim(self, run: Run, rank: float, n_pages: int, ck_entry) -> None:
        """Evict ``run``'s last block (it is first in the order), then the next while the new last
        block stays first: below the next leaf in the queue and no higher than the next checkpoint
        (dropping a checkpoint with its block only raises that bound). Queue what is left."""
        pool, policy, block, cks = self.pool, self.policy, self.block_size, run.checkpoints
        run.version = -1
        rival = self._peek_leaf()
        ck_rank = ck_entry[0] if ck_entry is not None else float("inf")
        touched = run.touched
        simple_leaf, simple_ck = policy.lru_leaves, policy.lru_checkpoints
        hi, freed, dropped = run.hi, 0, 0
        while True:
            ck = cks.pop(hi, None)
            if ck is not None:
                ck.run = None
                dropped += 1
            hi -= 1
            freed += 1
            if hi < run.lo or pool.n_free + freed + dropped * self.checkpoint_pages >= n_pages:
                break
            has = hi in cks
            if has:
                rank = (run.last_access if simple_ck and simple_leaf
                        else policy.kv_priority(self, run.last_access, hi * block, True))
            elif not simple_leaf:
                rank = policy.kv_priority(self, run.last_access, hi * block, False)
            else:
                rank = run.last_access
            if rank > ck_rank or (rival is not None and (rank, touched, hi) >= rival[:3]):
                break
        k = run.hi - hi
        pool.n_free += freed + dropped * self.checkpoint_pages
        self.n_blocks -= k
        self.n_evicted += k
        self.n_checkpoints -= dropped
        self.checkpoints_evicted += dropped
        if hi >= run.lo:
            del run.keys[hi - run.lo + 1:]
            run.hi = hi
            self._push_leaf(run)
            return
        parent = run.parent
        del parent.children[run.key]
        run.alive = False
        self.n_runs -= 1
        if parent is self.root or parent.refcount:
            return
        if not parent.children:
            self._push_leaf(parent)
        if parent.parked:  # a branch point may have one child left: evictable alone again
            self._push_checkpoints(self._unpark(parent))

    def check_invariants(self) -> None:
        """Pages used == blocks + checkpoint pages; runs are consistent chains; every evictable leaf and
        checkpoint is queued at its current rank (so the queues' lowest is the order's first)."""
        blocks = checkpoints = runs = 0
        leaves = {id(e[4]): e for e in self._leaves if self._leaf_valid(e)}
        queued = {id(e[4]): e for e in self._checkpoints if e[4].run is not None and e[4].version == e[3]}
        policy, block, stack = self.policy, self.block_size, list(self.root.children.values())
        while stack:
            run = stack.pop()
            runs += 1
            assert run.alive and run.lo <= run.hi and len(run.keys) == run.hi - run.lo + 1
            assert run.parent.children.get(run.key) is run and run.lo == run.parent.hi + 1
            assert run.refcount == 0
            blocks += len(run.keys)
            if not run.children:
                rank = policy.kv_priority(self, run.last_access, run.hi * block, run.hi in run.checkpoints)
                assert leaves[id(run)][:3] == (rank, run.touched, run.hi), "a leaf is not queued at its rank"
            for d, ck in run.checkpoints.items():
                assert ck.run is run and ck.depth == d and run.lo <= d <= run.hi
                if policy.free_states or (policy.protect_branch_points
                                          and (1 if d < run.hi else len(run.children)) != 1):
                    continue
                rank = policy.checkpoint_priority(self, ck.last_access, d * block)
                assert queued[id(ck)][:3] == (rank, ck.touched, d), "a checkpoint is not queued at its rank"
            checkpoints += len(run.checkpoints)
            stack.extend(run.children.values())
        assert (runs, blocks, checkpoints) == (self.n_runs, self.n_blocks, self.n_checkpoints)
        assert self.pool.n_used == blocks + checkpoints * self.checkpoint_pages
