"""Rollback strategies, part 3: projection replay, and the same records in a ring buffer.

**Replay.** Leave the committed state alone; keep, per verified position, a *record* of
the projected KDA inputs the verify computed anyway (k, v, g, beta, plus the raw conv
inputs). After acceptance, run the accepted path's records as recurrent steps from the
committed state, and rebuild the conv state from the raw inputs. At 48B a record is
about 1/20 (fp32) to 1/40 (bf16) of a state (:mod:`kimilab.costs.spec`). Per step it
moves three states (the verify reads the committed one, the replay reads it again and
writes the new one) plus the records. Fused into the next step's verify -- the state one
step behind, as TensorRT-LLM's Mamba-2 replay keeps it -- the second read disappears;
that is the lazy ring of :mod:`kimilab.speculative.lazy` with the shortest ring.

**Ring.** The same records in a fixed window of ``window`` >= k+1 slots allocated once
per request and reused every step, plus a :class:`ConvRing` of raw conv rows that also
keeps the ``kernel - 1`` committed rows before the window: the conv state after any
accepted path is a slice of that ring, so its rollback is a pointer move (on a tree, the
path's rows are first moved together). A window too small is refused up front.
"""

from __future__ import annotations

from typing import Sequence

import numpy as np

from kimilab.config import ModelConfig
from kimilab.model import CacheProtocol
from kimilab.pool import PagePool
from kimilab.speculative.rollback import Rollback, StepSlotsRollback
from kimilab.speculative.scratch import ScratchSlots, conv_row_layout, record_layout
from kimilab.speculative.verify import VerifyView, conv_after, state_steps
from kimilab.validate import check_int

__all__ = ["ReplayRollback", "RingRollback", "ConvRing"]


def _records(config: ModelConfig, captures: dict, with_conv: bool) -> dict:
    """The record fields of every verified position, {(field, layer): [n, ...]}."""
    arrays = {}
    for i in config.kda_layers:
        cap = captures[i]
        arrays["k", i], arrays["v", i], arrays["g", i], arrays["beta", i] = cap.k, cap.v, cap.g, cap.beta
        if with_conv:
            arrays["conv", i] = cap.conv_inputs
    return arrays


def _replay(config: ModelConfig, cache: CacheProtocol, rec: dict) -> dict:
    """{layer: state after the records' recurrent steps from the cache's committed state}."""
    return {i: state_steps(cache.kda_state(i), rec["k", i], rec["v", i], rec["g", i], rec["beta", i])
            for i in config.kda_layers}


class ConvRing:
    """Raw conv rows of every KDA layer in ``n_rows`` slots; the conv state is the kernel - 1 rows
    before ``head``. ``write`` puts a verify's rows at head.., ``commit(path)`` moves ``head`` past
    the accepted path (gathering a tree path's rows first)."""

    def __init__(self, config: ModelConfig, pool: PagePool, n_rows: int, owner=None) -> None:
        self.config, self.layout = config, conv_row_layout(config)
        self.history = config.conv_kernel - 1
        self.n_rows = check_int("n_rows", n_rows, self.history + 1)
        self.slots = ScratchSlots(pool, self.layout, self.n_rows, owner=owner)
        self.head = 0

    def _at(self, start: int, n: int) -> np.ndarray:
        return (start + np.arange(n)) % self.n_rows

    def seed(self, cache: CacheProtocol) -> None:
        """Start from the cache's conv state (a one-time write, not counted as step traffic)."""
        rows = {("conv", i): cache.conv_state(i) for i in self.config.kda_layers}
        self.slots.write(np.arange(self.history), self.layout.pack(rows, self.history))
        self.slots.bytes_written = 0
        self.head = self.history

    def write(self, captures: dict, n: int) -> None:
        rows = {("conv", i): captures[i].conv_inputs for i in self.config.kda_layers}
        self.slots.write(self._at(self.head, n), self.layout.pack(rows, n))

    def commit(self, path: Sequence[int]) -> None:
        path = list(path)
        if path != list(range(len(path))):  # a tree path: its rows, read first, then moved together
            rows = self.slots.read([(self.head + p) % self.n_rows for p in path])
            self.slots.write(self._at(self.head, len(path)), rows)
        self.head = (self.head + len(path)) % self.n_rows

    def state(self) -> dict:
        """{layer: conv state [W-1, C]} at ``head``."""
        rows = self.layout.unpack(self.slots.read(self._at(self.head - self.history, self.history)))
        return {i: rows["conv", i] for i in self.config.kda_layers}


