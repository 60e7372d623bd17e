"""What each device of a :class:`~kimilab.costs.deployment.Deployment` holds and does.

One request's cache and the weights do not spread evenly over n devices; how they land
depends on how attention is split (``deployment.attention``):

- ``"tp"``: every request lives on every device, split by heads. KDA states and conv
  states shard by KDA head; GQA/MHA KV by KV head (a device holds at least one: vLLM
  replicates KV heads when there are fewer than devices); MLA's latent is ONE shared KV
  head, so every device holds the whole latent cache of every request. All weights are
  spread evenly.
- ``"dp"``: each device holds whole requests and runs their attention and KDA layers
  itself; the mixer weights (:func:`~kimilab.costs.hardware.mixer_params`) are replicated
  on every device, the rest (experts, MLP, embeddings) is spread evenly.

These give the *busiest* device's share, which sets a step's time and a device's memory.
"""

from __future__ import annotations

from kimilab.config import ModelConfig
from kimilab.costs._check import check_config
from kimilab.costs.deployment import Deployment
from kimilab.costs.hardware import mixer_params, weight_model
from kimilab.validate import check_int

__all__ = ["check_pair", "kv_heads_per_device", "state_heads_per_device", "requests_on_busiest_device",
           "device_weight_bytes", "device_weight_bytes_read", "device_linear_flops"]


def check_pair(cfg: ModelConfig, deployment: Deployment) -> None:
    """ValueError unless ``cfg`` is a ModelConfig and ``deployment`` a Deployment."""
    check_config(cfg)
    if not isinstance(deployment, Deployment):
        raise ValueError(f"deployment: expected a kimilab.costs.Deployment, got {type(deployment).__name__}")


def kv_heads_per_device(cfg: ModelConfig, deployment: Deployment) -> tuple[int, int]:
    """(KV heads one device stores, KV heads in all): MLA's latent is one head, kept whole under TP."""
    check_pair(cfg, deployment)
    heads = 1 if cfg.attn_kind == "mla" else cfg.attn_kv_heads_eff
    return (heads if deployment.tp == 1 else max(1, heads // deployment.tp)), heads


def state_heads_per_device(cfg: ModelConfig, deployment: Deployment) -> tuple[int, int]:
    """(KDA heads one device holds, KDA heads in all): TP splits them (at least one per device)."""
    check_pair(cfg, deployment)
    return -(-cfg.n_heads // deployment.tp), cfg.n_heads


def requests_on_busiest_device(batch: int, deployment: Deployment) -> int:
    """TP: every device holds (a share of) every request; DP: requests are dealt out evenly."""
    batch = check_int("batch", batch, 0)
    return batch if deployment.attention == "tp" else -(-batch // deployment.n_devices)


def _replicated_params(cfg: ModelConfig, deployment: Deployment) -> float:
    """Parameters every device holds in full: the mixers under DP-attention, none under TP."""
    if deployment.attention == "tp" or deployment.n_devices == 1:
        return 0.0
    return min(float(mixer_params(cfg)), weight_model(cfg).total_params)


def device_weight_bytes(cfg: ModelConfig, deployment: Deployment) -> float:
    """Weight bytes each device must hold (spread evenly, mixers replicated under DP)."""
    check_pair(cfg, deployment)
    w = weight_model(cfg)
    rep = _replicated_params(cfg, deployment)
    return (rep + (w.total_params - rep) / deployment.n_devices) * w.bytes_per_param


def device_weight_bytes_read(cfg: ModelConfig, deployment: Deployment, tokens: int) -> float:
    """Weight bytes the busiest device reads in a step over ``tokens`` tokens (the experts
    those tokens route to, read once for the whole step; spread evenly)."""
    check_pair(cfg, deployment)
    w = weight_model(cfg)
    read = w.params_read(max(1, tokens))
    rep = min(_replicated_params(cfg, deployment), read)
    return (rep + (read - rep) / deployment.n_devices) * w.bytes_per_param


def device_linear_flops(cfg: ModelConfig, deployment: Deployment, tokens: int, busiest_tokens: int) -> float:
    """Weight-matmul FLOPs of the busiest device: 2 per activated parameter per token.

    TP splits them evenly. Under DP the mixer projections of the ``busiest_tokens`` tokens
    that device owns stay on it; the rest (experts, MLP, head) is spread.
    """
    check_pair(cfg, deployment)
    w = weight_model(cfg)
    n = deployment.n_devices
    total = 2.0 * w.active_params * tokens
    if deployment.attention == "tp" or n == 1:
        return total / n
    mixer = 2.0 * min(float(mixer_params(cfg)), w.active_params)
    return busiest_tokens * mixer + tokens * (2.0 * w.active_params - mixer) / n
