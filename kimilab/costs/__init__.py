"""Analytic memory, FLOP and decode-time model for any ModelConfig (numbers only, no arrays).

Three kinds of per-request cache, named as the cache protocol names them:

- ``"kv"``: global-attention layers store, per token, K and V for every KV head
  (MHA/GQA) or one MLA latent plus its decoupled rope key (MLA). Grows with context.
- ``"kda_state"``: every KDA layer holds one H x K x V state matrix. Fixed size.
- ``"conv_state"``: every KDA layer keeps the last (kernel - 1) inputs of its short
  convolution over q, k and v. Fixed size.

The decode model is a roofline: a decode step reads the weights it uses once (shared by
the whole batch) plus every request's cache, and takes max(bytes / bandwidth,
FLOPs / peak). The hardware numbers below are ASSUMPTIONS (an H800-class accelerator),
named so a reader can change them; nothing here was measured on a GPU.
"""

from __future__ import annotations

from dataclasses import dataclass

from kimilab.ops.attention import causal_pairs
from kimilab.config import ModelConfig
from kimilab.kda import chunk_kda_flops, recurrent_kda_flops

__all__ = [
    "Accelerator", "Deployment", "WeightModel",
    "H800_CLASS", "HBM_BANDWIDTH_BYTES_PER_S", "HBM_CAPACITY_BYTES", "PEAK_BF16_FLOPS_PER_S",
    "DEFAULT_DEPLOYMENT", "PUBLISHED_WEIGHTS", "KINDS",
    "kv_bytes_per_token_layer", "kv_bytes_per_token", "kda_state_bytes_per_layer",
    "kda_state_bytes", "conv_state_bytes_per_layer", "conv_state_bytes", "checkpoint_bytes",
    "request_bytes", "request_total_bytes", "cache_anatomy",
    "estimate_params", "weight_model", "weight_bytes", "weight_bytes_read",
    "linear_flops_per_token",
    "prefill_flops", "decode_flops_per_token",
    "decode_step_bytes", "decode_bytes_per_token", "decode_step_seconds", "max_batch",
    "DecodePoint", "decode_point", "hybrid_vs_baseline_report",
]

KINDS = ("kv", "kda_state", "conv_state")

# ----- hardware assumptions ----------------------------------------------------
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
        if not isinstance(self.n_devices, int) or isinstance(self.n_devices, bool) or self.n_devices < 1:
            raise ValueError(f"Deployment.n_devices={self.n_devices!r}: expected a positive int")

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


# ----- weights -----------------------------------------------------------------

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
        batch = _check_int("batch", batch, 1)
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
    _check_cfg(cfg)
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
    _check_cfg(cfg)
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


# ----- cache bytes ---------------------------------------------------------------

def _check_cfg(cfg) -> ModelConfig:
    if not isinstance(cfg, ModelConfig):
        raise ValueError(f"cfg: expected a kimilab.config.ModelConfig, got {type(cfg).__name__}")
    return cfg


def _check_int(name: str, value, minimum: int) -> int:
    if isinstance(value, bool) or not hasattr(value, "__index__"):
        raise ValueError(f"{name}: expected an int >= {minimum} (tokens), got {value!r}")
    value = value.__index__()
    if value < minimum:
        raise ValueError(f"{name}: expected an int >= {minimum} (tokens), got {value!r}")
    return value


def kv_bytes_per_token_layer(cfg: ModelConfig) -> int:
    """Bytes one global layer stores per token (K+V, or MLA latent + rope key)."""
    return _check_cfg(cfg).kv_elems_per_token_layer * cfg.kv_bytes


def kv_bytes_per_token(cfg: ModelConfig) -> int:
    """KV bytes per token summed over all global-attention layers."""
    return len(_check_cfg(cfg).attn_layers) * kv_bytes_per_token_layer(cfg)


def kda_state_bytes_per_layer(cfg: ModelConfig) -> int:
    """Bytes of one KDA layer's H x K x V state at ``state_bytes`` per element."""
    return _check_cfg(cfg).kda_state_elems_layer * cfg.state_bytes


def kda_state_bytes(cfg: ModelConfig) -> int:
    """Recurrent-state bytes of one request, all KDA layers (independent of context)."""
    return len(_check_cfg(cfg).kda_layers) * kda_state_bytes_per_layer(cfg)


def conv_state_bytes_per_layer(cfg: ModelConfig) -> int:
    return _check_cfg(cfg).conv_state_elems_layer * cfg.conv_bytes


def conv_state_bytes(cfg: ModelConfig) -> int:
    """Conv rolling-state bytes of one request, all KDA layers (independent of context)."""
    return len(_check_cfg(cfg).kda_layers) * conv_state_bytes_per_layer(cfg)


def checkpoint_bytes(cfg: ModelConfig) -> int:
    """Bytes of one state checkpoint: every KDA state plus every conv state."""
    return kda_state_bytes(cfg) + conv_state_bytes(cfg)


