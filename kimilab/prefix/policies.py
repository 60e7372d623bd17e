"""Checkpoint policies: where a hybrid prefix cache keeps KDA states, and what it evicts first.

A *policy* (not to be confused with a pool's page *layout*) answers two questions
for :class:`~kimilab.prefix.hybrid.HybridPrefixCache`: after a request's blocks
are in the tree, at which block ends should a state checkpoint be admitted; and
how to rank evictable things (lower goes first).

* ``kv-only``     a pure-attention model: states are free, usable hit = KV hit;
* ``every-block`` a state at every block boundary (vLLM ``all``);
* ``align``       states at prefill-chunk ends and request ends (vLLM ``align``);
* ``ends``        a state at each request's end only, plain LRU: the simplest
                  thing that works, and the baseline the others are measured over;
* ``ends+branch`` ``ends`` plus branch points discovered as traffic arrives (kept
                  while they branch), still plain LRU: ``dual`` without ``alpha``;
* ``dual``        states at request ends and at branch points discovered as
                  traffic arrives, evicted by recency + alpha x (FLOPs of the
                  whole prefix per checkpoint); optional coarse checkpoints every
                  ``interval`` tokens. Marconi's own eviction is in
                  :mod:`kimilab.prefix.marconi`;
* ``chunk-ends``  what vLLM ``align`` and SGLang's scheduler strategies admit: a
                  state at each prefill chunk's end, at the request end and
                  (``kv_boundary``) where a prompt's KV hit outruns its state hit;
* ``periodic``    TensorRT-LLM's ``mamba_state_cache_interval``: states at every
                  multiple of ``interval`` from token 0, and at the request end.

``dual`` = ``ends`` + branch points + FLOP-aware eviction (``alpha``), each a
subclass of the one before: ``ends+branch`` - ``ends`` measures what branch
points add, ``dual`` - ``ends+branch`` what ``alpha`` adds (``dual`` with
``alpha=0`` *is* ``ends+branch``).
"""

from __future__ import annotations

import bisect

from dataclasses import dataclass
from typing import TYPE_CHECKING, Sequence

from kimilab.validate import check_float, check_int

if TYPE_CHECKING:
    from kimilab.prefix.hybrid import HybridPrefixCache

__all__ = ["Placement", "Policy", "KVOnly", "NoStates", "EveryBlock", "Align", "Ends", "EndsBranch", "Dual", "ChunkEnds",
           "Periodic", "POLICIES", "make_policy", "check_interval"]


@dataclass(frozen=True)
class Placement:
    """Where a request's checkpoints may go, in numbers only (so any tree can ask).

    ``ends[i]`` is the prefix length at the end of the i-th block of the prompt now in
    the tree (root-side first); ``branch`` is True when the last matched block has two
    or more children after this request's insertion (the prompt left a cached path there).
    """

    ends: Sequence[int]  # prefix length (tokens) at the end of each of the prompt's cached blocks
    n_matched: int  # how many of them were cached before this request
    usable_end: int  # tokens covered by the usable hit (a checkpoint or 0)
    n_tokens: int  # prompt length
    branch: bool = False  # the last matched block is now a branch point


class Policy:
    """Base policy: where checkpoints are admitted and how evictable things are ranked.

    Ranks are "lower goes first". The base ranks by last use (LRU), separately for
    KV leaves and for checkpoints; any checkpoint of an unpinned node may be evicted.
    """

    name = "policy"
    free_states = False  # True: states cost nothing and exist everywhere (pure attention)
    protect_branch_points = False  # True: a checkpoint on a node with >= 2 children is kept
    # True: a KV leaf without a checkpoint ranks by its last use alone, whatever its depth
    # (kv_priority(cache, t, end, False) == t). RunPrefixCache then trims a run's tail without
    # ranking each block; a policy whose leaf rank depends on depth must set it False.
    lru_leaves = True
    # True: checkpoints rank by last use alone, as KV leaves with a checkpoint do
    # (checkpoint_priority(cache, t, end) == kv_priority(cache, t, end, True) == t), so
    # RunPrefixCache may skip ranking those too.
    lru_checkpoints = True

    def positions(self, p: Placement) -> list[int]:
        """Indices into ``p.path`` whose end should get a checkpoint."""
        raise NotImplementedError

    def now(self, cache: "HybridPrefixCache") -> float:
        """The clock stamped on every use: requests served so far."""
        return float(cache.clock)

    def kv_priority(self, cache: "HybridPrefixCache", last_access: float, end: int, has_checkpoint: bool) -> float:
        """Rank of an evictable KV leaf ending at ``end`` (with its checkpoint, if any): its last use."""
        return last_access

    def checkpoint_priority(self, cache: "HybridPrefixCache", last_access: float, end: int) -> float:
        """Rank of a checkpoint at ``end`` evicted on its own: its last use."""
        return last_access

    def describe(self) -> str:
        return self.name


