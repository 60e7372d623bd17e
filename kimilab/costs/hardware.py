"""Devices, links and weights: the parts a :class:`~kimilab.costs.deployment.Deployment` is built from.

An :class:`Accelerator` is one device (HBM capacity, HBM bandwidth, dense bf16 peak
FLOP/s): vendor data-sheet figures taken as given, never measured here. A :class:`Link`
is what connects devices: per-collective latency and algorithm bandwidth, fitted in
:mod:`kimilab.costs.calibration` from Vidur's measured NVLink all-reduces. A
:class:`~kimilab.config.WeightModel` (carried by the config, ``cfg.weights``) says how many
parameters a model has and how many a step over B tokens touches (mixture of experts:
the union of the routed experts the batch picks).
"""

from __future__ import annotations

from dataclasses import dataclass

from kimilab.config import ModelConfig, WeightModel
from kimilab.costs._check import check_config

__all__ = [
    "Accelerator", "H800", "H200", "H20", "A100", "CPU", "Link", "NVLINK_H100", "INFINIBAND_NDR", "LOOPBACK",
    "WeightModel", "estimate_params", "mixer_params", "weight_model",
]


@dataclass(frozen=True)
class Accelerator:
    """One device: HBM capacity (bytes), HBM bandwidth (bytes/s), dense bf16 peak FLOP/s."""

    name: str
    hbm_bytes: float
    hbm_bandwidth: float
    peak_flops: float
    source: str = ""


H800 = Accelerator("H800 (H100-SXM class)", 80e9, 3.35e12, 989e12,
                   source="NVIDIA H100 SXM data sheet (the H800 has the same HBM3 and FLOPs, a narrower NVLink)")
H200 = Accelerator("H200 SXM", 141e9, 4.8e12, 989e12, source="NVIDIA H200 data sheet: 141 GB HBM3e at 4.8 TB/s")
H20 = Accelerator("H20", 96e9, 4.0e12, 148e12, source="NVIDIA H20 data sheet: 96 GB HBM3 at 4.0 TB/s, 148 TFLOP/s")
A100 = Accelerator("A100 SXM 80GB", 80e9, 2.039e12, 312e12,
                   source="NVIDIA A100 data sheet: 80 GB HBM2e at 2,039 GB/s, 312 TFLOP/s dense bf16")
# The machine the reduced model runs on: its bytes are what the tests measure, its times are never modelled.
CPU = Accelerator("this CPU", 0.0, 1.0, 1.0, source="the reduced model's arrays (bytes only)")


@dataclass(frozen=True)
class Link:
    """How devices talk: ``latency`` seconds per collective plus bytes / ``bandwidth``.

    ``bandwidth`` is the algorithm ("bus") bandwidth of a ring collective, so an all-reduce
    of m bytes over n devices takes latency + 2 (n - 1) / n * m / bandwidth.
    """

    name: str
    bandwidth: float
    latency: float
    source: str = ""

    def all_reduce_seconds(self, nbytes: float, n: int) -> float:
        """One all-reduce of ``nbytes`` over ``n`` devices (0 on one device)."""
        if n <= 1 or nbytes <= 0:
            return 0.0
        return self.latency + 2.0 * (n - 1) / n * nbytes / self.bandwidth

    def all_to_all_seconds(self, nbytes: float, n: int) -> float:
        """One all-to-all in which each device sends ``nbytes`` spread over the others."""
        if n <= 1 or nbytes <= 0:
            return 0.0
        return self.latency + (n - 1) / n * nbytes / self.bandwidth

    def send_seconds(self, nbytes: float) -> float:
        """One point-to-point message."""
        return self.latency + nbytes / self.bandwidth if nbytes > 0 else 0.0


# Fitted to Vidur's measured 4- and 8-GPU all-reduce medians on an H100 DGX (NVSwitch),
# 2 KB to 64 MB (kimilab.costs.calibration.fit_link reproduces the numbers; a test checks).
NVLINK_H100 = Link("NVLink/NVSwitch (H100 DGX)", 350e9, 30e-6,
                   source="fit to Vidur's H100 DGX all-reduce medians (data/calibration/vidur_h100_all_reduce.csv)")
# Between nodes: one 400 Gb/s NDR InfiniBand port per GPU (an assumption: data-sheet rate, a
# typical per-message latency); used only when a deployment spans nodes.
INFINIBAND_NDR = Link("InfiniBand NDR 400 Gb/s per GPU", 50e9, 10e-6, source="assumed: NDR data-sheet rate")
LOOPBACK = Link("one device (no link)", float("inf"), 0.0, source="nothing to send")


def _mixer_layer_params(cfg: ModelConfig) -> tuple[int, int]:
    """(params of one KDA layer, params of one global-attention layer), from shapes."""
    d, H, K = cfg.d_model, cfg.n_heads, cfg.head_dim
    kda_layer = (3 * d * H * K + H * K * d  # q, k, v, o
                 + cfg.conv_channels * cfg.conv_kernel  # depthwise conv
                 + d * H  # beta
                 + d * K + K * H * K + H + H * K  # low-rank gate, A_log, dt_bias
                 + d * H * K + K)  # output gate, per-head norm
    Ha, Hkv, Da = cfg.attn_heads_eff, cfg.attn_kv_heads_eff, cfg.attn_head_dim_eff
    if cfg.attn_kind == "mla":
        r, rope = cfg.kv_lora_rank, cfg.qk_rope_head_dim
        attn_layer = d * Ha * (Da + rope) + d * (r + rope) + r * Ha * 2 * Da + Ha * Da * d + r
    else:
        attn_layer = d * Ha * Da + 2 * d * Hkv * Da + Ha * Da * d
    return kda_layer, attn_layer


def mixer_params(cfg: ModelConfig) -> int:
    """Parameters of the token mixers (every KDA and global-attention layer), from shapes.

    These are what DP-attention replicates on every device. An estimate (projections, conv,
    gates, norms as :func:`estimate_params` counts them), also for the 48B shapes.
    """
    check_config(cfg)
    kda_layer, attn_layer = _mixer_layer_params(cfg)
    return int(len(cfg.kda_layers) * kda_layer + len(cfg.attn_layers) * attn_layer)


def estimate_params(cfg: ModelConfig) -> int:
    """Dense parameter count estimated from shapes (embeddings, untied head, layers, SwiGLU MLP).

    Used only for runnable configs without a weight model (e.g. ``tiny``); the runnable
    model's exact count may differ by small terms (norm weights, biases).
    """
    check_config(cfg)
    d = cfg.d_model
    total = 2 * cfg.vocab_size * d + d  # embedding, output head, final norm
    mlp = 3 * d * cfg.mlp_hidden + 2 * d  # SwiGLU + two norms
    return int(total + mixer_params(cfg) + cfg.n_layers * mlp)


def weight_model(cfg: ModelConfig) -> WeightModel:
    """The config's own weight model (``cfg.weights``), else a dense estimate for a runnable config.

    A shapes-only config without one raises: its MLP (a mixture of experts at 48B) is not
    in the shapes, so an estimate would silently miss most of the weights.
    """
    check_config(cfg)
    if cfg.weights is not None:
        return cfg.weights
    if cfg.shapes_only:
        raise ValueError(
            f"cfg={cfg.name!r} is shapes only and has no weight model: its MLP/experts are not in "
            "the shapes; give it one, e.g. cfg.with_(weights=kimilab.config.WeightModel(total, active, ...))")
    n = float(estimate_params(cfg))
    return WeightModel(n, n, bytes_per_param=cfg.itemsize, source="estimated from shapes (dense)")
