"""Verify: the k+1 window in one chunked forward, from the committed state; greedy acceptance.

The target model reads the window ``[last committed token, d_1 .. d_k]`` through a
:class:`VerifyView` of the request's cache: its KV goes into the request's cache (a KV
cache can always be truncated later), but the KDA and conv states the verify produces
land in the view, so the request's own states stay *committed* -- at the position before
the window -- until a rollback strategy decides where they go. (A GPU verify kernel does
the same: it reads the committed state and writes its results elsewhere.)
"""

from __future__ import annotations

from types import MappingProxyType

import numpy as np

from kimilab.model import CacheProtocol, Model, StateCheckpoint

__all__ = ["KVDelegate", "VerifyView", "verify", "greedy_accept", "state_steps", "conv_after"]


class KVDelegate(CacheProtocol):
    """A view of a request's cache (``base``) whose KV reads, appends and ``advance`` go to the
    request; where its states come from is the subclass's."""

    def __init__(self, cache: CacheProtocol) -> None:
        super().__init__(cache.config)
        self.base = cache
        self._seq_len = cache.seq_len

    def append_kv(self, i: int, k: np.ndarray, v: np.ndarray) -> None:
        self.base.append_kv(i, k, v)

    def kv(self, i: int) -> tuple[np.ndarray, np.ndarray]:
        return self.base.kv(i)

    def advance(self, n: int) -> None:
        self.base.advance(n)
        self._seq_len = self.base.seq_len

    def _kv_length(self, i: int) -> int:
        return int(self.base.kv(i)[0].shape[0])


class VerifyView(KVDelegate):
    """A request's cache as a verify pass sees it: KV is the request's, new states are the view's.

    Reads of a state return the view's copy if the verify wrote one, else the request's
    committed state; ``advance`` advances the request's cache (its KV grew). The view
    itself cannot truncate, clone or free the request: roll back the request's cache.
    """

    def __init__(self, cache: CacheProtocol) -> None:
        if not isinstance(cache, CacheProtocol) or isinstance(cache, VerifyView):
            raise ValueError(f"cache: expected a request's CacheProtocol, got {type(cache).__name__}")
        super().__init__(cache)
        self.committed = cache.seq_len  # the position the request's states stand at
        self._kda: dict[int, np.ndarray] = {}
        self._conv: dict[int, np.ndarray] = {}

    def kda_state(self, i: int) -> np.ndarray:
        i = self._layer(i, "kda_state")
        return self._kda[i] if i in self._kda else self.base.kda_state(i)

    def set_kda_state(self, i: int, state: np.ndarray) -> None:
        i, state = self._checked_state(i, state, "kda_state")
        self._kda[i] = np.array(state, dtype=self.dtype, copy=True)

    def conv_state(self, i: int) -> np.ndarray:
        i = self._layer(i, "conv_state")
        return self._conv[i] if i in self._conv else self.base.conv_state(i)

    def set_conv_state(self, i: int, conv: np.ndarray) -> None:
        i, conv = self._checked_state(i, conv, "conv_state")
        self._conv[i] = np.array(conv, dtype=self.dtype, copy=True)

    def _drop_kv_after(self, n: int) -> None:
        raise TypeError("VerifyView cannot truncate: roll back the request's cache (view.base)")

    def _release(self) -> None:
        self._kda, self._conv = {}, {}

    def nbytes_by_kind(self) -> dict[str, int]:
        """Bytes the view holds itself (the verify's own states), not the request's."""
        return {"kv": 0, "kda_state": int(sum(a.nbytes for a in self._kda.values())),
                "conv_state": int(sum(a.nbytes for a in self._conv.values()))}

    def clone(self):
        raise TypeError("VerifyView cannot be cloned: clone the request's cache (view.base)")

    def verified_checkpoint(self, seq_len: int) -> StateCheckpoint:
        """The verify's final states labelled as position ``seq_len`` -- correct only if every
        verified token is kept (used to demonstrate the broken no-rollback "trim")."""
        return StateCheckpoint(self.config, seq_len, MappingProxyType(dict(self._kda)),
                               MappingProxyType(dict(self._conv)))


def verify(model: Model, window: list[int],
           cache: CacheProtocol) -> tuple[np.ndarray, dict, VerifyView]:
    """Run ``window`` through ``model`` in one chunked forward on top of ``cache``.

    Returns (logits [len(window), vocab], the capture dict {KDA layer: KDACapture}, the
    view). Afterwards the cache holds the window's KV (seq_len grew by len(window)) and
    its committed KDA/conv states, untouched.
    """
    view = VerifyView(cache)
    captures: dict = {}
    logits = model.prefill(window, view, capture=captures)
    return logits, captures, view


def greedy_accept(drafts: list[int], logits: np.ndarray) -> tuple[int, int]:
    """(j, next token): the drafts d_1..d_j the target agrees with, and its own token after them.

    Row t of ``logits`` predicts the token after window position t; draft d_{t+1} is
    accepted while it equals that argmax. The target's token at the first mismatch (or
    after the last draft) comes free with the same forward.
    """
    targets = np.argmax(logits, axis=-1)
    j = 0
    while j < len(drafts) and int(drafts[j]) == int(targets[j]):
        j += 1
    return j, int(targets[j])


def state_steps(state: np.ndarray, k: np.ndarray, v: np.ndarray, g: np.ndarray, beta: np.ndarray,
                every: bool = False) -> np.ndarray:
    """The KDA state after running tokens k, g [T, H, K], v [T, H, V], beta [T, H] from ``state``.

    The state half of :func:`kimilab.kda.kda_update` (the output read is not needed to
    go back), token by token: decay each key-row, then the delta-rule correction.
    ``every=True`` returns the state after every token, [T, H, K, V].
    """
    S = np.array(state, copy=True)
    decay = np.exp(g)
    out = np.empty((len(k),) + S.shape, dtype=S.dtype) if every else None
    for t in range(len(k)):
        S *= decay[t][:, :, None]
        kS = np.matmul(k[t][:, None, :], S)[:, 0, :]  # S^T k  [H, V]
        S += (beta[t][:, None] * k[t])[:, :, None] * (v[t] - kS)[:, None, :]
        if every:
            out[t] = S
    return out if every else S


def conv_after(conv_state: np.ndarray, conv_inputs: np.ndarray, n: int) -> np.ndarray:
    """The conv state after the first ``n`` of ``conv_inputs`` [T, C]: the last W-1 raw inputs."""
    rows = np.concatenate([conv_state, conv_inputs[:n]], axis=0)
    return rows[rows.shape[0] - conv_state.shape[0]:].copy()
