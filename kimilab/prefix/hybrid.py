"""Dual-granularity prefix caching: KV pages per block, KDA state checkpoints where a policy says.

A hybrid model can reuse a cached prefix only where it has BOTH the KV of every
global layer for the whole prefix (cheap, cached per block in a
:class:`kimilab.radix.RadixTree`) AND a checkpoint of every KDA and conv state
at exactly that position (expensive: at 48B scale one checkpoint weighs as much
as ~10 KV pages of 512 tokens). The *usable hit* of a request is the deepest
position where both exist; the model recomputes everything after it.

Both kinds of memory come out of one :class:`kimilab.pool.PagePool`, so a
policy that stores many states caches fewer blocks. Policies are small
objects deciding where to admit a checkpoint and how to rank what to evict:

* ``kv-only``     a pure-attention model: states are free, usable hit = KV hit;
* ``every-block`` a state at every block boundary (vLLM ``all``);
* ``align``       states at prefill-chunk ends and request ends (vLLM ``align``);
* ``dual``        states at request ends and at branch points discovered as
                  traffic arrives, evicted by recency + FLOPs saved per byte
                  (Marconi); optional coarse checkpoints every ``interval`` tokens.
"""

from __future__ import annotations

import argparse
import heapq
import json
import math
import sys
import time
from dataclasses import dataclass, field
from typing import Sequence

import numpy as np

from kimilab import costs as memory
from kimilab.model.cache import HybridCache
from kimilab.config import ModelConfig, preset
from kimilab.pool.pages import PagePool
from kimilab.prefix.radix import Node, RadixTree

__all__ = [
    "CacheCosts",
    "Checkpoint",
    "Policy",
    "Placement",
    "KVOnly",
    "EveryBlock",
    "Align",
    "Dual",
    "POLICIES",
    "make_policy",
    "Outcome",
    "HybridPrefixCache",
    "ReplayResult",
    "replay",
    "ModelPrefixCache",
    "main",
]


# --------------------------------------------------------------------------- costs


@dataclass(frozen=True)
class CacheCosts:
    """What caching costs and saves for one model: bytes per KV token, per checkpoint, FLOPs."""

    config: ModelConfig
    kv_bytes_per_token: int
    checkpoint_bytes: int

    _cold: dict = field(default_factory=dict, compare=False, repr=False)

    @classmethod
    def of(cls, config: ModelConfig) -> "CacheCosts":
        return cls(config, memory.kv_bytes_per_token(config), memory.checkpoint_bytes(config))

    @property
    def pair_flops(self) -> int:
        """FLOPs one more cached token adds per new token (global attention, all layers)."""
        return memory.prefill_flops(self.config, 1, 1) - memory.prefill_flops(self.config, 1, 0)

    def prefill_flops(self, n_new: int, n_cached: int = 0) -> int:
        """``memory.prefill_flops``, memoised: cost(n, c) = cost(n, 0) + n * c * pair_flops.

        The cached prefix only adds attention pairs (n_new * n_cached of them); a
        test holds this equal to the direct call.
        """
        cold = self._cold.get(n_new)
        if cold is None:
            cold = self._cold[n_new] = memory.prefill_flops(self.config, n_new, 0)
            if "pair" not in self._cold:
                self._cold["pair"] = self.pair_flops
        return cold + (n_new * n_cached * self._cold["pair"] if n_cached and n_new else 0)

    def flops_saved(self, n_tokens: int, hit: int) -> int:
        """FLOPs a hit of ``hit`` tokens saves on an ``n_tokens`` prompt (vs a cold prefill)."""
        return self.prefill_flops(n_tokens) - self.prefill_flops(n_tokens - hit, hit)


# --------------------------------------------------------------------------- policies


class Checkpoint:
    """A cached state at the end of a tree node: its pages, rank for eviction, and (optionally) the state."""

    __slots__ = ("alloc", "priority", "serial", "last_access", "state")

    def __init__(self, alloc, last_access: int):
        self.alloc = alloc
        self.priority = 0.0
        self.serial = -1
        self.last_access = last_access
        self.state = None  # a kimilab.cache.StateCheckpoint when real tensors are cached


