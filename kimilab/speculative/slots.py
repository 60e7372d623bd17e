"""Rollback strategies, part 2: slot selection -- vLLM's snapshots, of which nothing is copied back.

vLLM's KDA and gated-delta kernels (``fla/ops/fused_recurrent.py``, reached from ``kda.py``
with ``IS_KDA``) give each request a row of state slots, ``ssm_state_indices[request, t]``.
A verify reads its initial state from slot ``num_accepted_tokens - 1`` -- the state after
the last token the previous step accepted -- and writes the state after each of its
positions t to slot t; on a tree (``IS_EAGLE_TREE``) node t starts from its parent's slot.
Acceptance only records which slot is live: nothing is copied.

Here slot 0 is the request's own state (the cache's KDA and conv states) and slots 1 .. n-1
are scratch pages held for the whole request, so a request keeps max_nodes states in all
-- one fewer than a copy-back's max_nodes + 1. A step moves n + 1 states: the live one
read, one written per position. While the live slot is not 0 the cache's own state is
stale; :meth:`SlotRollback.current` shows the model the live slot, and
:meth:`SlotRollback.finish` copies it home once, when the request ends.
"""

from __future__ import annotations

import numpy as np

from kimilab.config import ModelConfig
from kimilab.model import CacheProtocol
from kimilab.pool import PagePool
from kimilab.speculative.rollback import Rollback, StateView, checkpoint_at, snapshot_arrays
from kimilab.speculative.scratch import ScratchSlots, checkpoint_layout
from kimilab.speculative.verify import VerifyView

__all__ = ["SlotRollback"]


class SlotRollback(Rollback):
    """One state slot per verified position; the next verify starts from the accepted slot."""

    name = "slot"

    def __init__(self, config: ModelConfig, pool: PagePool, k: int, owner=None, *,
                 max_nodes=None) -> None:
        super().__init__(config, pool, k, owner, max_nodes=max_nodes)
        self.layout = checkpoint_layout(config)
        self._slots: ScratchSlots | None = None  # slots 1 .. max_nodes - 1
        self.live = 0  # the slot holding the committed state (0: the cache's own)

    def scratch_pages(self, page_bytes: int) -> int:
        return (self.max_nodes - 1) * -(-self.layout.nbytes // page_bytes)

    @property
    def held_bytes(self) -> int:
        return 0 if self._slots is None else self._slots.nbytes

    def _live_slots(self) -> list:
        return [self._slots]

    def _read_live(self) -> tuple[dict, dict]:
        row = self.layout.unpack(self._slots.read(self.live - 1))
        layers = self.config.kda_layers
        return {i: row["state", i][0] for i in layers}, {i: row["conv", i][0] for i in layers}

    def _current(self, cache: CacheProtocol) -> CacheProtocol:
        if self.live == 0:
            return super()._current(cache)
        return StateView(cache, *self._read_live())

    def _peek(self, cache: CacheProtocol) -> CacheProtocol:
        return cache if self.live == 0 else StateView(cache, *self._read_live())

    def _save(self, view: VerifyView, captures: dict) -> None:
        n = self._n
        # every position's state, from the live state
        arrays = snapshot_arrays(self.config, view.base, captures, self._window)
        if self._slots is None:
            self._slots = ScratchSlots(self.pool, self.layout, self.max_nodes - 1, owner=self.owner)
        cache = view.base.base if isinstance(view.base, StateView) else view.base
        for i in self.config.kda_layers:  # slot 0 is the request's own state
            cache.set_kda_state(i, arrays["state", i][0])
            cache.set_conv_state(i, arrays["conv", i][0])
        self._state_traffic += self._ckpt_bytes
        if n > 1:
            rest = {key: a[1:] for key, a in arrays.items()}
            self._slots.write(np.arange(n - 1), self.layout.pack(rest, n - 1))

    def _restore(self, cache: CacheProtocol, path: list[int]) -> None:
        self.live = path[-1]  # the whole rollback: remember which slot is live
        self._move_kv_only(cache, path)

    def finish(self, cache: CacheProtocol) -> None:
        if self.live:
            states, convs = self._read_live()
            cache.truncate(cache.seq_len, checkpoint_at(self.config, cache.seq_len, states, convs))
            self._state_traffic += self._ckpt_bytes
            self.live = 0

    def close(self) -> None:
        self._free_slots(self._slots)
        self._slots = None
