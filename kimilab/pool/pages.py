"""The unified page pool: one preallocated arena cut into equal pages.

A hybrid request holds memory of very different shapes: KV blocks that grow
page by page, one fixed KDA state and one conv state per KDA layer, and later
state checkpoints (prefix caching) and scratch (speculative decoding). One
:class:`PagePool` keeps all of them. It hands out :class:`~kimilab.pool.handles.Allocation`
handles, each a set of pages of one kind with a reference count (``share`` /
``free``), so prefix sharing and copy-on-write build on it. Allocate and free
cost O(pages moved), never O(pool): free pages sit on a stack, and the
bookkeeping arrays grow with the pages ever used, so ``backed=False`` (accounting
only) can model a pool of any size — a 48B-scale cache, or an unbounded one.

The pool knows nothing of prefix trees or models: it moves pages and counts bytes.
"""

from __future__ import annotations

import itertools

import numpy as np

from kimilab.config import PAGE_KINDS
from kimilab.pool.handles import (Allocation, DoubleFree, ForeignHandle, PoolError, PoolExhausted, PoolStats,
                                  RefcountError, _Block)
from kimilab.validate import check_int

__all__ = ["PagePool", "PageCount", "KIND_CODES", "FREE_CODE", "UNBOUNDED_PAGES", "check_kind"]

KIND_CODES = {kind: code for code, kind in enumerate(PAGE_KINDS)}  # page map: -1 = free
FREE_CODE = -1
UNBOUNDED_PAGES = 1 << 62  # an accounting-only pool this large stands for "no capacity limit"


def check_kind(kind) -> int:
    """The page-map code of ``kind`` (one of config.PAGE_KINDS), else ValueError naming it."""
    try:
        return KIND_CODES[kind]
    except (KeyError, TypeError):
        raise ValueError(f"kind={kind!r}: expected one of {PAGE_KINDS}") from None


_POOL_UIDS = itertools.count(1)


