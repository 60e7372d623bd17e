"""The unified page pool: one preallocated arena, fixed-size pages, typed allocations.

A hybrid request holds memory of very different shapes: KV blocks that grow
page by page, one fixed KDA state and one conv state per KDA layer, and later
state checkpoints (prefix caching) and scratch (speculative decoding). This
module keeps all of them in ONE arena cut into equal pages:

* :class:`PagePool` hands out :class:`Allocation` handles, each a set of pages
  of one kind with a reference count (``share`` / ``free``), so prefix sharing
  and copy-on-write can build on it. Allocate and free cost O(pages moved),
  never O(pool): free pages sit on a stack.
* ``backed=False`` keeps only the accounting, so a 48B-scale serving
  simulation can run without gigabytes of RAM.
* Page-sizing policies (:class:`UnifiedPages`, :class:`VllmPaddedPages`,
  :class:`JengaPages`, :class:`SplitPools`) say how a request's cache maps to
  pages under each production design, and :class:`RequestAllocator` admits,
  grows and releases whole requests on the pools a policy builds.

The pool knows nothing of prefix trees or models: it moves pages and counts bytes.
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass, field

import numpy as np

from kimilab.config import ModelConfig

__all__ = [
    "KINDS", "KIND_CODES", "PoolError", "PoolExhausted", "HandleError", "DoubleFree",
    "ForeignHandle", "RefcountError", "Allocation", "PoolStats", "PagePool", "LcmPagePool",
    "CacheShapes", "Footprint", "UnifiedPages", "VllmPaddedPages", "JengaPages", "SplitPools",
    "RequestAllocator", "waste_table",
]

KINDS = ("kv", "kda_state", "conv_state", "checkpoint", "scratch")
KIND_CODES = {kind: code for code, kind in enumerate(KINDS)}  # page map: -1 = free
FREE_CODE = -1


def _check_kind(kind) -> int:
    try:
        return KIND_CODES[kind]
    except (KeyError, TypeError):
        raise ValueError(f"kind={kind!r}: expected one of {KINDS}") from None


def _check_count(name: str, value, minimum: int = 1) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < minimum:
        raise ValueError(f"{name}={value!r}: expected an int >= {minimum}")
    return int(value)


# ----- errors ------------------------------------------------------------------

class PoolError(RuntimeError):
    """Base class of every pool error."""


class PoolExhausted(PoolError):
    """Not enough free pages. The pool is left exactly as it was before the call.

    Build it with :meth:`of`, which reads the pool's own accounting, so every
    "out of memory" in the book says the same things the same way.
    """

    def __init__(self, kind: str, requested_pages: int, n_free: int, n_pages: int,
                 used_by_kind: dict[str, int], page_bytes: int, pool_name: str = "pool"):
        self.kind = kind
        self.requested_pages = requested_pages
        self.n_free = n_free
        self.n_pages = n_pages
        self.used_by_kind = dict(used_by_kind)
        self.page_bytes = page_bytes
        self.pool_name = pool_name
        used = ", ".join(f"{k}={v}" for k, v in used_by_kind.items() if v) or "nothing"
        super().__init__(
            f"{pool_name}: cannot allocate {requested_pages} {kind!r} page(s) "
            f"({requested_pages * page_bytes} B): only {n_free} of {n_pages} pages free "
            f"({n_free * page_bytes} B); pages in use by kind: {used}"
        )

    @classmethod
    def of(cls, pool: "PagePool", kind: str, requested_pages: int, what: str = "") -> "PoolExhausted":
        """The error for ``pool`` failing to supply ``requested_pages`` pages of ``kind``.

        ``what`` (e.g. ``"admit 7"``) is added to the pool's name in the message.
        """
        name = f"{pool.name} ({what})" if what else pool.name
        return cls(kind, requested_pages, pool.n_free, pool.n_pages, pool.stats().pages_by_kind,
                   pool.page_bytes, name)


class HandleError(PoolError, ValueError):
    """A handle was misused (freed twice, freed on the wrong pool, refcount broken)."""


class DoubleFree(HandleError):
    """This handle was already freed."""


class ForeignHandle(HandleError):
    """The handle belongs to another pool (or is not a handle at all)."""


class RefcountError(HandleError):
    """A reference count would drop below zero (an accounting bug upstream)."""


# ----- handles and stats -------------------------------------------------------

class _Block:
    """The shared part of an allocation: its pages, kind, bytes and reference count."""

    __slots__ = ("block_id", "kind", "pages", "nbytes", "refcount")

    def __init__(self, block_id: int, kind: str, pages: np.ndarray, nbytes: int):
        self.block_id, self.kind, self.pages, self.nbytes = block_id, kind, pages, nbytes
        self.refcount = 1


class Allocation:
    """One reference to a set of pages of one kind.

    ``pool.share(a)`` returns a NEW handle to the same pages (refcount + 1); every
    handle is freed exactly once, and the pages go back when the last one is.
    """

    __slots__ = ("_block", "_pool_uid", "handle_id", "_live")

    def __init__(self, block: _Block, pool_uid: int, handle_id: int):
        self._block, self._pool_uid, self.handle_id, self._live = block, pool_uid, handle_id, True

    @property
    def kind(self) -> str:
        return self._block.kind

    @property
    def pages(self) -> np.ndarray:
        """Page indices (read-only), in the order the bytes are laid out."""
        return self._block.pages

    @property
    def n_pages(self) -> int:
        return int(self._block.pages.shape[0])

    @property
    def nbytes(self) -> int:
        """Bytes the caller asked for (<= n_pages * page_bytes)."""
        return self._block.nbytes

    @property
    def block_id(self) -> int:
        return self._block.block_id

    @property
    def refcount(self) -> int:
        return self._block.refcount

    @property
    def live(self) -> bool:
        return self._live

    def __repr__(self) -> str:
        state = "live" if self._live else "freed"
        return (f"Allocation(kind={self.kind!r}, n_pages={self.n_pages}, nbytes={self.nbytes}, "
                f"block={self.block_id}, refcount={self.refcount}, {state})")


@dataclass(frozen=True)
class PoolStats:
    """A consistent snapshot of a pool's accounting."""

    n_pages: int
    page_bytes: int
    n_free: int
    pages_by_kind: dict[str, int]
    requested_bytes_by_kind: dict[str, int]
    high_water_pages: int
    n_allocations: int  # live blocks
    n_handles: int  # live handles (>= n_allocations when pages are shared)

    @property
    def n_used(self) -> int:
        return self.n_pages - self.n_free

    @property
    def used_bytes(self) -> int:
        return self.n_used * self.page_bytes

    @property
    def requested_bytes(self) -> int:
        return sum(self.requested_bytes_by_kind.values())

    @property
    def waste_bytes_by_kind(self) -> dict[str, int]:
        """Internal waste: pages * page_bytes - requested bytes, per kind."""
        return {k: self.pages_by_kind[k] * self.page_bytes - self.requested_bytes_by_kind[k]
                for k in KINDS}

    @property
    def waste_bytes(self) -> int:
        return self.used_bytes - self.requested_bytes

    @property
    def utilisation(self) -> float:
        """Fraction of the pool's pages in use."""
        return self.n_used / self.n_pages


