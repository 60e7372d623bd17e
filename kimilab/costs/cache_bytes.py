"""Bytes of the caches one request holds, by kind, on ONE device of a deployment.

The three kinds are :data:`kimilab.config.CACHE_KINDS`:

- ``"kv"``: global-attention layers store, per token, K and V for every KV head
  (MHA/GQA) or one MLA latent plus its decoupled key part (MLA: ``qk_rope_head_dim``
  dims; with Kimi Linear's ``mla_use_nope: true`` they are not rotated). Grows with context.
- ``"kda_state"``: every KDA layer holds one H x K x V state matrix. Fixed size.
- ``"conv_state"``: every KDA layer keeps the last (kernel - 1) inputs of its short
  convolution over q, k and v. Fixed size.

Every function takes the :class:`~kimilab.costs.deployment.Deployment` and answers for
one of its devices (:mod:`~kimilab.costs.parallel` says what each device holds): under
tensor parallelism the states shard by head while MLA's latent is held whole on every
device, so the ratio of state to KV bytes -- the price of a checkpoint in KV pages --
depends on the deployment. The whole model's bytes are those of a one-device deployment
(e.g. :data:`~kimilab.costs.deployment.LOCAL`). :class:`CacheShapes` carries the same
numbers as one record for the page pool, built from the functions so they cannot disagree.
"""

from __future__ import annotations

from dataclasses import dataclass

from kimilab.config import ModelConfig
from kimilab.costs.deployment import Deployment
from kimilab.costs.parallel import check_pair, kv_heads_per_device, state_heads_per_device
from kimilab.validate import check_int

__all__ = [
    "kv_bytes_per_token_layer", "kv_bytes_per_token", "kda_state_bytes_per_layer",
    "kda_state_bytes", "conv_state_bytes_per_layer", "conv_state_bytes", "checkpoint_bytes",
    "request_bytes", "request_total_bytes", "crossover_tokens", "cache_anatomy", "CacheShapes",
]


def _layer_bytes(elems: int, heads: tuple[int, int], itemsize: int) -> int:
    """Bytes one device holds of a layer's ``elems`` elements, split evenly over ``heads = (mine, all)``."""
    mine, total = heads
    return elems // total * mine * itemsize


def kv_bytes_per_token_layer(cfg: ModelConfig, deployment: Deployment) -> int:
    """Bytes one global layer stores per token on one device (K+V of its KV heads, or MLA's latent)."""
    return _layer_bytes(cfg.kv_elems_per_token_layer, kv_heads_per_device(cfg, deployment), cfg.kv_bytes)


def kda_state_bytes_per_layer(cfg: ModelConfig, deployment: Deployment) -> int:
    """Bytes of one KDA layer's state on one device (its heads of H x K x V, ``state_bytes`` each)."""
    return _layer_bytes(cfg.kda_state_elems_layer, state_heads_per_device(cfg, deployment), cfg.state_bytes)


def conv_state_bytes_per_layer(cfg: ModelConfig, deployment: Deployment) -> int:
    """Bytes of one KDA layer's conv window on one device (its heads' channels)."""
    return _layer_bytes(cfg.conv_state_elems_layer, state_heads_per_device(cfg, deployment), cfg.conv_bytes)


def kv_bytes_per_token(cfg: ModelConfig, deployment: Deployment) -> int:
    """KV bytes per token on one device, summed over all global-attention layers."""
    check_pair(cfg, deployment)
    return len(cfg.attn_layers) * kv_bytes_per_token_layer(cfg, deployment)


def kda_state_bytes(cfg: ModelConfig, deployment: Deployment) -> int:
    """Recurrent-state bytes of one request on one device, all KDA layers (independent of context)."""
    check_pair(cfg, deployment)
    return len(cfg.kda_layers) * kda_state_bytes_per_layer(cfg, deployment)


