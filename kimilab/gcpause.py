"""Pause Python's cyclic garbage collector while a long simulation runs.

A fleet run makes and drops millions of small objects (tree nodes, page handles,
checkpoints); reference counting frees every one of them, because a run makes no
reference cycles per request (``tests/test_engine.py`` checks it). The cyclic
collector does not know that: every few hundred allocations it walks the young
objects, and every so often all of the run's live ones. On a 100,000-request run
that walking was a third of the wall time. Results do not depend on it.

The caches themselves are cycles (a tree node and its parent point at each other), so
a dropped fleet used to wait for the collector: once resumed, it walked everything the
run had left, about a second per run of the Mooncake trace. ``Fleet.close`` unlinks the
trees, and ``with Fleet(...)`` keeps the collector paused until then, so what the run
made is freed by reference counting too.
"""

from __future__ import annotations

import gc
from contextlib import contextmanager

__all__ = ["gc_paused"]


@contextmanager
def gc_paused():
    """Disable the cyclic collector inside the block; restore its previous state after."""
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was_enabled:
            gc.enable()
