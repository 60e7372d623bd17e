"""Chapter 4's checked exercises: sizing page pools."""

from kimilab import costs
from kimilab.config import kimi_linear_48b
from kimilab.costs import CacheShapes
from kimilab.exercises import exercise
from kimilab.pool import UnifiedPages

GIB = 2**30


@exercise("4.1", "requests in an 8 GiB unified pool",
          hint=("A request's footprint is whole pages: its fixed states, then its KV pages.",
                "Round up per layer and per kind, count a request's pages, and see how many whole requests "
                 "the budget's pages hold."))
def _():
    s48, layout = CacheShapes.from_config(kimi_linear_48b, costs.ONE_H200), UnifiedPages()
    page_bytes = layout.page_bytes(s48)["main"]
    return (8 * GIB // page_bytes) // (layout.footprint(s48, 4096).reserved_bytes // page_bytes)


@exercise("4.2", "vLLM's block at 64-token alignment",
          hint=("vLLM makes every layer's page the same size, so an attention block must be large enough to "
                 "hold one KDA layer's states.",
                "The block's token count is a multiple of the alignment; take the smallest one whose "
                 "attention page holds the states."))
def _():
    return costs.vllm_hybrid_pages(kimi_linear_48b, costs.ONE_H200, align_tokens=64).block_tokens


@exercise("4.3", "padding of one vLLM state page",
          hint=("Equal-size pages: a state page is as big as an attention block's page, whatever the state "
                 "needs.",
                "Padding is the page's bytes minus one KDA layer's recurrent and conv state bytes."))
def _():
    return costs.vllm_hybrid_pages(kimi_linear_48b, costs.ONE_H200).state_padding_bytes
