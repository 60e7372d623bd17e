"""How much cache one device of a deployment can hold, and how many requests fit.

A device's HBM holds its share of the weights, a reserve for a step's activations, and
the cache; the engine may use ``memory_utilization`` of the HBM in all (vLLM's
``--gpu-memory-utilization``). Under tensor parallelism every device holds a share of
every request, so the instance holds what one device holds; under DP-attention each
device holds its own requests, so the instance holds n devices' worth.
"""

from __future__ import annotations

from kimilab.config import ModelConfig
from kimilab.costs.cache_bytes import kv_bytes_per_token, request_total_bytes
from kimilab.costs.deployment import Deployment
from kimilab.costs.parallel import device_weight_bytes

__all__ = ["cache_budget_bytes", "capacity_tokens", "max_batch"]


def cache_budget_bytes(cfg: ModelConfig, deployment: Deployment) -> float:
    """Bytes of each device's HBM left for caches (0 if the weights do not even fit)."""
    dev = deployment.device
    free = (deployment.memory_utilization * dev.hbm_bytes - device_weight_bytes(cfg, deployment)
            - deployment.activation_reserve_bytes)
    return max(0.0, free)


def _per_instance(deployment: Deployment) -> int:
    return deployment.n_devices if deployment.attention == "dp" else 1


def capacity_tokens(cfg: ModelConfig, deployment: Deployment) -> int:
    """Tokens of KV the instance holds if its whole cache budget went to KV (its page pool's size)."""
    per_token = kv_bytes_per_token(cfg, deployment)
    if per_token <= 0:
        raise ValueError(f"cfg={cfg.name!r} has no KV cache: its capacity is not counted in tokens")
    return int(cache_budget_bytes(cfg, deployment) // per_token) * _per_instance(deployment)


def max_batch(cfg: ModelConfig, deployment: Deployment, context_len: int) -> int:
    """Requests of ``context_len`` tokens whose caches fit in the instance at once (0 if none)."""
    per_request = request_total_bytes(cfg, deployment, context_len)
    if per_request <= 0:
        return 0
    return int(cache_budget_bytes(cfg, deployment) // per_request) * _per_instance(deployment)
