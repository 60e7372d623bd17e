"""What each device of a :class:`~kimilab.costs.hardware.Deployment` holds and does: TP vs DP-attention.

One request's cache and the weights are not spread evenly over n devices; how they land
depends on how attention is split (``deployment.attention``):

- ``"tp"`` (tensor parallelism): every request lives on every rank, split by heads. KDA
  states and conv states shard by KDA head; GQA/MHA KV by KV head (a rank holds at least
  one, so with fewer KV heads than ranks they are replicated); MLA's latent is ONE shared
  KV head, so every rank holds the whole latent cache of every request. All weights are
  spread evenly.
- ``"dp"`` (DP-attention): each rank holds whole requests and runs their attention and KDA
  layers itself; the mixer weights (:func:`~kimilab.costs.hardware.mixer_params`) are
  replicated on every rank, the rest (experts, MLP, embeddings) is spread evenly.

These functions give the bytes and FLOPs of the *busiest* rank, which sets a step's time.
"""

from __future__ import annotations

from kimilab.config import ModelConfig
from kimilab.costs._check import check_config
from kimilab.costs.cache_bytes import checkpoint_bytes, kv_bytes_per_token
from kimilab.costs.hardware import Deployment, WeightModel, mixer_params, weight_bytes, weight_bytes_read, weight_model
from kimilab.validate import check_int

__all__ = [
    "kv_rank_fraction", "state_rank_fraction", "request_rank_bytes", "requests_on_busiest_rank",
    "rank_weight_bytes", "rank_weight_bytes_read", "rank_flops",
]


def _ceil_share(units: int, n: int) -> float:
    """Fraction of ``units`` heads one of ``n`` ranks holds (at least one whole head)."""
    return -(-units // n) / units


def kv_rank_fraction(cfg: ModelConfig, deployment: Deployment) -> float:
    """Fraction of a request's KV cache on each rank that holds the request.

    TP: 1 / (KV heads per rank share); MLA has one latent head, so 1.0 (replicated).
    DP: 1.0 (the one rank holding the request holds all of it).
    """
    check_config(cfg)
    if deployment.attention == "dp":
        return 1.0
    heads = 1 if cfg.attn_kind == "mla" else cfg.attn_kv_heads_eff
    return _ceil_share(heads, deployment.n_devices)


def state_rank_fraction(cfg: ModelConfig, deployment: Deployment) -> float:
    """Fraction of a request's KDA + conv states on each rank that holds it (TP: by KDA head)."""
    check_config(cfg)
    if deployment.attention == "dp":
        return 1.0
    return _ceil_share(cfg.n_heads, deployment.n_devices)


def request_rank_bytes(cfg: ModelConfig, context_len: int, deployment: Deployment) -> int:
    """Cache bytes one request of ``context_len`` tokens occupies on a rank that holds it."""
    L = check_int("context_len", context_len, 0, unit="tokens")
    kv = L * kv_bytes_per_token(cfg) * kv_rank_fraction(cfg, deployment)
    return int(round(kv + checkpoint_bytes(cfg) * state_rank_fraction(cfg, deployment)))


def requests_on_busiest_rank(batch: int, deployment: Deployment) -> int:
    """TP: every rank holds (a share of) every request; DP: requests are dealt out evenly."""
    batch = check_int("batch", batch, 0)
    return batch if deployment.attention == "tp" else -(-batch // deployment.n_devices)


def _replicated_bytes(cfg: ModelConfig, deployment: Deployment, w: WeightModel) -> float:
    """Weight bytes every rank holds in full: the mixers under DP-attention, none under TP."""
    if deployment.attention == "tp" or deployment.n_devices == 1:
        return 0.0
    return min(float(mixer_params(cfg)), w.total_params) * w.bytes_per_param


def rank_weight_bytes(cfg: ModelConfig, deployment: Deployment, weights: WeightModel | None = None) -> float:
    """Weight bytes each rank must hold (spread evenly, mixers replicated under DP)."""
    w = weights or weight_model(cfg)
    rep = _replicated_bytes(cfg, deployment, w)
    return rep + (weight_bytes(cfg, w) - rep) / deployment.n_devices


def rank_weight_bytes_read(cfg: ModelConfig, batch: int, deployment: Deployment,
                           weights: WeightModel | None = None) -> float:
    """Weight bytes the busiest rank reads in a step over ``batch`` tokens (experts read evenly)."""
    w = weights or weight_model(cfg)
    total = weight_bytes_read(cfg, batch, w)
    rep = min(_replicated_bytes(cfg, deployment, w), total)
    return rep + (total - rep) / deployment.n_devices


def rank_flops(cfg: ModelConfig, total_flops: float, n_tokens: int, busiest_tokens: int,
               deployment: Deployment, weights: WeightModel | None = None) -> float:
    """FLOPs of the busiest rank, for a step doing ``total_flops`` over ``n_tokens`` tokens.

    TP splits everything evenly. Under DP the mixer part (mixer weights, attention pairs,
    KDA, conv) of the ``busiest_tokens`` tokens the busiest rank owns stays on that rank;
    the rest (experts, MLP, head: 2 FLOPs per activated non-mixer parameter) is spread.
    """
    n = deployment.n_devices
    if deployment.attention == "tp" or n == 1 or n_tokens == 0:
        return total_flops / n
    w = weights or weight_model(cfg)
    spread_per_token = max(2.0 * (w.active_params - mixer_params(cfg)), 0.0)
    mixer_per_token = total_flops / n_tokens - spread_per_token
    return busiest_tokens * mixer_per_token + n_tokens * spread_per_token / n
