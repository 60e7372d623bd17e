"""Chapter 1's checked exercises: what a KV cache costs in bytes."""

from kimilab import costs
from kimilab.config import all_mla_27, gqa_8b
from kimilab.exercises import exercise


@exercise("1.1", "MHA bytes per token", hint="layers x 2 (K and V) x KV heads x head dim x 2 bytes (bf16).")
def _():
    return costs.kv_bytes_per_token(gqa_8b.with_(attn_kind="mha", attn_kv_heads=32), costs.ONE_H200)


@exercise("1.2", "GQA cache of a 32k-token request", hint="KV bytes per token of gqa_8b times 32,768 tokens.")
def _():
    return costs.kv_bytes_per_token(gqa_8b, costs.ONE_H200) * 32768


@exercise("1.3", "cache = weights", rtol=0.01,
          hint="the weights are stored once; the cache grows by a fixed number of bytes per token.")
def _():
    return costs.device_weight_bytes(all_mla_27, costs.ONE_H200) / costs.kv_bytes_per_token(all_mla_27, costs.ONE_H200)


@exercise("1.6", "all-MLA requests that fit at TP8",
          hint="each device keeps the whole MLA latent of every request (one KV head cannot be split): "
               "divide one device's cache budget by one request's bytes, rounding down.")
def _():
    return costs.max_batch(all_mla_27, costs.VLLM_TP8_H200, 131072)
