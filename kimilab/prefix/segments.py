"""A prefix cache whose tree nodes are *segments*: runs of KV blocks that end where a state is kept.

Marconi's radix tree and SGLang's ``MambaRadixCache`` store a hybrid prefix this way: a node
is the stretch of KV between two places that matter -- a state checkpoint, a branch point,
a leaf -- and holds at most one state, at its end. A *unit* is a node with a state; a leaf
always is one. Evicting a leaf unit frees its whole segment (the KV of its blocks and its
state); evicting an inner unit frees the state only, and its segment merges into its
child's (Marconi's ``_evict_intermediate_node``, SGLang's "tombstone").

:class:`SegmentCache` keeps that tree over whole blocks keyed by hash ids, for replays
(accounting only, one request at a time), and lets a *scorer* pick what goes: Marconi's
normalised FLOP efficiency and recency (:mod:`~kimilab.prefix.marconi`), a clairvoyant
bound (:mod:`~kimilab.prefix.oracle`), or SGLang's two LRU lists (:class:`LRUScorer`). The
per-unit numbers a scorer reads live in numpy arrays (:class:`Units`), so choosing a victim
among thousands of units is one vectorised pass. Memory is one pool (``state_share=None``:
a checkpoint takes ``ceil(checkpoint bytes / page bytes)`` KV pages) or two fixed pools
(SGLang's ``--mamba-full-memory-ratio`` r: the states get r / (1 + r) of the bytes, in
slots of one checkpoint each). A test holds every outcome equal to a slow block-by-block twin.
"""

from __future__ import annotations

import numpy as np

from kimilab.config import ModelConfig
from kimilab.costs import Deployment
from kimilab.prefix.blocks import split_prompt
from kimilab.prefix.hybrid import Outcome, shared_costs
from kimilab.prefix.policies import Placement, Policy
from kimilab.prefix.precision import checkpoint_bytes as precision_bytes
from kimilab.validate import check_float, check_int

__all__ = ["Seg", "Units", "LRUScorer", "SegmentCache"]


class Seg:
    """Blocks at depths ``lo..hi`` of one path (block d ends at token d * block_size); a state at ``hi``
    if ``slot >= 0``."""

    __slots__ = ("keys", "lo", "hi", "parent", "children", "slot", "pins", "last")

    def __init__(self, keys: list, lo: int, parent, last: float = 0.0):
        self.keys, self.lo, self.hi = keys, lo, lo + len(keys) - 1
        self.parent, self.children = parent, {}
        self.slot, self.pins, self.last = -1, 0, last


class Units:
    """The per-unit numbers scorers read, one row (slot) per node that holds a state."""

    def __init__(self, capacity: int = 256):
        self.node: list = [None] * capacity
        self.last = np.zeros(capacity)  # last use (the scorer's clock)
        self.hi = np.zeros(capacity, dtype=np.int64)  # depth of the state (blocks)
        self.start = np.zeros(capacity, dtype=np.int64)  # depth where its segment starts (its parent's end)
        self.nchild = np.zeros(capacity, dtype=np.int64)
        self.free = np.zeros(capacity, dtype=bool)  # alive and not pinned
        self.serial = np.zeros(capacity, dtype=np.int64)  # creation order: the last tie-break
        self.next_use = np.zeros(capacity)  # the oracle's: index of the next request that reaches it
        self.top = 0  # slots ever used
        self.spare: list = []
        self.count = 0
        self._serial = 0

    def add(self, node: Seg) -> None:
        if self.spare:
            i = self.spare.pop()
        else:
            i = self.top
            self.top += 1
            if i == len(self.node):
                self._grow()
        self._serial += 1
        node.slot = i
        self.node[i] = node
        self.last[i], self.hi[i], self.serial[i] = node.last, node.hi, self._serial
        self.start[i] = node.parent.hi
        self.nchild[i] = len(node.children)
        self.free[i] = node.pins == 0
        self.count += 1

    def remove(self, node: Seg) -> None:
        i = node.slot
        node.slot = -1
        self.node[i] = None
        self.free[i] = False
        self.spare.append(i)
        self.count -= 1

    def _grow(self) -> None:
        n = 2 * len(self.node)
        self.node += [None] * (n - len(self.node))
        for name in ("last", "hi", "start", "nchild", "free", "serial", "next_use"):
            old = getattr(self, name)
            new = np.zeros(n, dtype=old.dtype)
            new[: len(old)] = old
            setattr(self, name, new)

    def pick(self, score: np.ndarray, idx: np.ndarray) -> Seg:
        """The unit of ``idx`` with the lowest score; ties go to the older (last use), then the earlier made."""
        k = int(score.argmin())
        best = np.flatnonzero(score == score[k])
        if best.size > 1:
            k = best[np.lexsort((self.serial[idx[best]], self.last[idx[best]]))[0]]
        return self.node[idx[k]]


