"""The hardware and the weights a step must read: ASSUMED numbers, named so a reader can change them.

An :class:`Accelerator` is one device (HBM capacity, HBM bandwidth, peak FLOP/s); a
:class:`Deployment` is n of them serving one replica, with attention split by tensor
parallelism (``"tp"``) or data-parallel attention (``"dp"``). A
:class:`~kimilab.config.WeightModel` (carried by the config, ``cfg.weights``) says how
many parameters a model has and how many a step over B tokens touches (mixture of
experts: the union of the routed experts the batch picks). The hardware figures are
vendor data-sheet numbers for an H800-class accelerator taken as assumptions; nothing
here was measured on a GPU.
"""

from __future__ import annotations

from dataclasses import dataclass

from kimilab.config import WeightModel, ModelConfig, all_mla_27, gqa_8b, kimi_linear_48b
from kimilab.costs._check import check_config
from kimilab.validate import check_int

__all__ = [
    "HBM_CAPACITY_BYTES", "HBM_BANDWIDTH_BYTES_PER_S", "PEAK_BF16_FLOPS_PER_S",
    "Accelerator", "H800_CLASS", "Deployment", "DEFAULT_DEPLOYMENT",
    "WeightModel", "PUBLISHED_WEIGHTS", "estimate_params", "mixer_params", "weight_model", "weight_bytes",
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


_ATTENTION_MODES = ("tp", "dp")


@dataclass(frozen=True)
class Deployment:
    """n identical devices serving one model replica, and how attention is split over them.

    ``attention="tp"`` (tensor parallelism, vLLM's and SGLang's default with ``--tp n``):
    every layer is split by heads. KDA states and the conv state shard by head, GQA/MHA KV
    by KV head, but MLA has ONE latent KV head, so its latent cache is replicated on
    every rank. ``attention="dp"`` (DP-attention, vLLM/SGLang's data-parallel attention):
    each rank runs attention for its own requests and holds their whole caches, the
    attention and KDA weights are replicated, and the rest (experts, MLP, embeddings)
    is spread over the ranks. Idealised either way: weights not replicated are spread
    evenly, experts are read evenly, no activation or workspace reserve, no
    communication time. With one device the two modes are the same.
    """

    device: Accelerator = H800_CLASS
    n_devices: int = 1
    attention: str = "tp"

    def __post_init__(self) -> None:
        check_int("Deployment.n_devices", self.n_devices, 1)
        if self.attention not in _ATTENTION_MODES:
            raise ValueError(f"Deployment.attention={self.attention!r}: expected one of {_ATTENTION_MODES} "
                             "(tensor-parallel or data-parallel attention)")

    @property
    def hbm_bytes(self) -> float:
        return self.device.hbm_bytes * self.n_devices

    @property
    def bandwidth(self) -> float:
        return self.device.hbm_bandwidth * self.n_devices

    @property
    def peak_flops(self) -> float:
        return self.device.peak_flops * self.n_devices

    def with_attention(self, attention: str) -> "Deployment":
        """The same devices with attention split the other way (``"tp"`` or ``"dp"``)."""
        return Deployment(self.device, self.n_devices, attention)


# 48B of bf16 weights (96 GB) do not fit one 80 GB device, so the default is one
# 8-device node with tensor-parallel attention (an assumption; any n and mode work).
DEFAULT_DEPLOYMENT = Deployment(H800_CLASS, 8)


# Kept for callers that looked weights up by preset name; the weight model now lives on
# the config (``cfg.weights``), so a renamed copy keeps it. Not consulted by weight_model().
PUBLISHED_WEIGHTS: dict[str, WeightModel] = {
    "kimi_linear_48b": kimi_linear_48b.weights,
    "all_mla_27": all_mla_27.weights,
    "gqa_8b": gqa_8b.weights,
}


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

    These are what DP-attention replicates on every rank. An estimate (projections, conv,
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


def weight_bytes(cfg: ModelConfig, weights: WeightModel | None = None) -> int:
    """Bytes of all weights (what must fit in memory)."""
    w = weights or weight_model(cfg)
    return int(round(w.total_params * w.bytes_per_param))


def weight_bytes_read(cfg: ModelConfig, batch: int = 1, weights: WeightModel | None = None) -> int:
    """Weight bytes one step over ``batch`` tokens reads (active experts' union), whole replica."""
    w = weights or weight_model(cfg)
    return int(round(w.params_read(batch) * w.bytes_per_param))
