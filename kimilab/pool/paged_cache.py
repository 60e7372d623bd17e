"""A per-request hybrid cache that lives on the pages of a :class:`~kimilab.pool.PagePool`.

:class:`PagedHybridCache` implements the same cache protocol as the contiguous
:class:`kimilab.cache.HybridCache`, but every byte it holds is in the pool's arena:

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
place. Nothing else keeps a second copy of the cache. :meth:`free` returns
every page.
"""

from __future__ import annotations

from types import MappingProxyType
from typing import Mapping

import numpy as np

from kimilab.model.cache import HybridCache, StateCheckpoint
from kimilab.config import ModelConfig
from kimilab.pool.pages import PagePool, PoolError, PoolExhausted

__all__ = ["PagedHybridCache"]


def _readonly(a: np.ndarray) -> np.ndarray:
    a.flags.writeable = False
    return a


class PagedHybridCache:
    """The cache protocol of :class:`kimilab.cache.HybridCache`, stored on pool pages."""

    def __init__(self, config: ModelConfig, pool: PagePool, *, block_tokens: int = 16) -> None:
        _check(config)
        if not isinstance(pool, PagePool):
            raise ValueError(f"pool: expected a kimilab.pool.PagePool, got {type(pool).__name__}")
        if not pool.backed:
            raise ValueError("pool: expected a backed pool (PagePool(..., backed=True)); "
                             "an accounting-only pool has no bytes to hold a cache")
        if isinstance(block_tokens, bool) or not isinstance(block_tokens, (int, np.integer)) or block_tokens < 1:
            raise ValueError(f"block_tokens={block_tokens!r}: expected an int >= 1 (tokens per KV block)")
        self.config = config
        self.pool = pool
        self.dtype = np.dtype(config.dtype)
        self.block_tokens = int(block_tokens)
        item = self.dtype.itemsize
        self._hkv, self._dk = config.attn_kv_heads_eff, config.attn_head_dim_eff
        self._dv = self._dk
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
        H, K = config.n_heads, config.head_dim
        self._state_shape = (H, K, K)
        self._conv_shape = (config.conv_kernel - 1, config.conv_channels)
        self._state_nbytes = H * K * K * item
        self._conv_nbytes = self._conv_shape[0] * self._conv_shape[1] * item
        # all fixed-size allocations at once, or none
        need = len(config.kda_layers) * (pool.pages_for_bytes(self._state_nbytes) +
                                         pool.pages_for_bytes(self._conv_nbytes))
        if need > pool.n_free:
            raise PoolExhausted.of(pool, "kda_state", need)
        self._kda = {i: pool.allocate_bytes("kda_state", self._state_nbytes, zero=True)
                     for i in config.kda_layers}
        self._conv = {i: pool.allocate_bytes("conv_state", self._conv_nbytes, zero=True)
                      for i in config.kda_layers}
        self._blocks: dict[int, list] = {i: [] for i in config.attn_layers}  # block tables
        self._page_table = {i: np.zeros(0, dtype=np.int64) for i in config.attn_layers}
        self._kv_len = dict.fromkeys(config.attn_layers, 0)
        self._seq_len = 0
        self._freed = False

    # ----- arena views -------------------------------------------------------
    def _rows(self) -> np.ndarray:
        """The arena as [n_pages, tokens_per_page, row_elems] of the KV dtype (a view)."""
        arena = self.pool.arena()
        used = self.tokens_per_page * self._row_elems * self.dtype.itemsize
        return arena[:, :used].view(self.dtype).reshape(self.pool.n_pages, self.tokens_per_page,
                                                        self._row_elems)

    def _live(self) -> None:
        if self._freed:
            raise PoolError("PagedHybridCache: this cache was freed; its pages belong to the pool again")

    def _layer(self, i, table: dict, what: str) -> int:
        self._live()
        if isinstance(i, bool) or not isinstance(i, (int, np.integer)) or int(i) not in table:
            kind = "KDA" if what != "kv" else "global-attention"
            raise ValueError(f"layer i={i!r} is not a {kind} layer of {self.config.name!r}; "
                             f"{kind} layers are {tuple(sorted(table))}")
        return int(i)

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

    # ----- bookkeeping --------------------------------------------------------
    @property
    def seq_len(self) -> int:
        return self._seq_len

    def advance(self, n: int) -> None:
        """Record that ``n`` more tokens went through every layer (once per model call)."""
        self._live()
        if not isinstance(n, (int, np.integer)) or isinstance(n, bool) or n < 0:
            raise ValueError(f"advance(n={n!r}): expected a non-negative int")
        new = self._seq_len + int(n)
        for i, length in self._kv_len.items():
            if length != new:
                raise ValueError(
                    f"advance(n={n}): global layer {i} holds {length} KV rows but seq_len "
                    f"would become {new}; append_kv for every global layer before advancing")
        self._seq_len = new

    # ----- KDA layers -----------------------------------------------------------
    def kda_state(self, i: int) -> np.ndarray:
        """Recurrent state [H, K, V] of KDA layer ``i`` (a read-only snapshot)."""
        i = self._layer(i, self._kda, "kda_state")
        return self._read(self._kda[i], self._state_nbytes, self._state_shape)

    def set_kda_state(self, i: int, state: np.ndarray) -> None:
        i = self._layer(i, self._kda, "kda_state")
        state = np.asarray(state)
        if state.shape != self._state_shape:
            raise ValueError(f"set_kda_state(i={i}, state): expected shape [H, K, V] = "
                             f"{list(self._state_shape)}, got {list(state.shape)}")
        self._write(self._kda[i], state)

    def conv_state(self, i: int) -> np.ndarray:
        """Conv rolling state [W-1, C] of KDA layer ``i`` (a read-only snapshot)."""
        i = self._layer(i, self._conv, "conv_state")
        return self._read(self._conv[i], self._conv_nbytes, self._conv_shape)

    def set_conv_state(self, i: int, conv: np.ndarray) -> None:
        i = self._layer(i, self._conv, "conv_state")
        conv = np.asarray(conv)
        if conv.shape != self._conv_shape:
            raise ValueError(f"set_conv_state(i={i}, conv): expected shape [W-1, C] = "
                             f"{list(self._conv_shape)}, got {list(conv.shape)}")
        self._write(self._conv[i], conv)

    # ----- global layers ---------------------------------------------------------
    def append_kv(self, i: int, k: np.ndarray, v: np.ndarray) -> None:
        """Append k [T, Hkv, Dk], v [T, Hkv, Dv] to layer ``i``, taking new blocks as needed.

        All-or-nothing: if the pool cannot supply every block needed, PoolExhausted is
        raised before anything changes.
        """
        i = self._layer(i, self._kv_len, "kv")
        k, v = np.asarray(k), np.asarray(v)
        if k.ndim != 3 or k.shape[1:] != (self._hkv, self._dk):
            raise ValueError(f"append_kv(i={i}, k): expected shape [T, Hkv, Dk] = "
                             f"[T, {self._hkv}, {self._dk}], got {list(k.shape)}")
        if v.shape != (k.shape[0], self._hkv, self._dv):
            raise ValueError(f"append_kv(i={i}, v): expected shape [T, Hkv, Dv] = "
                             f"[{k.shape[0]}, {self._hkv}, {self._dv}], got {list(v.shape)}")
        T = k.shape[0]
        if T == 0:
            return
        start = self._kv_len[i]
        need_blocks = -(-(start + T) // self.block_tokens) - len(self._blocks[i])
        if need_blocks > 0:
            need = need_blocks * self.pages_per_block
            if need > self.pool.n_free:
                raise PoolExhausted.of(self.pool, "kv", need)
            new = [self.pool.allocate("kv", self.pages_per_block) for _ in range(need_blocks)]
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
        i = self._layer(i, self._kv_len, "kv")
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
        i = self._layer(i, self._kv_len, "kv")
        return [a.block_id for a in self._blocks[i]]

    # ----- sizes -------------------------------------------------------------------
    def nbytes_by_kind(self) -> dict[str, int]:
        """Bytes held (used KV rows, exact state sizes), as HybridCache counts them."""
        item = self.dtype.itemsize
        return {
            "kv": int(sum(self._kv_len.values()) * self._row_elems * item),
            "kda_state": len(self._kda) * self._state_nbytes,
            "conv_state": len(self._conv) * self._conv_nbytes,
        }

    @property
    def nbytes(self) -> int:
        return int(sum(self.nbytes_by_kind().values()))

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
    def free(self) -> None:
        """Give every page back to the pool. The cache cannot be used afterwards."""
        self._live()
        for alloc in self.allocations():
            self.pool.free(alloc)
        self._kda, self._conv = {}, {}
        self._blocks = {i: [] for i in self._blocks}
        self._freed = True

    def __enter__(self) -> "PagedHybridCache":
        return self

    def __exit__(self, *exc) -> None:
        if not self._freed:
            self.free()

    def clone(self) -> "PagedHybridCache":
        """A deep copy on fresh pages of the same pool (continuing one never affects the other)."""
        self._live()
        need = self.n_pages
        if need > self.pool.n_free:
            raise PoolExhausted.of(self.pool, "kv", need)
        out = PagedHybridCache(self.config, self.pool, block_tokens=self.block_tokens)
        arena = self.pool.arena()
        for i in self._kda:
            arena[out._kda[i].pages] = arena[self._kda[i].pages]
            arena[out._conv[i].pages] = arena[self._conv[i].pages]
        for i, blocks in self._blocks.items():
            new = [self.pool.allocate("kv", self.pages_per_block) for _ in blocks]
            for a, b in zip(new, blocks):
                arena[a.pages] = arena[b.pages]
            out._blocks[i] = new
            out._page_table[i] = (np.concatenate([a.pages for a in new]) if new
                                  else np.zeros(0, dtype=np.int64))
        out._kv_len = dict(self._kv_len)
        out._seq_len = self._seq_len
        return out

    def checkpoint(self) -> StateCheckpoint:
        """Copies of every KDA and conv state at the current position."""
        self._live()
        return StateCheckpoint(
            config=self.config,
            seq_len=self._seq_len,
            kda_states=MappingProxyType({i: self.kda_state(i) for i in self._kda}),
            conv_states=MappingProxyType({i: self.conv_state(i) for i in self._conv}),
        )

    @classmethod
    def from_checkpoint(cls, config: ModelConfig, ckpt: StateCheckpoint,
                        kv: Mapping[int, tuple[np.ndarray, np.ndarray]] | None = None, *,
                        pool: PagePool, block_tokens: int = 16) -> "PagedHybridCache":
        """A paged cache at ``ckpt.seq_len`` (see HybridCache.from_checkpoint); pages from ``pool``."""
        if not isinstance(ckpt, StateCheckpoint):
            raise ValueError(f"ckpt: expected a StateCheckpoint, got {type(ckpt).__name__}")
        if ckpt.config != config:
            raise ValueError(f"ckpt.config={ckpt.config.name!r} does not match config={config.name!r}")
        if set(ckpt.kda_states) != set(config.kda_layers) or set(ckpt.conv_states) != set(config.kda_layers):
            raise ValueError(f"ckpt: expected states for KDA layers {config.kda_layers}")
        kv = dict(kv or {})
        extra = set(kv) - set(config.attn_layers)
        if extra:
            raise ValueError(f"kv: layers {sorted(extra)} are not global layers {config.attn_layers}")
        for i in config.attn_layers:
            if i not in kv and ckpt.seq_len:
                raise ValueError(f"kv: missing (K, V) for global layer {i} (needed for {ckpt.seq_len} tokens)")
            if i in kv and (np.shape(kv[i][0])[0] != ckpt.seq_len or np.shape(kv[i][1])[0] != ckpt.seq_len):
                raise ValueError(f"kv[{i}]: expected {ckpt.seq_len} rows (ckpt.seq_len), "
                                 f"got K {np.shape(kv[i][0])[0]}, V {np.shape(kv[i][1])[0]}")
        out = cls(config, pool, block_tokens=block_tokens)
        try:
            for i in config.kda_layers:
                out.set_kda_state(i, ckpt.kda_states[i])
                out.set_conv_state(i, ckpt.conv_states[i])
            for i in config.attn_layers:
                if i in kv:
                    out.append_kv(i, *kv[i])
        except Exception:
            out.free()
            raise
        out._seq_len = ckpt.seq_len
        return out

    def __repr__(self) -> str:
        if self._freed:
            return f"PagedHybridCache(config={self.config.name!r}, freed)"
        b = self.nbytes_by_kind()
        return (f"PagedHybridCache(config={self.config.name!r}, seq_len={self._seq_len}, "
                f"pages={self.n_pages} x {self.pool.page_bytes} B, kv={b['kv']} B, "
                f"kda_state={b['kda_state']} B, conv_state={b['conv_state']} B)")


def _check(config) -> None:
    """The same config rules as the contiguous cache (runnable, non-MLA)."""
    from kimilab.model.cache import check_runnable_config

    check_runnable_config(config)
