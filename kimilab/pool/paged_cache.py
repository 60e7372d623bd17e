"""A per-request hybrid cache that lives on the pages of a :class:`~kimilab.pool.PagePool`.

:class:`PagedHybridCache` implements the cache protocol of
:class:`kimilab.model.CacheProtocol` (the contiguous twin is
:class:`kimilab.model.HybridCache`), but every byte it holds is in the pool's arena:

* KV of each global layer sits in blocks of ``block_tokens`` tokens. A block is
  one pool allocation (kind ``"kv"``) of a few pages; a per-layer **block
  table** lists the blocks in order. A token row (its K then V for every KV
  head) never straddles a page, so a page holds ``page_bytes // row_bytes``
  tokens.
* Each KDA layer's recurrent state and conv state is one allocation
  (``"kda_state"`` / ``"conv_state"``), zeroed when the request starts.

Writes go straight into the arena through numpy views (no staging copy).
Reads gather: ``kv(i)`` collects the layer's rows through the block table
(the CPU stand-in for a paged-attention kernel reading blocks), and state
reads return a snapshot copy because ``set_kda_state`` overwrites the pages in
place. Nothing else keeps a second copy of the cache. ``truncate`` gives whole
blocks past the cut back to the pool; :meth:`free` returns every page.
:meth:`from_blocks` starts a request on blocks someone else holds too (a
prefix cache's pages), taking its own reference to each.
"""

from __future__ import annotations

from typing import Mapping, Sequence

import numpy as np

from kimilab.config import ModelConfig
from kimilab.model.cache import CacheProtocol, StateCheckpoint, check_checkpoint
from kimilab.pool.handles import Allocation, PoolError, PoolExhausted
from kimilab.pool.pages import PagePool
from kimilab.validate import check_int

__all__ = ["PagedHybridCache"]


def _readonly(a: np.ndarray) -> np.ndarray:
    a.flags.writeable = False
    return a


def _table(blocks: list) -> np.ndarray:
    """The page table of a block list: every block's pages, in token order."""
    return np.concatenate([a.pages for a in blocks]) if blocks else np.zeros(0, dtype=np.int64)


