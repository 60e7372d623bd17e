"""The ONE cost model: bytes, FLOPs and time for any ModelConfig on a named Deployment (numbers only).

- :mod:`~kimilab.costs.deployment`: :class:`Deployment`, the one object behind every byte and
  every second (devices, attention and expert split, links, kernel efficiencies, per-layer
  overhead, memory share), the calibrated :class:`Kernels`, and the named deployments;
- :mod:`~kimilab.costs.hardware`: accelerators, links, and the weights a model has;
- :mod:`~kimilab.costs.parallel`: what each device holds and does under TP vs DP-attention;
- :mod:`~kimilab.costs.cache_bytes`: bytes of each cache kind per device, and :class:`CacheShapes`;
- :mod:`~kimilab.costs.memory`: the cache budget per device, the pool's capacity, the batch that fits;
- :mod:`~kimilab.costs.flops`: prefill and decode FLOPs (work, the same on any deployment), and
  :class:`CacheCosts`, what a cached prefix costs and saves on one deployment;
- :mod:`~kimilab.costs.steptime`: one forward pass of a batch -- step, decode and prefill seconds;
- :mod:`~kimilab.costs.roofline`: decode operating points and :func:`summary` (``python -m kimilab memory``);
- :mod:`~kimilab.costs.vllm_pages`: vLLM's hybrid page layout per device;
- :mod:`~kimilab.costs.calibration`: the published measurements the kernels are fitted to;
- :mod:`~kimilab.costs.inputs`: every input of a deployment's numbers, sourced, fitted or assumed;
- :mod:`~kimilab.costs.spec`: speculative-decoding rollback bytes and time over batch.

Every function that returns bytes or seconds takes the deployment (no default), so no
number can mix two deployments. Everything is re-exported here:
``from kimilab import costs; costs.kv_bytes_per_token(cfg, costs.DEFAULT_DEPLOYMENT)``.
"""

from kimilab.costs.cache_bytes import (
    CacheShapes, cache_anatomy, checkpoint_bytes, conv_state_bytes, conv_state_bytes_per_layer,
    crossover_tokens, kda_state_bytes, kda_state_bytes_per_layer, kv_bytes_per_token, kv_bytes_per_token_layer,
    request_bytes, request_total_bytes,
)
from kimilab.costs.deployment import (
    CALIBRATED, REPORT_KERNELS, DEFAULT_DEPLOYMENT, DEPLOYMENTS, DP4_EP4_H200, LOCAL, ONE_H200, REPORT_TP4_H800, VLLM_TP4_H200,
    VLLM_TP8_H200, Deployment, Kernels, deployment,
)
from kimilab.costs.flops import (
    CacheCosts, attention_decode_flops, attention_prefill_flops, decode_flops_per_token, kda_decode_flops,
    kda_prefill_flops, linear_flops_per_token, mixer_decode_flops, mixer_prefill_flops, prefill_flops,
)
from kimilab.costs.hardware import (
    CPU, H20, H200, H800, INFINIBAND_NDR, LOOPBACK, NVLINK_H100, Accelerator, Link, WeightModel, estimate_params,
    mixer_params, weight_model,
)
from kimilab.costs.ensemble import AXES, Band, Member, band, member_deployments, members
from kimilab.costs.inputs import inputs
from kimilab.costs.memory import cache_budget_bytes, capacity_tokens, max_batch
from kimilab.costs.parallel import (
    device_linear_flops, device_weight_bytes, device_weight_bytes_read, kv_heads_per_device,
    requests_on_busiest_device, state_heads_per_device,
)
from kimilab.costs.roofline import DecodePoint, decode_crossover_tokens, decode_point, summary
from kimilab.costs.steptime import (
    linear_seconds, StepTimer, StepWork, checkpoint_write_seconds, decode_step_seconds, prefill_chunks, prefill_seconds,
    prefill_seconds_saved, step_seconds, step_work,
)
from kimilab.costs.vllm_pages import VllmHybridPages, vllm_hybrid_pages, vllm_pages_of

__all__ = [
    # deployment and hardware
    "Deployment", "Kernels", "CALIBRATED", "REPORT_KERNELS", "DEFAULT_DEPLOYMENT", "DEPLOYMENTS", "VLLM_TP4_H200", "VLLM_TP8_H200",
    "DP4_EP4_H200", "ONE_H200", "REPORT_TP4_H800", "LOCAL", "deployment",
    "Accelerator", "Link", "WeightModel", "H800", "H200", "H20", "CPU", "NVLINK_H100", "INFINIBAND_NDR", "LOOPBACK",
    "estimate_params", "mixer_params", "weight_model",
    # per device
    "kv_heads_per_device", "state_heads_per_device", "requests_on_busiest_device", "device_weight_bytes",
    "device_weight_bytes_read", "device_linear_flops",
    # cache bytes per device
    "kv_bytes_per_token_layer", "kv_bytes_per_token", "kda_state_bytes_per_layer", "kda_state_bytes",
    "conv_state_bytes_per_layer", "conv_state_bytes", "checkpoint_bytes", "request_bytes",
    "request_total_bytes", "crossover_tokens", "cache_anatomy", "CacheShapes",
    # memory, and what every number rests on
    "linear_seconds", "cache_budget_bytes", "capacity_tokens", "max_batch", "inputs", "Band", "Member", "band", "members", "member_deployments", "AXES",
    # FLOPs
    "linear_flops_per_token", "prefill_flops", "attention_prefill_flops", "kda_prefill_flops", "mixer_prefill_flops",
    "decode_flops_per_token", "attention_decode_flops", "kda_decode_flops", "mixer_decode_flops", "CacheCosts",
    # time
    "StepWork", "step_work", "step_seconds", "decode_step_seconds", "prefill_chunks", "prefill_seconds",
    "prefill_seconds_saved", "checkpoint_write_seconds", "StepTimer",
    "DecodePoint", "decode_point", "decode_crossover_tokens", "summary",
    # vLLM's pages
    "VllmHybridPages", "vllm_hybrid_pages", "vllm_pages_of",
]