def check_interval(interval, block_size: int, name: str) -> None:
    if interval is None:
        return
    check_int(f"{name}.interval", interval, 1, unit="tokens, or None")
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


class NoStates(Policy):
    """A prefix cache on a hybrid model that keeps KV blocks but never a state checkpoint:
    it finds KV hits it can never use (chapter 5's lesson, the experiment's control)."""

    name = "no-states"

    def positions(self, p: Placement) -> list[int]:
        return []


class EveryBlock(Policy):
    """vLLM ``all``: a state at every block boundary the request computed."""

    name = "every-block"

    def positions(self, p: Placement) -> Sequence[int]:
        """Every end past the usable hit: a ``range`` when ``p.ends`` is one (the run tree then
        admits the checkpoints run by run instead of position by position)."""
        if isinstance(p.ends, range) and p.ends.step > 0:  # sorted: skip the covered ends in O(log n)
            return range(bisect.bisect_right(p.ends, p.usable_end), len(p.ends))
        return [i for i, end in enumerate(p.ends) if end > p.usable_end]


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
            i for i, end in enumerate(p.ends)
            if end > p.usable_end and (end - p.usable_end) % self.interval == 0
        ]
        last = len(p.ends) - 1
        if p.ends and p.ends[last] > p.usable_end and (not out or out[-1] != last):
            out.append(last)
        return out

    def describe(self) -> str:
        return f"{self.name}(interval={self.interval})"


def _request_end(p: Placement) -> list[int]:
    """The last whole block the prompt left in the tree, if the prefill computes it."""
    last = len(p.ends) - 1
    return [last] if last >= 0 and p.ends[last] > p.usable_end else []


def _branch_point(p: Placement) -> list[int]:
    """The deepest KV-cached node where the prompt leaves a cached path (see :class:`Dual`)."""
    j = p.n_matched - 1
    if p.branch and 0 <= j < len(p.ends) - 1 and p.ends[j] > p.usable_end:
        return [j]
    return []


class Ends(Policy):
    """A state at each request's end only (the last whole block its prompt leaves in the tree),
    plain LRU eviction of KV leaves and states alike: the simplest thing that works.

    A later request reuses a prefix only up to an earlier request's end, which is
    exactly what multi-turn traffic re-sends (the previous turn plus its reply).
    Recency is stamped on the cache's own clock, turnovers (pages admitted / pool
    pages), as ``dual`` stamps it: consecutive requests that admit no page share a
    stamp, and such ties go to the one whose last request came first (then the
    shallower). So ``ends``, ``ends+branch`` and ``dual`` differ only in what
    each adds, never in how time is counted.
    """

    name = "ends"

    def positions(self, p: Placement) -> list[int]:
        return _request_end(p)

    def now(self, cache) -> float:
        return cache.turnover


class EndsBranch(Ends):
    """``ends`` plus branch points (:class:`Dual`'s discovery), plain LRU: exactly ``Dual(alpha=0)``.

    As in ``dual``, a state on a node with two or more children (a live branch
    point) is never evicted on its own.
    """

    name = "ends+branch"
    protect_branch_points = True

    def positions(self, p: Placement) -> list[int]:
        return sorted(set(_request_end(p) + _branch_point(p)))