class PagedHybridCache(CacheProtocol):
    """The cache protocol on pool pages; ``owner`` labels every pool handle it takes."""

    _freed_error = PoolError

    def __init__(self, config: ModelConfig, pool: PagePool, *, block_tokens: int = 16, owner=None) -> None:
        super().__init__(config)
        if not isinstance(pool, PagePool):
            raise ValueError(f"pool: expected a kimilab.pool.PagePool, got {type(pool).__name__}")
        if not pool.backed:
            raise ValueError("pool: expected a backed pool (PagePool(..., backed=True)); "
                             "an accounting-only pool has no bytes to hold a cache")
        self.block_tokens = check_int("block_tokens", block_tokens, 1, unit="tokens per KV block")
        self.pool, self.owner = pool, owner
        item = self.dtype.itemsize
        self._row_elems = self._hkv * (self._dk + self._dv)
        row_bytes = self._row_elems * item
        if pool.page_bytes % item:
            raise ValueError(f"pool.page_bytes={pool.page_bytes}: expected a multiple of the "
                             f"{self.dtype} itemsize ({item} B)")
        self.tokens_per_page = pool.page_bytes // row_bytes if config.attn_layers else self.block_tokens
        if config.attn_layers and self.tokens_per_page < 1:
            raise ValueError(f"pool.page_bytes={pool.page_bytes}: a page must hold at least one KV "
                             f"token row ({row_bytes} B = Hkv x (Dk + Dv) x {item} B)")
        self.pages_per_block = -(-self.block_tokens // self.tokens_per_page)
        self._state_nbytes = int(np.prod(self._state_shape)) * item
        self._conv_nbytes = int(np.prod(self._conv_shape)) * item
        # all fixed-size allocations at once, or none
        need = len(config.kda_layers) * (pool.pages_for_bytes(self._state_nbytes) +
                                         pool.pages_for_bytes(self._conv_nbytes))
        if not pool.ensure_free(need):
            raise PoolExhausted.of(pool, "kda_state+conv_state", need)
        self._kda = {i: pool.allocate_bytes("kda_state", self._state_nbytes, zero=True, owner=owner)
                     for i in config.kda_layers}
        self._conv = {i: pool.allocate_bytes("conv_state", self._conv_nbytes, zero=True, owner=owner)
                      for i in config.kda_layers}
        self._blocks: dict[int, list] = {i: [] for i in config.attn_layers}  # block tables
        self._page_table = {i: _table([]) for i in config.attn_layers}
        self._kv_len = dict.fromkeys(config.attn_layers, 0)

    # ----- arena views -------------------------------------------------------
    def _rows(self) -> np.ndarray:
        """The arena as [n_pages, tokens_per_page, row_elems] of the KV dtype (a view)."""
        arena = self.pool.arena()
        used = self.tokens_per_page * self._row_elems * self.dtype.itemsize
        return arena[:, :used].view(self.dtype).reshape(self.pool.n_pages, self.tokens_per_page,
                                                        self._row_elems)

    def _slots(self, i: int, positions: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(page, slot in page) of token ``positions`` of layer ``i`` via the block table."""
        block, within = np.divmod(positions, self.block_tokens)
        logical = block * self.pages_per_block + within // self.tokens_per_page
        return self._page_table[i][logical], within % self.tokens_per_page

    def _read(self, alloc, nbytes: int, shape) -> np.ndarray:
        flat = self.pool.arena()[alloc.pages].reshape(-1)[:nbytes]
        return _readonly(flat.view(self.dtype).reshape(shape))

    def _write(self, alloc, value: np.ndarray) -> None:
        raw = np.ascontiguousarray(value, dtype=self.dtype).reshape(-1).view(np.uint8)
        pages = alloc.pages
        page_bytes = self.pool.page_bytes
        arena = self.pool.arena()
        full = raw.shape[0] // page_bytes
        if full:
            arena[pages[:full]] = raw[: full * page_bytes].reshape(full, page_bytes)
        rest = raw.shape[0] - full * page_bytes
        if rest:
            arena[pages[full], :rest] = raw[full * page_bytes:]

    # ----- KDA layers -----------------------------------------------------------
    def kda_state(self, i: int) -> np.ndarray:
        """Recurrent state [H, K, V] of KDA layer ``i`` (a read-only snapshot)."""
        return self._read(self._kda[self._layer(i, "kda_state")], self._state_nbytes, self._state_shape)

    def set_kda_state(self, i: int, state: np.ndarray) -> None:
        i, state = self._checked_state(i, state, "kda_state")
        self._write(self._kda[i], state)

    def conv_state(self, i: int) -> np.ndarray:
        """Conv rolling state [W-1, C] of KDA layer ``i`` (a read-only snapshot)."""
        return self._read(self._conv[self._layer(i, "conv_state")], self._conv_nbytes, self._conv_shape)

    def set_conv_state(self, i: int, conv: np.ndarray) -> None:
        i, conv = self._checked_state(i, conv, "conv_state")
        self._write(self._conv[i], conv)

    # ----- global layers ---------------------------------------------------------
    def append_kv(self, i: int, k: np.ndarray, v: np.ndarray) -> None:
        """Append k [T, Hkv, Dk], v [T, Hkv, Dv] to layer ``i``, taking new blocks as needed.

        All-or-nothing: if the pool cannot supply every block needed, PoolExhausted is
        raised before anything changes.
        """
        i, k, v = self._checked_kv(i, k, v)
        T = k.shape[0]
        if T == 0:
            return
        start = self._kv_len[i]
        need_blocks = -(-(start + T) // self.block_tokens) - len(self._blocks[i])
        if need_blocks > 0:
            need = need_blocks * self.pages_per_block
            if not self.pool.ensure_free(need):
                raise PoolExhausted.of(self.pool, "kv", need)
            new = [self.pool.allocate("kv", self.pages_per_block, owner=self.owner)
                   for _ in range(need_blocks)]
            self._blocks[i].extend(new)
            self._page_table[i] = np.concatenate([self._page_table[i]] + [a.pages for a in new])
        pages, slots = self._slots(i, np.arange(start, start + T))
        rows = self._rows()
        kd = self._hkv * self._dk
        rows[pages, slots, :kd] = k.reshape(T, kd)
        rows[pages, slots, kd:] = v.reshape(T, self._hkv * self._dv)
        self._kv_len[i] = start + T

    def kv(self, i: int) -> tuple[np.ndarray, np.ndarray]:
        """(K [L, Hkv, Dk], V [L, Hkv, Dv]) of layer ``i``, gathered through its block table."""
        i = self._layer(i, "kv")
        L = self._kv_len[i]
        rows = self._rows()
        if self.block_tokens % self.tokens_per_page == 0:  # pages are full: gather whole pages
            n = -(-L // self.tokens_per_page)
            flat = rows[self._page_table[i][:n]].reshape(n * self.tokens_per_page, self._row_elems)[:L]
        else:
            pages, slots = self._slots(i, np.arange(L))
            flat = rows[pages, slots]
        kd = self._hkv * self._dk
        K = _readonly(flat[:, :kd].reshape(L, self._hkv, self._dk))
        V = _readonly(flat[:, kd:].reshape(L, self._hkv, self._dv))
        return K, V

    def block_table(self, i: int) -> list[int]:
        """Block ids (pool allocation ids) of layer ``i``, in token order."""
        return [a.block_id for a in self._blocks[self._layer(i, "kv")]]

    def _kv_length(self, i: int) -> int:
        return self._kv_len[i]

    def _drop_kv_after(self, n: int) -> None:
        """Give back every block past the one holding row n-1.

        A partly kept block that someone else also holds (a prefix cache's page) is
        first copied to a private block, because this cache will write the rows past n.
        """
        keep = -(-n // self.block_tokens)
        cow = [i for i, blocks in self._blocks.items()
               if n % self.block_tokens and self._kv_len[i] > n and blocks[keep - 1].refcount > 1]
        need = len(cow) * self.pages_per_block
        if not self.pool.ensure_free(need):
            raise PoolExhausted.of(self.pool, "kv", need, "truncate: copy a shared block")
        arena = self.pool.arena()
        for i, blocks in self._blocks.items():
            for alloc in blocks[keep:]:
                self.pool.free(alloc)
            del blocks[keep:]
            if i in cow:
                private = self.pool.allocate("kv", self.pages_per_block, owner=self.owner)
                arena[private.pages] = arena[blocks[-1].pages]
                self.pool.free(blocks[-1])
                blocks[-1] = private
            self._page_table[i] = _table(blocks)
            self._kv_len[i] = min(self._kv_len[i], n)

    # ----- sizes -------------------------------------------------------------------
    def nbytes_by_kind(self) -> dict[str, int]:
        """Bytes held (used KV rows, exact state sizes), as HybridCache counts them."""
        item = self.dtype.itemsize
        return {
            "kv": int(sum(self._kv_len.values()) * self._row_elems * item),
            "kda_state": len(self._kda) * self._state_nbytes,
            "conv_state": len(self._conv) * self._conv_nbytes,
        }

    def reserved_bytes_by_kind(self) -> dict[str, int]:
        """Bytes of the pages held (what other requests cannot use)."""
        pb = self.pool.page_bytes
        return {
            "kv": sum(a.n_pages for b in self._blocks.values() for a in b) * pb,
            "kda_state": sum(a.n_pages for a in self._kda.values()) * pb,
            "conv_state": sum(a.n_pages for a in self._conv.values()) * pb,
        }

    def allocations(self) -> list:
        """Every pool handle this cache holds (states first, then KV blocks)."""
        return (list(self._kda.values()) + list(self._conv.values()) +
                [a for b in self._blocks.values() for a in b])

    @property
    def n_pages(self) -> int:
        return sum(a.n_pages for a in self.allocations())

    # ----- lifetime and copies --------------------------------------------------------
    def _release(self) -> None:
        """Give every handle back to the pool (pages others still hold stay theirs)."""
        for alloc in self.allocations():
            self.pool.free(alloc)
        self._kda, self._conv = {}, {}
        self._blocks = {i: [] for i in self._blocks}
        self._page_table = {i: _table([]) for i in self._blocks}
        self._kv_len = dict.fromkeys(self._kv_len, 0)

    def clone(self) -> "PagedHybridCache":
        """A deep copy on fresh pages of the same pool (continuing one never affects the other)."""
        self._live()
        need = self.n_pages
        if not self.pool.ensure_free(need):
            raise PoolExhausted.of(self.pool, "kv", need)
        out = PagedHybridCache(self.config, self.pool, block_tokens=self.block_tokens, owner=self.owner)
        arena = self.pool.arena()
        for i in self._kda:
            arena[out._kda[i].pages] = arena[self._kda[i].pages]
            arena[out._conv[i].pages] = arena[self._conv[i].pages]
        for i, blocks in self._blocks.items():
            new = [self.pool.allocate("kv", self.pages_per_block, owner=self.owner) for _ in blocks]
            for a, b in zip(new, blocks):
                arena[a.pages] = arena[b.pages]
            out._blocks[i] = new
            out._page_table[i] = _table(new)
        out._kv_len = dict(self._kv_len)
        out._seq_len = self._seq_len
        return out

    @classmethod
    def from_checkpoint(cls, config: ModelConfig, ckpt: StateCheckpoint,
                        kv: Mapping[int, tuple[np.ndarray, np.ndarray]] | None = None, *,
                        pool: PagePool, block_tokens: int = 16, owner=None) -> "PagedHybridCache":
        """A paged cache at ``ckpt.seq_len`` (see CacheProtocol.from_checkpoint); pages from ``pool``."""
        return super().from_checkpoint(config, ckpt, kv, pool=pool, block_tokens=block_tokens, owner=owner)

    def adopt(self, blocks: Mapping[int, Sequence[Allocation]], checkpoint: StateCheckpoint | None = None) -> None:
        """Start this empty cache on KV blocks someone else allocated (e.g. a prefix cache's pages).

        ``blocks`` maps every global layer to its blocks in token order; the cache takes
        its own handle to each (``pool.share``), so the caller keeps and frees its own.
        The cache then stands at ``checkpoint.seq_len`` with the checkpoint's states (at 0
        with zero states if None): the blocks' first ``seq_len`` rows must hold those
        tokens' KV. Blocks past them are written by the next appends. All or nothing.
        """
        self._live()
        config, pool = self.config, self.pool
        if self._seq_len or any(self._blocks.values()):
            raise ValueError("adopt: expected an empty cache (seq_len 0, no KV blocks)")
        seq_len = 0
        if checkpoint is not None:
            check_checkpoint(config, checkpoint, "checkpoint")
            seq_len = checkpoint.seq_len
        blocks = dict(blocks)
        if set(blocks) != set(config.attn_layers):
            raise ValueError(f"blocks: expected block lists for the global layers {config.attn_layers}, "
                             f"got {sorted(blocks)}")
        for i in config.attn_layers:
            held = list(blocks[i])
            for j, alloc in enumerate(held):
                if not isinstance(alloc, Allocation) or alloc.kind != "kv" or alloc.n_pages != self.pages_per_block:
                    raise ValueError(f"blocks[{i}][{j}]: expected a 'kv' Allocation of {self.pages_per_block} "
                                     f"page(s) (block_tokens={self.block_tokens}), got {alloc!r}")
            if len(held) * self.block_tokens < seq_len:
                raise ValueError(f"blocks[{i}]: {len(held)} block(s) of {self.block_tokens} tokens "
                                 f"cannot hold seq_len={seq_len}")
        for i in config.attn_layers:
            self._blocks[i] = [pool.share(alloc, owner=self.owner) for alloc in blocks[i]]
            self._page_table[i] = _table(self._blocks[i])
            self._kv_len[i] = seq_len
        if checkpoint is not None:
            self._restore_states(checkpoint)
        self._seq_len = seq_len

    @classmethod
    def from_blocks(cls, config: ModelConfig, pool: PagePool, *, block_tokens: int,
                    blocks: Mapping[int, Sequence[Allocation]], checkpoint: StateCheckpoint | None = None,
                    owner=None) -> "PagedHybridCache":
        """A new cache on its own state pages, started on existing KV blocks (see :meth:`adopt`)."""
        out = cls(config, pool, block_tokens=block_tokens, owner=owner)
        try:
            out.adopt(blocks, checkpoint)
        except BaseException:
            out.free()
            raise
        return out

    def __repr__(self) -> str:
        if self._freed:
            return f"PagedHybridCache(config={self.config.name!r}, freed)"
        b = self.nbytes_by_kind()
        return (f"PagedHybridCache(config={self.config.name!r}, seq_len={self._seq_len}, "
                f"pages={self.n_pages} x {self.pool.page_bytes} B, kv={b['kv']} B, "
                f"kda_state={b['kda_state']} B, conv_state={b['conv_state']} B)")
