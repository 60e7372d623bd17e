"""FLOPs of prefill and decode for any config, and what a cached prefix saves.

Weight matmuls cost 2 FLOPs per activated parameter per token. Global attention adds
its (query, key) pairs, so prefill grows with the cached prefix and decode with the
context. KDA (``kimilab.kda``'s counters) and the short convolution cost the same per
token at any context: the state carries the past. :class:`CacheCosts` memoises
:func:`prefill_flops` for one model, which a prefix-cache simulation calls per request.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import cached_property

from kimilab.config import ModelConfig
from kimilab.costs._check import check_config
from kimilab.costs.cache_bytes import checkpoint_bytes, kv_bytes_per_token
from kimilab.costs.hardware import WeightModel, weight_model
from kimilab.kda import chunk_kda_flops, recurrent_kda_flops
from kimilab.ops.attention import causal_pairs
from kimilab.validate import check_int

__all__ = ["linear_flops_per_token", "prefill_flops", "decode_flops_per_token", "CacheCosts"]


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
    check_config(cfg)
    n_new = check_int("n_new", n_new, 0, unit="tokens")
    n_cached = check_int("n_cached", n_cached, 0, unit="tokens")
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
    check_config(cfg)
    L = check_int("context_len", context_len, 0, unit="tokens")
    total = linear_flops_per_token(cfg)
    total += len(cfg.attn_layers) * (L + 1) * _decode_key_flops(cfg)
    per_kda = recurrent_kda_flops(1, cfg.n_heads, cfg.head_dim, cfg.head_dim)
    per_kda += 2 * cfg.conv_kernel * cfg.conv_channels
    total += len(cfg.kda_layers) * per_kda
    return int(total)


@dataclass(frozen=True)
class CacheCosts:
    """What caching costs and saves for one model: bytes per KV token, per checkpoint, FLOPs."""

    config: ModelConfig
    kv_bytes_per_token: int
    checkpoint_bytes: int

    _cold: dict = field(default_factory=dict, compare=False, repr=False)  # n_new -> prefill_flops(n_new)

    @classmethod
    def of(cls, config: ModelConfig) -> "CacheCosts":
        return cls(config, kv_bytes_per_token(config), checkpoint_bytes(config))

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
