"""Short causal depthwise convolution and its rolling state.

Every KDA layer passes its q, k and v projections through a tiny convolution
along time (kernel 4): channel c of the output at step t mixes channel c of the
inputs at steps t-3..t. To continue a sequence later, a request must keep the
last ``W - 1`` inputs — the *conv state*, a second small fixed-size cache beside
the KDA state matrix.

Conventions: x [T, C]; weight [C, W] where ``weight[:, W-1]`` multiplies the
current input and ``weight[:, 0]`` the oldest; state [W-1, C] holds the previous
inputs, oldest first (zeros at the start of a request).
"""

from __future__ import annotations

import numpy as np

__all__ = ["causal_conv1d", "causal_conv1d_step"]


def _check(x: np.ndarray, weight: np.ndarray, state, x_ndim: int, fn: str):
    x, weight = np.asarray(x), np.asarray(weight)
    layout = "[T, C]" if x_ndim == 2 else "[C]"
    if x.ndim != x_ndim:
        raise ValueError(f"{fn}(x): expected layout {layout}, got shape {list(x.shape)}")
    C = x.shape[-1]
    if weight.ndim != 2 or weight.shape[0] != C or weight.shape[1] < 1:
        raise ValueError(f"{fn}(weight): expected shape [C, W] with C={C}, got {list(weight.shape)}")
    W = weight.shape[1]
    dtype = np.result_type(x, weight)
    if state is None:
        state = np.zeros((W - 1, C), dtype=dtype)
    else:
        state = np.asarray(state)
        if state.shape != (W - 1, C):
            raise ValueError(f"{fn}(state): expected shape [W-1, C] = [{W - 1}, {C}], "
                             f"got {list(state.shape)}")
    return x, weight, state.astype(dtype, copy=False), W, dtype


def causal_conv1d(x: np.ndarray, weight: np.ndarray, state: np.ndarray | None = None):
    """Depthwise causal conv over a whole sequence.

    Returns (y [T, C], new_state [W-1, C]); new_state is the last W-1 inputs
    (from ``state`` if the sequence is shorter), so chunks can be chained exactly.
    """
    x, weight, state, W, dtype = _check(x, weight, state, 2, "causal_conv1d")
    T = x.shape[0]
    padded = np.concatenate([state, x.astype(dtype, copy=False)], axis=0)  # [W-1+T, C]
    y = np.zeros((T, x.shape[1]), dtype=dtype)
    for tap in range(W):  # W is 4: a loop over taps, each a whole-array multiply-add
        y += weight[:, tap] * padded[tap: tap + T]
    new_state = padded[padded.shape[0] - (W - 1):].copy()
    return y, new_state


def causal_conv1d_step(x_t: np.ndarray, weight: np.ndarray, state: np.ndarray | None = None):
    """One decode step: x_t [C] -> (y_t [C], new_state [W-1, C]). Twin of :func:`causal_conv1d`."""
    x_t, weight, state, W, dtype = _check(x_t, weight, state, 1, "causal_conv1d_step")
    window = np.concatenate([state, x_t[None, :].astype(dtype, copy=False)], axis=0)  # [W, C]
    y_t = np.einsum("cw,wc->c", weight, window)
    return y_t, window[1:].copy()
