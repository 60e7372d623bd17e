"""Where KDA's per-channel decay ``g`` and write strength ``beta`` come from.

A KDA layer projects each token to a raw gate ``[H, K]`` and a raw ``beta`` logit
``[H]``. :func:`kda_gate` turns the raw gate into natural-log decays ``g <= 0`` with a
per-head scale ``exp(A_log[h])`` and a per-channel bias (Kimi Linear's softplus gate);
:func:`kda_gate_lowerbound` is the bounded variant that keeps every ``g`` in
``(lower_bound, 0)``. ``beta = sigmoid(logit)``. q and k are L2-normalised
(:func:`l2_normalize`) before they reach the kernels. All of these are elementwise and
follow the input's dtype; the formulas match flash-linear-attention's naive gates.
"""

from __future__ import annotations

import numpy as np

from kimilab.kda._inputs import float_array

__all__ = ["l2_normalize", "softplus", "sigmoid", "kda_gate", "kda_gate_lowerbound", "beta_from_logits"]


def l2_normalize(x, eps: float = 1e-6) -> np.ndarray:
    """``x / sqrt(sum(x**2) + eps)`` over the last axis (how KDA normalises q and k)."""
    x = float_array("x", x)
    return x / np.sqrt(np.sum(x * x, axis=-1, keepdims=True) + eps)


def softplus(x) -> np.ndarray:
    """``log(1 + exp(x))`` without overflow."""
    return np.logaddexp(0.0, x).astype(np.asarray(x).dtype, copy=False)


def sigmoid(x) -> np.ndarray:
    """``1 / (1 + exp(-x))`` without overflow for large ``|x|``."""
    x = np.asarray(x)
    e = np.exp(-np.abs(x))
    return np.where(x >= 0, 1.0 / (1.0 + e), e / (1.0 + e)).astype(x.dtype, copy=False)


def _gate_params(raw, A_log, dt_bias, *, allow_no_A: bool):
    raw = float_array("raw", raw)
    if raw.ndim < 2:
        raise ValueError(f"raw: expected [..., H, K], got shape {raw.shape}")
    H, K = raw.shape[-2:]
    A = None
    if A_log is not None:
        A = float_array("A_log", A_log)
        if A.size != H or A.ndim > 2:
            raise ValueError(f"A_log: expected [H] with H={H} (from raw [..., H={H}, K={K}]), got shape {A.shape}")
        A = A.reshape(H, 1).astype(raw.dtype)
    elif not allow_no_A:
        raise ValueError(f"A_log: expected [H] with H={H}, got None")
    x = raw
    if dt_bias is not None:
        bias = float_array("dt_bias", dt_bias)
        if bias.shape not in ((H * K,), (H, K)):
            raise ValueError(
                f"dt_bias: expected [H*K]={H * K} or [H, K]=({H}, {K}) (from raw [..., H={H}, K={K}]), "
                f"got shape {bias.shape}"
            )
        x = raw + bias.reshape(H, K).astype(raw.dtype)
    return x, A


def kda_gate(raw, A_log, dt_bias=None) -> np.ndarray:
    """Softplus gate ``g = -exp(A_log[h]) * softplus(raw + dt_bias)`` (natural-log decay, <= 0).

    raw ``[..., H, K]`` (the low-rank gate projection of x), A_log ``[H]``,
    dt_bias ``[H*K]`` or ``[H, K]`` (optional). Output dtype follows ``raw``.
    """
    x, A = _gate_params(raw, A_log, dt_bias, allow_no_A=False)
    return (-np.exp(A) * softplus(x)).astype(x.dtype, copy=False)


def kda_gate_lowerbound(raw, A_log, dt_bias=None, lower_bound: float = -5.0) -> np.ndarray:
    """Bounded gate ``g = lower_bound * sigmoid(exp(A_log[h]) * (raw + dt_bias))``, in (lb, 0).

    ``A_log`` may be None (then no per-head scale). ``lower_bound`` in [-5, 0).
    """
    lb = float(lower_bound)
    if not -5.0 <= lb < 0.0:
        raise ValueError(f"lower_bound: expected a float in [-5, 0), got {lower_bound!r}")
    x, A = _gate_params(raw, A_log, dt_bias, allow_no_A=True)
    if A is not None:
        x = np.exp(A) * x
    return (lb * sigmoid(x)).astype(x.dtype, copy=False)


def beta_from_logits(b) -> np.ndarray:
    """Delta-rule strength ``beta = sigmoid(b)`` in (0, 1)."""
    return sigmoid(float_array("b", b))