@dataclass(frozen=True)
class Placement:
    """Where a request's checkpoints may go: the path after insertion and what was hit."""

    path: list  # every node of the prompt now in the tree, root-side first
    n_matched: int  # how many of them were cached before this request
    usable_end: int  # tokens covered by the usable hit (a checkpoint or 0)
    n_tokens: int  # prompt length


class Policy:
    """Base policy: where checkpoints are admitted and how evictable things are ranked.

    Ranks are "lower goes first". The base ranks by last use (LRU), separately for
    KV leaves and for checkpoints; any checkpoint of an unpinned node may be evicted.
    """

    name = "policy"
    free_states = False  # True: states cost nothing and exist everywhere (pure attention)
    protect_branch_points = False  # True: a checkpoint on a node with >= 2 children is kept

    def positions(self, p: Placement) -> list[int]:
        """Indices into ``p.path`` whose end should get a checkpoint."""
        raise NotImplementedError

    def now(self, cache: "HybridPrefixCache") -> float:
        """The clock stamped on every use: requests served so far."""
        return float(cache.tree.clock)

    def kv_priority(self, cache: "HybridPrefixCache", node: Node) -> float:
        """Rank of an evictable KV leaf (with its checkpoint, if any): its last use."""
        return node.last_access

    def checkpoint_priority(self, cache: "HybridPrefixCache", node: Node) -> float:
        """Rank of a checkpoint evicted on its own: its last use."""
        return node.payload.last_access

    def describe(self) -> str:
        return self.name


def _check_interval(interval, block_size: int, name: str) -> None:
    if interval is None:
        return
    if isinstance(interval, bool) or not isinstance(interval, (int, np.integer)) or interval <= 0:
        raise ValueError(f"{name}.interval={interval!r}: expected a positive int (tokens) or None")
    if interval % block_size:
        raise ValueError(
            f"{name}.interval={interval}: expected a multiple of block_size={block_size} "
            "(checkpoints sit on block boundaries)"
        )


class KVOnly(Policy):
    """What a pure-attention model gets: no states to keep, usable hit = KV hit (the upper bound)."""

    name = "kv-only"
    free_states = True

    def positions(self, p: Placement) -> list[int]:
        return []


class EveryBlock(Policy):
    """vLLM ``all``: a state at every block boundary the request computed."""

    name = "every-block"

    def positions(self, p: Placement) -> list[int]:
        return [i for i, node in enumerate(p.path) if node.end > p.usable_end]


class Align(Policy):
    """vLLM ``align`` / SGLang periodic: states at prefill-chunk ends and at the request end.

    Prefill runs in chunks of ``interval`` tokens starting at the usable hit, so
    chunk ends sit at ``usable + k * interval``; the last cached block is the
    request end.
    """

    name = "align"

    def __init__(self, interval: int = 2048):
        self.interval = interval

    def positions(self, p: Placement) -> list[int]:
        out = [
            i for i, node in enumerate(p.path)
            if node.end > p.usable_end and (node.end - p.usable_end) % self.interval == 0
        ]
        last = len(p.path) - 1
        if p.path and p.path[last].end > p.usable_end and (not out or out[-1] != last):
            out.append(last)
        return out

    def describe(self) -> str:
        return f"{self.name}(interval={self.interval})"


