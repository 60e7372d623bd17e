"""Page layouts: how one request's cache maps to pages under each production design.

A *layout* (not to be confused with a prefix cache's checkpoint *policy*) names
the pools it needs, their page sizes, and the pieces a request takes:

* :class:`UnifiedPages`   one pool of small pages; every object takes ceil(bytes / page);
* :class:`VllmPaddedPages` vLLM's hybrid layout (derived by :func:`kimilab.costs.vllm_hybrid_pages`):
  one page size, attention blocks grown and state pages padded until they match, layers
  in equal-size groups whose block ids cost a page in every layer of the group;
* :class:`JengaPages`     Jenga's LCM large pages carved into per-kind small pages;
* :class:`SplitPools`     SGLang's separate KV and state pools.

Sizes come from :class:`kimilab.costs.CacheShapes` (the one cost model).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from kimilab.config import CACHE_KINDS
from kimilab.costs import CacheShapes, VllmHybridPages, vllm_pages_of
from kimilab.pool.jenga import LcmPagePool
from kimilab.pool.pages import PagePool
from kimilab.validate import check_int

__all__ = ["Footprint", "PageLayout", "UnifiedPages", "VllmPaddedPages", "JengaPages", "SplitPools"]


@dataclass(frozen=True)
class Footprint:
    """One request's memory under a layout: requested vs reserved bytes, by kind."""

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
class PageLayout:
    """Shared machinery: a layout names pools, their page sizes, and a request's pieces.

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
        check_int("n_tokens", n_tokens, 0)
        page = self.page_bytes(shapes)
        requested = dict.fromkeys(CACHE_KINDS, 0)
        reserved = dict(requested)
        for pool, kind, pages, nbytes in self.pieces(shapes):
            requested[kind] += nbytes
            reserved[kind] += pages * page[pool]
        requested["kv"] = n_tokens * shapes.kv_bytes_per_token
        reserved["kv"] = self.n_blocks(shapes, n_tokens) * self.kv_block_pages(shapes) * page[self.kv_pool]
        return Footprint(requested, reserved)

    def build_pools(self, shapes: CacheShapes, budget_bytes: int) -> dict:
        """Accounting-only pools for a memory budget (bytes)."""
        check_int("budget_bytes", budget_bytes, 1)
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
class UnifiedPages(PageLayout):
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
class VllmPaddedPages(PageLayout):
    """vLLM's hybrid layout, as :func:`kimilab.costs.vllm_hybrid_pages` derives it.

    Every layer's page has one size: the attention block grows (in multiples of
    ``align_tokens``) until one layer's page holds one KDA layer's states, which are
    padded up to it. Layers are grouped by type into groups of one size (the last KDA
    group padded with empty layer slots), and a block id names one page in every layer
    slot of its group. So this pool's page is a *block*: ``group_size`` layer pages. KV
    takes one block per ``block_tokens`` tokens in each attention group; a request's
    states take one block in each KDA group, padded slots included.
    """

    align_tokens: int = 16
    key = "vllm-padded"

    def pages(self, shapes: CacheShapes) -> VllmHybridPages:
        """The derived layout (block size, layer groups, padding) for these shapes."""
        return vllm_pages_of(shapes, self.align_tokens)

    def block_tokens(self, shapes):
        return self.pages(shapes).block_tokens

    def page_bytes(self, shapes):
        return {"main": self.pages(shapes).block_bytes}

    def kv_block_pages(self, shapes):
        return self.pages(shapes).attn_groups

    def pieces(self, shapes):
        return [("main", "kda_state", self.pages(shapes).checkpoint_blocks, shapes.fixed_bytes)]

    def describe(self, shapes):
        p = self.pages(shapes)
        return (f"{self.key}: block id = {p.group_size} layer pages of {p.page_bytes} B = {p.block_bytes} B; "
                f"KV block {p.block_tokens} tokens; {p.attn_groups} attention + {p.kda_groups} KDA group(s), "
                f"{p.padded_layers} padded layer slot(s); a request's states = {p.checkpoint_blocks} blocks")


@dataclass(frozen=True)
class JengaPages(PageLayout):
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
        check_int("budget_bytes", budget_bytes, 1)
        large = self.page_bytes(shapes)["main"]
        if budget_bytes < large:
            raise ValueError(f"budget_bytes={budget_bytes}: less than one LCM large page ({large} B)")
        return {"main": LcmPagePool(budget_bytes // large, self.small_bytes(shapes), name="jenga")}


@dataclass(frozen=True)
class SplitPools(PageLayout):
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

