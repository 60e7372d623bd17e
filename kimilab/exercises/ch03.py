"""Chapter 3's checked exercises: the hybrid model's per-request cache."""

from kimilab import costs
from kimilab.config import kimi_linear_48b, tiny
from kimilab.exercises import exercise


@exercise("3.1", "tiny cache at 1000 tokens",
          hint=("A hybrid request holds KV that grows with its tokens plus states that do not.",
                "Add the global layers' KV for 1,000 tokens to the KDA and conv states of every KDA layer."))
def _():
    return costs.request_total_bytes(tiny, costs.LOCAL, 1000)


@exercise("3.2", "KV overtakes the states",
          hint=("The states are a fixed cost; KV grows by a fixed amount per token.",
                "Find the first whole number of tokens whose KV bytes exceed the fixed-state bytes "
                 "(strictly)."))
def _():
    return costs.checkpoint_bytes(tiny, costs.LOCAL) // costs.kv_bytes_per_token(tiny, costs.LOCAL) + 1


@exercise("3.3", "one 48B request's states",
          hint=("Every KDA layer keeps a recurrent state and a short-conv state, at any length.",
                "Sum one layer's fp32 state and bf16 conv state, then count the KDA layers."))
def _():
    return costs.checkpoint_bytes(kimi_linear_48b, costs.ONE_H200)


@exercise("3.6", "a checkpoint's padding at TP8",
          hint=("vLLM pads each layer's state page up to the attention page, and pads the last group with empty "
                "layer slots.",
                "At TP8 a device keeps 4 of 32 KDA heads but the whole MLA latent; 20 KDA layers fill 3 groups "
                "of 7."))
def _():
    pages = costs.vllm_hybrid_pages(kimi_linear_48b, costs.VLLM_TP8_H200)
    return pages.checkpoint_padding_bytes


@exercise("3.7", "500,000-token hybrid requests at TP8",
          hint=("Under tensor parallelism every device holds a share of every request.",
                "That share is the whole MLA latent and an eighth of the states; divide one device's cache "
                "budget by it, rounding down."))
def _():
    return costs.max_batch(kimi_linear_48b, costs.VLLM_TP8_H200, 500_000)