class Dual(Policy):
    """Marconi-style: states at request ends and at branch points found as traffic arrives.

    A branch point is the deepest KV-cached node of a prompt where it leaves a
    cached path: the node already had a child, so with this prompt it has two
    (its KV was hit, its state did not exist, and the prefill passes through it
    anyway). A prompt that merely extends a cached leaf creates no branch. ``interval`` adds coarse checkpoints at absolute
    multiples of that many tokens (None: none).

    Eviction ranks a unit (a leaf with its checkpoint, or a checkpoint alone) by
    ``recency + alpha * value``. Recency is the cache's own clock at last use,
    counted in *turnovers* (pages admitted so far / pool pages), so the rank means
    the same at any traffic rate and memory size; value is the FLOPs the checkpoint
    saves per byte it holds (prefill FLOPs of its prefix, per checkpoint), in units
    of a one-block checkpoint's. ``alpha`` = turnovers of age one unit of value is
    worth (0: plain LRU); the default was tuned coarsely on the book's traces, as
    Marconi tunes its weight per workload. As in Marconi, a checkpoint on a node
    with two or more children (a live branch point) is never evicted on its own.
    """

    name = "dual"
    protect_branch_points = True

    def __init__(self, interval: int | None = None, alpha: float = 0.005):
        if isinstance(alpha, bool) or not isinstance(alpha, (int, float)) or not (
                alpha >= 0 and math.isfinite(alpha)):
            raise ValueError(f"Dual.alpha={alpha!r}: expected a finite float >= 0")
        self.interval = interval
        self.alpha = float(alpha)
        self._value_cache: dict[int, float] = {}

    def positions(self, p: Placement) -> list[int]:
        out = set()
        last = len(p.path) - 1
        if last >= 0 and p.path[last].end > p.usable_end:
            out.add(last)  # request end
        j = p.n_matched - 1
        if 0 <= j < last and p.path[j].end > p.usable_end and len(p.path[j].children) >= 2:
            out.add(j)  # branch point: the prompt leaves a cached path here (not just extends it)
        if self.interval:
            for i, node in enumerate(p.path):
                if node.end > p.usable_end and node.end % self.interval == 0:
                    out.add(i)
        return sorted(out)

    def value(self, cache: "HybridPrefixCache", end: int) -> float:
        """FLOPs saved per byte by a checkpoint at ``end``, relative to one at the first block."""
        v = self._value_cache.get(end)
        if v is None:
            v = self._value_cache[end] = (cache.costs.prefill_flops(end)
                                          / cache.costs.prefill_flops(cache.block_size))
        return v

    def now(self, cache) -> float:
        return cache.turnover

    def kv_priority(self, cache, node) -> float:
        if node.payload is None:
            return node.last_access
        return node.last_access + self.alpha * self.value(cache, node.end)

    def checkpoint_priority(self, cache, node) -> float:
        return node.payload.last_access + self.alpha * self.value(cache, node.end)

    def describe(self) -> str:
        return f"{self.name}(interval={self.interval}, alpha={self.alpha:g})"


POLICIES = {"kv-only": KVOnly, "every-block": EveryBlock, "align": Align, "dual": Dual}


def make_policy(name: str, **kwargs) -> Policy:
    """A fresh policy object by name (``interval=`` for align/dual, ``alpha=`` for dual)."""
    if name not in POLICIES:
        raise ValueError(f"policy={name!r}: expected one of {sorted(POLICIES)}")
    return POLICIES[name](**kwargs)


# --------------------------------------------------------------------------- the cache


