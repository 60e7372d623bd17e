"""Cheaper state checkpoints: the bytes of a cached state at a lower precision, and the rounding itself.

A prefix cache may keep its checkpoints at a lower precision than the running state,
because a cached state is read once, on a hit, and then decoding goes on at full
precision: the only error is one rounding of the state.

* ``"native"``: the model's own widths (Kimi-Linear-48B: fp32 KDA states, bf16 conv windows).
* ``"bf16"``: the KDA states rounded to bfloat16 (round to nearest even); conv windows native.
* ``"int8"``: SGLang's scheme (``srt/mem_cache/mamba_checkpoint_pool.py``): each KDA state
  stored as int8 with one symmetric scale per (head, key channel) -- the maximum of ``|S|`` over
  the value axis divided by 127, kept in the state's own dtype -- and the conv window at its
  native dtype; dequantised once on a hit.

:func:`checkpoint_bytes` prices a checkpoint on one device of a deployment (the heads it
holds), from the same per-layer functions as :func:`kimilab.costs.checkpoint_bytes`;
:func:`round_state` applies the rounding to a state array (chapter 6 measures what it costs).
"""

from __future__ import annotations

import numpy as np

from kimilab.config import ModelConfig
from kimilab.costs import Deployment, conv_state_bytes_per_layer, kda_state_bytes_per_layer
from kimilab.costs.parallel import state_heads_per_device
from kimilab.validate import check_choice

__all__ = ["PRECISIONS", "checkpoint_bytes", "round_state", "to_bf16", "int8_quantize", "int8_dequantize"]

PRECISIONS = ("native", "bf16", "int8")
_QMAX = 127


def checkpoint_bytes(cfg: ModelConfig, deployment: Deployment, precision: str = "native") -> int:
    """Bytes of one checkpoint (every KDA state and conv window) on one device, at ``precision``."""
    check_choice("precision", precision, PRECISIONS)
    conv = conv_state_bytes_per_layer(cfg, deployment)
    if precision == "native":
        state = kda_state_bytes_per_layer(cfg, deployment)
    else:
        heads, _ = state_heads_per_device(cfg, deployment)
        elems = heads * cfg.head_dim * cfg.head_dim
        if precision == "bf16":
            state = 2 * elems
        else:  # one int8 per element, one scale per (head, key channel) in the state's dtype
            state = elems + heads * cfg.head_dim * cfg.state_bytes
    return len(cfg.kda_layers) * (state + conv)


def to_bf16(x: np.ndarray) -> np.ndarray:
    """``x`` rounded to bfloat16 (the top 16 bits of a float32, round to nearest even), as float64."""
    bits = np.asarray(x, dtype=np.float32).view(np.uint32).astype(np.uint64)
    bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000
    return bits.astype(np.uint32).view(np.float32).astype(np.float64)


def int8_quantize(state: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """A KDA state ``[..., H, K, V]`` as (int8 values, scales ``[..., H, K, 1]``): symmetric, one scale
    per (head, key channel) over the value axis, the scale rounded to float32 before dividing
    (as SGLang's ``Int8CheckpointStore.quantize``, whose d_v axis is our V)."""
    s = np.asarray(state, dtype=np.float64)
    amax = np.maximum(np.abs(s).max(axis=-1, keepdims=True), 1e-8)
    scale = (amax / _QMAX).astype(np.float32).astype(np.float64)
    q = np.clip(np.rint(s / scale), -_QMAX, _QMAX).astype(np.int8)
    return q, scale


def int8_dequantize(q: np.ndarray, scale: np.ndarray) -> np.ndarray:
    return q.astype(np.float64) * scale


def round_state(state: np.ndarray, precision: str) -> np.ndarray:
    """What a checkpoint at ``precision`` gives back on a hit. ``"native"`` is float32 here: the
    48B model's KDA states are fp32 (the reduced model computes in float64)."""
    check_choice("precision", precision, PRECISIONS)
    if precision == "native":
        return np.asarray(state, dtype=np.float32).astype(np.float64)
    if precision == "bf16":
        return to_bf16(state)
    return int8_dequantize(*int8_quantize(state))
