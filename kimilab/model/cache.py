"""The per-request cache of a hybrid model: the cache protocol, and its contiguous implementation.

A request running through a hybrid model holds three kinds of memory
(``kimilab.config.CACHE_KINDS``):

* ``kv``          — for every global-attention layer, the keys and values of every
                    token so far. Append-only; grows with the context.
* ``kda_state``   — for every KDA layer, one H x K x V matrix. Fixed size; every
                    token *overwrites* it.
* ``conv_state``  — for every KDA layer, the last (kernel - 1) inputs of the short
                    causal convolution. Fixed size; a rolling window.

The model talks to a cache only through :class:`CacheProtocol`: read and write each
layer's part, ``advance`` once per model call, ``truncate`` to roll back. The base
class holds the checks every cache shares (layer lookup, shapes, advance
consistency, checkpoint validation), so an implementation only stores bytes:
:class:`HybridCache` in contiguous numpy arrays here, ``PagedHybridCache`` on pool
pages (:mod:`kimilab.pool.paged_cache`). :class:`StateCheckpoint` freezes the
fixed-size part (KDA + conv states at one position): a prefix cache resumes from
it, and ``truncate`` needs one, because a state cannot un-absorb tokens.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from types import MappingProxyType
from typing import Mapping

import numpy as np

from kimilab.config import ModelConfig
from kimilab.ops.attention import KVCache
from kimilab.validate import check_int

__all__ = ["CacheProtocol", "HybridCache", "StateCheckpoint", "check_runnable_config", "check_checkpoint"]


def _readonly(a: np.ndarray) -> np.ndarray:
    view = a.view()
    view.flags.writeable = False
    return view


def _frozen_copy(a: np.ndarray, dtype) -> np.ndarray:
    out = np.array(a, dtype=dtype, copy=True)
    out.flags.writeable = False
    return out


def check_runnable_config(config) -> None:
    """Raise ValueError unless ``config`` is a ModelConfig the numpy model can run."""
    if not isinstance(config, ModelConfig):
        raise ValueError(f"config: expected a kimilab.config.ModelConfig, got {type(config).__name__}")
    if config.shapes_only:
        raise ValueError(
            f"config={config.name!r} is shapes only (shapes_only=True): it feeds the analytic "
            "cost model (kimilab.costs), no arrays can be built for it; use config.tiny"
        )
    if config.attn_kind == "mla":
        raise ValueError(
            "config.attn_kind='mla': the runnable cache stores per-head K and V; "
            "use attn_kind 'mha' or 'gqa' (MLA is modelled analytically in kimilab.costs)"
        )


def _state_shapes(config: ModelConfig) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """(KDA state shape [H, K, V], conv state shape [W-1, C]) of one KDA layer."""
    return ((config.n_heads, config.head_dim, config.head_dim),
            (config.conv_kernel - 1, config.conv_channels))


@dataclass(frozen=True)
class StateCheckpoint:
    """Copies of every KDA state and conv state of one request at ``seq_len``.

    This is the fixed-size part of the cache. Together with the KV of the first
    ``seq_len`` tokens (which the KV cache already keeps, append-only) it is
    everything needed to continue the request from that position.
    """

    config: ModelConfig
    seq_len: int
    kda_states: Mapping[int, np.ndarray]  # layer -> [H, K, V]
    conv_states: Mapping[int, np.ndarray]  # layer -> [W-1, C]

    @property
    def nbytes(self) -> int:
        return int(sum(a.nbytes for a in self.kda_states.values()) +
                   sum(a.nbytes for a in self.conv_states.values()))

    def __repr__(self) -> str:
        return (f"StateCheckpoint(config={self.config.name!r}, seq_len={self.seq_len}, "
                f"layers={len(self.kda_states)}, nbytes={self.nbytes})")


def check_checkpoint(config: ModelConfig, ckpt, name: str = "ckpt") -> None:
    """ValueError naming ``name`` unless ``ckpt`` is a StateCheckpoint of ``config``'s shapes."""
    if not isinstance(ckpt, StateCheckpoint):
        raise ValueError(f"{name}: expected a StateCheckpoint, got {type(ckpt).__name__}")
    if ckpt.config != config:
        raise ValueError(f"{name}.config={ckpt.config.name!r} does not match config={config.name!r}")
    if set(ckpt.kda_states) != set(config.kda_layers) or set(ckpt.conv_states) != set(config.kda_layers):
        raise ValueError(f"{name}: expected states for KDA layers {config.kda_layers}")
    state_shape, conv_shape = _state_shapes(config)
    for i in config.kda_layers:
        for what, a, shape in (("kda_states", ckpt.kda_states[i], state_shape),
                               ("conv_states", ckpt.conv_states[i], conv_shape)):
            if np.shape(a) != shape:
                raise ValueError(f"{name}.{what}[{i}]: expected shape {list(shape)}, got {list(np.shape(a))}")


