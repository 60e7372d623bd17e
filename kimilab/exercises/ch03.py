"""Chapter 3's checked exercises: the hybrid model's per-request cache."""

from kimilab import costs
from kimilab.config import kimi_linear_48b, tiny
from kimilab.exercises import exercise


@exercise("3.1", "tiny cache at 1000 tokens",
          hint="KV grows by 2 layers x 2 x 4 heads x 32 x 8 B per token; the KDA and conv states are fixed.")
def _():
    return costs.request_total_bytes(tiny, costs.LOCAL, 1000)


@exercise("3.2", "KV overtakes the states", hint="divide the fixed-state bytes by the KV bytes per token, plus one.")
def _():
    return costs.checkpoint_bytes(tiny, costs.LOCAL) // costs.kv_bytes_per_token(tiny, costs.LOCAL) + 1


@exercise("3.3", "one 48B request's states",
          hint="20 KDA layers x (32 x 128 x 128 fp32 state + the bf16 conv state); costs.checkpoint_bytes.")
def _():
    return costs.checkpoint_bytes(kimi_linear_48b, costs.ONE_H200)