class PagePool:
    """``n_pages`` pages of ``page_bytes`` bytes in one preallocated numpy arena.

    ``allocate(kind, n)`` pops n pages from a free stack (O(n)); ``free`` pushes
    them back when the last handle goes. Nothing ever scans the pool, except
    :meth:`check_invariants` (for tests). Never-used pages are handed out in
    order from a bump pointer; when the pool drains completely both reset in
    O(1), so an emptied pool behaves exactly like a fresh one. Freed pages are
    not zeroed (``allocate(zero=True)`` does it for the pages it hands out).
    The bookkeeping arrays grow with the highest page ever used, so an
    accounting-only pool costs memory for what it holds, not for ``n_pages``.
    """

    def __init__(self, n_pages: int, page_bytes: int, *, backed: bool = True, name: str = "pool"):
        self.n_pages = check_int("n_pages", n_pages, 1)
        self.page_bytes = check_int("page_bytes", page_bytes, 1)
        if backed and self.page_bytes % 8:
            raise ValueError(f"page_bytes={page_bytes}: a backed pool needs a multiple of 8 "
                             "(pages are viewed as float64 arrays)")
        self.backed = bool(backed)
        self.name = name
        self._uid = next(_POOL_UIDS)
        self._arena = np.zeros(self.n_pages * self.page_bytes, dtype=np.uint8) if backed else None
        # Free pages = a stack of recycled pages (top at the end) + the never-used
        # pages [bump, n_pages). Recycled pages go out first.
        # Plain Python lists: allocating a page or two must cost a few list operations,
        # not a dozen numpy calls (a trace replay allocates and frees ~10^5 times).
        self._stack: list[int] = []
        self._bump = 0
        self._page_kind = bytearray()  # kind code + 1 of pages [0, bump) (0 = free)
        self._blocks: dict[int, _Block] = {}
        self._block_ids = itertools.count()
        self._handle_ids = itertools.count()
        self._n_handles = 0
        self._pages_by_kind = dict.fromkeys(PAGE_KINDS, 0)
        self._requested_by_kind = dict.fromkeys(PAGE_KINDS, 0)
        self._high_water = 0
        # Called with a page count when an allocation does not fit: whoever holds pages it
        # can give up (a prefix cache's unpinned blocks) frees some. None: nobody.
        self.reclaim = None

    # ----- allocation --------------------------------------------------------
    @property
    def n_free(self) -> int:
        return len(self._stack) + self.n_pages - self._bump

    @property
    def n_used(self) -> int:
        return self._bump - len(self._stack)

    def pages_for_bytes(self, nbytes: int) -> int:
        """Pages needed to hold ``nbytes`` (at least one)."""
        return max(1, -(-check_int("nbytes", nbytes, 0) // self.page_bytes))

    @property
    def capacity_bytes(self) -> int:
        return self.n_pages * self.page_bytes

    @property
    def reserved_bytes(self) -> int:
        """Bytes of the pages in use (padding included)."""
        return self.n_used * self.page_bytes

    def exhausted(self, kind: str, n_pages: int, what: str = "") -> PoolExhausted:
        """The error this pool raises when ``n_pages`` pages of ``kind`` do not fit."""
        return PoolExhausted.of(self, kind, n_pages, what)

    def ensure_free(self, n_pages: int) -> bool:
        """Are ``n_pages`` pages free, after asking :attr:`reclaim` (if set) to free some?"""
        if n_pages > self.n_free and self.reclaim is not None:
            self.reclaim(n_pages)
        return n_pages <= self.n_free

    def fits(self, demand: dict[str, int]) -> bool:
        """Would ``{kind: n_pages}`` fit right now (all of it together)?"""
        return sum(demand.values()) <= self.n_free

    def _take_pages(self, kind: str, code: int, n: int) -> list[int]:
        """``n`` free pages marked ``kind`` (recycled ones first, top of the stack first),
        after asking :attr:`reclaim` for room; PoolExhausted if they do not fit."""
        if not self.ensure_free(n):
            raise PoolExhausted.of(self, kind, n)
        stack = self._stack
        recycled = min(n, len(stack))
        if recycled:
            pages = stack[-recycled:]
            del stack[-recycled:]
            pages.reverse()
        else:
            pages = []
        fresh = n - recycled
        if fresh:
            pages.extend(range(self._bump, self._bump + fresh))
            self._bump += fresh
            self._page_kind.extend(bytes(fresh))
        kinds, mark = self._page_kind, code + 1
        for p in pages:
            kinds[p] = mark
        return pages

    def allocate(self, kind: str, n_pages: int, *, nbytes: int | None = None,
                 zero: bool = False, owner=None) -> Allocation:
        """Take ``n_pages`` pages for ``kind``; ``nbytes`` (default: all of them) is what
        the caller will really use, and the rest counts as internal waste. ``owner``
        labels the handle (a request id, ``"prefix"``, ...)."""
        code = check_kind(kind)
        n = check_int("n_pages", n_pages, 1)
        capacity = n * self.page_bytes
        nbytes = capacity if nbytes is None else check_int("nbytes", nbytes, 0)
        if nbytes > capacity:
            raise ValueError(f"nbytes={nbytes}: more than the {n} page(s) asked for hold "
                             f"({capacity} B at page_bytes={self.page_bytes})")
        pages = self._take_pages(kind, code, n)
        block = _Block(next(self._block_ids), kind, pages, nbytes)
        self._blocks[block.block_id] = block
        self._pages_by_kind[kind] += n
        self._requested_by_kind[kind] += nbytes
        self._high_water = max(self._high_water, self.n_used)
        self._n_handles += 1
        if zero and self.backed:
            self._pages2d()[block.pages] = 0
        return Allocation(block, self._uid, next(self._handle_ids), owner)

    def allocate_each(self, kind: str, count: int, *, owner=None) -> list[Allocation]:
        """``count`` allocations of one page each, checked (and reclaimed for) once.

        Page for page, id for id, what ``count`` calls of ``allocate(kind, 1)`` return:
        a cache caching a prompt's blocks takes them in one call.
        """
        code = check_kind(kind)
        count = check_int("count", count, 0)
        if not count:
            return []
        pages = self._take_pages(kind, code, count)
        block_ids, handle_ids, blocks = self._block_ids, self._handle_ids, self._blocks
        uid, page_bytes = self._uid, self.page_bytes
        out = []
        for p in pages:
            block = _Block(next(block_ids), kind, [p], page_bytes)
            blocks[block.block_id] = block
            out.append(Allocation(block, uid, next(handle_ids), owner))
        self._pages_by_kind[kind] += count
        self._requested_by_kind[kind] += count * page_bytes
        self._high_water = max(self._high_water, self.n_used)
        self._n_handles += count
        return out

    def allocate_bytes(self, kind: str, nbytes: int, *, zero: bool = False, owner=None) -> Allocation:
        """Allocate enough pages for ``nbytes`` bytes."""
        return self.allocate(kind, self.pages_for_bytes(nbytes), nbytes=nbytes, zero=zero, owner=owner)

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

    def share(self, alloc: Allocation, owner=None) -> Allocation:
        """A new handle to the same pages, held by ``owner``; the pages stay until every
        handle is freed. Handing pages over = share to the new owner, free the old handle."""
        block = self._own(alloc, "share")
        block.refcount += 1
        self._n_handles += 1
        return Allocation(block, self._uid, next(self._handle_ids), owner)

    def free(self, alloc: Allocation) -> None:
        """Drop one reference; the pages return to the free stack at refcount 0."""
        block = self._own(alloc, "free")
        alloc._live = False
        block.refcount -= 1
        self._n_handles -= 1
        if block.refcount:
            return
        pages = block.page_list
        self._stack.extend(reversed(pages))
        kinds = self._page_kind
        for p in pages:
            kinds[p] = 0
        n = len(pages)
        self._pages_by_kind[block.kind] -= n
        self._requested_by_kind[block.kind] -= block.nbytes
        del self._blocks[block.block_id]
        if len(self._stack) == self._bump:  # everything is free again: back to the fresh layout, O(1)
            self._stack.clear()
            self._bump = 0
            del self._page_kind[:]

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
        out = np.full(self.n_pages, FREE_CODE, dtype=np.int8)
        out[:len(self._page_kind)] = np.frombuffer(bytes(self._page_kind), dtype=np.uint8).astype(np.int8) - 1
        return out

    def free_pages(self) -> np.ndarray:
        """Free pages, next-to-be-allocated first (a copy)."""
        return np.concatenate([np.array(self._stack[::-1], dtype=np.int64),
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
        assert np.all(self.page_map()[free] == FREE_CODE), "a free page has a kind"
        for kind in PAGE_KINDS:
            blocks = [b for b in self._blocks.values() if b.kind == kind]
            assert self._pages_by_kind[kind] == sum(b.pages.shape[0] for b in blocks), kind
            assert self._requested_by_kind[kind] == sum(b.nbytes for b in blocks), kind
            for b in blocks:
                assert np.all(self.page_map()[b.pages] == KIND_CODES[kind]), kind
        assert all(b.refcount >= 1 for b in self._blocks.values()), "a live block has refcount < 1"
        assert self._n_handles == sum(b.refcount for b in self._blocks.values()), "handle count"
        assert self.n_used <= self._high_water <= self.n_pages, "high-water mark"

    def __repr__(self) -> str:
        mode = "backed" if self.backed else "accounting only"
        return (f"PagePool({self.name!r}, n_pages={self.n_pages}, page_bytes={self.page_bytes}, "
                f"free={self.n_free}, {mode})")


class PageCount:
    """The pool of an accounting-only cache: just how many pages there are and how many are free."""

    __slots__ = ("n_pages", "page_bytes", "n_free")

    def __init__(self, n_pages: int, page_bytes: int):
        self.n_pages, self.page_bytes, self.n_free = n_pages, page_bytes, n_pages

    @property
    def n_used(self) -> int:
        return self.n_pages - self.n_free