def _check_kv_rows(config: ModelConfig, kv, seq_len: int) -> dict:
    """``kv`` as a dict, or ValueError unless it maps global layers to (K, V) of ``seq_len`` rows."""
    kv = dict(kv or {})
    extra = set(kv) - set(config.attn_layers)
    if extra:
        raise ValueError(f"kv: layers {sorted(extra)} are not global layers {config.attn_layers}")
    for i in config.attn_layers:
        if i not in kv and seq_len:
            raise ValueError(f"kv: missing (K, V) for global layer {i} (needed for {seq_len} tokens)")
        if i in kv and (np.shape(kv[i][0])[0] != seq_len or np.shape(kv[i][1])[0] != seq_len):
            raise ValueError(f"kv[{i}]: expected {seq_len} rows (ckpt.seq_len), "
                             f"got K {np.shape(kv[i][0])[0]}, V {np.shape(kv[i][1])[0]}")
    return kv


class CacheProtocol(ABC):
    """What the model reads and writes for one request, and the checks every cache shares.

    Per KDA layer ``i``: ``kda_state(i)`` / ``set_kda_state(i, S)`` ([H, K, V]) and
    ``conv_state(i)`` / ``set_conv_state(i, c)`` ([W-1, C]). Per global layer:
    ``append_kv(i, k, v)`` and ``kv(i)`` (everything cached). Then, once per model
    call, ``advance(n)``. ``truncate(n, checkpoint)`` rolls back to position n;
    ``checkpoint()`` / ``from_checkpoint`` freeze and resume; ``free()`` releases.

    A subclass stores the bytes: it implements the abstract methods, using
    :meth:`_layer`, :meth:`_checked_state` and :meth:`_checked_kv` for the checks.
    """

    _freed_error: type[Exception] = RuntimeError

    def __init__(self, config: ModelConfig) -> None:
        check_runnable_config(config)
        self.config = config
        self.dtype = np.dtype(config.dtype)
        self._state_shape, self._conv_shape = _state_shapes(config)
        self._hkv, self._dk = config.attn_kv_heads_eff, config.attn_head_dim_eff
        self._dv = self._dk
        self._seq_len = 0
        self._freed = False

    # ----- shared checks ------------------------------------------------------
    def _live(self) -> None:
        if self._freed:
            raise self._freed_error(f"{type(self).__name__}: this cache was freed; it holds nothing any more")

    def _layer(self, i, what: str) -> int:
        """``i`` as an int if it is a layer holding ``what`` ("kv" or a state kind), else ValueError."""
        self._live()
        layers = self.config.attn_layers if what == "kv" else self.config.kda_layers
        if isinstance(i, bool) or not isinstance(i, (int, np.integer)) or int(i) not in layers:
            kind = "global-attention" if what == "kv" else "KDA"
            raise ValueError(f"layer i={i!r} is not a {kind} layer of {self.config.name!r}; "
                             f"{kind} layers are {tuple(sorted(layers))}")
        return int(i)

    def _checked_state(self, i, value, what: str) -> tuple[int, np.ndarray]:
        """(layer, array) for ``set_kda_state`` / ``set_conv_state``, shapes checked."""
        i = self._layer(i, what)
        value = np.asarray(value)
        shape, arg, dims = ((self._state_shape, "state", "[H, K, V]") if what == "kda_state"
                            else (self._conv_shape, "conv", "[W-1, C]"))
        if value.shape != shape:
            raise ValueError(f"set_{what}(i={i}, {arg}): expected shape {dims} = "
                             f"{list(shape)}, got {list(value.shape)}")
        return i, value

    def _checked_kv(self, i, k, v) -> tuple[int, np.ndarray, np.ndarray]:
        """(layer, k, v) for ``append_kv``: k [T, Hkv, Dk], v [T, Hkv, Dv] in the cache dtype."""
        i = self._layer(i, "kv")
        k, v = np.asarray(k, dtype=self.dtype), np.asarray(v, dtype=self.dtype)
        hkv, dk, dv = self._hkv, self._dk, self._dv
        if k.ndim != 3 or k.shape[1:] != (hkv, dk):
            raise ValueError(f"append_kv(i={i}, k): expected shape [T, Hkv, Dk] = "
                             f"[T, {hkv}, {dk}], got {list(k.shape)}")
        if v.shape != (k.shape[0], hkv, dv):
            raise ValueError(f"append_kv(i={i}, v): expected shape [T, Hkv, Dv] = "
                             f"[{k.shape[0]}, {hkv}, {dv}], got {list(v.shape)}")
        return i, k, v

    # ----- what each cache stores ---------------------------------------------------
    @abstractmethod
    def kda_state(self, i: int) -> np.ndarray:
        """Recurrent state [H, K, V] of KDA layer ``i`` (read-only)."""

    @abstractmethod
    def set_kda_state(self, i: int, state: np.ndarray) -> None: ...

    @abstractmethod
    def conv_state(self, i: int) -> np.ndarray:
        """Conv rolling state [W-1, C] of KDA layer ``i`` (previous inputs, oldest first; read-only)."""

    @abstractmethod
    def set_conv_state(self, i: int, conv: np.ndarray) -> None: ...

    @abstractmethod
    def append_kv(self, i: int, k: np.ndarray, v: np.ndarray) -> None:
        """Append keys k [T, Hkv, Dk] and values v [T, Hkv, Dv] to global layer ``i``."""

    @abstractmethod
    def kv(self, i: int) -> tuple[np.ndarray, np.ndarray]:
        """Everything cached for global layer ``i``: (K [L, Hkv, Dk], V [L, Hkv, Dv]), read-only."""

    @abstractmethod
    def _kv_length(self, i: int) -> int:
        """KV rows global layer ``i`` holds."""

    @abstractmethod
    def _drop_kv_after(self, n: int) -> None:
        """Keep only the first ``n`` KV rows of every global layer (all or nothing)."""

    @abstractmethod
    def _release(self) -> None:
        """Drop (or give back) everything held; called once by :meth:`free`."""

    @abstractmethod
    def nbytes_by_kind(self) -> dict[str, int]:
        """Bytes held per kind of ``kimilab.config.CACHE_KINDS`` (used KV rows, exact states)."""

    @abstractmethod
    def clone(self) -> "CacheProtocol":
        """A deep copy: continuing either one never affects the other."""

    # ----- shared behaviour -------------------------------------------------------
    @property
    def seq_len(self) -> int:
        """Tokens already absorbed by every layer."""
        return self._seq_len

    @property
    def nbytes(self) -> int:
        return int(sum(self.nbytes_by_kind().values()))

    def advance(self, n: int) -> None:
        """Record that ``n`` more tokens went through every layer (called once per model call)."""
        self._live()
        n = check_int("n", n, 0)
        new = self._seq_len + n
        for i in self.config.attn_layers:
            if self._kv_length(i) != new:
                raise ValueError(
                    f"advance(n={n}): global layer {i} holds {self._kv_length(i)} KV rows but seq_len "
                    f"would become {new}; append_kv for every global layer before advancing"
                )
        self._seq_len = new

    def truncate(self, n: int, checkpoint: StateCheckpoint | None = None) -> None:
        """Roll back to position ``n``: drop every global layer's KV past n, set ``seq_len = n``.

        KV rows are simply forgotten. A KDA state cannot un-absorb tokens, so when
        ``n < seq_len`` and the model has KDA layers, ``checkpoint`` must be a
        :class:`StateCheckpoint` taken at ``seq_len == n``; its states are restored.
        Afterwards the cache equals one that never went past n. Nothing changes if
        an argument is refused.
        """
        self._live()
        n = check_int("n", n, 0)
        if n > self._seq_len:
            raise ValueError(f"n={n}: expected n <= seq_len={self._seq_len} (truncate only drops tokens)")
        if checkpoint is None:
            if n < self._seq_len and self.config.kda_layers:
                raise ValueError(
                    f"checkpoint=None: truncating from seq_len={self._seq_len} to n={n} needs a "
                    f"StateCheckpoint taken at seq_len == {n} (a KDA state cannot un-absorb tokens)")
        else:
            check_checkpoint(self.config, checkpoint, "checkpoint")
            if checkpoint.seq_len != n:
                raise ValueError(f"checkpoint.seq_len={checkpoint.seq_len}: expected a checkpoint "
                                 f"taken at seq_len == n={n}")
        self._drop_kv_after(n)
        if checkpoint is not None:
            self._restore_states(checkpoint)
        self._seq_len = n

    def _restore_states(self, ckpt: StateCheckpoint) -> None:
        for i in self.config.kda_layers:
            self.set_kda_state(i, ckpt.kda_states[i])
            self.set_conv_state(i, ckpt.conv_states[i])

    def checkpoint(self) -> StateCheckpoint:
        """Freeze copies of every KDA and conv state at the current position."""
        self._live()
        layers = self.config.kda_layers
        return StateCheckpoint(
            config=self.config,
            seq_len=self._seq_len,
            kda_states=MappingProxyType({i: _frozen_copy(self.kda_state(i), self.dtype) for i in layers}),
            conv_states=MappingProxyType({i: _frozen_copy(self.conv_state(i), self.dtype) for i in layers}),
        )

    @classmethod
    def from_checkpoint(cls, config: ModelConfig, ckpt: StateCheckpoint,
                        kv: Mapping[int, tuple[np.ndarray, np.ndarray]] | None = None, **storage):
        """A cache positioned at ``ckpt.seq_len``: states from ``ckpt``, KV rows from ``kv``.

        ``kv`` maps every global layer to its (K, V) for the first ``ckpt.seq_len``
        tokens (may be omitted when ``ckpt.seq_len == 0`` or there are no global
        layers). ``storage`` goes to the constructor (e.g. ``pool=`` for a paged cache).
        """
        check_checkpoint(config, ckpt, "ckpt")
        kv = _check_kv_rows(config, kv, ckpt.seq_len)
        out = cls(config, **storage)
        try:
            out._restore_states(ckpt)
            for i, (k, v) in kv.items():
                out.append_kv(i, k, v)
        except BaseException:
            out.free()
            raise
        out._seq_len = ckpt.seq_len
        return out

    def free(self) -> None:
        """Release everything this cache holds; it cannot be used afterwards."""
        self._live()
        self._release()
        self._freed = True

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        if not self._freed:
            self.free()


