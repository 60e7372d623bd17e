"""The unified page pool: pages and handles, the Jenga allocator, page layouts, the paged cache."""

from kimilab.pool.pages import *  # noqa: F401,F403
from kimilab.pool.pages import __all__ as _pages_all
from kimilab.pool.paged_cache import PagedHybridCache

__all__ = list(_pages_all) + ["PagedHybridCache"]