class Dual(EndsBranch):
    """Marconi-style: states at request ends and at branch points found as traffic arrives.

    A branch point is the deepest KV-cached node of a prompt where it leaves a
    cached path: the node already had a child, so with this prompt it has two
    (its KV was hit, its state did not exist, and the prefill passes through it
    anyway). A prompt that merely extends a cached leaf creates no branch.
    ``interval`` adds coarse checkpoints at absolute multiples of that many tokens
    (None: none). Without it, ``dual`` is ``ends+branch`` plus ``alpha``.

    Eviction ranks a unit (a leaf with its checkpoint, or a checkpoint alone) by
    ``recency + alpha * value``. Recency is the cache's own clock at last use,
    counted in *turnovers* (pages admitted so far / pool pages), so the rank means
    the same at any traffic rate and memory size; value is the FLOPs the checkpoint
    saves per byte it holds (prefill FLOPs of its prefix, per checkpoint), in units
    of a one-block checkpoint's. A KV leaf without a checkpoint is ranked by
    recency alone.

    ``alpha`` (>= 0, default 0.005) is how many turnovers of age one unit of value
    is worth: a checkpoint whose prefix costs ``v`` times a one-block prefill to
    recompute outlives an equally recent one-block checkpoint by ``alpha * (v - 1)``
    turnovers. ``alpha=0`` is plain LRU over the same admitted states, exactly
    ``ends+branch`` (a test holds them equal); a large ``alpha`` keeps long
    prefixes almost regardless of age. The default was tuned coarsely on the book's
    generated traces, as Marconi tunes its weight per workload. As in Marconi, a
    checkpoint on a node with two or more children (a live branch point) is never
    evicted on its own.
    """

    name = "dual"
    lru_checkpoints = False

    def __init__(self, interval: int | None = None, alpha: float = 0.005):
        check_float("Dual.alpha", alpha, minimum=0.0)
        self.interval = interval
        self.alpha = float(alpha)
        self._value_cache: dict[int, float] = {}

    def positions(self, p: Placement) -> list[int]:
        # request end; branch point: the prompt leaves a cached path there (not just extends it)
        out = set(_request_end(p) + _branch_point(p))
        if self.interval:
            for i, end in enumerate(p.ends):
                if end > p.usable_end and end % self.interval == 0:
                    out.add(i)
        return sorted(out)

    def value(self, cache: "HybridPrefixCache", end: int) -> float:
        """FLOPs saved per byte by a checkpoint at ``end``, relative to one at the first block."""
        v = self._value_cache.get(end)
        if v is None:
            v = self._value_cache[end] = (cache.costs.prefill_flops(end)
                                          / cache.costs.prefill_flops(cache.block_size))
        return v

    def kv_priority(self, cache, last_access, end, has_checkpoint) -> float:
        if not has_checkpoint:
            return last_access
        return last_access + self.alpha * self.value(cache, end)

    def checkpoint_priority(self, cache, last_access, end) -> float:
        return last_access + self.alpha * self.value(cache, end)

    def describe(self) -> str:
        return f"{self.name}(interval={self.interval}, alpha={self.alpha:g})"


def _kv_boundary(p: Placement) -> list[int]:
    """The deepest matched block, when the prompt's KV hit reaches past its usable hit and the prompt
    goes on: vLLM's shared-prefix boundary, SGLang's ``mamba_branching_seqlen``."""
    j = p.n_matched - 1
    return [j] if 0 <= j < len(p.ends) - 1 and p.ends[j] > p.usable_end else []


class ChunkEnds(Align):
    """States where the engines that ship put them, with plain LRU eviction.

    A prefill runs in chunks of ``interval`` tokens from the usable hit (vLLM ``align`` splits
    chunks on its block grid: ``interval`` = ``max_num_batched_tokens`` rounded down to blocks;
    SGLang ``no_buffer`` copies the state at each chunked-prefill chunk's end); each chunk end
    and the request end get a state. ``kv_boundary=True`` adds one more: the deepest block of the
    prompt's KV hit when it lies past the usable hit -- vLLM's shared-prefix boundary (Marconi's
    idea, merged for ``align``) and SGLang ``extra_buffer``'s branching point. With
    ``kv_boundary=False`` it is :class:`Align`.
    """

    name = "chunk-ends"

    def __init__(self, interval: int = 8192, kv_boundary: bool = True):
        super().__init__(interval)
        self.kv_boundary = bool(kv_boundary)

    def positions(self, p: Placement) -> list[int]:
        out = super().positions(p)
        return sorted(set(out + _kv_boundary(p))) if self.kv_boundary else out

    def describe(self) -> str:
        return f"{self.name}(interval={self.interval}, kv_boundary={self.kv_boundary})"


class Periodic(Ends):
    """TensorRT-LLM's ``mamba_state_cache_interval``: a state at every multiple of ``interval``
    tokens counted from token 0 (not from the hit), and one at the request end; LRU."""

    name = "periodic"

    def __init__(self, interval: int = 2048):
        self.interval = interval

    def positions(self, p: Placement) -> list[int]:
        out = [i for i, end in enumerate(p.ends) if end > p.usable_end and end % self.interval == 0]
        return sorted(set(out + _request_end(p)))

    def describe(self) -> str:
        return f"{self.name}(interval={self.interval})"


POLICIES = {"kv-only": KVOnly, "no-states": NoStates, "every-block": EveryBlock, "align": Align, "ends": Ends,
            "ends+branch": EndsBranch, "dual": Dual, "chunk-ends": ChunkEnds,
            "periodic": Periodic}


def make_policy(name: str, **kwargs) -> Policy:
    """A fresh policy object by name (``interval=`` for align/dual/chunk-ends/periodic, ``alpha=`` for
    dual, ``kv_boundary=`` for chunk-ends; e.g. ``make_policy("dual", alpha=0.0)``)."""
    if name not in POLICIES:
        raise ValueError(f"policy={name!r}: expected one of {sorted(POLICIES)}")
    try:
        return POLICIES[name](**kwargs)
    except TypeError:
        raise ValueError(f"policy={name!r}: unexpected options {sorted(kwargs)} "
                         f"(interval= for align/dual/chunk-ends/periodic, alpha= for dual, "
                         f"kv_boundary= for chunk-ends)") from None


