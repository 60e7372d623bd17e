"""Rollback strategies, part 1: the interface, the broken "trim", and snapshots copied back.

Every strategy answers the same calls around one verify of n positions (a chain of
k+1, or the nodes of a token tree):

* ``current(cache)``  the request as the model must see it before the next verify: the
  cache itself, or (strategies that leave the committed state elsewhere) a view of it;
* ``save(view, captures, window)``  after the verify: keep what going back will need;
* ``restore(cache, path)``  after acceptance: put the cache at the committed position
  plus the accepted ``path`` of window nodes (an int ``keep`` means the first keep
  positions of a chain). On a tree the path's KV rows are moved together first (the
  rejected branches' rows are dropped), then the strategy sets the states;
* ``finish(cache)``  at the end of the request: leave the cache holding its true state;
* ``close()``  give back every scratch page.

Each strategy counts the bytes it moves (``moved_bytes``): every byte of state, snapshot,
record or ring entry read or written in a step, the verify's read of the committed state
included -- what its GPU twin moves through HBM. Plain decoding moves two states (read
one, write one). The tests hold the counts to :func:`kimilab.costs.spec.moved_bytes`.

:class:`TrimOnly` is the bug mlx-lm found (its ``trim()`` on a recurrent cache).
:class:`SnapshotRollback` is SGLang's design: a state per verified position in scratch,
the accepted one copied back into the request's state.
"""

from __future__ import annotations

import time
from abc import ABC, abstractmethod
from types import MappingProxyType
from typing import Sequence

import numpy as np

from kimilab.config import ModelConfig
from kimilab.model import CacheProtocol, StateCheckpoint
from kimilab.pool import PagePool
from kimilab.speculative.scratch import ScratchSlots, checkpoint_layout
from kimilab.speculative.tree import Window
from kimilab.speculative.tree_kda import node_states
from kimilab.speculative.verify import KVDelegate, VerifyView
from kimilab.validate import check_int

__all__ = ["Rollback", "StepSlotsRollback", "TrimOnly", "SnapshotRollback", "StateView", "checkpoint_at", "node_convs", "snapshot_arrays"]


def checkpoint_at(config: ModelConfig, seq_len: int, states: dict, convs: dict) -> StateCheckpoint:
    """A StateCheckpoint of ``states`` / ``convs`` (KDA layer -> array) at ``seq_len``."""
    return StateCheckpoint(config, seq_len, MappingProxyType(dict(states)), MappingProxyType(dict(convs)))


def _relabel(cache: CacheProtocol, seq_len: int) -> StateCheckpoint:
    """The cache's own states, labelled ``seq_len``: truncating with it moves KV only."""
    layers = cache.config.kda_layers
    return checkpoint_at(cache.config, seq_len, {i: cache.kda_state(i) for i in layers},
                         {i: cache.conv_state(i) for i in layers})


def node_convs(conv0: np.ndarray, raw: np.ndarray, window: Window) -> np.ndarray:
    """Every node's conv state [n, W-1, C]: the last W-1 raw inputs on its root path."""
    w = conv0.shape[0]
    out = np.empty((len(window),) + conv0.shape, dtype=np.result_type(conv0, raw))
    for i in range(len(window)):
        rows = np.concatenate([conv0, raw[window.path(i)]], axis=0)
        out[i] = rows[rows.shape[0] - w:]
    return out


def snapshot_arrays(config: ModelConfig, committed: CacheProtocol, captures: dict, window: Window) -> dict:
    """Every node's KDA and conv state, {("state" | "conv", layer): [n, ...]}, from the committed
    states of ``committed`` and the verify's captured inputs (each node from its parent's state)."""
    arrays = {}
    for i in config.kda_layers:
        cap = captures[i]
        arrays["state", i] = node_states(committed.kda_state(i), cap.k, cap.v, cap.g, cap.beta, window)
        arrays["conv", i] = node_convs(committed.conv_state(i), cap.conv_inputs, window)
    return arrays


class StateView(KVDelegate):
    """A request's cache with its KDA and conv states read from elsewhere (``states``, ``convs``):
    what a strategy that leaves the committed state outside the request's own slot shows
    the model. KV reads, appends and ``advance`` go to the cache; states cannot be set."""

    def __init__(self, cache: CacheProtocol, states: dict, convs: dict) -> None:
        super().__init__(cache)
        self._states, self._convs = states, convs

    def kda_state(self, i: int) -> np.ndarray:
        return self._states[self._layer(i, "kda_state")]

    def conv_state(self, i: int) -> np.ndarray:
        return self._convs[self._layer(i, "conv_state")]

    def set_kda_state(self, i: int, state: np.ndarray) -> None:
        raise TypeError("StateView is read-only: the strategy owns the states")

    set_conv_state = set_kda_state

    def _drop_kv_after(self, n: int) -> None:
        raise TypeError("StateView cannot truncate: roll back the request's cache")

    def _release(self) -> None:
        pass

    def nbytes_by_kind(self) -> dict[str, int]:
        return self.base.nbytes_by_kind()

    def clone(self):
        raise TypeError("StateView cannot be cloned: clone the request's cache")