class LRUScorer:
    """SGLang's ``MambaRadixCache`` eviction: the least recently used leaf when KV is short, the least
    recently used state anywhere (an inner one becomes a tombstone) when states are short. A request
    touches every node of its path, deeper ones later (``reset_node_and_parents_mru``)."""

    name = "lru"
    touch_path = True

    def victim(self, cache: "SegmentCache", kind: str) -> Seg | None:
        u = cache.units
        mask = u.free[: u.top] & (u.nchild[: u.top] == 0) if kind == "kv" else u.free[: u.top].copy()
        idx = np.flatnonzero(mask)
        if not idx.size:
            return None
        return u.pick(u.last[idx], idx)


class SegmentCache:
    """Hybrid prefix cache over segments, accounting only; ``serve`` returns :class:`Outcome` as the
    other caches do. ``policy`` says where states go, ``scorer`` what is evicted; ``state_share`` =
    r / (1 + r) splits memory into a KV pool and a state pool (None: one pool)."""

    def __init__(self, config: ModelConfig, policy: Policy, scorer, *, deployment: Deployment, block_size: int,
                 capacity_tokens: int | None, state_share: float | None = None, precision: str = "native"):
        if not isinstance(policy, Policy) or policy.free_states:
            raise ValueError(f"policy: expected a kimilab.prefix.Policy that keeps states, got {policy!r}")
        self.block_size = B = check_int("block_size", block_size, 1, unit="tokens")
        self.costs = costs = shared_costs(config, deployment)
        self.precision = precision
        self.checkpoint_bytes = precision_bytes(config, deployment, precision)
        self.page_bytes = B * costs.kv_bytes_per_token
        budget = None if capacity_tokens is None else check_int("capacity_tokens", capacity_tokens, B, unit="tokens")
        self.capacity_tokens = budget
        big = 1 << 40
        if state_share is None:
            self.n_pages = big if budget is None else budget // B
            self.checkpoint_pages = -(-self.checkpoint_bytes // self.page_bytes)
            self.state_slots = None
        else:
            share = check_float("state_share", state_share, minimum=0.0)
            if not 0.0 < share < 1.0:
                raise ValueError(f"state_share={state_share!r}: expected a fraction in (0, 1)")
            total = None if budget is None else budget * costs.kv_bytes_per_token
            self.n_pages = big if total is None else int(total * (1 - share) // self.page_bytes)
            self.state_slots = big if total is None else int(total * share // self.checkpoint_bytes)
            self.checkpoint_pages = 0
        self.policy, self.scorer, self.state_share = policy, scorer, state_share
        self.policy_name = f"{policy.name}/{scorer.name}"
        self.root = Seg([], 1, None)
        self.root.hi = 0
        self.root.pins = 1
        self.units = Units()
        self.kv_free, self.states_free = self.n_pages, self.state_slots
        self.n_blocks = 0
        self.clock = 0  # requests served
        self.tick = 0.0  # the scorers' clock: +1 at a lookup, an insertion and an eviction (Marconi's)
        self.checkpoints_admitted = self.checkpoints_evicted = self.pages_admitted = 0
        self.evictions = 0
        self.flops_table = np.zeros(0)  # cold prefill FLOPs by depth, for scorers that weigh them

    # ----- what the simulation loop reads -----------------------------------------------
    @property
    def pool(self):
        return self  # the loop reads pool.page_bytes and pool.n_pages

    @property
    def kv_pages(self) -> int:
        return self.n_blocks

    @property
    def n_checkpoints(self) -> int:
        return self.units.count

    @property
    def checkpoint_pages_used(self) -> int:
        return self.units.count * self.checkpoint_pages

    @property
    def checkpoint_bytes_used(self) -> int:
        """Bytes the states hold: whole pages in one pool, exact slots in a state pool."""
        if self.state_slots is None:
            return self.checkpoint_pages_used * self.page_bytes
        return self.units.count * self.checkpoint_bytes

    # ----- the tree ---------------------------------------------------------------------
    def _match(self, keys: list):
        """(fully matched nodes, blocks matched, the node the match stops inside or None, blocks into it)."""
        node, i, path = self.root, 0, []
        while i < len(keys):
            child = node.children.get(keys[i])
            if child is None:
                break
            own = child.keys
            j = len(own)
            if keys[i:i + j] != own:  # the prompt stops or branches inside this segment
                j, stop = 1, min(j, len(keys) - i)
                while j < stop and keys[i + j] == own[j]:
                    j += 1
                return path, i + j, child, j
            path.append(child)
            i += j
            node = child
        return path, i, None, 0

    def _set_pins(self, node: Seg, delta: int) -> None:
        node.pins += delta
        if node.slot >= 0:
            self.units.free[node.slot] = node.pins == 0

    def _split(self, node: Seg, j: int) -> Seg:
        """Cut ``node`` after its first ``j`` blocks; the new upper node is returned, ``node`` keeps the rest."""
        upper = Seg(node.keys[:j], node.lo, node.parent, node.last)
        upper.pins = node.pins
        node.parent.children[node.keys[0]] = upper
        node.keys = node.keys[j:]
        node.lo += j
        node.parent = upper
        upper.children[node.keys[0]] = node
        if node.slot >= 0:
            self.units.start[node.slot] = upper.hi
        return upper

    def _set_nchild(self, node: Seg) -> None:
        if node.slot >= 0:
            self.units.nchild[node.slot] = len(node.children)

    def _merge_down(self, node: Seg) -> None:
        """A stateless node with one child is no boundary: it joins its child's segment."""
        (child,) = node.children.values()
        child.keys = node.keys + child.keys
        child.lo = node.lo
        child.parent = node.parent
        node.parent.children[child.keys[0]] = child
        if child.slot >= 0:
            self.units.start[child.slot] = node.parent.hi
        self.scorer_merge(node, child)

    def scorer_merge(self, upper: Seg, child: Seg) -> None:
        merge = getattr(self.scorer, "merge", None)
        if merge is not None:
            merge(self, upper, child)

    def _tidy(self, node: Seg) -> None:
        """Keep boundaries only at states and branches: merge or delete ``node`` if it is neither."""
        while node is not self.root and node.slot < 0 and node.pins == 0 and len(node.children) <= 1:
            parent = node.parent
            if parent.children.get(node.keys[0]) is not node:
                return  # already merged away or deleted
            if node.children:
                self._merge_down(node)
                return
            del parent.children[node.keys[0]]  # a stateless leaf: its KV serves nothing
            self._free_blocks(len(node.keys))
            self._set_nchild(parent)
            node = parent

    def _free_blocks(self, k: int) -> None:
        self.n_blocks -= k
        self.kv_free += k

    def _evict(self, node: Seg) -> None:
        """Evict a unit: a leaf with its segment, or an inner state alone."""
        self.evictions += 1
        self.checkpoints_evicted += 1
        self.units.remove(node)
        self._give_state()
        parent = node.parent
        if node.children:
            if len(node.children) == 1:
                self._merge_down(node)
            return
        del parent.children[node.keys[0]]
        self._free_blocks(len(node.keys))
        self._set_nchild(parent)
        self._tidy(parent)

    def _give_state(self) -> None:
        if self.state_slots is None:
            self.kv_free += self.checkpoint_pages
        else:
            self.states_free += 1

    def _reclaim(self, blocks: int, states: int) -> bool:
        """Evict until ``blocks`` KV pages and ``states`` checkpoints fit; False if everything left is pinned."""
        victim = self.scorer.victim
        if self.state_slots is None:
            need = blocks + states * self.checkpoint_pages
            if self.kv_free < need:
                self.tick += 1  # one eviction call per request (Marconi's clock)
            while self.kv_free < need:
                node = victim(self, "any")
                if node is None:
                    return False
                self._evict(node)
            return True
        if self.kv_free < blocks or self.states_free < states:
            self.tick += 1
        while self.kv_free < blocks:
            node = victim(self, "kv")
            if node is None:
                return False
            self._evict(node)
        while self.states_free < states:
            node = victim(self, "state")
            if node is None:
                return False
            self._evict(node)
        return True

    def _fit(self, blocks: int, states: int) -> tuple[int, int]:
        if self.state_slots is None:
            got = min(blocks, self.kv_free)
            return got, min(states, (self.kv_free - got) // self.checkpoint_pages)
        return min(blocks, self.kv_free), min(states, self.states_free)

    # ----- serving ----------------------------------------------------------------------
    def serve(self, keys=None, n_tokens=None, *, tokens=None) -> Outcome:
        """One request, start to end."""
        if tokens is not None:
            raise ValueError("tokens: SegmentCache replays hash-id traces only (give keys= and n_tokens=)")
        n = int(n_tokens)
        if n <= 0:
            raise ValueError(f"n_tokens={n}: expected a prompt of at least one token")
        return self.serve_whole(split_prompt(keys, n, None, self.block_size, False)[0], n)

    def serve_whole(self, keys: list, n: int) -> Outcome:
        """:meth:`serve` for a prompt already cut into its whole blocks' keys (a replay repeats it)."""
        B, scorer = self.block_size, self.scorer
        self.clock += 1
        self.tick += 1
        if hasattr(self.policy, "begin"):
            self.policy.begin(self.clock - 1, keys)
        path, m, part, j = self._match(keys)
        limit = n - 1
        usable_node = next((nd for nd in reversed(path) if nd.slot >= 0 and nd.hi * B <= limit), None)
        usable = usable_node.hi * B if usable_node is not None else 0
        if usable_node is not None and hasattr(scorer, "on_hit"):
            scorer.on_hit(self, usable_node)
        last_has_child = part is not None or bool(path and path[-1].children)
        branch = 0 < m < len(keys) and last_has_child
        ends = range(B, (len(keys) + 1) * B, B)
        have = {nd.hi for nd in path if nd.slot >= 0}
        wanted = [i + 1 for i in self.policy.positions(Placement(ends, m, usable, n, branch))
                  if (i + 1) * B > usable and i + 1 not in have]
        if hasattr(scorer, "before_insert"):
            scorer.before_insert(self, keys, n)
        pinned = path + ([part] if part is not None else [])
        for nd in pinned:
            self._set_pins(nd, 1)
        self.tick += 2  # the insertion and its own lookup (Marconi's clock)
        # KV past the deepest state of a new branch serves no hybrid hit: it is not kept
        new = max([d for d in wanted if d > m], default=m) - m
        self._reclaim(new, len(wanted))
        got, n_states = self._fit(new, len(wanted))
        if got < new or n_states < len(wanted):  # larger than the pool: keep it up to its deepest state that fits
            wanted = [d for d in wanted[:n_states] if d <= m + got]
            got = max([d for d in wanted if d > m], default=m) - m
        added, path = self._insert(keys, path, m, part, j, got, wanted, pinned)
        if hasattr(scorer, "on_request"):
            scorer.on_request(self, path)
        self.checkpoints_admitted += len(added)
        self.pages_admitted += got + len(added) * self.checkpoint_pages
        return Outcome(n, min(m * B, limit), usable, len(added), tuple(d * B for d in added), m)

    def _insert(self, keys, path, m, part, j, got, wanted, pinned) -> tuple[list, list]:
        """Add the new blocks and the states at ``wanted`` depths; unpin; stamp the path."""
        top = path[-1] if path else self.root
        if part is not None and (got or (wanted and wanted[0] <= m)):
            top = self._split(part, j)  # the new upper node is pinned like part was
            pinned.append(top)
            path = path + [top]
        if got:
            leaf = Seg(keys[m:m + got], m + 1, top, self.tick)
            top.children[leaf.keys[0]] = leaf
            self._set_nchild(top)
            self.n_blocks += got
            self.kv_free -= got
            path = path + [leaf]
        added = []
        for d in wanted:
            at = next(nd for nd in path if nd.lo <= d <= nd.hi) if path else None
            if at is None:
                continue
            if d < at.hi:
                upper = self._split(at, d - at.lo + 1)
                path.insert(path.index(at), upper)
                if at.pins:
                    pinned.append(upper)
                at = upper
            at.last = self.tick
            self.units.add(at)
            self._set_nchild(at)
            if self.state_slots is None:
                self.kv_free -= self.checkpoint_pages
            else:
                self.states_free -= 1
            added.append(d)
        if getattr(self.scorer, "touch_path", False):
            for nd in path:
                nd.last = self.tick + nd.hi * 1e-9
                if nd.slot >= 0:
                    self.units.last[nd.slot] = nd.last
        for nd in pinned:
            self._set_pins(nd, -1)
        for nd in pinned:
            self._tidy(nd)
        return added, path

    def describe(self) -> str:
        scorer = getattr(self.scorer, "describe", None)
        return f"{self.policy_name}: {scorer()}" if scorer else f"{self.policy_name}: {self.policy.describe()}"

    # ----- checks -------------------------------------------------------------------------
    def check_invariants(self) -> None:
        """Pools add up; every leaf has a state; boundaries sit only at states and branches."""
        blocks = units = 0
        stack = list(self.root.children.values())
        while stack:
            nd = stack.pop()
            assert nd.parent.children[nd.keys[0]] is nd and nd.lo == nd.parent.hi + 1
            assert nd.hi == nd.lo + len(nd.keys) - 1 and nd.pins == 0
            assert nd.slot >= 0 or len(nd.children) >= 2, "a boundary without a state or a branch"
            if nd.slot >= 0:
                units += 1
                u = self.units
                assert u.node[nd.slot] is nd and u.hi[nd.slot] == nd.hi and u.start[nd.slot] == nd.parent.hi
                assert u.nchild[nd.slot] == len(nd.children) and u.free[nd.slot]
            blocks += len(nd.keys)
            stack.extend(nd.children.values())
        assert (blocks, units) == (self.n_blocks, self.units.count)
        if self.state_slots is None:
            assert self.kv_free == self.n_pages - blocks - units * self.checkpoint_pages
        else:
            assert (self.kv_free, self.states_free) == (self.n_pages - blocks, self.state_slots - units)
