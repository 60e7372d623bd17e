"""The per-request cache of a hybrid model, and the protocol every cache implements.

A request running through a hybrid model holds three kinds of memory:

* ``kv``          — for every global-attention layer, the keys and values of every
                    token so far. Append-only; grows with the context.
* ``kda_state``   — for every KDA layer, one H x K x V matrix. Fixed size; every
                    token *overwrites* it.
* ``conv_state``  — for every KDA layer, the last (kernel - 1) inputs of the short
                    causal convolution. Fixed size; a rolling window.

The model talks to a cache only through the methods of :class:`HybridCache`
(the "cache protocol"), so a paged implementation (``kimilab.paged``) can stand
in for this contiguous one. :class:`StateCheckpoint` freezes the fixed-size part
(KDA + conv states at one position) so a prefix cache can resume from it.
"""

from __future__ import annotations

from dataclasses import dataclass
from types import MappingProxyType
from typing import Mapping

import numpy as np

from kimilab.ops.attention import KVCache
from kimilab.config import ModelConfig

__all__ = ["HybridCache", "StateCheckpoint", "CACHE_KINDS", "check_runnable_config"]

CACHE_KINDS = ("kv", "kda_state", "conv_state")


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
            "memory model (kimilab.memory), no arrays can be built for it; use config.tiny"
        )
    if config.attn_kind == "mla":
        raise ValueError(
            f"config.attn_kind='mla': the runnable cache stores per-head K and V; "
            "use attn_kind 'mha' or 'gqa' (MLA is modelled analytically in kimilab.memory)"
        )


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


def _copy_kv(buf: KVCache) -> KVCache:
    out = KVCache(buf.n_kv_heads, buf.head_dim, buf.value_dim, dtype=buf.dtype,
                  capacity=max(buf.length, 1))
    if buf.length:
        out.append(buf.keys.copy(), buf.values.copy())
    return out