class Rollback(ABC):
    """How speculative decoding goes back after a verify (see the module docstring).

    ``k`` is the most drafts a chain verify carries; ``max_nodes`` (default k+1) the most
    positions any verify carries (a tree's nodes). Scratch pages come from ``pool``.
    ``seconds`` accumulates wall-clock time in current / save / restore, ``moved_bytes`` the bytes moved.
    """

    name = "rollback"

    def __init__(self, config: ModelConfig, pool: PagePool | None, k: int, owner=None, *,
                 max_nodes: int | None = None) -> None:
        self.config, self.pool, self.owner = config, pool, owner
        self.k = check_int("k", k, 1, unit="draft tokens")
        self.max_nodes = self.k + 1 if max_nodes is None else check_int(
            "max_nodes", max_nodes, self.k + 1, unit="verified positions, at least k+1")
        self.seconds = {"current": 0.0, "save": 0.0, "restore": 0.0}
        self.flushes = 0  # state write-backs (lazy strategies)
        self.last_history, self.last_flush = 0, False  # what the last `current` folded / wrote back
        self._state_traffic = 0  # bytes of the request's own states read or written
        self._freed_traffic = 0  # scratch traffic of slots already freed
        self._committed = 0  # cache.seq_len before the verify
        self._n = 0  # positions verified
        self._window: Window | None = None
        self._ckpt_bytes = checkpoint_layout(config).nbytes

    def scratch_pages(self, page_bytes: int) -> int:
        """Pool pages this strategy holds at most (to size a private pool)."""
        return 0

    @property
    def held_bytes(self) -> int:
        """Scratch bytes held right now (data, without page padding)."""
        return 0

    def _live_slots(self) -> list:
        """The ScratchSlots this strategy holds now (their byte counters are its scratch traffic)."""
        return []

    @property
    def moved_bytes(self) -> int:
        """Every byte this strategy has read or written so far (see the module docstring)."""
        live = sum(s.bytes_written + s.bytes_read for s in self._live_slots() if s is not None)
        return self._state_traffic + self._freed_traffic + live

    def _free_slots(self, slots) -> None:
        if slots is not None:
            self._freed_traffic += slots.bytes_written + slots.bytes_read
            slots.free()

    def current(self, cache: CacheProtocol) -> CacheProtocol:
        """The request as the model sees it before a verify: its KV, and its committed states
        wherever the strategy keeps them (a lazy strategy may write its state back here)."""
        start = time.perf_counter()
        out = self._current(cache)
        self.seconds["current"] += time.perf_counter() - start
        return out

    def _current(self, cache: CacheProtocol) -> CacheProtocol:
        """Here: the cache itself, whose states the next verify reads (one state's bytes)."""
        self._state_traffic += self._ckpt_bytes
        return cache

    def peek(self, cache: CacheProtocol) -> CacheProtocol:
        """The request with its true states, for checks: like :meth:`current`, but nothing is
        counted and nothing is written back."""
        counters = [(s, s.bytes_read, s.bytes_written) for s in self._live_slots() if s is not None]
        traffic = self._state_traffic
        try:
            return self._peek(cache)
        finally:
            for s, r, w in counters:
                s.bytes_read, s.bytes_written = r, w
            self._state_traffic = traffic

    def _peek(self, cache: CacheProtocol) -> CacheProtocol:
        return cache

    def save(self, view: VerifyView, captures: dict, window: Window | None = None) -> None:
        """After a verify through ``view`` of a chain (``window=None``) or a tree ``window``."""
        start = time.perf_counter()
        self._committed = view.committed
        self._n = view.base.seq_len - view.committed
        if self._n > self.max_nodes:
            raise ValueError(f"a verify of {self._n} positions: this strategy holds at most "
                             f"max_nodes={self.max_nodes}")
        self._window = Window.chain(self._n) if window is None else window
        if len(self._window) != self._n:
            raise ValueError(f"window: {len(self._window)} nodes, but {self._n} positions were verified")
        self._save(view, captures)
        self.seconds["save"] += time.perf_counter() - start

    def restore(self, cache: CacheProtocol, keep) -> None:
        """Put ``cache`` at committed + the accepted path (``keep``: a path from node 0, or a count)."""
        if isinstance(keep, (int, np.integer)) and not isinstance(keep, bool):
            keep = check_int("keep", keep, 1, unit="verified positions")
            if keep > self._n:
                raise ValueError(f"keep={keep}: only {self._n} positions were verified")
            path = list(range(keep))
        else:
            path = [int(p) for p in keep]
            if not path or path[0] != 0 or any(self._window.parents[b] != a for a, b in zip(path, path[1:])):
                raise ValueError(f"keep={path}: expected a path from node 0 down the verified tree")
        start = time.perf_counter()
        if path != list(range(len(path))):
            self._gather_kv(cache, path)
        self._restore(cache, path)
        self.seconds["restore"] += time.perf_counter() - start

    def _gather_kv(self, cache: CacheProtocol, path: Sequence[int]) -> None:
        """Keep the committed KV rows and those of ``path``'s nodes, moved together in path order."""
        c, rows = self._committed, np.asarray(path) + self._committed
        kept = {i: tuple(np.array(a[rows]) for a in cache.kv(i)) for i in self.config.attn_layers}
        cache.truncate(c, _relabel(cache, c))
        for i, (k, v) in kept.items():
            cache.append_kv(i, k, v)
        cache.advance(len(path))

    def _set(self, cache: CacheProtocol, path, states: dict, convs: dict) -> None:
        """The cache at committed + len(path) with these states (counted as one state write)."""
        n = self._committed + len(path)
        cache.truncate(n, checkpoint_at(self.config, n, states, convs))
        self._state_traffic += self._ckpt_bytes

    def _move_kv_only(self, cache: CacheProtocol, path) -> None:
        """The cache at committed + len(path), its state slot left as it is."""
        n = self._committed + len(path)
        cache.truncate(n, _relabel(cache, n))

    @abstractmethod
    def _save(self, view: VerifyView, captures: dict) -> None: ...

    @abstractmethod
    def _restore(self, cache: CacheProtocol, path: list[int]) -> None: ...

    def finish(self, cache: CacheProtocol) -> None:
        """At the end of a request: the cache holds its true state (lazy strategies write it back)."""

    def close(self) -> None:
        """Give back every scratch page (the strategy cannot be used afterwards)."""

    def __repr__(self) -> str:
        return f"{type(self).__name__}(k={self.k}, max_nodes={self.max_nodes})"


