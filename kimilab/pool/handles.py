"""Pool handles and errors: an Allocation is one reference to pages of one kind.

Every allocation has an *owner* (a request id, ``"prefix"``, ...) so that pages can
change hands without moving: a finished request's KV blocks become cached prefix
when the prefix cache takes a new handle (``pool.share(alloc, owner="prefix")``)
and the request frees its own. The errors say exactly what went wrong; a failed
call never changes the pool.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from kimilab.config import PAGE_KINDS

if TYPE_CHECKING:
    from kimilab.pool.pages import PagePool

__all__ = ["PoolError", "PoolExhausted", "HandleError", "DoubleFree", "ForeignHandle", "RefcountError",
           "Allocation", "PoolStats"]


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

    __slots__ = ("block_id", "kind", "page_list", "nbytes", "refcount", "_array")

    def __init__(self, block_id: int, kind: str, page_list: list, nbytes: int):
        self.block_id, self.kind, self.page_list, self.nbytes = block_id, kind, page_list, nbytes
        self.refcount = 1
        self._array = None

    @property
    def pages(self) -> np.ndarray:
        """The page indices as a read-only int64 array (made on first use: accounting never needs it)."""
        if self._array is None:
            self._array = np.array(self.page_list, dtype=np.int64)
            self._array.flags.writeable = False
        return self._array


class Allocation:
    """One reference to a set of pages of one kind.

    ``pool.share(a)`` returns a NEW handle to the same pages (refcount + 1); every
    handle is freed exactly once, and the pages go back when the last one is.
    """

    __slots__ = ("_block", "_pool_uid", "handle_id", "_live", "owner")

    def __init__(self, block: _Block, pool_uid: int, handle_id: int, owner=None):
        self._block, self._pool_uid, self.handle_id, self._live = block, pool_uid, handle_id, True
        self.owner = owner  # who holds this reference: a request id, "prefix", ... (None: anonymous)

    @property
    def kind(self) -> str:
        return self._block.kind

    @property
    def pages(self) -> np.ndarray:
        """Page indices (read-only), in the order the bytes are laid out."""
        return self._block.pages

    @property
    def n_pages(self) -> int:
        return len(self._block.page_list)

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
        owner = "" if self.owner is None else f", owner={self.owner!r}"
        return (f"Allocation(kind={self.kind!r}, n_pages={self.n_pages}, nbytes={self.nbytes}, "
                f"block={self.block_id}, refcount={self.refcount}{owner}, {state})")


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
                for k in PAGE_KINDS}

    @property
    def waste_bytes(self) -> int:
        return self.used_bytes - self.requested_bytes

    @property
    def utilisation(self) -> float:
        """Fraction of the pool's pages in use."""
        return self.n_used / self.n_pages