@dataclass(frozen=True)
class Outcome:
    """What one request got from the cache (tokens)."""

    n_tokens: int
    kv_hit: int  # deepest position with KV cached (what an attention model would reuse)
    usable_hit: int  # deepest position with KV AND a state checkpoint: where prefill resumes
    checkpoints_added: int
    checkpoint_positions: tuple = ()

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
                 partial_blocks: bool = False):
        if not isinstance(policy, Policy):
            raise ValueError(f"policy: expected a kimilab.prefix.Policy, got {type(policy).__name__}")
        expected = block_size * costs.kv_bytes_per_token
        if pool.page_bytes != expected:
            raise ValueError(
                f"pool.page_bytes={pool.page_bytes}: expected block_size * kv_bytes_per_token = "
                f"{block_size} * {costs.kv_bytes_per_token} = {expected} (one block of KV per page)"
            )
        _check_interval(getattr(policy, "interval", None), block_size, policy.name)
        self.pool = pool
        self.block_size = block_size
        self.page_bytes = pool.page_bytes
        self.policy = policy
        self.costs = costs
        self.checkpoint_pages = 0 if policy.free_states else -(-costs.checkpoint_bytes // pool.page_bytes)
        self.tree = RadixTree(pool, block_size, partial_blocks=partial_blocks,
                              on_evict=self._on_evict, reclaim=self._reclaim)
        self.tree.priority_of = lambda node: policy.kv_priority(self, node)
        self.tree.now = lambda: policy.now(self)
        self._checkpoint_key = ("checkpoint", self.checkpoint_pages, costs.checkpoint_bytes)
        self._heap: list = []
        self._serial = 0
        self.n_checkpoints = 0
        self.pages_admitted = 0  # KV + checkpoint pages ever taken: the cache's own clock
        self.checkpoints_admitted = 0
        self.checkpoints_evicted = 0

    @classmethod
    def for_budget(cls, config: ModelConfig, policy: Policy, *, block_size: int,
                   capacity_tokens: int, partial_blocks: bool = False) -> "HybridPrefixCache":
        """A cache over an accounting-only pool of ``capacity_tokens // block_size`` pages."""
        for name, value in (("block_size", block_size), ("capacity_tokens", capacity_tokens)):
            if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value <= 0:
                raise ValueError(f"{name}={value!r}: expected a positive int (tokens)")
        if capacity_tokens < block_size:
            raise ValueError(
                f"capacity_tokens={capacity_tokens}: expected at least one block "
                f"(block_size={block_size})"
            )
        costs = CacheCosts.of(config)
        pool = PagePool(int(capacity_tokens) // int(block_size), int(block_size) * costs.kv_bytes_per_token,
                        backed=False, name=f"prefix-{policy.name}")
        return cls(pool, int(block_size), policy, costs, partial_blocks=partial_blocks)

    # ----- checkpoints ------------------------------------------------------
    def _push_checkpoint(self, node: Node) -> None:
        ck = node.payload
        self._serial += 1
        ck.serial = self._serial
        ck.priority = priority = self.policy.checkpoint_priority(self, node)
        heapq.heappush(self._heap, (priority, self._serial, node))
        if len(self._heap) > 64 + 4 * max(self.n_checkpoints, 1):
            keep = []
            for entry in self._heap:
                if self._valid(entry):
                    keep.append(entry)
                else:
                    self._forget(entry)
            heapq.heapify(keep)
            self._heap = keep

    @staticmethod
    def _forget(entry) -> None:
        """An entry leaves the heap: if it was its checkpoint's only one, mark it for re-queueing."""
        ck = entry[2].payload
        if ck is not None and ck.serial == entry[1]:
            ck.serial = -1

    def _valid(self, entry) -> bool:
        _, serial, node = entry
        ck = node.payload
        if not node.alive or ck is None or ck.serial != serial or node.refcount:
            return False
        if self.policy.protect_branch_points and len(node.children) != 1:
            return False  # branch points stay; a leaf's checkpoint goes with the leaf
        return True

    def _peek_checkpoint(self) -> Node | None:
        heap = self._heap
        while heap:
            entry = heap[0]
            if self._valid(entry):
                return entry[2]
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

    def _reclaim(self, n_pages: int) -> bool:
        tree = self.tree
        while tree.n_available < n_pages:
            leaf = tree.peek_evictable()
            ck_node = self._peek_checkpoint()
            if leaf is None and ck_node is None:
                return False
            if ck_node is None or (leaf is not None and leaf.priority <= ck_node.payload.priority):
                tree.evict_node(leaf)
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
            node.payload = Checkpoint(alloc, node.last_access)
        self.n_checkpoints += len(allocs)
        self.checkpoints_admitted += len(allocs)
        self.pages_admitted += len(allocs) * self.checkpoint_pages
        return nodes[: len(allocs)]

    # ----- serving ----------------------------------------------------------
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
        self.pages_admitted += len(path) - len(m.nodes)
        limit = n - 1  # leave one token to compute: its logits start the decode
        kv_hit = min(m.hit_tokens, limit)
        usable_node = None
        if policy.free_states:
            usable = kv_hit
        else:
            usable = 0
            for node in reversed(m.nodes):
                if node.payload is not None and node.end <= limit:
                    usable, usable_node = node.end, node
                    break
        added = []
        if not policy.free_states:
            placement = Placement(path, len(m.nodes), usable, n)
            wanted = [path[i] for i in policy.positions(placement)]
            wanted = [node for node in wanted if node.payload is None and node.end > usable]
            if wanted:
                added = self._admit(wanted)
            if usable_node is not None:
                ck = usable_node.payload
                ck.last_access = usable_node.last_access
                ck.serial = -1  # re-queue at the new rank in finish()
        outcome = Outcome(n, kv_hit, usable, len(added), tuple(node.end for node in added))
        return outcome, path, usable_node, added

    def finish(self, path) -> None:
        """Unpin a request's path; its checkpoints become evictable again."""
        self.tree.unpin(path)
        for node in path:
            if node.payload is not None and node.refcount == 0 and node.payload.serial == -1:
                self._push_checkpoint(node)

    def serve(self, keys=None, n_tokens=None, *, tokens=None) -> Outcome:
        """One request, start to end (accounting only)."""
        outcome, path, _, _ = self.begin(keys, n_tokens, tokens=tokens)
        self.finish(path)
        return outcome

    def evict_all(self) -> None:
        """Drop every unpinned checkpoint and block (what is pinned stays)."""
        for node in self.tree.nodes():
            if node.payload is not None and node.refcount == 0:
                self._drop_checkpoint(node)
                self.checkpoints_evicted -= 1  # a clear-out, not an eviction decision
        self.tree.evict_all()

    # ----- accounting -------------------------------------------------------
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
        with_ck = [n for n in nodes if n.payload is not None]
        assert len(with_ck) == self.n_checkpoints, (len(with_ck), self.n_checkpoints)
        stats = self.pool.stats()
        assert stats.pages_by_kind["kv"] == self.kv_pages
        assert stats.pages_by_kind["checkpoint"] == self.checkpoint_pages_used
        assert self.pool.n_used == self.kv_pages + self.checkpoint_pages_used


# --------------------------------------------------------------------------- replay


@dataclass
class ReplayResult:
    """Totals of one trace replay through one policy at one memory budget."""

    policy: str
    model: str
    block_size: int
    capacity_tokens: int
    capacity_pages: int
    checkpoint_pages: int
    kv_bytes_per_token: int = 0
    checkpoint_bytes_each: int = 0  # one checkpoint's real bytes (it is charged checkpoint_pages pages)
    requests: int = 0
    prompt_tokens: int = 0
    kv_hit_tokens: int = 0
    usable_hit_tokens: int = 0
    prefill_flops_cold: int = 0
    prefill_flops: int = 0
    checkpoints_admitted: int = 0
    checkpoints_evicted: int = 0
    kv_bytes_peak: int = 0
    checkpoint_bytes_peak: int = 0
    kv_bytes_mean: float = 0.0
    checkpoint_bytes_mean: float = 0.0
    wall_seconds: float = 0.0
    per_request: list = field(default_factory=list, repr=False)

    @property
    def recomputed_tokens(self) -> int:
        return self.prompt_tokens - self.usable_hit_tokens

    @property
    def kv_hit_rate(self) -> float:
        return self.kv_hit_tokens / self.prompt_tokens if self.prompt_tokens else 0.0

    @property
    def usable_hit_rate(self) -> float:
        return self.usable_hit_tokens / self.prompt_tokens if self.prompt_tokens else 0.0

    @property
    def prefill_flops_saved(self) -> int:
        return self.prefill_flops_cold - self.prefill_flops

    def as_dict(self) -> dict:
        """The CLI's JSON object (fixed key order). Byte figures are pool pages in use x page bytes."""
        cold = self.prefill_flops_cold
        return {
            "policy": self.policy,
            "model": self.model,
            "block_size": self.block_size,
            "capacity_tokens": self.capacity_tokens,
            "capacity_pages": self.capacity_pages,
            "checkpoint_pages": self.checkpoint_pages,
            "kv_bytes_per_token": self.kv_bytes_per_token,
            "checkpoint_bytes_each": self.checkpoint_bytes_each,
            "requests": self.requests,
            "prompt_tokens": self.prompt_tokens,
            "kv_hit_tokens": self.kv_hit_tokens,
            "usable_hit_tokens": self.usable_hit_tokens,
            "recomputed_tokens": self.recomputed_tokens,
            "kv_hit_rate": round(self.kv_hit_rate, 6),
            "usable_hit_rate": round(self.usable_hit_rate, 6),
            "checkpoints_admitted": self.checkpoints_admitted,
            "checkpoints_evicted": self.checkpoints_evicted,
            "kv_bytes_peak": self.kv_bytes_peak,
            "checkpoint_bytes_peak": self.checkpoint_bytes_peak,
            "kv_bytes_mean": round(self.kv_bytes_mean),
            "checkpoint_bytes_mean": round(self.checkpoint_bytes_mean),
            "prefill_flops_cold": cold,
            "prefill_flops_saved": self.prefill_flops_saved,
            "prefill_flops_saved_fraction": round(self.prefill_flops_saved / cold, 6) if cold else 0.0,
            "wall_seconds": round(self.wall_seconds, 3),
        }


def replay(records: Sequence, policy: Policy | str, *, config: ModelConfig, block_size: int,
           capacity_tokens: int, partial_blocks: bool = False,
           keep_per_request: bool = False) -> ReplayResult:
    """Replay Mooncake records in timestamp order through one policy and memory budget.

    ``capacity_tokens`` is memory in tokens of the model's KV
    (``capacity_tokens * kv_bytes_per_token`` bytes), shared by KV pages and
    checkpoints, rounded down to whole pages (``capacity_pages`` in the result).
    """
    if isinstance(policy, str):
        policy = make_policy(policy)
    start = time.perf_counter()
    cache = HybridPrefixCache.for_budget(config, policy, block_size=block_size,
                                         capacity_tokens=capacity_tokens,
                                         partial_blocks=partial_blocks)
    costs, page_bytes = cache.costs, cache.page_bytes
    res = ReplayResult(policy.name, config.name, block_size, int(capacity_tokens),
                       cache.pool.n_pages, cache.checkpoint_pages, costs.kv_bytes_per_token,
                       costs.checkpoint_bytes)
    order = sorted(range(len(records)), key=lambda i: (records[i].timestamp, i))
    kv_sum = ck_sum = 0
    for i in order:
        rec = records[i]
        if rec.input_length == 0:
            raise ValueError(f"records[{i}].input_length=0: expected prompts of at least one token")
        out = cache.serve(rec.hash_ids, rec.input_length)
        n, u = out.n_tokens, out.usable_hit
        res.requests += 1
        res.prompt_tokens += n
        res.kv_hit_tokens += out.kv_hit
        res.usable_hit_tokens += u
        res.prefill_flops_cold += costs.prefill_flops(n)
        res.prefill_flops += costs.prefill_flops(n - u, u)
        kv = cache.kv_pages
        ck = cache.checkpoint_pages_used
        kv_sum += kv
        ck_sum += ck
        if kv > res.kv_bytes_peak:
            res.kv_bytes_peak = kv
        if ck > res.checkpoint_bytes_peak:
            res.checkpoint_bytes_peak = ck
        if keep_per_request:
            res.per_request.append(out)
    res.kv_bytes_peak *= page_bytes
    res.checkpoint_bytes_peak *= page_bytes
    if res.requests:
        res.kv_bytes_mean = kv_sum * page_bytes / res.requests
        res.checkpoint_bytes_mean = ck_sum * page_bytes / res.requests
    res.checkpoints_admitted = cache.checkpoints_admitted
    res.checkpoints_evicted = cache.checkpoints_evicted
    res.wall_seconds = time.perf_counter() - start
    return res


# --------------------------------------------------------------------------- real tensors


class ModelPrefixCache:
    """The same cache holding real tensors for the runnable model: KV rows per block, states.

    :meth:`prefill` serves a prompt from the deepest usable hit: it rebuilds a
    :class:`kimilab.cache.HybridCache` from the checkpoint and the cached KV
    blocks, prefills only the rest (split at the positions where the policy
    admits new checkpoints, captured on the way), then stores the new blocks.
    """

    def __init__(self, model, policy: Policy | str, *, block_size: int, capacity_tokens: int,
                 partial_blocks: bool = False):
        if isinstance(policy, str):
            policy = make_policy(policy)
        if policy.free_states:
            raise ValueError(
                "policy='kv-only' keeps no states, so a hybrid model cannot resume from it; "
                "use every-block, align or dual"
            )
        self.model = model
        self.config = model.config
        self.cache = HybridPrefixCache.for_budget(self.config, policy, block_size=block_size,
                                                  capacity_tokens=capacity_tokens,
                                                  partial_blocks=partial_blocks)

    def _restore(self, path, usable_node) -> HybridCache:
        cfg = self.config
        if usable_node is None:
            return HybridCache(cfg)
        blocks = []
        for node in path:
            blocks.append(node.block_data)
            if node is usable_node:
                break
        kv = {
            i: (np.concatenate([b[i][0] for b in blocks]), np.concatenate([b[i][1] for b in blocks]))
            for i in cfg.attn_layers
        }
        return HybridCache.from_checkpoint(cfg, usable_node.payload.state, kv=kv)

    def prefill(self, tokens):
        """``(logits [n - usable, vocab], final HybridCache, Outcome)`` for one prompt."""
        tokens = np.asarray(tokens, dtype=np.int64)
        if tokens.ndim != 1 or tokens.size == 0:
            raise ValueError(f"tokens: expected a non-empty 1-D array of token ids, got shape {tokens.shape}")
        cache = self.cache
        outcome, path, usable_node, added = cache.begin(tokens=tokens)
        try:
            kv_cache = self._restore(path, usable_node)
            pos = outcome.usable_hit
            wanted = {node.end: node for node in added}
            cuts = sorted(wanted) + [len(tokens)]
            pieces = []
            for cut in cuts:
                if cut > pos:
                    pieces.append(self.model.prefill(tokens[pos:cut], kv_cache))
                    pos = cut
                if cut in wanted:
                    wanted[cut].payload.state = kv_cache.checkpoint()
            logits = np.concatenate(pieces) if pieces else np.zeros((0, self.config.vocab_size))
            for node in path:
                if node.block_data is None:
                    start = node.end - node.n_tokens
                    node.block_data = {
                        i: (np.array(kv_cache.kv(i)[0][start:node.end]),
                            np.array(kv_cache.kv(i)[1][start:node.end]))
                        for i in self.config.attn_layers
                    }
        finally:
            cache.finish(path)
        return logits, kv_cache, outcome


# --------------------------------------------------------------------------- CLI


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an int") from None
    if value <= 0:
        raise argparse.ArgumentTypeError(f"{value} must be a positive int")
    return value


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m kimilab.prefix",
        description="Replay a Mooncake-format trace through a dual-granularity prefix cache "
                    "and print one JSON object of hit rates, memory and FLOPs.",
    )
    p.add_argument("trace", metavar="TRACE.jsonl", help="Mooncake jsonl trace "
                   "(timestamp, input_length, output_length, hash_ids)")
    p.add_argument("--block-size", type=_positive_int, default=512,
                   help="tokens per hash block and per KV page (default 512, Mooncake's)")
    p.add_argument("--capacity-tokens", type=_positive_int, required=True,
                   help="cache memory in tokens of the model's KV (N * kv_bytes_per_token bytes), "
                        "shared by KV pages and state checkpoints")
    p.add_argument("--policy", choices=sorted(POLICIES), required=True)
    p.add_argument("--model", default="kimi_linear_48b",
                   help="config preset whose bytes and FLOPs are used (default kimi_linear_48b)")
    p.add_argument("--interval", type=_positive_int, default=None,
                   help="checkpoint interval in tokens for align (default 2048) and dual (default none)")
    p.add_argument("--alpha", type=float, default=0.005,
                   help="dual: weight of FLOPs-per-byte vs recency (in cache turnovers; default 0.005)")
    p.add_argument("--partial-blocks", action="store_true",
                   help="also cache a prompt's trailing partial block")
    return p


def main(argv: Sequence[str] | None = None) -> int:
    parser = _parser()
    args = parser.parse_args(argv)
    from kimilab.traffic.trace import load_trace

    try:
        config = preset(args.model)
    except ValueError as err:
        parser.error(f"--model: {err}")
    if args.policy == "kv-only" and args.interval is not None:
        parser.error("--interval: the kv-only policy keeps no checkpoints")
    kwargs = {}
    if args.interval is not None:
        kwargs["interval"] = args.interval
    if args.policy == "dual":
        kwargs["alpha"] = args.alpha
    if args.capacity_tokens < args.block_size:
        parser.error(f"--capacity-tokens={args.capacity_tokens}: expected at least one block "
                     f"(--block-size={args.block_size})")
    try:
        policy = make_policy(args.policy, **kwargs)
        records = load_trace(args.trace, args.block_size)
        result = replay(records, policy, config=config, block_size=args.block_size,
                        capacity_tokens=args.capacity_tokens, partial_blocks=args.partial_blocks)
    except (ValueError, OSError) as err:
        parser.error(str(err))
    out = result.as_dict()
    out["policy_detail"] = policy.describe()
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