def conv_state_bytes(cfg: ModelConfig, deployment: Deployment) -> int:
    """Conv rolling-state bytes of one request on one device, all KDA layers."""
    check_pair(cfg, deployment)
    return len(cfg.kda_layers) * conv_state_bytes_per_layer(cfg, deployment)


def checkpoint_bytes(cfg: ModelConfig, deployment: Deployment) -> int:
    """Bytes of one state checkpoint on one device: every KDA state plus every conv window."""
    check_pair(cfg, deployment)
    return kda_state_bytes(cfg, deployment) + conv_state_bytes(cfg, deployment)


def request_bytes(cfg: ModelConfig, deployment: Deployment, context_len: int) -> dict[str, int]:
    """Cache bytes of one request of ``context_len`` tokens on one device that holds it, by kind."""
    L = check_int("context_len", context_len, 0, unit="tokens")
    return {"kv": L * kv_bytes_per_token(cfg, deployment), "kda_state": kda_state_bytes(cfg, deployment),
            "conv_state": conv_state_bytes(cfg, deployment)}


def request_total_bytes(cfg: ModelConfig, deployment: Deployment, context_len: int) -> int:
    return sum(request_bytes(cfg, deployment, context_len).values())


def crossover_tokens(cfg: ModelConfig, baseline: ModelConfig, deployment: Deployment) -> int | None:
    """Smallest context at which one request of ``cfg`` holds fewer bytes per device than one of
    ``baseline`` (None if it never does: ``cfg`` grows at least as fast per token)."""
    fixed = checkpoint_bytes(cfg, deployment) - checkpoint_bytes(baseline, deployment)
    saved_per_token = kv_bytes_per_token(baseline, deployment) - kv_bytes_per_token(cfg, deployment)
    if saved_per_token <= 0:
        return 0 if fixed < 0 and saved_per_token == 0 else None
    return max(0, fixed // saved_per_token + 1)


def cache_anatomy(cfg: ModelConfig, deployment: Deployment) -> list[dict]:
    """One row per cache kind: layers holding it, bytes per layer on one device (per token if it grows)."""
    check_pair(cfg, deployment)
    rows = [
        {"kind": "kv", "layers": len(cfg.attn_layers), "bytes_per_layer": kv_bytes_per_token_layer(cfg, deployment),
         "grows_with_context": True, "unit": "per token"},
        {"kind": "kda_state", "layers": len(cfg.kda_layers),
         "bytes_per_layer": kda_state_bytes_per_layer(cfg, deployment), "grows_with_context": False,
         "unit": "per request"},
        {"kind": "conv_state", "layers": len(cfg.kda_layers),
         "bytes_per_layer": conv_state_bytes_per_layer(cfg, deployment), "grows_with_context": False,
         "unit": "per request"},
    ]
    return [r for r in rows if r["layers"]]


@dataclass(frozen=True)
class CacheShapes:
    """Bytes of each per-request cache object on one device, as one record for the page pool.

    :meth:`from_config` reads every size off the functions above for one deployment, so
    the pool and the analytic model count the same bytes.
    """

    name: str
    kv_token_bytes: int  # one token, one global layer
    n_attn_layers: int
    state_bytes: int  # one KDA layer's recurrent state
    conv_bytes: int  # one KDA layer's conv state
    n_kda_layers: int
    deployment: str = ""  # the deployment's name
    tensor_parallel: int = 1  # its attention TP size

    @classmethod
    def from_config(cls, cfg: ModelConfig, deployment: Deployment) -> "CacheShapes":
        check_pair(cfg, deployment)
        return cls(
            name=cfg.name,
            kv_token_bytes=kv_bytes_per_token_layer(cfg, deployment),
            n_attn_layers=len(cfg.attn_layers),
            state_bytes=kda_state_bytes_per_layer(cfg, deployment),
            conv_bytes=conv_state_bytes_per_layer(cfg, deployment),
            n_kda_layers=len(cfg.kda_layers),
            deployment=deployment.name,
            tensor_parallel=deployment.tp,
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
