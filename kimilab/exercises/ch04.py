"""Chapter 4's checked exercises: sizing page pools."""

from kimilab import costs
from kimilab.config import kimi_linear_48b
from kimilab.costs import CacheShapes
from kimilab.exercises import exercise
from kimilab.pool import UnifiedPages

DEP = costs.DEFAULT_DEPLOYMENT  # per device of vLLM's TP4 recipe


@exercise("4.1", "4,096-token requests in one TP4 device's unified pool",
          hint="pages in the pool = the device's cache budget // page bytes; pages per request = its states' pages "
               "(rounded up per layer) + its KV blocks in every global layer; divide and round down.")
def _():
    s48, layout = CacheShapes.from_config(kimi_linear_48b, DEP), UnifiedPages()
    page_bytes = layout.page_bytes(s48)["main"]
    budget = int(costs.cache_budget_bytes(kimi_linear_48b, DEP))
    return (budget // page_bytes) // (layout.footprint(s48, 4096).reserved_bytes // page_bytes)


@exercise("4.2", "vLLM's block at 64-token alignment on a TP4 device",
          hint="the smallest multiple of 64 tokens whose MLA page on one device holds one KDA layer's states there.")
def _():
    return costs.vllm_hybrid_pages(kimi_linear_48b, DEP, align_tokens=64).block_tokens


@exercise("4.3", "padding of one vLLM state page on a TP4 device",
          hint="one layer's page on the device (its block x one MLA layer's bytes per token) minus one KDA layer's "
               "recurrent + conv state on that device.")
def _():
    return costs.vllm_hybrid_pages(kimi_linear_48b, DEP).state_padding_bytes