# ----- the pool ----------------------------------------------------------------

_POOL_UIDS = itertools.count(1)


class PagePool:
    """``n_pages`` pages of ``page_bytes`` bytes in one preallocated numpy arena.

    ``allocate(kind, n)`` pops n pages from a free stack (O(n)); ``free`` pushes
    them back when the last handle goes. Nothing ever scans the pool, except
    :meth:`check_invariants` (for tests). Never-used pages are handed out in
    order from a bump pointer; when the pool drains completely both reset in
    O(1), so an emptied pool behaves exactly like a fresh one. Freed pages are not zeroed (``allocate(zero=True)``
    does it for the pages it hands out).
    """

    def __init__(self, n_pages: int, page_bytes: int, *, backed: bool = True, name: str = "pool"):
        self.n_pages = _check_count("n_pages", n_pages)
        self.page_bytes = _check_count("page_bytes", page_bytes)
        if backed and self.page_bytes % 8:
            raise ValueError(f"page_bytes={page_bytes}: a backed pool needs a multiple of 8 "
                             "(pages are viewed as float64 arrays)")
        self.backed = bool(backed)
        self.name = name
        self._uid = next(_POOL_UIDS)
        self._arena = np.zeros(self.n_pages * self.page_bytes, dtype=np.uint8) if backed else None
        # Free pages = a stack of recycled pages (top at the end) + the never-used
        # pages [bump, n_pages). Recycled pages go out first.
        self._stack = np.zeros(self.n_pages, dtype=np.int64)
        self._top = 0
        self._bump = 0
        self._page_kind = np.full(self.n_pages, FREE_CODE, dtype=np.int8)
        self._blocks: dict[int, _Block] = {}
        self._block_ids = itertools.count()
        self._handle_ids = itertools.count()
        self._n_handles = 0
        self._pages_by_kind = dict.fromkeys(KINDS, 0)
        self._requested_by_kind = dict.fromkeys(KINDS, 0)
        self._high_water = 0

    # ----- allocation --------------------------------------------------------
    @property
    def n_free(self) -> int:
        return self._top + self.n_pages - self._bump

    @property
    def n_used(self) -> int:
        return self._bump - self._top

    def pages_for_bytes(self, nbytes: int) -> int:
        """Pages needed to hold ``nbytes`` (at least one)."""
        return max(1, -(-_check_count("nbytes", nbytes, 0) // self.page_bytes))

    def fits(self, demand: dict[str, int]) -> bool:
        """Would ``{kind: n_pages}`` fit right now (all of it together)?"""
        return sum(demand.values()) <= self.n_free

    def allocate(self, kind: str, n_pages: int, *, nbytes: int | None = None,
                 zero: bool = False) -> Allocation:
        """Take ``n_pages`` pages for ``kind``; ``nbytes`` (default: all of them) is what
        the caller will really use, and the rest counts as internal waste."""
        code = _check_kind(kind)
        n = _check_count("n_pages", n_pages)
        capacity = n * self.page_bytes
        nbytes = capacity if nbytes is None else _check_count("nbytes", nbytes, 0)
        if nbytes > capacity:
            raise ValueError(f"nbytes={nbytes}: more than the {n} page(s) asked for hold "
                             f"({capacity} B at page_bytes={self.page_bytes})")
        if n > self.n_free:
            raise PoolExhausted.of(self, kind, n)
        recycled = min(n, self._top)
        top = self._top - recycled
        fresh = n - recycled
        if fresh:
            pages = np.concatenate([self._stack[top:self._top][::-1],
                                    np.arange(self._bump, self._bump + fresh, dtype=np.int64)])
            self._bump += fresh
        else:
            pages = self._stack[top:self._top][::-1].copy()
        pages.flags.writeable = False
        self._top = top
        self._page_kind[pages] = code
        block = _Block(next(self._block_ids), kind, pages, nbytes)
        self._blocks[block.block_id] = block
        self._pages_by_kind[kind] += n
        self._requested_by_kind[kind] += nbytes
        self._high_water = max(self._high_water, self.n_used)
        self._n_handles += 1
        if zero and self.backed:
            self._pages2d()[pages] = 0
        return Allocation(block, self._uid, next(self._handle_ids))

    def allocate_bytes(self, kind: str, nbytes: int, *, zero: bool = False) -> Allocation:
        """Allocate enough pages for ``nbytes`` bytes."""
        return self.allocate(kind, self.pages_for_bytes(nbytes), nbytes=nbytes, zero=zero)

    def _own(self, alloc, verb: str) -> _Block:
        if not isinstance(alloc, Allocation):
            raise ForeignHandle(f"{verb}(alloc): expected an Allocation from this pool, "
                                f"got {type(alloc).__name__}")
        if alloc._pool_uid != self._uid:
            raise ForeignHandle(f"{verb}({alloc!r}): the handle belongs to another pool, "
                                f"not {self.name!r}")
        if not alloc._live:
            raise DoubleFree(f"{verb}({alloc!r}): this handle was already freed")
        block = alloc._block
        if self._blocks.get(block.block_id) is not block or block.refcount <= 0:
            raise RefcountError(f"{verb}({alloc!r}): block {block.block_id} has refcount "
                                f"{block.refcount}; it would drop below zero")
        return block

    def share(self, alloc: Allocation) -> Allocation:
        """A new handle to the same pages; the pages stay until every handle is freed."""
        block = self._own(alloc, "share")
        block.refcount += 1
        self._n_handles += 1
        return Allocation(block, self._uid, next(self._handle_ids))

    def free(self, alloc: Allocation) -> None:
        """Drop one reference; the pages return to the free stack at refcount 0."""
        block = self._own(alloc, "free")
        alloc._live = False
        block.refcount -= 1
        self._n_handles -= 1
        if block.refcount:
            return
        pages = block.pages
        n = pages.shape[0]
        self._stack[self._top:self._top + n] = pages[::-1]
        self._top += n
        self._page_kind[pages] = FREE_CODE
        self._pages_by_kind[block.kind] -= n
        self._requested_by_kind[block.kind] -= block.nbytes
        del self._blocks[block.block_id]
        if self._top == self._bump:  # everything is free again: back to the fresh layout, O(1)
            self._top = self._bump = 0

    # ----- bytes -------------------------------------------------------------
    def _pages2d(self) -> np.ndarray:
        if not self.backed:
            raise PoolError(f"{self.name}: backed=False keeps accounting only; it has no bytes")
        return self._arena.reshape(self.n_pages, self.page_bytes)

    def arena(self) -> np.ndarray:
        """The whole arena as [n_pages, page_bytes] uint8 (a view)."""
        return self._pages2d()

    def buffer(self, alloc: Allocation) -> np.ndarray:
        """The allocation's bytes as a uint8 view [n_pages, page_bytes].

        Pages that are consecutive in the arena give one strided view; otherwise
        the pages are scattered and a single view cannot exist, so use
        :meth:`page_views` (one view per page) instead.
        """
        block = self._own(alloc, "buffer")
        pages = block.pages
        first = int(pages[0])
        if pages.shape[0] > 1 and not np.array_equal(pages, np.arange(first, first + pages.shape[0])):
            raise PoolError(f"buffer({alloc!r}): pages are not consecutive; use page_views()")
        return self._pages2d()[first:first + pages.shape[0]]

    def is_contiguous(self, alloc: Allocation) -> bool:
        pages = self._own(alloc, "is_contiguous").pages
        return bool(pages.shape[0] == 1 or np.all(np.diff(pages) == 1))

    def page_views(self, alloc: Allocation) -> list[np.ndarray]:
        """One uint8 view [page_bytes] per page, in layout order."""
        arena = self._pages2d()
        return [arena[p] for p in self._own(alloc, "page_views").pages]

    # ----- inspection --------------------------------------------------------
    def stats(self) -> PoolStats:
        return PoolStats(
            n_pages=self.n_pages, page_bytes=self.page_bytes, n_free=self.n_free,
            pages_by_kind=dict(self._pages_by_kind),
            requested_bytes_by_kind=dict(self._requested_by_kind),
            high_water_pages=self._high_water, n_allocations=len(self._blocks),
            n_handles=self._n_handles,
        )

    def page_map(self) -> np.ndarray:
        """Kind code of every page (see KIND_CODES; -1 = free), a copy."""
        return self._page_kind.copy()

    def free_pages(self) -> np.ndarray:
        """Free pages, next-to-be-allocated first (a copy)."""
        return np.concatenate([self._stack[:self._top][::-1],
                               np.arange(self._bump, self.n_pages, dtype=np.int64)])

    def reset_high_water(self) -> None:
        self._high_water = self.n_used

    def check_invariants(self) -> None:
        """Recount everything from scratch (O(pool)); raise AssertionError on any mismatch."""
        free = self.free_pages()
        assert len(np.unique(free)) == free.shape[0], "a page is on the free stack twice"
        owned = [b.pages for b in self._blocks.values()]
        used = np.concatenate(owned) if owned else np.zeros(0, dtype=np.int64)
        assert len(np.unique(used)) == used.shape[0], "a page belongs to two allocations"
        assert free.shape[0] + used.shape[0] == self.n_pages, (
            f"free {free.shape[0]} + used {used.shape[0]} != total {self.n_pages} (leaked pages)")
        assert not np.intersect1d(free, used).size, "a page is both free and in use"
        assert np.all(self._page_kind[free] == FREE_CODE), "a free page has a kind"
        for kind in KINDS:
            blocks = [b for b in self._blocks.values() if b.kind == kind]
            assert self._pages_by_kind[kind] == sum(b.pages.shape[0] for b in blocks), kind
            assert self._requested_by_kind[kind] == sum(b.nbytes for b in blocks), kind
            for b in blocks:
                assert np.all(self._page_kind[b.pages] == KIND_CODES[kind]), kind
        assert all(b.refcount >= 1 for b in self._blocks.values()), "a live block has refcount < 1"
        assert self._n_handles == sum(b.refcount for b in self._blocks.values()), "handle count"
        assert self.n_used <= self._high_water <= self.n_pages, "high-water mark"

    def __repr__(self) -> str:
        mode = "backed" if self.backed else "accounting only"
        return (f"PagePool({self.name!r}, n_pages={self.n_pages}, page_bytes={self.page_bytes}, "
                f"free={self.n_free}, {mode})")


class LcmPagePool:
    """Jenga-style two-level allocator (accounting only).

    Large pages of ``large_bytes`` (a common multiple of every kind's small page)
    come from a :class:`PagePool`; a large page is dedicated to one kind while
    any of its small pages is in use and is split into ``large_bytes //
    small_bytes[kind]`` small pages. Small pages left unused inside a held large
    page are the price: nobody of another kind can use them.
    """

    def __init__(self, n_large: int, small_bytes: dict[str, int], *, name: str = "jenga"):
        if not small_bytes:
            raise ValueError("small_bytes: expected {kind: page bytes} for at least one kind")
        for kind, b in small_bytes.items():
            _check_kind(kind)
            _check_count(f"small_bytes[{kind!r}]", b)
        self.small_bytes = dict(small_bytes)
        self.large_bytes = math.lcm(*self.small_bytes.values())
        self.name = name
        self.large = PagePool(n_large, self.large_bytes, backed=False, name=name)
        self.per_large = {k: self.large_bytes // b for k, b in self.small_bytes.items()}
        self._held: dict[str, dict[int, list]] = {k: {} for k in self.small_bytes}  # kind -> {large id: [alloc, free slots]}
        self._spare: dict[str, int] = dict.fromkeys(self.small_bytes, 0)  # free small slots per kind
        self._used_small = dict.fromkeys(self.small_bytes, 0)
        self._requested = dict.fromkeys(self.small_bytes, 0)
        self._tickets = itertools.count()
        self._live: dict[int, tuple[str, list[tuple[int, int]], int]] = {}

    def page_bytes_for(self, kind: str) -> int:
        return self.small_bytes[kind]

    def fits(self, demand: dict[str, int]) -> bool:
        large_needed = 0
        for kind, n in demand.items():
            short = n - self._spare[kind]
            if short > 0:
                large_needed += -(-short // self.per_large[kind])
        return large_needed <= self.large.n_free

    def allocate(self, kind: str, n_pages: int, *, nbytes: int | None = None) -> int:
        """``n_pages`` small pages of ``kind``; returns a ticket for :meth:`free`."""
        if kind not in self.small_bytes:
            raise ValueError(f"kind={kind!r}: this pool has small pages for {tuple(self.small_bytes)}")
        n = _check_count("n_pages", n_pages)
        nbytes = n * self.small_bytes[kind] if nbytes is None else nbytes
        if not self.fits({kind: n}):
            need = -(-(n - self._spare[kind]) // self.per_large[kind])
            raise PoolExhausted.of(self.large, kind, need)
        taken: list[tuple[int, int]] = []  # (large block id, small pages taken there)
        held = self._held[kind]
        remaining = n
        for lid, entry in held.items():  # fill partly used large pages first
            if remaining == 0:
                break
            take = min(entry[1], remaining)
            if take:
                entry[1] -= take
                taken.append((lid, take))
                remaining -= take
        while remaining:
            alloc = self.large.allocate(kind, 1)
            take = min(self.per_large[kind], remaining)
            held[alloc.block_id] = [alloc, self.per_large[kind] - take]
            self._spare[kind] += self.per_large[kind]
            taken.append((alloc.block_id, take))
            remaining -= take
        self._spare[kind] -= n
        self._used_small[kind] += n
        self._requested[kind] += nbytes
        ticket = next(self._tickets)
        self._live[ticket] = (kind, taken, nbytes)
        return ticket

    def free(self, ticket: int) -> None:
        try:
            kind, taken, nbytes = self._live.pop(ticket)
        except KeyError:
            raise DoubleFree(f"{self.name}: ticket {ticket!r} is not live (freed twice or foreign)") from None
        held = self._held[kind]
        for lid, take in taken:
            entry = held[lid]
            entry[1] += take
            if entry[1] == self.per_large[kind]:  # the large page is empty again
                self.large.free(entry[0])
                del held[lid]
                self._spare[kind] -= self.per_large[kind]
        n = sum(t for _, t in taken)
        self._spare[kind] += n
        self._used_small[kind] -= n
        self._requested[kind] -= nbytes

    @property
    def capacity_bytes(self) -> int:
        return self.large.n_pages * self.large_bytes

    @property
    def reserved_bytes(self) -> int:
        """Bytes of large pages held by some kind (unusable by the others)."""
        return self.large.n_used * self.large_bytes

    @property
    def requested_bytes(self) -> int:
        return sum(self._requested.values())

    @property
    def used_small_bytes(self) -> int:
        return sum(self._used_small[k] * self.small_bytes[k] for k in self.small_bytes)


# ----- request shapes and page-sizing policies ---------------------------------

@dataclass(frozen=True)
class CacheShapes:
    """Bytes of each per-request cache object of a model (computed from its config)."""

    name: str
    kv_token_bytes: int  # one token, one global layer
    n_attn_layers: int
    state_bytes: int  # one KDA layer's recurrent state
    conv_bytes: int  # one KDA layer's conv state
    n_kda_layers: int

    @classmethod
    def from_config(cls, cfg: ModelConfig) -> "CacheShapes":
        if not isinstance(cfg, ModelConfig):
            raise ValueError(f"cfg: expected a kimilab.config.ModelConfig, got {type(cfg).__name__}")
        return cls(
            name=cfg.name,
            kv_token_bytes=cfg.kv_elems_per_token_layer * cfg.kv_bytes,
            n_attn_layers=len(cfg.attn_layers),
            state_bytes=cfg.kda_state_elems_layer * cfg.state_bytes,
            conv_bytes=cfg.conv_state_elems_layer * cfg.conv_bytes,
            n_kda_layers=len(cfg.kda_layers),
        )

    @property
    def kv_bytes_per_token(self) -> int:
        """All global layers together."""
        return self.kv_token_bytes * self.n_attn_layers

    @property
    def fixed_bytes(self) -> int:
        """KDA + conv states of every KDA layer: what a request holds at any length."""
        return (self.state_bytes + self.conv_bytes) * self.n_kda_layers

    def request_bytes(self, n_tokens: int) -> int:
        return self.fixed_bytes + n_tokens * self.kv_bytes_per_token


@dataclass(frozen=True)
class Footprint:
    """One request's memory under a policy: requested vs reserved bytes, by kind."""

    requested: dict[str, int]
    reserved: dict[str, int]

    @property
    def requested_bytes(self) -> int:
        return sum(self.requested.values())

    @property
    def reserved_bytes(self) -> int:
        return sum(self.reserved.values())

    @property
    def waste_bytes(self) -> int:
        return self.reserved_bytes - self.requested_bytes

    @property
    def waste_fraction(self) -> float:
        return self.waste_bytes / self.reserved_bytes if self.reserved_bytes else 0.0


def _ceil_div(a: int, b: int) -> int:
    return -(-a // b)


@dataclass(frozen=True)
class _Policy:
    """Shared machinery: a policy names pools, their page sizes, and a request's pieces.

    ``pieces(shapes)`` lists the fixed objects (allocated at admission) as
    (pool name, kind, pages, requested bytes); KV grows in blocks of
    ``block_tokens(shapes)`` tokens, each block taking ``kv_block_pages(shapes)``
    pages of pool ``kv_pool`` (all global layers together).
    """

    key = "?"
    kv_pool = "main"

    def page_bytes(self, shapes: CacheShapes) -> dict[str, int]:
        raise NotImplementedError

    def block_tokens(self, shapes: CacheShapes) -> int:
        raise NotImplementedError

    def kv_block_pages(self, shapes: CacheShapes) -> int:
        raise NotImplementedError

    def pieces(self, shapes: CacheShapes) -> list[tuple[str, str, int, int]]:
        raise NotImplementedError

    def budget_split(self, shapes: CacheShapes, budget_bytes: int) -> dict[str, int]:
        """Bytes of the budget each pool gets (default: all to one pool)."""
        return {self.kv_pool: budget_bytes}

    def n_blocks(self, shapes: CacheShapes, n_tokens: int) -> int:
        return _ceil_div(max(n_tokens, 0), self.block_tokens(shapes))

    def footprint(self, shapes: CacheShapes, n_tokens: int) -> Footprint:
        """Requested and reserved bytes of one request holding ``n_tokens`` tokens."""
        _check_count("n_tokens", n_tokens, 0)
        page = self.page_bytes(shapes)
        requested = dict.fromkeys(("kv", "kda_state", "conv_state"), 0)
        reserved = dict(requested)
        for pool, kind, pages, nbytes in self.pieces(shapes):
            requested[kind] += nbytes
            reserved[kind] += pages * page[pool]
        requested["kv"] = n_tokens * shapes.kv_bytes_per_token
        reserved["kv"] = self.n_blocks(shapes, n_tokens) * self.kv_block_pages(shapes) * page[self.kv_pool]
        return Footprint(requested, reserved)

    def build_pools(self, shapes: CacheShapes, budget_bytes: int) -> dict:
        """Accounting-only pools for a memory budget (bytes)."""
        _check_count("budget_bytes", budget_bytes)
        page = self.page_bytes(shapes)
        pools = {}
        for name, nbytes in self.budget_split(shapes, budget_bytes).items():
            n = nbytes // page[name]
            if n < 1:
                raise ValueError(f"budget_bytes={budget_bytes}: pool {name!r} gets {nbytes} B, "
                                 f"less than one {page[name]} B page")
            pools[name] = PagePool(n, page[name], backed=False, name=f"{self.key}:{name}")
        return pools

    def describe(self, shapes: CacheShapes) -> str:
        pages = ", ".join(f"{k}={v} B" for k, v in self.page_bytes(shapes).items())
        return f"{self.key}: pages {pages}; KV block {self.block_tokens(shapes)} tokens"


@dataclass(frozen=True)
class UnifiedPages(_Policy):
    """One pool of small pages; every object takes ceil(bytes / page) pages.

    Page = one ``block_tokens`` KV block of one global layer unless
    ``page_bytes`` is given. A KDA state spans many (possibly scattered) pages,
    so waste is only the tail of each object; the price is indirection.
    """

    block_tokens_: int = 16
    page_bytes_: int | None = None
    key = "unified"

    def page_bytes(self, shapes):
        return {"main": self.page_bytes_ or self.block_tokens_ * shapes.kv_token_bytes}

    def block_tokens(self, shapes):
        return self.block_tokens_

    def kv_block_pages(self, shapes):
        page = self.page_bytes(shapes)["main"]
        return shapes.n_attn_layers * _ceil_div(self.block_tokens_ * shapes.kv_token_bytes, page)

    def pieces(self, shapes):
        page = self.page_bytes(shapes)["main"]
        n = shapes.n_kda_layers
        out = []
        if n:
            out.append(("main", "kda_state", n * _ceil_div(shapes.state_bytes, page), n * shapes.state_bytes))
            out.append(("main", "conv_state", n * _ceil_div(shapes.conv_bytes, page), n * shapes.conv_bytes))
        return out


@dataclass(frozen=True)
class VllmPaddedPages(_Policy):
    """vLLM's hybrid layout: one page size for everything.

    A KDA layer's states (recurrent + conv) live in ONE page per layer, so the
    attention block grows to ``align_tokens * ceil(state_page / (align_tokens *
    kv_token_bytes))`` tokens to match, and the state page is padded up to the
    attention page. Short requests reserve a whole (large) block per layer.
    """

    align_tokens: int = 16
    key = "vllm-padded"

    def block_tokens(self, shapes):
        state_page = shapes.state_bytes + shapes.conv_bytes
        per_unit = self.align_tokens * shapes.kv_token_bytes
        return self.align_tokens * max(1, _ceil_div(state_page, per_unit))

    def page_bytes(self, shapes):
        return {"main": self.block_tokens(shapes) * shapes.kv_token_bytes}

    def kv_block_pages(self, shapes):
        return shapes.n_attn_layers

    def pieces(self, shapes):
        n = shapes.n_kda_layers
        return [("main", "kda_state", n, n * (shapes.state_bytes + shapes.conv_bytes))] if n else []


@dataclass(frozen=True)
class JengaPages(_Policy):
    """Jenga's two-level layout: large pages = LCM of the KV page and the state page,
    each large page carved into small pages of one kind (see :class:`LcmPagePool`)."""

    block_tokens_: int = 16
    key = "jenga"

    def block_tokens(self, shapes):
        return self.block_tokens_

    def small_bytes(self, shapes) -> dict[str, int]:
        return {"kv": self.block_tokens_ * shapes.kv_token_bytes,
                "kda_state": shapes.state_bytes + shapes.conv_bytes}

    def page_bytes(self, shapes):
        return {"main": math.lcm(*self.small_bytes(shapes).values())}

    def kv_block_pages(self, shapes):
        return shapes.n_attn_layers

    def pieces(self, shapes):
        n = shapes.n_kda_layers
        return [("main", "kda_state", n, n * (shapes.state_bytes + shapes.conv_bytes))] if n else []

    def footprint(self, shapes, n_tokens):
        small = self.small_bytes(shapes)
        requested = {"kv": n_tokens * shapes.kv_bytes_per_token,
                     "kda_state": shapes.n_kda_layers * shapes.state_bytes,
                     "conv_state": shapes.n_kda_layers * shapes.conv_bytes}
        reserved = {"kv": self.n_blocks(shapes, n_tokens) * shapes.n_attn_layers * small["kv"],
                    "kda_state": shapes.n_kda_layers * small["kda_state"], "conv_state": 0}
        return Footprint(requested, reserved)

    def build_pools(self, shapes, budget_bytes):
        _check_count("budget_bytes", budget_bytes)
        large = self.page_bytes(shapes)["main"]
        if budget_bytes < large:
            raise ValueError(f"budget_bytes={budget_bytes}: less than one LCM large page ({large} B)")
        return {"main": LcmPagePool(budget_bytes // large, self.small_bytes(shapes), name="jenga")}


@dataclass(frozen=True)
class SplitPools(_Policy):
    """SGLang-style: a KV pool and a separate state pool with one slot per request.

    ``state_to_kv_ratio`` r gives the state pool r / (1 + r) of the budget
    (SGLang's ``--mamba-full-memory-ratio``, default 0.9). Neither pool can lend
    pages to the other.
    """

    state_to_kv_ratio: float = 0.9
    block_tokens_: int = 16
    key = "split"
    kv_pool = "kv"

    def __post_init__(self):
        if not (isinstance(self.state_to_kv_ratio, (int, float)) and self.state_to_kv_ratio > 0):
            raise ValueError(f"state_to_kv_ratio={self.state_to_kv_ratio!r}: expected a number > 0")

    def block_tokens(self, shapes):
        return self.block_tokens_

    def page_bytes(self, shapes):
        return {"kv": self.block_tokens_ * shapes.kv_token_bytes, "state": max(shapes.fixed_bytes, 1)}

    def kv_block_pages(self, shapes):
        return shapes.n_attn_layers

    def pieces(self, shapes):
        n = shapes.n_kda_layers
        if not n:
            return []
        return [("state", "kda_state", 1, shapes.fixed_bytes)]  # one slot holds both states

    def footprint(self, shapes, n_tokens):
        base = super().footprint(shapes, n_tokens)
        reserved = dict(base.reserved)  # the slot is counted under kda_state; move conv's share
        if shapes.n_kda_layers:
            reserved["kda_state"] -= shapes.n_kda_layers * shapes.conv_bytes
            reserved["conv_state"] = shapes.n_kda_layers * shapes.conv_bytes
        return Footprint(base.requested, reserved)

    def budget_split(self, shapes, budget_bytes):
        r = float(self.state_to_kv_ratio)
        state = int(budget_bytes * r / (1.0 + r))
        return {"kv": budget_bytes - state, "state": state}


def waste_table(shapes: CacheShapes, policies, contexts) -> list[dict]:
    """Per-request internal waste for every (policy, context length)."""
    rows = []
    for policy in policies:
        for n in contexts:
            fp = policy.footprint(shapes, n)
            rows.append({"model": shapes.name, "policy": policy.key, "tokens": int(n),
                         "requested_bytes": fp.requested_bytes, "reserved_bytes": fp.reserved_bytes,
                         "waste_bytes": fp.waste_bytes, "waste_fraction": fp.waste_fraction})
    return rows


# ----- whole requests on a policy's pools ---------------------------------------

@dataclass
class _RequestMemory:
    tokens: int
    handles: list = field(default_factory=list)  # (pool name, handle) of the fixed states
    kv_handles: list = field(default_factory=list)  # each covers one or more KV blocks
    n_blocks: int = 0


class RequestAllocator:
    """Admit, grow and release whole requests on the pools a policy builds.

    Every call is all-or-nothing: when something does not fit, :class:`PoolExhausted`
    is raised and no pool changed.
    """

    def __init__(self, policy: _Policy, shapes: CacheShapes, budget_bytes: int):
        self.policy, self.shapes, self.budget_bytes = policy, shapes, int(budget_bytes)
        self.pools = policy.build_pools(shapes, budget_bytes)
        self._pieces = [p for p in policy.pieces(shapes) if p[2] > 0]
        self._requested_fixed = sum(p[3] for p in policy.pieces(shapes))
        self._block_tokens = policy.block_tokens(shapes)
        self._block_pages = policy.kv_block_pages(shapes)
        self._block_bytes = self._block_tokens * shapes.kv_bytes_per_token
        self._requests: dict[object, _RequestMemory] = {}
        self._tokens = 0

    def _demand(self, n_blocks: int, with_fixed: bool) -> dict[str, dict[str, int]]:
        demand: dict[str, dict[str, int]] = {name: {} for name in self.pools}
        if with_fixed:
            for pool, kind, pages, _ in self._pieces:
                demand[pool][kind] = demand[pool].get(kind, 0) + pages
        if n_blocks:
            kv = demand[self.policy.kv_pool]
            kv["kv"] = kv.get("kv", 0) + n_blocks * self._block_pages
        return demand

    def _require(self, demand, what: str) -> None:
        for name, d in demand.items():
            if d and not self.pools[name].fits(d):
                kind = max(d, key=d.get)
                pool = self.pools[name]
                pages = pool.large if isinstance(pool, LcmPagePool) else pool
                raise PoolExhausted.of(pages, kind, sum(d.values()), what)

    def _alloc(self, pool_name: str, kind: str, n: int, nbytes: int):
        return self.pools[pool_name].allocate(kind, n, nbytes=nbytes)

    def fits(self, n_tokens: int) -> bool:
        demand = self._demand(self.policy.n_blocks(self.shapes, n_tokens), True)
        return all(not d or self.pools[n].fits(d) for n, d in demand.items())

    def admit(self, request_id, n_tokens: int) -> None:
        """Reserve the fixed states and KV blocks for ``n_tokens`` tokens."""
        if request_id in self._requests:
            raise ValueError(f"request_id={request_id!r} is already admitted")
        n_blocks = self.policy.n_blocks(self.shapes, n_tokens)
        self._require(self._demand(n_blocks, True), f"admit {request_id!r}")
        mem = _RequestMemory(tokens=int(n_tokens))
        for pool, kind, pages, nbytes in self._pieces:
            mem.handles.append((pool, self._alloc(pool, kind, pages, nbytes)))
        if n_blocks:  # the prompt's blocks in one allocation
            mem.kv_handles.append(self._alloc(self.policy.kv_pool, "kv", n_blocks * self._block_pages, None))
        mem.n_blocks = n_blocks
        self._requests[request_id] = mem
        self._tokens += mem.tokens

    def grow(self, request_id, n_tokens: int) -> None:
        """Make room for the request to hold ``n_tokens`` tokens in total."""
        mem = self._requests[request_id]
        extra = self.policy.n_blocks(self.shapes, n_tokens) - mem.n_blocks
        if extra > 0:
            self._require(self._demand(extra, False), f"grow {request_id!r}")
            mem.kv_handles.append(self._alloc(self.policy.kv_pool, "kv", extra * self._block_pages, None))
            mem.n_blocks += extra
        self._tokens += int(n_tokens) - mem.tokens
        mem.tokens = int(n_tokens)

    def release(self, request_id) -> None:
        mem = self._requests.pop(request_id)
        for pool, h in mem.handles:
            self.pools[pool].free(h)
        kv = self.pools[self.policy.kv_pool]
        for h in mem.kv_handles:
            kv.free(h)
        self._tokens -= mem.tokens

    # ----- accounting ---------------------------------------------------------
    @property
    def n_requests(self) -> int:
        return len(self._requests)

    @property
    def capacity_bytes(self) -> int:
        return int(sum(p.capacity_bytes if isinstance(p, LcmPagePool) else p.n_pages * p.page_bytes
                       for p in self.pools.values()))

    @property
    def reserved_bytes(self) -> int:
        """Bytes no other request can use right now (pages held, incl. padding)."""
        return int(sum(p.reserved_bytes if isinstance(p, LcmPagePool) else p.n_used * p.page_bytes
                       for p in self.pools.values()))

    @property
    def requested_bytes(self) -> int:
        """Bytes the running requests really hold (states + KV of their tokens)."""
        return self.n_requests * self._requested_fixed + self._tokens * self.shapes.kv_bytes_per_token

    @property
    def padding_bytes(self) -> int:
        """Reserved but holding nothing: page rounding, unfilled blocks, Jenga slack."""
        return self.reserved_bytes - self.requested_bytes
