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
          hint="20 KDA layers x (32 x 128 x 128 fp32 state + the bf16 conv state of 3 x 12,288 channels).")
def _():
    return costs.checkpoint_bytes(kimi_linear_48b, costs.ONE_H200)


@exercise("3.6", "a checkpoint's padding at TP8",
          hint="per device at TP8 a KDA layer keeps 4 of its 32 heads but an MLA page holds the whole latent; "
               "the block is the smallest multiple of 16 tokens whose page holds one layer's state, and 20 KDA "
               "layers fill 3 groups of 7.")
def _():
    pages = costs.vllm_hybrid_pages(kimi_linear_48b, costs.VLLM_TP8_H200)
    return pages.checkpoint_padding_bytes


@exercise("3.7", "524,288-token hybrid requests at TP8",
          hint="under TP every device holds a share of every request: the whole MLA latent and an eighth of the "
               "states; divide one device's cache budget by that, rounding down.")
def _():
    return costs.max_batch(kimi_linear_48b, costs.VLLM_TP8_H200, 524288)
