"""The unified page pool: pages and handles, the Jenga allocator, page layouts, whole requests.

One concept per module, in the order the book builds them:

* ``handles``     Allocation (pages of one kind, refcounted, with an owner), PoolStats, the errors
* ``pages``       PagePool: one arena of equal pages (or accounting only, any size)
* ``jenga``       LcmPagePool: Jenga's two-level allocator, same interface
* ``layouts``     how a request maps to pages: unified / vLLM-padded / Jenga / split pools
* ``requests``    RequestAllocator: admit, grow, release whole requests on a layout's pools
* ``paged_cache`` PagedHybridCache: the model's cache protocol on pool pages
"""

from kimilab.pool.handles import (Allocation, DoubleFree, ForeignHandle, HandleError, PoolError, PoolExhausted,
                                  PoolStats, RefcountError)
from kimilab.pool.jenga import JengaHandle, LcmPagePool
from kimilab.pool.layouts import Footprint, JengaPages, PageLayout, SplitPools, UnifiedPages, VllmPaddedPages
from kimilab.pool.paged_cache import PagedHybridCache
from kimilab.pool.pages import FREE_CODE, KIND_CODES, UNBOUNDED_PAGES, PageCount, PagePool
from kimilab.pool.requests import RequestAllocator

__all__ = [
    "Allocation", "DoubleFree", "ForeignHandle", "HandleError", "PoolError", "PoolExhausted", "PoolStats",
    "RefcountError", "PagePool", "PageCount", "KIND_CODES", "FREE_CODE", "UNBOUNDED_PAGES", "LcmPagePool", "JengaHandle", "Footprint",
    "PageLayout", "UnifiedPages", "VllmPaddedPages", "JengaPages", "SplitPools", "RequestAllocator",
    "PagedHybridCache",
]
