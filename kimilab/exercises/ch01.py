"""Chapter 1's checked exercises: what a KV cache costs in bytes."""

from kimilab import costs
from kimilab.config import all_mla_27, gqa_8b
from kimilab.exercises import exercise


@exercise("1.1", "48-layer MHA bytes per token",
          hint=("A KV cache stores one key and one value vector per KV head, per layer, per token.",
                "Without GQA every query head has its own KV head; bf16 is 2 bytes a number."))
def _():
    return costs.kv_bytes_per_token(gqa_8b.with_(attn_kind="mha", attn_kv_heads=32, layer_pattern="A" * 48), costs.ONE_H200)


@exercise("1.2", "GQA cache of a 32k-token request",
          hint=("A KV cache grows by the same number of bytes with every token it holds.",
                "Multiply the bytes one token costs under this model by the request's length."))
def _():
    return costs.kv_bytes_per_token(gqa_8b, costs.ONE_H200) * 32768


@exercise("1.3", "cache = weights", rtol=0.01,
          hint=("The weights are a fixed cost; the cache grows linearly with the context.",
                "Find the context at which per-token cache bytes, times tokens, reach the weight bytes."))
def _():
    return costs.device_weight_bytes(all_mla_27, costs.ONE_H200) / costs.kv_bytes_per_token(all_mla_27, costs.ONE_H200)


@exercise("1.6", "all-MLA requests that fit at TP8",
          hint=("Under tensor parallelism MLA's one latent KV head cannot be split: every device keeps all of it.",
                "Divide one device's cache budget by one request's bytes on that device, rounding down."))
def _():
    return costs.max_batch(all_mla_27, costs.VLLM_TP8_H200, 131072)
