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

from kimilab.config import ModelConfig
from kimilab.costs import Deployment
from kimilab.pool.pages import UNBOUNDED_PAGES, PageCount
from kimilab.prefix.blocks import split_prompt
from kimilab.prefix.hybrid import Outcome, shared_costs
from kimilab.prefix.policies import Placement, Policy, check_interval
from kimilab.prefix.precision import checkpoint_bytes as precision_bytes
from kimilab.prefix.run_evict import RunEviction
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


class RunPrefixCache(RunEviction):
    """Accounting-only hybrid prefix cache over runs of blocks; results equal :class:`HybridPrefixCache`'s."""

    def __init__(self, config: ModelConfig, policy: Policy, *, deployment: Deployment, block_size: int,
                 capacity_tokens: int | None, precision: str = "native"):
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
        self.precision = precision  # the checkpoints' (kimilab.prefix.precision): sets their pages
        self.checkpoint_bytes = precision_bytes(config, deployment, precision)
        self.checkpoint_pages = 0 if policy.free_states else -(-self.checkpoint_bytes // self.pool.page_bytes)
        self.root = _Run([], 1, None, 0.0)
        self.root.hi = 0
        self.root.refcount = 1
        self.clock = 0
        self.n_runs = self.n_blocks = self.n_evicted = 0
        self._leaf_heap: list = []
        self._leaf_serial = 0
        self._heap: list = []  # (rank, serial, _Checkpoint) or (rank, first serial, _Batch of them)
        self._queued = 0  # checkpoints entries in the heap, as the block tree would count its own
        self._serial = 0
        self.n_checkpoints = self.checkpoints_admitted = self.checkpoints_evicted = 0
        self.pages_admitted = 0
        self._unqueued: set = set()  # checkpoints whose heap entry was dropped while their run was pinned

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
            if isinstance(positions, range):  # every block past the hit: admitted run by run
                wanted = self._wanted_runs(path, positions, first, matched)
                got = self._allocate(self.checkpoint_pages, sum(len(ds) for _, ds in wanted))
                left = got
                for run, ds in wanted:
                    if len(ds) > left:
                        ds = ds[:left]
                    if not ds:
                        break
                    left -= len(ds)
                    stamp = run.last_access
                    cks = [_Checkpoint(run, d, stamp) for d in ds]
                    run.checkpoints.update(zip(ds, cks))
                    requeue += cks
                    added += [d * block for d in ds]
            else:  # a few positions: one by one
                wanted, los = [], None
                run, runs_hi = None, -1
                for i in positions:
                    d = i + 1
                    if d <= first:
                        continue
                    if d > runs_hi:  # the run holding depth d (path runs are in depth order)
                        los = los or [r.lo for r in path]
                        run = path[bisect.bisect_right(los, d) - 1]
                        runs_hi = run.hi
                    if d not in run.checkpoints:
                        wanted.append((run, d))
                got = self._allocate(self.checkpoint_pages, len(wanted))
                for run, d in wanted[:got]:
                    run.checkpoints[d] = ck = _Checkpoint(run, d, run.last_access)
                    requeue.append(ck)
                    added.append(d * block)
            self.n_checkpoints += got
            self.checkpoints_admitted += got
            self.pages_admitted += got * self.checkpoint_pages
            if usable_ck is not None:
                usable_ck.last_access = usable_ck.run.last_access
                usable_ck.serial = -1
                requeue.insert(0, usable_ck)  # shallower than every new one: the list stays in tree order
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

    def _finish(self, path: list, requeue: list) -> None:
        """Unpin the path; queue its unqueued checkpoints (new, reused, or dropped from the heap while
        pinned) root-side first, by depth within a run -- the block tree's order."""
        for run in path:
            run.refcount -= 1
            if run.refcount == 0 and not run.children:
                self._push_leaf(run)
        if self.policy.free_states:
            return
        back = []
        if self._unqueued:
            order = {id(run): i for i, run in enumerate(path)}
            back = [ck for ck in self._unqueued if ck.run is not None and id(ck.run) in order]
            self._unqueued.difference_update(back)
            self._unqueued = {ck for ck in self._unqueued if ck.run is not None}
            back = [ck for ck in back if ck.serial == -1]  # the others were queued again since
        if back:  # checkpoints dropped from the heap may sit anywhere on the path: sort them in
            requeue = sorted(set(requeue + back), key=lambda ck: (order[id(ck.run)], ck.depth))
        # every one is unqueued (new, reused, or back) on a path run, and the path is unpinned now
        self._push_checkpoints(requeue)

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
        assert self._queued == sum(len(x.cks) - x.i if hasattr(x, 'cks') else 1 for _, _, x in self._heap)
