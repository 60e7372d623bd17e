"""The ONE analytic cost model: bytes, FLOPs and time for any ModelConfig (numbers only, no arrays).

- :mod:`~kimilab.costs.hardware`: the assumed accelerator, deployments (TP or DP-attention),
  and the weights a step reads;
- :mod:`~kimilab.costs.cache_bytes`: bytes of each cache kind a request holds, and
  :class:`CacheShapes`, the same sizes as one record for the page pool;
- :mod:`~kimilab.costs.flops`: prefill and decode FLOPs, and :class:`CacheCosts`, what
  a cached prefix costs and saves (for the prefix cache);
- :mod:`~kimilab.costs.parallel`: what each device holds and does under TP vs DP-attention;
- :mod:`~kimilab.costs.roofline`: the largest batch that fits, decode-step time, and
  :func:`summary`, a hybrid-vs-baseline table (``python -m kimilab memory``);
- :mod:`~kimilab.costs.prefill`: prefill seconds (and what a hit saves), checkpoint-copy seconds;
- :mod:`~kimilab.costs.vllm_pages`: vLLM's hybrid page layout (block size, layer groups).

Everything is re-exported here: ``from kimilab import costs; costs.kv_bytes_per_token(cfg)``.
"""

from kimilab.costs.cache_bytes import (
    CacheShapes, cache_anatomy, checkpoint_bytes, conv_state_bytes, conv_state_bytes_per_layer,
    crossover_tokens, kda_state_bytes, kda_state_bytes_per_layer, kv_bytes_per_token, kv_bytes_per_token_layer,
    request_bytes, request_total_bytes,
)
from kimilab.costs.flops import CacheCosts, decode_flops_per_token, linear_flops_per_token, prefill_flops
from kimilab.costs.hardware import (
    DEFAULT_DEPLOYMENT, H800_CLASS, HBM_BANDWIDTH_BYTES_PER_S, HBM_CAPACITY_BYTES, PEAK_BF16_FLOPS_PER_S,
    PUBLISHED_WEIGHTS, Accelerator, Deployment, WeightModel, estimate_params, mixer_params, weight_bytes,
    weight_bytes_read, weight_model,
)
from kimilab.costs.parallel import (
    kv_rank_fraction, rank_flops, rank_weight_bytes, rank_weight_bytes_read, request_rank_bytes,
    requests_on_busiest_rank, state_rank_fraction,
)
from kimilab.costs.prefill import (
    PREFILL_EFFICIENCY, PrefillTimer, checkpoint_write_seconds, prefill_seconds, prefill_seconds_saved,
)
from kimilab.costs.roofline import (
    DecodePoint, decode_bytes_per_token, decode_point, decode_rank_bytes, decode_step_bytes,
    decode_step_seconds, max_batch, summary,
)
from kimilab.costs.vllm_pages import VllmHybridPages, vllm_hybrid_pages

__all__ = [
    # hardware
    "Accelerator", "Deployment", "WeightModel", "H800_CLASS", "HBM_BANDWIDTH_BYTES_PER_S",
    "HBM_CAPACITY_BYTES", "PEAK_BF16_FLOPS_PER_S", "DEFAULT_DEPLOYMENT", "PUBLISHED_WEIGHTS",
    "estimate_params", "mixer_params", "weight_model", "weight_bytes", "weight_bytes_read",
    # cache bytes
    "kv_bytes_per_token_layer", "kv_bytes_per_token", "kda_state_bytes_per_layer", "kda_state_bytes",
    "conv_state_bytes_per_layer", "conv_state_bytes", "checkpoint_bytes", "request_bytes",
    "request_total_bytes", "crossover_tokens", "cache_anatomy", "CacheShapes",
    # FLOPs
    "linear_flops_per_token", "prefill_flops", "decode_flops_per_token", "CacheCosts",
    # per-device split (TP vs DP-attention)
    "kv_rank_fraction", "state_rank_fraction", "request_rank_bytes", "requests_on_busiest_rank",
    "rank_weight_bytes", "rank_weight_bytes_read", "rank_flops",
    # roofline
    "decode_step_bytes", "decode_bytes_per_token", "decode_rank_bytes", "decode_step_seconds", "max_batch",
    "DecodePoint", "decode_point", "summary",
    # prefill time
    "PREFILL_EFFICIENCY", "prefill_seconds", "prefill_seconds_saved", "checkpoint_write_seconds", "PrefillTimer",
    # vLLM's pages
    "VllmHybridPages", "vllm_hybrid_pages",
]