class TrimOnly(Rollback):
    """WRONG on purpose: truncate the KV, keep the states the whole window went into.

    This is what a ``trim()`` that only knows KV caches does to a recurrent cache: the
    states are labelled as if they had seen ``keep`` positions, but they absorbed all of
    them, rejected drafts included. Correct only when every draft was accepted. Chains only.
    """

    name = "none"

    def _save(self, view: VerifyView, captures: dict) -> None:
        if not self._window.is_chain:
            raise ValueError("TrimOnly: a tree verify keeps no final state to trim to")
        self._view = view

    def _restore(self, cache: CacheProtocol, path: list[int]) -> None:
        n = self._committed + len(path)
        cache.truncate(n, self._view.verified_checkpoint(n))


class StepSlotsRollback(Rollback):
    """A strategy that fills one scratch slot per verified position at every ``save`` and frees
    them after ``restore``. What a slot holds is the subclass's: its ``_layout`` and the
    ``_arrays`` it packs from a verify (snapshots hold states, replay holds records)."""

    def __init__(self, config: ModelConfig, pool: PagePool, k: int, owner=None, *,
                 max_nodes=None) -> None:
        super().__init__(config, pool, k, owner, max_nodes=max_nodes)
        self.layout = self._layout(config)
        self._slots: ScratchSlots | None = None

    @abstractmethod
    def _layout(self, config: ModelConfig): ...

    @abstractmethod
    def _arrays(self, view: VerifyView, captures: dict) -> dict: ...

    def scratch_pages(self, page_bytes: int) -> int:
        return self.max_nodes * -(-self.layout.nbytes // page_bytes)

    @property
    def held_bytes(self) -> int:
        return 0 if self._slots is None else self._slots.nbytes

    def _live_slots(self) -> list:
        return [self._slots]

    def _save(self, view: VerifyView, captures: dict) -> None:
        n = self._n
        self._slots = ScratchSlots(self.pool, self.layout, n, owner=self.owner)
        self._slots.write(np.arange(n), self.layout.pack(self._arrays(view, captures), n))

    def close(self) -> None:
        self._free_slots(self._slots)
        self._slots = None


class SnapshotRollback(StepSlotsRollback):
    """SGLang's copy-back: every KDA and conv state after each verified position, in scratch;
    the accepted one copied back into the request's state.

    A GPU verify kernel writes these states as it passes each position (SGLang's
    ``intermediate_state_cache``; on a tree, each node from its parent's state). Our verify
    is the chunked (output-only) kernel, so ``save`` recomputes them node by node from the
    committed state and the captured inputs -- the same arithmetic as decoding. Per step
    it moves n + 2 states: n written, one read and one written back.
    """

    name = "snapshot"

    def _layout(self, config: ModelConfig):
        return checkpoint_layout(config)

    def _arrays(self, view: VerifyView, captures: dict) -> dict:
        return snapshot_arrays(self.config, view.base, captures, self._window)

    def _restore(self, cache: CacheProtocol, path: list[int]) -> None:
        chosen = self.layout.unpack(self._slots.read(path[-1]))
        self._set(cache, path, {i: chosen["state", i][0] for i in self.config.kda_layers},
                  {i: chosen["conv", i][0] for i in self.config.kda_layers})
        self.close()
