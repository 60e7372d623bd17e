"""Whole requests on the pools a page layout builds: admit, grow, release.

:class:`RequestAllocator` is what an engine asks "does this request fit?". Every
call is all-or-nothing: when something does not fit, ``PoolExhausted`` is raised
and no pool changed. Each allocation is owned by its request id.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from kimilab.costs import CacheShapes
from kimilab.pool.layouts import PageLayout

__all__ = ["RequestAllocator"]


@dataclass
class _RequestMemory:
    tokens: int
    handles: list = field(default_factory=list)  # (pool name, handle) of the fixed states
    kv_handles: list = field(default_factory=list)  # each covers one or more KV blocks
    n_blocks: int = 0


class RequestAllocator:
    """Admit, grow and release whole requests on the pools a page layout builds.

    Every call is all-or-nothing: when something does not fit, :class:`PoolExhausted`
    is raised and no pool changed.
    """

    def __init__(self, layout: PageLayout, shapes: CacheShapes, budget_bytes: int):
        self.layout, self.shapes, self.budget_bytes = layout, shapes, int(budget_bytes)
        self.pools = layout.build_pools(shapes, budget_bytes)
        self._pieces = [p for p in layout.pieces(shapes) if p[2] > 0]
        self._requested_fixed = sum(p[3] for p in layout.pieces(shapes))
        self._block_tokens = layout.block_tokens(shapes)
        self._block_pages = layout.kv_block_pages(shapes)
        self._block_bytes = self._block_tokens * shapes.kv_bytes_per_token
        self._requests: dict[object, _RequestMemory] = {}
        self._tokens = 0

    def _demand(self, n_blocks: int, with_fixed: bool) -> dict[str, dict[str, int]]:
        demand: dict[str, dict[str, int]] = {name: {} for name in self.pools}
        if with_fixed:
            for pool, kind, pages, _ in self._pieces:
                demand[pool][kind] = demand[pool].get(kind, 0) + pages
        if n_blocks:
            kv = demand[self.layout.kv_pool]
            kv["kv"] = kv.get("kv", 0) + n_blocks * self._block_pages
        return demand

    def _require(self, demand, what: str) -> None:
        for name, d in demand.items():
            if d and not self.pools[name].fits(d):
                kind = max(d, key=d.get)
                raise self.pools[name].exhausted(kind, sum(d.values()), what)

    def _alloc(self, pool_name: str, kind: str, n: int, nbytes: int, owner):
        return self.pools[pool_name].allocate(kind, n, nbytes=nbytes, owner=owner)

    def fits(self, n_tokens: int) -> bool:
        demand = self._demand(self.layout.n_blocks(self.shapes, n_tokens), True)
        return all(not d or self.pools[n].fits(d) for n, d in demand.items())

    def admit(self, request_id, n_tokens: int) -> None:
        """Reserve the fixed states and KV blocks for ``n_tokens`` tokens."""
        if request_id in self._requests:
            raise ValueError(f"request_id={request_id!r} is already admitted")
        n_blocks = self.layout.n_blocks(self.shapes, n_tokens)
        self._require(self._demand(n_blocks, True), f"admit {request_id!r}")
        mem = _RequestMemory(tokens=int(n_tokens))
        for pool, kind, pages, nbytes in self._pieces:
            mem.handles.append((pool, self._alloc(pool, kind, pages, nbytes, request_id)))
        if n_blocks:  # the prompt's blocks in one allocation
            n_pages = n_blocks * self._block_pages
            mem.kv_handles.append(self._alloc(self.layout.kv_pool, "kv", n_pages, None, request_id))
        mem.n_blocks = n_blocks
        self._requests[request_id] = mem
        self._tokens += mem.tokens

    def grow(self, request_id, n_tokens: int) -> None:
        """Make room for the request to hold ``n_tokens`` tokens in total."""
        mem = self._requests[request_id]
        extra = self.layout.n_blocks(self.shapes, n_tokens) - mem.n_blocks
        if extra > 0:
            self._require(self._demand(extra, False), f"grow {request_id!r}")
            mem.kv_handles.append(self._alloc(self.layout.kv_pool, "kv", extra * self._block_pages, None, request_id))
            mem.n_blocks += extra
        self._tokens += int(n_tokens) - mem.tokens
        mem.tokens = int(n_tokens)

    def release(self, request_id) -> None:
        mem = self._requests.pop(request_id)
        for pool, h in mem.handles:
            self.pools[pool].free(h)
        kv = self.pools[self.layout.kv_pool]
        for h in mem.kv_handles:
            kv.free(h)
        self._tokens -= mem.tokens

    # ----- accounting ---------------------------------------------------------
    @property
    def n_requests(self) -> int:
        return len(self._requests)

    @property
    def capacity_bytes(self) -> int:
        return int(sum(p.capacity_bytes for p in self.pools.values()))

    @property
    def reserved_bytes(self) -> int:
        """Bytes no other request can use right now (pages held, incl. padding)."""
        return int(sum(p.reserved_bytes for p in self.pools.values()))

    @property
    def requested_bytes(self) -> int:
        """Bytes the running requests really hold (states + KV of their tokens)."""
        return self.n_requests * self._requested_fixed + self._tokens * self.shapes.kv_bytes_per_token

    @property
    def padding_bytes(self) -> int:
        """Reserved but holding nothing: page rounding, unfilled blocks, Jenga slack."""
        return self.reserved_bytes - self.requested_bytes

