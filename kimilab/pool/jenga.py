"""Jenga's two-level allocator (SOSP'25), accounting only, with the pool's interface.

Large pages of a common multiple of every kind's small page come from a
:class:`~kimilab.pool.pages.PagePool`; a large page is dedicated to one kind
while any of its small pages is in use. It answers the same questions as a
``PagePool`` (``fits``, ``allocate``, ``free``, ``capacity_bytes``,
``reserved_bytes``, ``exhausted``) so the request allocator treats both alike.
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass

from kimilab.pool.handles import DoubleFree, PoolExhausted
from kimilab.pool.pages import PagePool, check_kind
from kimilab.validate import check_int

__all__ = ["LcmPagePool", "JengaHandle"]


@dataclass(frozen=True)
class JengaHandle:
    """What :meth:`LcmPagePool.allocate` hands out: small pages of one kind, with an owner."""

    ticket: int
    kind: str
    n_pages: int
    nbytes: int
    owner: object = None


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
            check_kind(kind)
            check_int(f"small_bytes[{kind!r}]", b, 1)
        self.small_bytes = dict(small_bytes)
        self.large_bytes = math.lcm(*self.small_bytes.values())
        self.name = name
        self.large = PagePool(n_large, self.large_bytes, backed=False, name=name)
        self.per_large = {k: self.large_bytes // b for k, b in self.small_bytes.items()}
        self._held: dict[str, dict[int, list]] = {k: {} for k in self.small_bytes}  # kind -> {large id: [alloc, free slots]}
        # kind -> {large id: entry} of held large pages with a free slot, in the order they got one
        self._partial: dict[str, dict[int, list]] = {k: {} for k in self.small_bytes}
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

    def exhausted(self, kind: str, n_pages: int, what: str = "") -> PoolExhausted:
        """The error raised when ``n_pages`` small pages of ``kind`` do not fit (large-page counts)."""
        return PoolExhausted.of(self.large, kind, n_pages, what)

    def allocate(self, kind: str, n_pages: int, *, nbytes: int | None = None, owner=None) -> "JengaHandle":
        """``n_pages`` small pages of ``kind``; returns the handle to :meth:`free`."""
        if kind not in self.small_bytes:
            raise ValueError(f"kind={kind!r}: this pool has small pages for {tuple(self.small_bytes)}")
        n = check_int("n_pages", n_pages, 1)
        nbytes = n * self.small_bytes[kind] if nbytes is None else nbytes
        if not self.fits({kind: n}):
            need = -(-(n - self._spare[kind]) // self.per_large[kind])
            raise self.exhausted(kind, need)
        taken: list[tuple[int, int]] = []  # (large block id, small pages taken there)
        held, partial = self._held[kind], self._partial[kind]
        remaining = n
        while remaining and partial:  # fill partly used large pages first, the longest partial first
            lid, entry = next(iter(partial.items()))
            take = min(entry[1], remaining)
            entry[1] -= take
            taken.append((lid, take))
            remaining -= take
            if not entry[1]:
                del partial[lid]
        while remaining:
            alloc = self.large.allocate(kind, 1)
            take = min(self.per_large[kind], remaining)
            held[alloc.block_id] = entry = [alloc, self.per_large[kind] - take]
            if entry[1]:
                partial[alloc.block_id] = entry
            self._spare[kind] += self.per_large[kind]
            taken.append((alloc.block_id, take))
            remaining -= take
        self._spare[kind] -= n
        self._used_small[kind] += n
        self._requested[kind] += nbytes
        handle = JengaHandle(next(self._tickets), kind, n, nbytes, owner)
        self._live[handle.ticket] = (kind, taken, nbytes)
        return handle

    def free(self, handle: "JengaHandle") -> None:
        try:
            kind, taken, nbytes = self._live.pop(handle.ticket)
        except (KeyError, AttributeError):
            raise DoubleFree(f"{self.name}: handle {handle!r} is not live (freed twice or foreign)") from None
        held, partial = self._held[kind], self._partial[kind]
        for lid, take in taken:
            entry = held[lid]
            entry[1] += take
            if entry[1] == self.per_large[kind]:  # the large page is empty again
                self.large.free(entry[0])
                del held[lid]
                partial.pop(lid, None)
                self._spare[kind] -= self.per_large[kind]
            else:
                partial.setdefault(lid, entry)
        n = sum(t for _, t in taken)
        self._spare[kind] += n
        self._used_small[kind] -= n
        self._requested[kind] -= nbytes

    def check_invariants(self) -> None:
        """Recount the small pages held in every large page; raise AssertionError on a mismatch."""
        self.large.check_invariants()
        for kind, held in self._held.items():
            in_use = sum(take for k, taken, _ in self._live.values() if k == kind for _, take in taken)
            assert in_use == self._used_small[kind], kind
            assert self._spare[kind] == sum(entry[1] for entry in held.values()), kind
            assert len(held) * self.per_large[kind] == in_use + self._spare[kind], kind
            partial = {lid for lid, entry in held.items() if entry[1]}
            assert partial == set(self._partial[kind]), kind
        assert self.large.n_used == sum(len(h) for h in self._held.values()), "large pages held"

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

