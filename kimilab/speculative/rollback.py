"""Rollback strategies, part 1: the interface, the broken "trim", and per-position snapshots.

Every strategy answers the same two calls around one verify of n = k+1 positions:

* ``save(view, captures)``  after the verify: keep whatever going back will need
  (the request's cache still holds its committed states; the view the verify's own);
* ``restore(cache, keep)``  after acceptance: put the cache at the committed position +
  ``keep`` (the last committed token and keep-1 accepted drafts), through the cache
  protocol's ``truncate(n, checkpoint)`` -- KV rows are forgotten, states restored.

``close()`` returns every scratch page. :class:`TrimOnly` is the bug mlx-lm found
(its ``trim()`` on a recurrent cache): drop the KV, keep the state that absorbed the
rejected drafts. :class:`SnapshotRollback` is what vLLM and SGLang do: a state per
verified position, in scratch pages; rollback selects one.
"""

from __future__ import annotations

import time
from abc import ABC, abstractmethod
from types import MappingProxyType

import numpy as np

from kimilab.config import ModelConfig
from kimilab.model import CacheProtocol, StateCheckpoint
from kimilab.pool import PagePool
from kimilab.speculative.scratch import ScratchSlots, checkpoint_layout
from kimilab.speculative.verify import VerifyView, conv_after, state_steps
from kimilab.validate import check_int

__all__ = ["Rollback", "TrimOnly", "SnapshotRollback", "checkpoint_at"]


def checkpoint_at(config: ModelConfig, seq_len: int, states: dict, convs: dict) -> StateCheckpoint:
    """A StateCheckpoint of ``states`` / ``convs`` (KDA layer -> array) at ``seq_len``."""
    return StateCheckpoint(config, seq_len, MappingProxyType(dict(states)), MappingProxyType(dict(convs)))


class Rollback(ABC):
    """How speculative decoding goes back after a verify: ``save``, then ``restore``, per step.

    ``k`` is the most drafts a verify carries (so at most k+1 positions); scratch pages
    come from ``pool``. ``seconds`` accumulates wall-clock time spent in save / restore.
    """

    name = "rollback"

    def __init__(self, config: ModelConfig, pool: PagePool | None, k: int, owner=None) -> None:
        self.config, self.pool, self.owner = config, pool, owner
        self.k = check_int("k", k, 1, unit="draft tokens")
        self.seconds = {"save": 0.0, "restore": 0.0}
        self._committed = 0  # cache.seq_len before the verify
        self._n = 0  # positions verified

    def scratch_pages(self, page_bytes: int) -> int:
        """Pool pages this strategy holds at most (to size a private pool)."""
        return 0

    @property
    def held_bytes(self) -> int:
        """Scratch bytes held right now (data, without page padding)."""
        return 0

    def save(self, view: VerifyView, captures: dict) -> None:
        """After a verify through ``view``: keep what going back needs."""
        start = time.perf_counter()
        self._committed = view.committed
        self._n = view.base.seq_len - view.committed
        self._save(view, captures)
        self.seconds["save"] += time.perf_counter() - start

    def restore(self, cache: CacheProtocol, keep: int) -> None:
        """Put ``cache`` at committed + ``keep`` positions (1 <= keep <= positions verified)."""
        keep = check_int("keep", keep, 1, unit="verified positions")
        if keep > self._n:
            raise ValueError(f"keep={keep}: only {self._n} positions were verified")
        start = time.perf_counter()
        self._restore(cache, keep)
        self.seconds["restore"] += time.perf_counter() - start

    @abstractmethod
    def _save(self, view: VerifyView, captures: dict) -> None: ...

    @abstractmethod
    def _restore(self, cache: CacheProtocol, keep: int) -> None: ...

    def close(self) -> None:
        """Give back every scratch page (the strategy cannot be used afterwards)."""

    def __repr__(self) -> str:
        return f"{type(self).__name__}(k={self.k})"


class TrimOnly(Rollback):
    """WRONG on purpose: truncate the KV, keep the states the whole window went into.

    This is what a ``trim()`` that only knows KV caches does to a recurrent cache: the
    states are labelled as if they had seen ``keep`` positions, but they absorbed all of
    them, rejected drafts included. Correct only when every draft was accepted.
    """

    name = "none"

    def _save(self, view: VerifyView, captures: dict) -> None:
        self._view = view

    def _restore(self, cache: CacheProtocol, keep: int) -> None:
        cache.truncate(self._committed + keep, self._view.verified_checkpoint(self._committed + keep))


class SnapshotRollback(Rollback):
    """A copy of every KDA and conv state after each verified position, in scratch pages.

    vLLM and SGLang keep one state per draft position (SGLang copies the accepted one
    back; vLLM's TPU runner keeps a slot per position and selects it). A GPU verify
    kernel writes these states as it passes each position; our verify is the chunked
    kernel, which only yields the last, so ``save`` recomputes them token by token from
    the committed state and the captured inputs -- the same arithmetic as decoding.
    """

    name = "snapshot"

    def __init__(self, config: ModelConfig, pool: PagePool, k: int, owner=None) -> None:
        super().__init__(config, pool, k, owner)
        self.layout = checkpoint_layout(config)
        self._slots: ScratchSlots | None = None

    def scratch_pages(self, page_bytes: int) -> int:
        return (self.k + 1) * -(-self.layout.nbytes // page_bytes)

    @property
    def held_bytes(self) -> int:
        return 0 if self._slots is None else self._slots.nbytes

    def _save(self, view: VerifyView, captures: dict) -> None:
        cache, n = view.base, self._n
        arrays = {}
        for i in self.config.kda_layers:
            cap = captures[i]
            arrays["state", i] = state_steps(cache.kda_state(i), cap.k, cap.v, cap.g, cap.beta, every=True)
            conv0, raw = cache.conv_state(i), cap.conv_inputs
            arrays["conv", i] = np.stack([conv_after(conv0, raw, t + 1) for t in range(n)])
        self._slots = ScratchSlots(self.pool, self.layout, n, owner=self.owner)
        self._slots.write(np.arange(n), self.layout.pack(arrays, n))

    def _restore(self, cache: CacheProtocol, keep: int) -> None:
        chosen = self.layout.unpack(self._slots.read(keep - 1))
        states = {i: chosen["state", i][0] for i in self.config.kda_layers}
        convs = {i: chosen["conv", i][0] for i in self.config.kda_layers}
        cache.truncate(self._committed + keep, checkpoint_at(self.config, self._committed + keep, states, convs))
        self._slots.free()
        self._slots = None

    def close(self) -> None:
        if self._slots is not None:
            self._slots.free()
            self._slots = None
