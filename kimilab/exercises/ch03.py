"""Chapter 3's checked exercises: the hybrid model's per-request cache."""

from kimilab import costs
from kimilab.config import kimi_linear_48b, tiny
from kimilab.exercises import exercise


@exercise("3.1", "tiny cache at 1000 tokens",
          hint=("A hybrid request holds KV that grows with its tokens plus states that do not.",
                "Add the global layers' KV for 1,000 tokens to the KDA and conv states of every KDA layer."))
def _():
    return costs.request_total_bytes(tiny, 1000)


@exercise("3.2", "KV overtakes the states",
          hint=("The states are a fixed cost; KV grows by a fixed amount per token.",
                "Find the first whole number of tokens whose KV bytes exceed the fixed-state bytes "
                 "(strictly)."))
def _():
    return costs.checkpoint_bytes(tiny) // costs.kv_bytes_per_token(tiny) + 1


@exercise("3.3", "one 48B request's states",
          hint=("Every KDA layer keeps a recurrent state and a short-conv state, at any length.",
                "Sum one layer's fp32 state and bf16 conv state, then count the KDA layers."))
def _():
    return costs.checkpoint_bytes(kimi_linear_48b)