class ReplayRollback(StepSlotsRollback):
    """Committed state + one record per verified position (scratch pages, freed every step)."""

    name = "replay"

    def _layout(self, config: ModelConfig):
        return record_layout(config, with_conv=True)

    def _arrays(self, view: VerifyView, captures: dict) -> dict:
        return _records(self.config, captures, True)

    def _restore(self, cache: CacheProtocol, path: list[int]) -> None:
        rec = self.layout.unpack(self._slots.read(path))
        self._state_traffic += self._ckpt_bytes  # the replay reads the committed state
        states = _replay(self.config, cache, rec)
        convs = {i: conv_after(cache.conv_state(i), rec["conv", i], len(path))
                 for i in self.config.kda_layers}
        self._set(cache, path, states, convs)
        self.close()


class RingRollback(Rollback):
    """Replay records in a fixed ring of ``window`` slots; the conv state is a pointer into a conv ring.

    Allocated once (on the first save), reused every step, freed by :meth:`close`.
    """

    name = "ring"

    def __init__(self, config: ModelConfig, pool: PagePool, k: int, window: int | None = None,
                 owner=None, *, max_nodes=None) -> None:
        super().__init__(config, pool, k, owner, max_nodes=max_nodes)
        self.window = (self.max_nodes if window is None
                       else check_int("window", window, 1, unit="positions"))
        if self.window < self.max_nodes:
            ring = f"window={self.window}: a ring of {self.window} positions cannot hold a verify"
            if self.max_nodes == self.k + 1:
                raise ValueError(f"{ring} of k+1={self.max_nodes} positions (k={self.k}); "
                                 "use window >= k+1")
            raise ValueError(f"{ring} of max_nodes={self.max_nodes} positions; "
                             "use window >= max_nodes")
        self.history = config.conv_kernel - 1
        self.conv_slots_n = self.window + self.history
        self.layout = record_layout(config, with_conv=False)
        self._records: ScratchSlots | None = None
        self._convs: ConvRing | None = None

    @property
    def head(self) -> int:
        """Conv-ring slot of the next position's raw inputs."""
        return 0 if self._convs is None else self._convs.head

    def scratch_pages(self, page_bytes: int) -> int:
        return (self.window * -(-self.layout.nbytes // page_bytes)
                + self.conv_slots_n * -(-conv_row_layout(self.config).nbytes // page_bytes))

    @property
    def held_bytes(self) -> int:
        return 0 if self._records is None else self._records.nbytes + self._convs.slots.nbytes

    def _live_slots(self) -> list:
        return [self._records, None if self._convs is None else self._convs.slots]

    def _open(self, cache: CacheProtocol) -> None:
        """Allocate both rings and seed the conv ring with the committed conv state."""
        self._records = ScratchSlots(self.pool, self.layout, self.window, owner=self.owner)
        try:
            self._convs = ConvRing(self.config, self.pool, self.conv_slots_n, owner=self.owner)
        except BaseException:
            self._records.free()
            self._records = None
            raise
        self._convs.seed(cache)

    def _save(self, view: VerifyView, captures: dict) -> None:
        n = self._n
        if n > self.window:
            raise ValueError(f"a verify of {n} positions overflows the ring window={self.window}")
        if self._records is None:
            self._open(view.base)
        records = _records(self.config, captures, False)
        self._records.write(np.arange(n), self.layout.pack(records, n))
        self._convs.write(captures, n)

    def _restore(self, cache: CacheProtocol, path: list[int]) -> None:
        rec = self.layout.unpack(self._records.read(path))
        # the replay reads the committed KDA states (the conv state is in the ring)
        self._state_traffic += self._ckpt_bytes - self.history * self._convs.layout.nbytes
        states = _replay(self.config, cache, rec)
        self._convs.commit(path)  # the conv rollback: a pointer move
        self._set(cache, path, states, self._convs.state())

    def close(self) -> None:
        self._free_slots(self._records)
        self._free_slots(None if self._convs is None else self._convs.slots)
        self._records = self._convs = None