class HybridCache:
    """Contiguous per-request cache: KV per global layer, KDA + conv state per KDA layer.

    States start at zero (an empty request). Arrays are stored in the config's
    compute dtype; ``nbytes`` counts exactly what is held (used KV rows, not
    spare capacity).
    """

    def __init__(self, config: ModelConfig) -> None:
        check_runnable_config(config)
        self.config = config
        self.dtype = np.dtype(config.dtype)
        self._seq_len = 0
        H, K = config.n_heads, config.head_dim
        W, C = config.conv_kernel, config.conv_channels
        self._kda = {i: np.zeros((H, K, K), dtype=self.dtype) for i in config.kda_layers}
        self._conv = {i: np.zeros((W - 1, C), dtype=self.dtype) for i in config.kda_layers}
        hkv, d = config.attn_kv_heads_eff, config.attn_head_dim_eff
        self._kv = {i: KVCache(hkv, d, d, dtype=self.dtype) for i in config.attn_layers}

    # ----- bookkeeping ----------------------------------------------------
    @property
    def seq_len(self) -> int:
        """Tokens already absorbed by every layer."""
        return self._seq_len

    def advance(self, n: int) -> None:
        """Record that ``n`` more tokens went through every layer (called once per model call)."""
        if not isinstance(n, (int, np.integer)) or isinstance(n, bool) or n < 0:
            raise ValueError(f"advance(n={n!r}): expected a non-negative int")
        new = self._seq_len + int(n)
        for i, buf in self._kv.items():
            if buf.length != new:
                raise ValueError(
                    f"advance(n={n}): global layer {i} holds {buf.length} KV rows but seq_len "
                    f"would become {new}; append_kv for every global layer before advancing"
                )
        self._seq_len = new

    def _layer(self, i, table: dict, what: str):
        if isinstance(i, bool) or not isinstance(i, (int, np.integer)) or int(i) not in table:
            kind = "KDA" if what != "kv" else "global-attention"
            raise ValueError(f"layer i={i!r} is not a {kind} layer of {self.config.name!r}; "
                             f"{kind} layers are {tuple(sorted(table))}")
        return int(i)

    # ----- KDA layers -----------------------------------------------------
    def kda_state(self, i: int) -> np.ndarray:
        """Recurrent state [H, K, V] of KDA layer ``i`` (read-only view)."""
        return _readonly(self._kda[self._layer(i, self._kda, "kda_state")])

    def set_kda_state(self, i: int, state: np.ndarray) -> None:
        i = self._layer(i, self._kda, "kda_state")
        state = np.asarray(state)
        if state.shape != self._kda[i].shape:
            raise ValueError(f"set_kda_state(i={i}, state): expected shape [H, K, V] = "
                             f"{list(self._kda[i].shape)}, got {list(state.shape)}")
        self._kda[i] = np.array(state, dtype=self.dtype, copy=True)

    def conv_state(self, i: int) -> np.ndarray:
        """Conv rolling state [W-1, C] of KDA layer ``i`` (previous inputs, oldest first)."""
        return _readonly(self._conv[self._layer(i, self._conv, "conv_state")])

    def set_conv_state(self, i: int, conv: np.ndarray) -> None:
        i = self._layer(i, self._conv, "conv_state")
        conv = np.asarray(conv)
        if conv.shape != self._conv[i].shape:
            raise ValueError(f"set_conv_state(i={i}, conv): expected shape [W-1, C] = "
                             f"{list(self._conv[i].shape)}, got {list(conv.shape)}")
        self._conv[i] = np.array(conv, dtype=self.dtype, copy=True)

    # ----- global layers --------------------------------------------------
    def append_kv(self, i: int, k: np.ndarray, v: np.ndarray) -> None:
        """Append keys k [T, Hkv, Dk] and values v [T, Hkv, Dv] to global layer ``i``."""
        i = self._layer(i, self._kv, "kv")
        buf = self._kv[i]
        k, v = np.asarray(k, dtype=self.dtype), np.asarray(v, dtype=self.dtype)
        hkv, dk, dv = buf.n_kv_heads, buf.head_dim, buf.value_dim
        if k.ndim != 3 or k.shape[1:] != (hkv, dk):
            raise ValueError(f"append_kv(i={i}, k): expected shape [T, Hkv, Dk] = "
                             f"[T, {hkv}, {dk}], got {list(k.shape)}")
        if v.shape != (k.shape[0], hkv, dv):
            raise ValueError(f"append_kv(i={i}, v): expected shape [T, Hkv, Dv] = "
                             f"[{k.shape[0]}, {hkv}, {dv}], got {list(v.shape)}")
        buf.append(k, v)

    def kv(self, i: int) -> tuple[np.ndarray, np.ndarray]:
        """Everything cached for global layer ``i``: (K [L, Hkv, Dk], V [L, Hkv, Dv]), read-only."""
        buf = self._kv[self._layer(i, self._kv, "kv")]
        return buf.keys, buf.values

    # ----- sizes ----------------------------------------------------------
    def nbytes_by_kind(self) -> dict[str, int]:
        return {
            "kv": int(sum(b.nbytes for b in self._kv.values())),
            "kda_state": int(sum(a.nbytes for a in self._kda.values())),
            "conv_state": int(sum(a.nbytes for a in self._conv.values())),
        }

    @property
    def nbytes(self) -> int:
        return int(sum(self.nbytes_by_kind().values()))

    # ----- copies ---------------------------------------------------------
    def clone(self) -> "HybridCache":
        """A deep copy: continuing either one never affects the other."""
        out = HybridCache.__new__(HybridCache)
        out.config, out.dtype, out._seq_len = self.config, self.dtype, self._seq_len
        out._kda = {i: a.copy() for i, a in self._kda.items()}
        out._conv = {i: a.copy() for i, a in self._conv.items()}
        out._kv = {i: _copy_kv(b) for i, b in self._kv.items()}
        return out

    def checkpoint(self) -> StateCheckpoint:
        """Freeze copies of every KDA and conv state at the current position."""
        return StateCheckpoint(
            config=self.config,
            seq_len=self._seq_len,
            kda_states=MappingProxyType({i: _frozen_copy(a, self.dtype) for i, a in self._kda.items()}),
            conv_states=MappingProxyType({i: _frozen_copy(a, self.dtype) for i, a in self._conv.items()}),
        )

    @classmethod
    def from_checkpoint(cls, config: ModelConfig, ckpt: StateCheckpoint,
                        kv: Mapping[int, tuple[np.ndarray, np.ndarray]] | None = None) -> "HybridCache":
        """A cache positioned at ``ckpt.seq_len``: states from ``ckpt``, KV rows from ``kv``.

        ``kv`` maps every global layer to its (K, V) for the first ``ckpt.seq_len``
        tokens (may be omitted when ``ckpt.seq_len == 0`` or there are no global layers).
        """
        if not isinstance(ckpt, StateCheckpoint):
            raise ValueError(f"ckpt: expected a StateCheckpoint, got {type(ckpt).__name__}")
        if ckpt.config != config:
            raise ValueError(f"ckpt.config={ckpt.config.name!r} does not match config={config.name!r}")
        out = cls(config)
        if set(ckpt.kda_states) != set(config.kda_layers) or set(ckpt.conv_states) != set(config.kda_layers):
            raise ValueError(f"ckpt: expected states for KDA layers {config.kda_layers}")
        for i in config.kda_layers:
            out.set_kda_state(i, ckpt.kda_states[i])
            out.set_conv_state(i, ckpt.conv_states[i])
        kv = dict(kv or {})
        extra = set(kv) - set(config.attn_layers)
        if extra:
            raise ValueError(f"kv: layers {sorted(extra)} are not global layers {config.attn_layers}")
        for i in config.attn_layers:
            if i not in kv:
                if ckpt.seq_len == 0:
                    continue
                raise ValueError(f"kv: missing (K, V) for global layer {i} "
                                 f"(needed for {ckpt.seq_len} tokens)")
            k, v = kv[i]
            if np.shape(k)[0] != ckpt.seq_len or np.shape(v)[0] != ckpt.seq_len:
                raise ValueError(f"kv[{i}]: expected {ckpt.seq_len} rows (ckpt.seq_len), "
                                 f"got K {np.shape(k)[0]}, V {np.shape(v)[0]}")
            out.append_kv(i, k, v)
        out._seq_len = ckpt.seq_len
        return out

    def __repr__(self) -> str:
        b = self.nbytes_by_kind()
        return (f"HybridCache(config={self.config.name!r}, seq_len={self._seq_len}, "
                f"kv={b['kv']} B, kda_state={b['kda_state']} B, conv_state={b['conv_state']} B)")
