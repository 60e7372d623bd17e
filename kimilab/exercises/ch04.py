"""Chapter 4's checked exercises: sizing page pools."""

from kimilab import costs
from kimilab.config import kimi_linear_48b
from kimilab.costs import CacheShapes
from kimilab.exercises import exercise
from kimilab.pool import UnifiedPages

GIB = 2**30


@exercise("4.1", "requests in an 8 GiB unified pool",
          hint="pages in the pool = budget // page_bytes; pages per request = its states' pages (ceil per layer) "
               "+ 7 layers x 256 blocks; divide and round down.")
def _():
    s48, layout = CacheShapes.from_config(kimi_linear_48b), UnifiedPages()
    page_bytes = layout.page_bytes(s48)["main"]
    return (8 * GIB // page_bytes) // (layout.footprint(s48, 4096).reserved_bytes // page_bytes)


@exercise("4.2", "vLLM's block at 64-token alignment",
          hint="the smallest multiple of 64 tokens whose MLA page (tokens x 1,152 B) holds one KDA layer's states.")
def _():
    return costs.vllm_hybrid_pages(kimi_linear_48b, costs.ONE_H200, align_tokens=64).block_tokens


@exercise("4.3", "padding of one vLLM state page",
          hint="one layer's page (1,888 tokens x 1,152 B) minus one KDA layer's recurrent + conv state.")
def _():
    return costs.vllm_hybrid_pages(kimi_linear_48b, costs.ONE_H200).state_padding_bytes