def request_bytes(cfg: ModelConfig, context_len: int) -> dict[str, int]:
    """Cache bytes of one request holding ``context_len`` tokens, by kind (keys as ``KINDS``)."""
    L = _check_int("context_len", context_len, 0)
    return {"kv": L * kv_bytes_per_token(cfg), "kda_state": kda_state_bytes(cfg),
            "conv_state": conv_state_bytes(cfg)}


def request_total_bytes(cfg: ModelConfig, context_len: int) -> int:
    return sum(request_bytes(cfg, context_len).values())


def cache_anatomy(cfg: ModelConfig) -> list[dict]:
    """One row per cache kind: layers holding it, bytes per layer (per token if it grows)."""
    _check_cfg(cfg)
    rows = [
        {"kind": "kv", "layers": len(cfg.attn_layers), "bytes_per_layer": kv_bytes_per_token_layer(cfg),
         "grows_with_context": True, "unit": "per token"},
        {"kind": "kda_state", "layers": len(cfg.kda_layers), "bytes_per_layer": kda_state_bytes_per_layer(cfg),
         "grows_with_context": False, "unit": "per request"},
        {"kind": "conv_state", "layers": len(cfg.kda_layers), "bytes_per_layer": conv_state_bytes_per_layer(cfg),
         "grows_with_context": False, "unit": "per request"},
    ]
    return [r for r in rows if r["layers"]]


# ----- FLOPs -------------------------------------------------------------------

def linear_flops_per_token(cfg: ModelConfig, weights: WeightModel | None = None) -> int:
    """Weight matmuls per token: 2 FLOPs per activated parameter (projections, MLP/experts, head)."""
    w = weights or weight_model(cfg)
    return int(round(2 * w.active_params))


def _prefill_pair_flops(cfg: ModelConfig) -> int:
    """FLOPs per (query, key) pair per global layer in prefill form (scores + mixing)."""
    H, D = cfg.attn_heads_eff, cfg.attn_head_dim_eff
    if cfg.attn_kind == "mla":  # decompressed heads: q.k over nope + rope dims, values D
        return 2 * H * (D + cfg.qk_rope_head_dim + D)
    return 2 * H * (D + D)


def _decode_key_flops(cfg: ModelConfig) -> int:
    """FLOPs per cached key per global layer for one decoded query."""
    H = cfg.attn_heads_eff
    if cfg.attn_kind == "mla":  # absorbed form: scores over latent + rope, mixing over latent
        r = cfg.kv_lora_rank
        return 2 * H * (r + cfg.qk_rope_head_dim + r)
    return _prefill_pair_flops(cfg)


def prefill_flops(cfg: ModelConfig, n_new: int, n_cached: int = 0) -> int:
    """FLOPs to prefill ``n_new`` tokens on top of ``n_cached`` already-cached ones.

    Weights: linear in n_new. Global attention: n_new * n_cached + n_new (n_new + 1) / 2
    pairs per layer. KDA: ``kda.chunk_kda_flops`` (chunk ``cfg.chunk_size``), linear in
    n_new and free of n_cached (the state carries the past). Conv: 2 * kernel * channels per token.
    """
    _check_cfg(cfg)
    n_new = _check_int("n_new", n_new, 0)
    n_cached = _check_int("n_cached", n_cached, 0)
    if n_new == 0:
        return 0
    total = n_new * linear_flops_per_token(cfg)
    total += len(cfg.attn_layers) * causal_pairs(n_new, n_cached + n_new) * _prefill_pair_flops(cfg)
    K = cfg.head_dim
    kda = chunk_kda_flops(n_new, cfg.n_heads, K, K, chunk=cfg.chunk_size)
    conv = 2 * cfg.conv_kernel * cfg.conv_channels * n_new
    total += len(cfg.kda_layers) * (kda + conv)
    return int(total)


def decode_flops_per_token(cfg: ModelConfig, context_len: int) -> int:
    """FLOPs to decode one token with ``context_len`` tokens already cached (recurrent KDA)."""
    _check_cfg(cfg)
    L = _check_int("context_len", context_len, 0)
    total = linear_flops_per_token(cfg)
    total += len(cfg.attn_layers) * (L + 1) * _decode_key_flops(cfg)
    per_kda = recurrent_kda_flops(1, cfg.n_heads, cfg.head_dim, cfg.head_dim)
    per_kda += 2 * cfg.conv_kernel * cfg.conv_channels
    total += len(cfg.kda_layers) * per_kda
    return int(total)


# ----- roofline decode -----------------------------------------------------------

def decode_step_bytes(cfg: ModelConfig, context_len: int, batch: int = 1,
                      weights: WeightModel | None = None) -> int:
    """Bytes one decode step reads: the weights it touches once, plus each request's cache.

    Writes (one new KV entry, the updated states) are left out; they are small beside the
    reads at long context.
    """
    batch = _check_int("batch", batch, 1)
    return weight_bytes_read(cfg, batch, weights) + batch * request_total_bytes(cfg, context_len)


