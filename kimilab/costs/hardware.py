"""The hardware and the weights a decode step must read: ASSUMED numbers, named so a reader can change them.

An :class:`Accelerator` is one device (HBM capacity, HBM bandwidth, peak FLOP/s); a
:class:`Deployment` is n of them serving one replica. A :class:`WeightModel` says how
many parameters a model has and how many a step over B tokens touches (mixture of
experts: the union of the routed experts the batch picks). The hardware figures are
vendor data-sheet numbers for an H800-class accelerator taken as assumptions; nothing
here was measured on a GPU.
"""

from __future__ import annotations

from dataclasses import dataclass

from kimilab.config import ModelConfig
from kimilab.costs._check import check_config
from kimilab.validate import check_int

__all__ = [
    "HBM_CAPACITY_BYTES", "HBM_BANDWIDTH_BYTES_PER_S", "PEAK_BF16_FLOPS_PER_S",
    "Accelerator", "H800_CLASS", "Deployment", "DEFAULT_DEPLOYMENT",
    "WeightModel", "PUBLISHED_WEIGHTS", "estimate_params", "weight_model", "weight_bytes",
    "weight_bytes_read",
]

# An H800/H100-SXM-class accelerator: 80 GB of HBM3 at ~3.35 TB/s, ~989 TFLOP/s dense
# bf16. These are vendor data-sheet figures taken as ASSUMPTIONS; real kernels reach
# only part of them, and we do not model the report's actual serving setup.
HBM_CAPACITY_BYTES = 80e9
HBM_BANDWIDTH_BYTES_PER_S = 3.35e12
PEAK_BF16_FLOPS_PER_S = 989e12


@dataclass(frozen=True)
class Accelerator:
    """One device: HBM capacity (bytes), HBM bandwidth (bytes/s), peak FLOP/s."""

    name: str
    hbm_bytes: float
    hbm_bandwidth: float
    peak_flops: float


H800_CLASS = Accelerator("H800-class (assumed)", HBM_CAPACITY_BYTES,
                         HBM_BANDWIDTH_BYTES_PER_S, PEAK_BF16_FLOPS_PER_S)


@dataclass(frozen=True)
class Deployment:
    """n identical devices serving one model replica, idealised: weights and caches spread
    evenly, bandwidth and FLOP/s add up, no activation or workspace reserve."""

    device: Accelerator = H800_CLASS
    n_devices: int = 1

    def __post_init__(self) -> None:
        check_int("Deployment.n_devices", self.n_devices, 1)

    @property
    def hbm_bytes(self) -> float:
        return self.device.hbm_bytes * self.n_devices

    @property
    def bandwidth(self) -> float:
        return self.device.hbm_bandwidth * self.n_devices

    @property
    def peak_flops(self) -> float:
        return self.device.peak_flops * self.n_devices


# 48B of bf16 weights (96 GB) do not fit one 80 GB device, so the default is one
# 8-device node (an assumption; any n works).
DEFAULT_DEPLOYMENT = Deployment(H800_CLASS, 8)


@dataclass(frozen=True)
class WeightModel:
    """Parameter counts that decide how many weight bytes a decode step reads.

    A mixture-of-experts model activates ``active_params`` per token; its routed experts
    (``n_routed_experts``, ``routed_top_k`` per token) hold the rest. With B tokens in a
    step, each routed expert is touched with probability 1 - (1 - k/E)^B (uniform routing,
    an assumption), so the bytes read grow from the active count at B = 1 towards all
    parameters at large B. Dense models (E = 0) read everything every step.
    """

    total_params: float
    active_params: float
    n_routed_experts: int = 0
    routed_top_k: int = 0
    bytes_per_param: int = 2
    source: str = ""

    def __post_init__(self) -> None:
        if not 0 < self.active_params <= self.total_params:
            raise ValueError(f"WeightModel.active_params={self.active_params!r}: expected 0 < active <= total")
        if self.n_routed_experts and not 0 < self.routed_top_k < self.n_routed_experts:
            raise ValueError(f"WeightModel.routed_top_k={self.routed_top_k!r}: expected 0 < k < n_routed_experts")

    @property
    def routed_params(self) -> float:
        """Parameters inside routed experts, from total = dense + R, active = dense + R k/E."""
        if not self.n_routed_experts:
            return 0.0
        frac = self.routed_top_k / self.n_routed_experts
        return (self.total_params - self.active_params) / (1.0 - frac)

    @property
    def dense_params(self) -> float:
        return self.total_params - self.routed_params

    def params_read(self, batch: int) -> float:
        """Expected distinct parameters one decode step over ``batch`` tokens touches."""
        batch = check_int("batch", batch, 1)
        if not self.n_routed_experts:
            return self.total_params
        miss = (1.0 - self.routed_top_k / self.n_routed_experts) ** batch
        return self.dense_params + self.routed_params * (1.0 - miss)


_KIMI_WEIGHTS = WeightModel(
    48e9, 3e9, n_routed_experts=256, routed_top_k=8, bytes_per_param=2,
    source="Kimi-Linear-48B-A3B: ~48B total, ~3B activated (tech report); 8 of 256 routed "
           "experts per token (public config, assumed); bf16",
)
# Published (or assumed) parameter counts by preset name. The all-MLA baseline differs only
# in its attention layers, so it is given the same weights (assumption).
PUBLISHED_WEIGHTS: dict[str, WeightModel] = {
    "kimi_linear_48b": _KIMI_WEIGHTS,
    "all_mla_27": WeightModel(48e9, 3e9, 256, 8, 2, source="assumed equal to kimi_linear_48b"),
    "gqa_8b": WeightModel(8.03e9, 8.03e9, bytes_per_param=2, source="Llama-3-8B-like dense, bf16"),
}


def estimate_params(cfg: ModelConfig) -> int:
    """Dense parameter count estimated from shapes (embeddings, untied head, layers, SwiGLU MLP).

    Used only for configs without a published count (e.g. ``tiny``); the runnable model's
    exact count may differ by small terms (norm weights, biases).
    """
    check_config(cfg)
    d, H, K = cfg.d_model, cfg.n_heads, cfg.head_dim
    total = 2 * cfg.vocab_size * d + d  # embedding, output head, final norm
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
    mlp = 3 * d * cfg.mlp_hidden + 2 * d  # SwiGLU + two norms
    total += len(cfg.kda_layers) * kda_layer + len(cfg.attn_layers) * attn_layer + cfg.n_layers * mlp
    return int(total)


def weight_model(cfg: ModelConfig) -> WeightModel:
    """Published counts for known presets (by name), else a dense estimate at the compute width."""
    check_config(cfg)
    if cfg.name in PUBLISHED_WEIGHTS:
        return PUBLISHED_WEIGHTS[cfg.name]
    n = float(estimate_params(cfg))
    return WeightModel(n, n, bytes_per_param=cfg.itemsize, source="estimated from shapes (dense)")


def weight_bytes(cfg: ModelConfig, weights: WeightModel | None = None) -> int:
    """Bytes of all weights (what must fit in memory)."""
    w = weights or weight_model(cfg)
    return int(round(w.total_params * w.bytes_per_param))


def weight_bytes_read(cfg: ModelConfig, batch: int = 1, weights: WeightModel | None = None) -> int:
    """Weight bytes one decode step over ``batch`` requests reads (active experts' union)."""
    w = weights or weight_model(cfg)
    return int(round(w.params_read(batch) * w.bytes_per_param))
