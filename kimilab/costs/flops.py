"""FLOPs of prefill and decode for any config, and what a cached prefix saves.

Weight matmuls cost 2 FLOPs per activated parameter per token. Global attention adds
its (query, key) pairs, so prefill grows with the cached prefix and decode with the
context. KDA (``kimilab.kda``'s counters) and the short convolution cost the same per
token at any context: the state carries the past. FLOPs are work, the same on any
deployment; how they split over devices is :mod:`~kimilab.costs.parallel`'s business.
:class:`CacheCosts` memoises :func:`prefill_flops` for one model on one deployment (with the
bytes a cached block and a checkpoint take per device), which a prefix cache calls per request.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import cached_property

from kimilab.config import ModelConfig
from kimilab.costs._check import check_config
from kimilab.costs.cache_bytes import checkpoint_bytes, kv_bytes_per_token
from kimilab.costs.deployment import Deployment
from kimilab.costs.hardware import WeightModel, weight_model
from kimilab.kda import chunk_kda_flops, recurrent_kda_flops
from kimilab.ops.attention import causal_pairs
from kimilab.validate import check_int

__all__ = ["linear_flops_per_token", "prefill_flops", "attention_prefill_flops", "kda_prefill_flops",
           "mixer_prefill_flops", "decode_flops_per_token", "attention_decode_flops", "kda_decode_flops",
           "mixer_decode_flops", "CacheCosts"]


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


def attention_prefill_flops(cfg: ModelConfig, n_new: int, n_cached: int = 0) -> int:
    """Global attention's share of a prefill: n_new * n_cached + n_new (n_new + 1) / 2 (query,
    key) pairs per layer, scores and mixing."""
    check_config(cfg)
    n_new = check_int("n_new", n_new, 0, unit="tokens")
    n_cached = check_int("n_cached", n_cached, 0, unit="tokens")
    return len(cfg.attn_layers) * causal_pairs(n_new, n_cached + n_new) * _prefill_pair_flops(cfg) if n_new else 0


def kda_prefill_flops(cfg: ModelConfig, n_new: int) -> int:
    """KDA's and the short conv's share of a prefill: ``kda.chunk_kda_flops`` (chunk
    ``cfg.chunk_size``) plus 2 * kernel * channels per token, every KDA layer; linear in n_new
    and free of the cached prefix (the state carries the past)."""
    check_config(cfg)
    n_new = check_int("n_new", n_new, 0, unit="tokens")
    if not n_new or not cfg.kda_layers:
        return 0
    K = cfg.head_dim
    kda = chunk_kda_flops(n_new, cfg.n_heads, K, K, chunk=cfg.chunk_size)
    conv = 2 * cfg.conv_kernel * cfg.conv_channels * n_new
    return int(len(cfg.kda_layers) * (kda + conv))


def mixer_prefill_flops(cfg: ModelConfig, n_new: int, n_cached: int = 0) -> int:
    """The token mixers' share of :func:`prefill_flops` (no weights): attention plus KDA."""
    return attention_prefill_flops(cfg, n_new, n_cached) + kda_prefill_flops(cfg, n_new)


def prefill_flops(cfg: ModelConfig, n_new: int, n_cached: int = 0) -> int:
    """FLOPs to prefill ``n_new`` tokens on top of ``n_cached`` already-cached ones: the weight
    matmuls (linear in n_new) plus :func:`mixer_prefill_flops`."""
    n_new = check_int("n_new", n_new, 0, unit="tokens")
    if n_new == 0:
        return mixer_prefill_flops(cfg, 0, n_cached)
    return n_new * linear_flops_per_token(cfg) + mixer_prefill_flops(cfg, n_new, n_cached)


def attention_decode_flops(cfg: ModelConfig, n_requests: int, context_sum: int) -> int:
    """Global attention's FLOPs in one decode step of ``n_requests`` requests holding
    ``context_sum`` tokens in all: every cached key (and the new one) once per layer (absorbed MLA)."""
    check_config(cfg)
    n = check_int("n_requests", n_requests, 0)
    return int(len(cfg.attn_layers) * (context_sum + n) * _decode_key_flops(cfg))


def kda_decode_flops(cfg: ModelConfig, n_requests: int) -> int:
    """KDA's and the conv's FLOPs in one decode step: one recurrent step per request and layer."""
    check_config(cfg)
    n = check_int("n_requests", n_requests, 0)
    if not cfg.kda_layers:
        return 0
    per_kda = recurrent_kda_flops(1, cfg.n_heads, cfg.head_dim, cfg.head_dim) + 2 * cfg.conv_kernel * cfg.conv_channels
    return int(n * len(cfg.kda_layers) * per_kda)


def mixer_decode_flops(cfg: ModelConfig, n_requests: int, context_sum: int) -> int:
    """The mixers' FLOPs of one decode step (attention plus KDA)."""
    return attention_decode_flops(cfg, n_requests, context_sum) + kda_decode_flops(cfg, n_requests)


def decode_flops_per_token(cfg: ModelConfig, context_len: int) -> int:
    """FLOPs to decode one token with ``context_len`` tokens already cached (recurrent KDA)."""
    L = check_int("context_len", context_len, 0, unit="tokens")
    return linear_flops_per_token(cfg) + mixer_decode_flops(cfg, 1, L)


@dataclass(frozen=True)
class CacheCosts:
    """What caching costs and saves for one model on one deployment: bytes per KV token and
    per checkpoint on one device, and prefill FLOPs (memoised)."""

    config: ModelConfig
    deployment: Deployment
    kv_bytes_per_token: int
    checkpoint_bytes: int

    _cold: dict = field(default_factory=dict, compare=False, repr=False)  # n_new -> prefill_flops(n_new)

    @classmethod
    def of(cls, config: ModelConfig, deployment: Deployment) -> "CacheCosts":
        return cls(config, deployment, kv_bytes_per_token(config, deployment), checkpoint_bytes(config, deployment))

    @cached_property
    def pair_flops(self) -> int:
        """FLOPs one more cached token adds per new token (global attention, all layers)."""
        return prefill_flops(self.config, 1, 1) - prefill_flops(self.config, 1, 0)

    def prefill_flops(self, n_new: int, n_cached: int = 0) -> int:
        """:func:`prefill_flops`, memoised: cost(n, c) = cost(n, 0) + n * c * pair_flops.

        The cached prefix only adds attention pairs (n_new * n_cached of them); a
        test holds this equal to the direct call.
        """
        cold = self._cold.get(n_new)
        if cold is None:
            cold = self._cold[n_new] = prefill_flops(self.config, n_new, 0)
        return cold + (n_new * n_cached * self.pair_flops if n_cached and n_new else 0)

    def flops_saved(self, n_tokens: int, hit: int) -> int:
        """FLOPs a hit of ``hit`` tokens saves on an ``n_tokens`` prompt (vs a cold prefill)."""
        return self.prefill_flops(n_tokens) - self.prefill_flops(n_tokens - hit, hit)
