"""Rollback strategies, part 2: projection replay, and the same records in a ring buffer.

**Replay.** Leave the committed state alone; keep, per verified token, a *record* of
the projected KDA inputs the verify computed anyway (k, v, g, beta, plus the raw conv
inputs). After acceptance of ``keep`` positions, run ``keep`` recurrent steps from the
committed state, and rebuild the conv state from the raw inputs. At 48B a record is
about 1/20 (fp32) to 1/40 (bf16) of a state (:mod:`kimilab.costs.spec`), and replaying
costs a few recurrent steps, not a forward pass. TensorRT-LLM's Mamba-2 rollback
replays the same way; Megatron-LM proposed a factorised variant.

**Ring.** The same records in a fixed window of ``window`` >= k+1 slots allocated once
per request and reused every step, plus a ring of raw conv rows that also keeps the
``kernel - 1`` committed rows before the window: the conv state after any accepted
length is a slice of that ring, so its rollback is a pointer move. A window shorter
than k+1 is refused up front (it would overwrite records still needed).
"""

from __future__ import annotations

import numpy as np

from kimilab.config import ModelConfig
from kimilab.model import CacheProtocol
from kimilab.pool import PagePool
from kimilab.speculative.rollback import Rollback, checkpoint_at
from kimilab.speculative.scratch import ScratchSlots, conv_row_layout, record_layout
from kimilab.speculative.verify import VerifyView, conv_after, state_steps
from kimilab.validate import check_int

__all__ = ["ReplayRollback", "RingRollback"]


def _records(config: ModelConfig, captures: dict, with_conv: bool) -> dict:
    """The record fields of every verified token, {(field, layer): [n, ...]}."""
    arrays = {}
    for i in config.kda_layers:
        cap = captures[i]
        arrays["k", i], arrays["v", i], arrays["g", i], arrays["beta", i] = cap.k, cap.v, cap.g, cap.beta
        if with_conv:
            arrays["conv", i] = cap.conv_inputs
    return arrays


def _replay(config: ModelConfig, cache: CacheProtocol, rec: dict, keep: int) -> dict:
    """{layer: state after ``keep`` recurrent steps from the cache's committed state}."""
    return {i: state_steps(cache.kda_state(i), rec["k", i][:keep], rec["v", i][:keep], rec["g", i][:keep],
                           rec["beta", i][:keep])
            for i in config.kda_layers}


class ReplayRollback(Rollback):
    """Committed state + one record per verified token (scratch pages, freed every step)."""

    name = "replay"

    def __init__(self, config: ModelConfig, pool: PagePool, k: int, owner=None) -> None:
        super().__init__(config, pool, k, owner)
        self.layout = record_layout(config, with_conv=True)
        self._slots: ScratchSlots | None = None

    def scratch_pages(self, page_bytes: int) -> int:
        return (self.k + 1) * -(-self.layout.nbytes // page_bytes)

    @property
    def held_bytes(self) -> int:
        return 0 if self._slots is None else self._slots.nbytes

    def _save(self, view: VerifyView, captures: dict) -> None:
        n = self._n
        self._slots = ScratchSlots(self.pool, self.layout, n, owner=self.owner)
        self._slots.write(np.arange(n), self.layout.pack(_records(self.config, captures, True), n))

    def _restore(self, cache: CacheProtocol, keep: int) -> None:
        rec = self.layout.unpack(self._slots.read(np.arange(keep)))
        states = _replay(self.config, cache, rec, keep)
        convs = {i: conv_after(cache.conv_state(i), rec["conv", i], keep) for i in self.config.kda_layers}
        cache.truncate(self._committed + keep, checkpoint_at(self.config, self._committed + keep, states, convs))
        self._slots.free()
        self._slots = None

    def close(self) -> None:
        if self._slots is not None:
            self._slots.free()
            self._slots = None


class RingRollback(Rollback):
    """Replay records in a fixed ring of ``window`` slots; the conv state is a pointer into a conv ring.

    Allocated once (on the first save), reused every step, freed by :meth:`close`.
    The conv ring has window + kernel - 1 rows; ``head`` is where the next verified
    position's raw conv inputs go, and the committed conv state is always the
    kernel - 1 rows before it. Accepting ``keep`` positions moves ``head`` by ``keep``.
    """

    name = "ring"

    def __init__(self, config: ModelConfig, pool: PagePool, k: int, window: int | None = None,
                 owner=None) -> None:
        super().__init__(config, pool, k, owner)
        self.window = self.k + 1 if window is None else check_int("window", window, 1, unit="positions")
        if self.window < self.k + 1:
            raise ValueError(f"window={self.window}: a ring of {self.window} positions cannot hold a verify "
                             f"of k+1={self.k + 1} positions (k={self.k}); use window >= k+1")
        self.history = config.conv_kernel - 1
        self.conv_slots_n = self.window + self.history
        self.layout = record_layout(config, with_conv=False)
        self.conv_layout = conv_row_layout(config)
        self._records: ScratchSlots | None = None
        self._convs: ScratchSlots | None = None
        self.head = 0  # conv-ring slot of the next position's raw inputs

    def scratch_pages(self, page_bytes: int) -> int:
        return (self.window * -(-self.layout.nbytes // page_bytes)
                + self.conv_slots_n * -(-self.conv_layout.nbytes // page_bytes))

    @property
    def held_bytes(self) -> int:
        return 0 if self._records is None else self._records.nbytes + self._convs.nbytes

    def _ring(self, start: int, n: int) -> np.ndarray:
        return (start + np.arange(n)) % self.conv_slots_n

    def _open(self, cache: CacheProtocol) -> None:
        """Allocate both rings and seed the conv ring with the committed conv state."""
        self._records = ScratchSlots(self.pool, self.layout, self.window, owner=self.owner)
        try:
            self._convs = ScratchSlots(self.pool, self.conv_layout, self.conv_slots_n, owner=self.owner)
        except BaseException:
            self._records.free()
            self._records = None
            raise
        rows = {("conv", i): cache.conv_state(i) for i in self.config.kda_layers}
        self._convs.write(np.arange(self.history), self.conv_layout.pack(rows, self.history))
        self.head = self.history

    def _save(self, view: VerifyView, captures: dict) -> None:
        n = self._n
        if n > self.window:
            raise ValueError(f"a verify of {n} positions overflows the ring window={self.window}")
        if self._records is None:
            self._open(view.base)
        self._records.write(np.arange(n), self.layout.pack(_records(self.config, captures, False), n))
        rows = {("conv", i): captures[i].conv_inputs for i in self.config.kda_layers}
        self._convs.write(self._ring(self.head, n), self.conv_layout.pack(rows, n))

    def _restore(self, cache: CacheProtocol, keep: int) -> None:
        rec = self.layout.unpack(self._records.read(np.arange(keep)))
        states = _replay(self.config, cache, rec, keep)
        self.head = (self.head + keep) % self.conv_slots_n  # the conv rollback: a pointer move
        rows = self.conv_layout.unpack(self._convs.read(self._ring(self.head - self.history, self.history)))
        convs = {i: rows["conv", i] for i in self.config.kda_layers}
        cache.truncate(self._committed + keep, checkpoint_at(self.config, self._committed + keep, states, convs))

    def close(self) -> None:
        for slots in (self._records, self._convs):
            if slots is not None:
                slots.free()
        self._records = self._convs = None
