"""Bytes of the caches one request holds, by kind: the ONE place these sizes are computed.

The three kinds are :data:`kimilab.config.CACHE_KINDS`:

- ``"kv"``: global-attention layers store, per token, K and V for every KV head
  (MHA/GQA) or one MLA latent plus its decoupled key part (MLA: ``qk_rope_head_dim``
  dims; with Kimi Linear's ``mla_use_nope: true`` they are not rotated). Grows with context.
- ``"kda_state"``: every KDA layer holds one H x K x V state matrix. Fixed size.
- ``"conv_state"``: every KDA layer keeps the last (kernel - 1) inputs of its short
  convolution over q, k and v. Fixed size.

The functions answer "how many bytes"; :class:`CacheShapes` carries the same numbers
as one record for the page pool, built from the functions so they cannot disagree.
"""

from __future__ import annotations

from dataclasses import dataclass

from kimilab.config import ModelConfig
from kimilab.costs._check import check_config
from kimilab.validate import check_int

__all__ = [
    "kv_bytes_per_token_layer", "kv_bytes_per_token", "kda_state_bytes_per_layer",
    "kda_state_bytes", "conv_state_bytes_per_layer", "conv_state_bytes", "checkpoint_bytes",
    "request_bytes", "request_total_bytes", "crossover_tokens", "cache_anatomy", "CacheShapes",
]


def kv_bytes_per_token_layer(cfg: ModelConfig) -> int:
    """Bytes one global layer stores per token (K+V, or MLA latent + decoupled key part)."""
    return check_config(cfg).kv_elems_per_token_layer * cfg.kv_bytes


def kv_bytes_per_token(cfg: ModelConfig) -> int:
    """KV bytes per token summed over all global-attention layers."""
    return len(check_config(cfg).attn_layers) * kv_bytes_per_token_layer(cfg)


def kda_state_bytes_per_layer(cfg: ModelConfig) -> int:
    """Bytes of one KDA layer's H x K x V state at ``state_bytes`` per element."""
    return check_config(cfg).kda_state_elems_layer * cfg.state_bytes


def kda_state_bytes(cfg: ModelConfig) -> int:
    """Recurrent-state bytes of one request, all KDA layers (independent of context)."""
    return len(check_config(cfg).kda_layers) * kda_state_bytes_per_layer(cfg)


def conv_state_bytes_per_layer(cfg: ModelConfig) -> int:
    return check_config(cfg).conv_state_elems_layer * cfg.conv_bytes


def conv_state_bytes(cfg: ModelConfig) -> int:
    """Conv rolling-state bytes of one request, all KDA layers (independent of context)."""
    return len(check_config(cfg).kda_layers) * conv_state_bytes_per_layer(cfg)


def checkpoint_bytes(cfg: ModelConfig) -> int:
    """Bytes of one state checkpoint: every KDA state plus every conv state."""
    return kda_state_bytes(cfg) + conv_state_bytes(cfg)


def request_bytes(cfg: ModelConfig, context_len: int) -> dict[str, int]:
    """Cache bytes of one request holding ``context_len`` tokens, by kind (keys as ``CACHE_KINDS``)."""
    L = check_int("context_len", context_len, 0, unit="tokens")
    return {"kv": L * kv_bytes_per_token(cfg), "kda_state": kda_state_bytes(cfg),
            "conv_state": conv_state_bytes(cfg)}


def request_total_bytes(cfg: ModelConfig, context_len: int) -> int:
    return sum(request_bytes(cfg, context_len).values())


def crossover_tokens(cfg: ModelConfig, baseline: ModelConfig) -> int | None:
    """Smallest context at which one request of ``cfg`` holds fewer cache bytes than one of
    ``baseline`` (None if it never does: ``cfg`` grows at least as fast per token)."""
    fixed = checkpoint_bytes(cfg) - checkpoint_bytes(baseline)
    saved_per_token = kv_bytes_per_token(baseline) - kv_bytes_per_token(cfg)
    if saved_per_token <= 0:
        return 0 if fixed < 0 and saved_per_token == 0 else None
    return max(0, fixed // saved_per_token + 1)


def cache_anatomy(cfg: ModelConfig) -> list[dict]:
    """One row per cache kind: layers holding it, bytes per layer (per token if it grows)."""
    check_config(cfg)
    rows = [
        {"kind": "kv", "layers": len(cfg.attn_layers), "bytes_per_layer": kv_bytes_per_token_layer(cfg),
         "grows_with_context": True, "unit": "per token"},
        {"kind": "kda_state", "layers": len(cfg.kda_layers), "bytes_per_layer": kda_state_bytes_per_layer(cfg),
         "grows_with_context": False, "unit": "per request"},
        {"kind": "conv_state", "layers": len(cfg.kda_layers), "bytes_per_layer": conv_state_bytes_per_layer(cfg),
         "grows_with_context": False, "unit": "per request"},
    ]
    return [r for r in rows if r["layers"]]


@dataclass(frozen=True)
class CacheShapes:
    """Bytes of each per-request cache object of a model, as one record for the page pool.

    :meth:`from_config` reads every size off the functions above, so the pool and the
    analytic model count the same bytes.
    """

    name: str
    kv_token_bytes: int  # one token, one global layer
    n_attn_layers: int
    state_bytes: int  # one KDA layer's recurrent state
    conv_bytes: int  # one KDA layer's conv state
    n_kda_layers: int

    @classmethod
    def from_config(cls, cfg: ModelConfig) -> "CacheShapes":
        check_config(cfg)
        return cls(
            name=cfg.name,
            kv_token_bytes=kv_bytes_per_token_layer(cfg),
            n_attn_layers=len(cfg.attn_layers),
            state_bytes=kda_state_bytes_per_layer(cfg),
            conv_bytes=conv_state_bytes_per_layer(cfg),
            n_kda_layers=len(cfg.kda_layers),
        )

    @property
    def kv_bytes_per_token(self) -> int:
        """All global layers together."""
        return self.kv_token_bytes * self.n_attn_layers

    @property
    def fixed_bytes(self) -> int:
        """KDA + conv states of every KDA layer: what a request holds at any length."""
        return (self.state_bytes + self.conv_bytes) * self.n_kda_layers

    def request_bytes(self, n_tokens: int) -> int:
        return self.fixed_bytes + n_tokens * self.kv_bytes_per_token
