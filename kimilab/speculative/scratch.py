"""Typed slots on a pool's scratch pages: where speculative decoding keeps what it may have to undo.

A :class:`SlotLayout` names the arrays one slot holds (every KDA layer's state and
conv state, or one token's projected KDA inputs) and packs them into one flat vector.
:class:`ScratchSlots` holds ``n_slots`` such slots on ``"scratch"`` pages of a
:class:`~kimilab.pool.PagePool`: one allocation, slot s on its own run of pages,
freed as one. So the pool's accounting (and its invariants) see every byte a rollback
strategy keeps, next to the request's KV and states.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping

import numpy as np

from kimilab.config import ModelConfig
from kimilab.pool import PagePool
from kimilab.validate import check_int

__all__ = ["SlotLayout", "ScratchSlots", "checkpoint_layout", "record_layout", "conv_row_layout"]


@dataclass(frozen=True)
class SlotLayout:
    """The arrays of one slot: ``fields`` = ((key, shape), ...) packed in order, one dtype."""

    fields: tuple
    dtype: np.dtype

    @property
    def sizes(self) -> list[int]:
        return [int(np.prod(shape)) for _, shape in self.fields]

    @property
    def elems(self) -> int:
        return int(sum(self.sizes))

    @property
    def nbytes(self) -> int:
        """Bytes of one slot's data (without page padding)."""
        return self.elems * np.dtype(self.dtype).itemsize

    def pack(self, arrays: Mapping, n: int) -> np.ndarray:
        """``arrays[key]`` of shape ``[n, *shape]`` for every field -> one ``[n, elems]`` array."""
        parts = [np.asarray(arrays[key], dtype=self.dtype).reshape(n, -1) for key, _ in self.fields]
        return np.concatenate(parts, axis=1)

    def unpack(self, flat: np.ndarray) -> dict:
        """``[n, elems]`` -> ``{key: [n, *shape]}`` (views into ``flat``)."""
        out, start = {}, 0
        for (key, shape), size in zip(self.fields, self.sizes):
            out[key] = flat[:, start:start + size].reshape((flat.shape[0],) + tuple(shape))
            start += size
        return out


def checkpoint_layout(config: ModelConfig) -> SlotLayout:
    """One slot = a whole state checkpoint: ("state", i) [H, K, V] and ("conv", i) [W-1, C] per KDA layer."""
    H, K, W = config.n_heads, config.head_dim, config.conv_kernel
    fields = []
    for i in config.kda_layers:
        fields += [(("state", i), (H, K, K)), (("conv", i), (W - 1, config.conv_channels))]
    return SlotLayout(tuple(fields), np.dtype(config.dtype))


def record_layout(config: ModelConfig, with_conv: bool = True) -> SlotLayout:
    """One slot = one token's replay record: k, v, g [H, K], beta [H] and (``with_conv``) the raw
    conv inputs [C] of every KDA layer -- the ``"post-conv"`` record of :mod:`kimilab.costs.spec`."""
    H, K = config.n_heads, config.head_dim
    fields = []
    for i in config.kda_layers:
        fields += [(("k", i), (H, K)), (("v", i), (H, K)), (("g", i), (H, K)), (("beta", i), (H,))]
        if with_conv:
            fields.append((("conv", i), (config.conv_channels,)))
    return SlotLayout(tuple(fields), np.dtype(config.dtype))


def conv_row_layout(config: ModelConfig) -> SlotLayout:
    """One slot = one position's raw conv inputs [C] of every KDA layer (a row of each conv state)."""
    return SlotLayout(tuple((("conv", i), (config.conv_channels,)) for i in config.kda_layers),
                      np.dtype(config.dtype))


class ScratchSlots:
    """``n_slots`` slots of ``layout`` on one allocation of scratch pages of ``pool``.

    Slot s takes pages [s * pages_per_slot, (s+1) * pages_per_slot) of the allocation
    (page-padded). :meth:`write` and :meth:`read` move whole slots and count the bytes they
    move (``bytes_written``, ``bytes_read``); :meth:`free` returns every page. ``nbytes`` is
    the data held (n_slots * layout.nbytes), the pool counts the padding as waste.
    """

    def __init__(self, pool: PagePool, layout: SlotLayout, n_slots: int, owner=None) -> None:
        if not isinstance(pool, PagePool) or not pool.backed:
            raise ValueError(f"pool: expected a backed kimilab.pool.PagePool, got {pool!r}")
        if not isinstance(layout, SlotLayout):
            raise ValueError(f"layout: expected a SlotLayout, got {type(layout).__name__}")
        self.pool, self.layout = pool, layout
        self.n_slots = check_int("n_slots", n_slots, 1)
        self.pages_per_slot = pool.pages_for_bytes(layout.nbytes)
        self.nbytes = self.n_slots * layout.nbytes
        self.bytes_written = self.bytes_read = 0  # data moved through write / read (no padding)
        self.alloc = pool.allocate("scratch", self.n_slots * self.pages_per_slot, nbytes=self.nbytes,
                                   owner=owner)

    @property
    def reserved_bytes(self) -> int:
        return self.alloc.n_pages * self.pool.page_bytes

    def _pages(self, slots: np.ndarray) -> np.ndarray:
        pps = self.pages_per_slot
        return self.alloc.pages[(slots[:, None] * pps + np.arange(pps)).reshape(-1)]

    def _slots(self, slots) -> np.ndarray:
        slots = np.atleast_1d(np.asarray(slots, dtype=np.int64))
        if slots.size and (slots.min() < 0 or slots.max() >= self.n_slots):
            raise ValueError(f"slots={slots.tolist()}: expected slot numbers in 0..{self.n_slots - 1}")
        return slots

    def write(self, slots, data: np.ndarray) -> None:
        """Write ``data [len(slots), layout.elems]`` into ``slots``."""
        slots = self._slots(slots)
        data = np.ascontiguousarray(data, dtype=self.layout.dtype)
        if data.shape != (slots.size, self.layout.elems):
            raise ValueError(f"data: expected shape [{slots.size}, {self.layout.elems}], got {list(data.shape)}")
        stride = self.pages_per_slot * self.pool.page_bytes
        buf = np.zeros((slots.size, stride), dtype=np.uint8)
        buf[:, :self.layout.nbytes] = data.view(np.uint8).reshape(slots.size, -1)
        self.pool.arena()[self._pages(slots)] = buf.reshape(-1, self.pool.page_bytes)
        self.bytes_written += slots.size * self.layout.nbytes

    def read(self, slots) -> np.ndarray:
        """A copy of ``slots``' data, [len(slots), layout.elems]."""
        slots = self._slots(slots)
        stride = self.pages_per_slot * self.pool.page_bytes
        raw = self.pool.arena()[self._pages(slots)].reshape(slots.size, stride)[:, :self.layout.nbytes]
        self.bytes_read += slots.size * self.layout.nbytes
        return np.ascontiguousarray(raw).view(self.layout.dtype)

    def free(self) -> None:
        """Give every page back to the pool."""
        self.pool.free(self.alloc)

    def __repr__(self) -> str:
        return (f"ScratchSlots(n_slots={self.n_slots}, slot={self.layout.nbytes} B, "
                f"pages={self.alloc.n_pages} x {self.pool.page_bytes} B)")
