"""What a multi-token-prediction (MTP) drafter costs a serving instance: weights, cache and steps.

An MTP drafter is one more decoder layer on top of the target: it reads the target's last hidden
state and the token just made, and its logits go through the target's own output head (the
embedding and the head are shared, as DeepSeek-V3's MTP module and Qwen3-Next's are built). We
take that layer to be a global-attention layer of the target's own shapes, with one layer's share
of the target's parameters (routed experts in the same proportion), so it holds a KV cache of its
own: one more global layer's KV for every token of every request, prefix-cached tokens included.

Per speculative step the drafter runs once over each request's verified positions (to extend its
own KV with what was kept and to make the first draft), then once per further draft token:
``k`` forwards of a one-layer model, each reading its layer's weights and the shared head.
An n-gram (prompt lookup) drafter is free and holds nothing.
"""

from __future__ import annotations

from kimilab.config import ModelConfig, WeightModel
from kimilab.costs.cache_bytes import kv_bytes_per_token, kv_bytes_per_token_layer
from kimilab.costs.deployment import Deployment
from kimilab.costs.memory import _per_instance, cache_budget_bytes
from kimilab.costs.parallel import device_weight_bytes
from kimilab.validate import check_choice

__all__ = ["DRAFTERS", "mtp_config", "drafter_weight_bytes", "drafter_kv_bytes_per_token", "spec_capacity_tokens"]

DRAFTERS = ("mtp", "ngram")


def mtp_config(cfg: ModelConfig) -> ModelConfig:
    """The MTP layer as a one-layer model of ``cfg``'s global-attention shapes: its own layer's share
    of the parameters plus the shared output head (what one of its forwards reads)."""
    one = cfg.with_(name=f"{cfg.name}-mtp", layer_pattern="A")
    if cfg.weights is None:
        return one  # a runnable config: its weights are estimated from the one layer's shapes
    w, head = cfg.weights, float(cfg.vocab_size * cfg.d_model)
    L = cfg.n_layers
    layer_total = (w.total_params - 2 * head) / L
    layer_active = max(w.active_params - 2 * head, w.active_params / 2) / L
    return one.with_(weights=WeightModel(layer_total + head, layer_active + head, w.n_routed_experts,
                                         w.routed_top_k, w.bytes_per_param,
                                         source=f"one layer's share of {cfg.name} plus its shared output head"))


def drafter_weight_bytes(cfg: ModelConfig, deployment: Deployment, drafter: str = "mtp") -> float:
    """Bytes the drafter adds to each device's weights: the MTP layer alone (its head is the target's)."""
    if check_choice("drafter", drafter, DRAFTERS) == "ngram":
        return 0.0
    mtp = mtp_config(cfg)
    full = device_weight_bytes(mtp, deployment)
    if cfg.weights is None:
        return full
    head = cfg.vocab_size * cfg.d_model * cfg.weights.bytes_per_param / deployment.n_devices
    return full - head


def drafter_kv_bytes_per_token(cfg: ModelConfig, deployment: Deployment, drafter: str = "mtp") -> int:
    """KV bytes per token the drafter keeps on one device (one global layer's; none for n-gram)."""
    if check_choice("drafter", drafter, DRAFTERS) == "ngram":
        return 0
    return kv_bytes_per_token_layer(cfg, deployment)


def spec_capacity_tokens(cfg: ModelConfig, deployment: Deployment, drafter: str = "mtp") -> int:
    """The instance's pool in the target's KV tokens when the drafter's weights and KV share its HBM:
    the cache budget less the drafter's layer, at the target's plus the drafter's KV per token
    (:func:`kimilab.costs.capacity_tokens` with no drafter)."""
    per_token = kv_bytes_per_token(cfg, deployment)
    if per_token <= 0:
        raise ValueError(f"cfg={cfg.name!r} has no KV cache: its capacity is not counted in tokens")
    budget = max(0.0, cache_budget_bytes(cfg, deployment) - drafter_weight_bytes(cfg, deployment, drafter))
    both = per_token + drafter_kv_bytes_per_token(cfg, deployment, drafter)
    return int(budget // both) * _per_instance(deployment)

