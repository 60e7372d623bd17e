"""Rollback strategies, part 4: the lazy ring (ReplaySSM) -- the state is written back every L tokens.

Replay and the ring still write the request's state once per step. ReplaySSM (vLLM RFC
#47572 and PRs #47576 / #49847, SGLang's ``fused_recurrent_gdn_replayssm.py``, Megatron-LM
#6617, TensorRT-LLM #14203) goes further:

* the request's state slot holds a **checkpoint** S_0, updated lazily;
* a **ring** of ``ring_len`` entries, longer than a verify, holds per position the update
  vector d, the key k and the gate g (:mod:`kimilab.speculative.tree_kda`): the state
  after m entries is ``fold(S_0, entries[:m])``, so the committed state is never stored;
* a verify computes its outputs from the checkpoint and the ring (here the fold becomes
  a temporary array the model reads; a GPU kernel keeps it in registers, tile by tile)
  and appends the window's entries after the ``cursor``;
* a rollback is a **cursor move** past the accepted entries (a tree path's entries are
  first moved together): the rejected ones are overwritten by the next verify;
* a **write-back** (flush) folds the committed entries into the checkpoint when the next
  verify would not fit: cursor + max_nodes > ring_len, about every ring_len - k tokens.

A step moves one state read and the history entries read, the window's entries written,
and one state written per flush: less than plain decoding's read-and-write once the
ring is long. The conv state is a pointer into a :class:`~kimilab.speculative.replay.ConvRing`.
With ring_len = max_nodes the flush runs every step -- the state one step behind, the
replay TensorRT-LLM merged for Mamba-2 (PR #13453).
"""

from __future__ import annotations

import numpy as np

from kimilab.config import ModelConfig
from kimilab.model import CacheProtocol
from kimilab.pool import PagePool
from kimilab.speculative.replay import ConvRing
from kimilab.speculative.rollback import Rollback, StateView, checkpoint_at
from kimilab.speculative.scratch import ScratchSlots, SlotLayout, conv_row_layout
from kimilab.speculative.tree_kda import fold, tree_kda
from kimilab.speculative.verify import VerifyView
from kimilab.validate import check_int

__all__ = ["LazyRingRollback", "entry_layout", "DEFAULT_RING"]

DEFAULT_RING = 16  # vLLM's and SGLang's default ReplaySSM buffer length


def entry_layout(config: ModelConfig) -> SlotLayout:
    """One ring entry = one position's d [H, V], k [H, K] and g [H, K] for every KDA layer."""
    H, K = config.n_heads, config.head_dim
    fields = []
    for i in config.kda_layers:
        fields += [(("d", i), (H, K)), (("k", i), (H, K)), (("g", i), (H, K))]
    return SlotLayout(tuple(fields), np.dtype(config.dtype))


class LazyRingRollback(Rollback):
    """A checkpoint in the request's state slot, a ring of update entries, a cursor (see module)."""

    name = "lazy-ring"

    def __init__(self, config: ModelConfig, pool: PagePool, k: int, ring_len: int | None = None,
                 owner=None, *, max_nodes=None) -> None:
        super().__init__(config, pool, k, owner, max_nodes=max_nodes)
        self.ring_len = max(DEFAULT_RING, self.max_nodes) if ring_len is None else check_int(
            "ring_len", ring_len, 1, unit="entries")
        if self.ring_len < self.max_nodes:
            raise ValueError(f"ring_len={self.ring_len}: a ring shorter than a verify of max_nodes="
                             f"{self.max_nodes} positions cannot hold it; "
                             f"use ring_len >= {self.max_nodes}")
        self.layout = entry_layout(config)
        self.history = config.conv_kernel - 1
        self._entries: ScratchSlots | None = None
        self._convs: ConvRing | None = None
        self.origin = 0  # ring slot of the first entry after the checkpoint
        self.cursor = 0  # committed entries since the checkpoint
        self._kda_bytes = self._ckpt_bytes - self.history * conv_row_layout(config).nbytes

    def scratch_pages(self, page_bytes: int) -> int:
        row = conv_row_layout(self.config).nbytes
        return (self.ring_len * -(-self.layout.nbytes // page_bytes)
                + (self.max_nodes + self.history) * -(-row // page_bytes))

    @property
    def held_bytes(self) -> int:
        return 0 if self._entries is None else self._entries.nbytes + self._convs.slots.nbytes

    def _live_slots(self) -> list:
        return [self._entries, None if self._convs is None else self._convs.slots]

    def _at(self, start: int, n: int) -> np.ndarray:
        return (self.origin + start + np.arange(n)) % self.ring_len

    def _folded(self, cache: CacheProtocol) -> dict:
        """{layer: the committed state}: the checkpoint with the cursor's entries folded in."""
        self._state_traffic += self._kda_bytes  # the checkpoint read
        if self.cursor == 0:
            return {i: cache.kda_state(i) for i in self.config.kda_layers}
        e = self.layout.unpack(self._entries.read(self._at(0, self.cursor)))
        return {i: fold(cache.kda_state(i), e["d", i], e["k", i], e["g", i])
                for i in self.config.kda_layers}

    def _current(self, cache: CacheProtocol) -> CacheProtocol:
        if self._entries is None:
            self._entries = ScratchSlots(self.pool, self.layout, self.ring_len, owner=self.owner)
            self._convs = ConvRing(self.config, self.pool, self.max_nodes + self.history,
                                   owner=self.owner)
            self._convs.seed(cache)
        states = self._folded(cache)
        self.last_history = self.cursor
        self.last_flush = self.cursor + self.max_nodes > self.ring_len
        if self.last_flush:  # the next verify would not fit: write back
            for i, S in states.items():
                cache.set_kda_state(i, S)
            self._state_traffic += self._kda_bytes
            self.origin, self.cursor = (self.origin + self.cursor) % self.ring_len, 0
            self.flushes += 1
        return StateView(cache, states, self._convs.state())

    def _peek(self, cache: CacheProtocol) -> CacheProtocol:
        if self._entries is None:
            return cache
        return StateView(cache, self._folded(cache), self._convs.state())

    def _save(self, view: VerifyView, captures: dict) -> None:
        n, arrays = self._n, {}
        for i in self.config.kda_layers:
            cap = captures[i]
            _, d = tree_kda(cap.q, cap.k, cap.v, cap.g, cap.beta, self._window,
                            view.base.kda_state(i))
            arrays["d", i], arrays["k", i], arrays["g", i] = d, cap.k, cap.g
        self._entries.write(self._at(self.cursor, n), self.layout.pack(arrays, n))
        self._convs.write(captures, n)

    def _restore(self, cache: CacheProtocol, path: list[int]) -> None:
        j = len(path)
        if path != list(range(j)):  # a tree path: its entries moved together after the cursor
            src = self._at(self.cursor, path[-1] + 1)[path]
            self._entries.write(self._at(self.cursor, j), self._entries.read(src))
        self.cursor += j  # the rollback: a cursor move
        self._convs.commit(path)
        self._move_kv_only(cache, path)

    def finish(self, cache: CacheProtocol) -> None:
        if self._entries is None:
            return
        states = self._folded(cache)
        ckpt = checkpoint_at(self.config, cache.seq_len, states, self._convs.state())
        cache.truncate(cache.seq_len, ckpt)
        self._state_traffic += self._ckpt_bytes
        self.origin, self.cursor = (self.origin + self.cursor) % self.ring_len, 0

    def close(self) -> None:
        self._free_slots(self._entries)
        self._free_slots(None if self._convs is None else self._convs.slots)
        self._entries = self._convs = None