def decode_bytes_per_token(cfg: ModelConfig, context_len: int, batch: int = 1,
                           weights: WeightModel | None = None) -> float:
    """Bytes read per decoded token: a step's bytes shared by the ``batch`` tokens it makes."""
    return decode_step_bytes(cfg, context_len, batch, weights) / batch


def decode_step_seconds(cfg: ModelConfig, context_len: int, batch: int = 1,
                        deployment: Deployment = DEFAULT_DEPLOYMENT,
                        weights: WeightModel | None = None) -> float:
    """Roofline time of one decode step = each request's TPOT: max(bytes/BW, FLOPs/peak)."""
    step_bytes = decode_step_bytes(cfg, context_len, batch, weights)
    step_flops = batch * decode_flops_per_token(cfg, context_len)
    return max(step_bytes / deployment.bandwidth, step_flops / deployment.peak_flops)


def max_batch(cfg: ModelConfig, context_len: int, deployment: Deployment = DEFAULT_DEPLOYMENT,
              weights: WeightModel | None = None) -> int:
    """Requests of ``context_len`` tokens whose caches fit beside the weights (0 if none)."""
    free = deployment.hbm_bytes - weight_bytes(cfg, weights)
    per_request = request_total_bytes(cfg, context_len)
    if free <= 0 or per_request <= 0:
        return 0
    return int(free // per_request)


@dataclass(frozen=True)
class DecodePoint:
    """One decode operating point of the roofline model."""

    batch: int
    step_bytes: int
    step_seconds: float  # = TPOT seen by each request

    @property
    def seconds_per_token(self) -> float:
        """Step time shared by the batch's tokens (inverse throughput)."""
        return self.step_seconds / self.batch

    @property
    def tokens_per_second(self) -> float:
        return self.batch / self.step_seconds


def decode_point(cfg: ModelConfig, context_len: int, batch: int | None = None,
                 deployment: Deployment = DEFAULT_DEPLOYMENT,
                 weights: WeightModel | None = None) -> DecodePoint:
    """The roofline at ``batch`` (default: the largest batch that fits; ValueError if none)."""
    if batch is None:
        batch = max_batch(cfg, context_len, deployment, weights)
        if batch < 1:
            raise ValueError(
                f"context_len={context_len}: not one request of {cfg.name} fits in "
                f"{deployment.hbm_bytes / 1e9:.0f} GB beside the weights; pass a larger deployment")
    return DecodePoint(batch, decode_step_bytes(cfg, context_len, batch, weights),
                       decode_step_seconds(cfg, context_len, batch, deployment, weights))


def hybrid_vs_baseline_report(hybrid: ModelConfig, baseline: ModelConfig,
                              contexts=(131072, 1048576),
                              deployment: Deployment = DEFAULT_DEPLOYMENT) -> list[str]:
    """Lines comparing cache bytes and roofline decode of two configs (used by ``__main__``)."""
    lines = []
    for L in contexts:
        h, b = request_total_bytes(hybrid, L), request_total_bytes(baseline, L)
        lines.append(f"context {L:>8d}: cache {h / 1e9:7.2f} GB vs {b / 1e9:7.2f} GB per request, "
                     f"ratio {h / b:.4f} ({1 - h / b:.1%} less)")
        h1, b1 = decode_point(hybrid, L, 1, deployment), decode_point(baseline, L, 1, deployment)
        lines.append(f"  batch 1: TPOT {h1.step_seconds * 1e3:.3f} ms vs {b1.step_seconds * 1e3:.3f} ms "
                     f"-> {b1.step_seconds / h1.step_seconds:.2f}x")
        hb, bb = decode_point(hybrid, L, None, deployment), decode_point(baseline, L, None, deployment)
        lines.append(f"  largest batch that fits: {hb.batch} vs {bb.batch}; time per token "
                     f"{hb.seconds_per_token * 1e3:.3f} ms vs {bb.seconds_per_token * 1e3:.3f} ms "
                     f"-> {bb.seconds_per_token / hb.seconds_per_token:.2f}x "
                     f"(per-request step {hb.step_seconds * 1e3:.1f} vs {bb.step_seconds * 1e3:.1f} ms)")
    return lines


if __name__ == "__main__":
    from kimilab.config import all_mla_27, kimi_linear_48b

    print(f"assumed device: {DEFAULT_DEPLOYMENT.n_devices} x {H800_CLASS.name}: "
          f"{H800_CLASS.hbm_bytes / 1e9:.0f} GB at {H800_CLASS.hbm_bandwidth / 1e12:.2f} TB/s each")
    for line in hybrid_vs_baseline_report(kimi_linear_48b, all_mla_27):
        print(line)