def _copy_kv(buf: KVCache) -> KVCache:
    out = KVCache(buf.n_kv_heads, buf.head_dim, buf.value_dim, dtype=buf.dtype,
                  capacity=max(buf.length, 1))
    if buf.length:
        out.append(buf.keys.copy(), buf.values.copy())
    return out


class HybridCache(CacheProtocol):
    """Contiguous per-request cache: KV per global layer, KDA + conv state per KDA layer.

    States start at zero (an empty request). Arrays are stored in the config's
    compute dtype; ``nbytes`` counts exactly what is held (used KV rows, not
    spare capacity). ``kv(i)`` returns views, valid until the next ``truncate``.
    """

    def __init__(self, config: ModelConfig) -> None:
        super().__init__(config)
        self._kda = {i: np.zeros(self._state_shape, dtype=self.dtype) for i in config.kda_layers}
        self._conv = {i: np.zeros(self._conv_shape, dtype=self.dtype) for i in config.kda_layers}
        self._kv = {i: KVCache(self._hkv, self._dk, self._dv, dtype=self.dtype) for i in config.attn_layers}

    # ----- KDA layers -----------------------------------------------------
    def kda_state(self, i: int) -> np.ndarray:
        """Recurrent state [H, K, V] of KDA layer ``i`` (read-only view)."""
        return _readonly(self._kda[self._layer(i, "kda_state")])

    def set_kda_state(self, i: int, state: np.ndarray) -> None:
        i, state = self._checked_state(i, state, "kda_state")
        self._kda[i] = np.array(state, dtype=self.dtype, copy=True)

    def conv_state(self, i: int) -> np.ndarray:
        """Conv rolling state [W-1, C] of KDA layer ``i`` (previous inputs, oldest first)."""
        return _readonly(self._conv[self._layer(i, "conv_state")])

    def set_conv_state(self, i: int, conv: np.ndarray) -> None:
        i, conv = self._checked_state(i, conv, "conv_state")
        self._conv[i] = np.array(conv, dtype=self.dtype, copy=True)

    # ----- global layers --------------------------------------------------
    def append_kv(self, i: int, k: np.ndarray, v: np.ndarray) -> None:
        """Append keys k [T, Hkv, Dk] and values v [T, Hkv, Dv] to global layer ``i``."""
        i, k, v = self._checked_kv(i, k, v)
        self._kv[i].append(k, v)

    def kv(self, i: int) -> tuple[np.ndarray, np.ndarray]:
        """Everything cached for global layer ``i``: (K [L, Hkv, Dk], V [L, Hkv, Dv]), read-only."""
        buf = self._kv[self._layer(i, "kv")]
        return buf.keys, buf.values

    def _kv_length(self, i: int) -> int:
        return self._kv[i].length

    def _drop_kv_after(self, n: int) -> None:
        for buf in self._kv.values():
            buf.truncate(min(n, buf.length))

    def _release(self) -> None:
        self._kda, self._conv, self._kv = {}, {}, {}

    # ----- sizes and copies ------------------------------------------------
    def nbytes_by_kind(self) -> dict[str, int]:
        return {
            "kv": int(sum(b.nbytes for b in self._kv.values())),
            "kda_state": int(sum(a.nbytes for a in self._kda.values())),
            "conv_state": int(sum(a.nbytes for a in self._conv.values())),
        }

    def clone(self) -> "HybridCache":
        """A deep copy: continuing either one never affects the other."""
        self._live()
        out = HybridCache.__new__(HybridCache)
        out.__dict__.update(self.__dict__)
        out._kda = {i: a.copy() for i, a in self._kda.items()}
        out._conv = {i: a.copy() for i, a in self._conv.items()}
        out._kv = {i: _copy_kv(b) for i, b in self._kv.items()}
        return out

    def __repr__(self) -> str:
        b = self.nbytes_by_kind()
        return (f"HybridCache(config={self.config.name!r}, seq_len={self._seq_len}, "
                f"kv={b['kv']} B, kda_state={b['kda_state']} B, conv_state={b['conv_state']} B)")
