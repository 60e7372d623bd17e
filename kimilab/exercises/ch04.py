"""Chapter 4's checked exercises: sizing page pools."""

from kimilab import costs
from kimilab.config import kimi_linear_48b
from kimilab.costs import CacheShapes
from kimilab.exercises import exercise
from kimilab.pool import UnifiedPages, VllmPaddedPages

DEP = costs.DEFAULT_DEPLOYMENT  # per device of vLLM's TP4 recipe


@exercise("4.1", "4,096-token requests in one TP4 device's unified pool",
          hint=("A request's footprint is whole pages: its fixed states, then its KV pages, all sized for one "
                "device.",
                "Count the pool's pages from the device's cache budget, then a request's pages (rounded up per "
                "layer and kind), and see how many whole requests fit."))
def _():
    s48, layout = CacheShapes.from_config(kimi_linear_48b, DEP), UnifiedPages()
    page_bytes = layout.page_bytes(s48)["main"]
    budget = int(costs.cache_budget_bytes(kimi_linear_48b, DEP))
    return (budget // page_bytes) // (layout.footprint(s48, 4096).reserved_bytes // page_bytes)


@exercise("4.2", "vLLM's block on a TP2 device",
          hint=("vLLM makes every layer's page the same size, so an attention block must be large enough to "
                "hold one KDA layer's states on one device.",
                "The block's token count is a multiple of the alignment; take the smallest one whose "
                "attention page holds the states."))
def _():
    return costs.vllm_hybrid_pages(kimi_linear_48b, DEP.with_(name="vllm-tp2-h200", n_devices=2)).block_tokens


@exercise("4.3", "padding of one vLLM state page on a TP4 device",
          hint=("Equal-size pages: a state page is as big as an attention block's page, whatever the state "
                "needs.",
                "Padding is the page's bytes minus one KDA layer's recurrent and conv state bytes, on one device."))
def _():
    return costs.vllm_hybrid_pages(kimi_linear_48b, DEP).state_padding_bytes


@exercise("4.4", "how many more short chats fit in a TP4 device's unified pool than in vLLM's",
          hint=("Both layouts get the same device budget; what differs is how many whole pages a short request "
                "takes in each.",
                "For each layout, count whole pages in the budget and whole pages per 300-token request; the "
                "answer is the difference of the two request counts."))
def _():
    s48, budget = CacheShapes.from_config(kimi_linear_48b, DEP), int(costs.cache_budget_bytes(kimi_linear_48b, DEP))
    fits = []
    for layout in (UnifiedPages(), VllmPaddedPages()):
        page = layout.page_bytes(s48)["main"]
        fits.append((budget // page) // (layout.footprint(s48, 300).reserved_bytes // page))
    return fits[0] - fits[1]
