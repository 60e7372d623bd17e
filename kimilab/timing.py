"""Wall-clock timing for the cells and benchmarks that show real CPU time.

Serving experiments run on simulated time; only cells marked
``# NBVAL_IGNORE_OUTPUT`` and ``bench/`` measure the machine. They all use
:func:`best_seconds`: the best of a few runs is the least disturbed by other work
on a shared machine, and ratios of two best times measured side by side are what
the book reports.
"""

from __future__ import annotations

import time
from typing import Callable

from kimilab.validate import check_int

__all__ = ["best_seconds"]


def best_seconds(fn: Callable[[], object], repeats: int = 3, *, warmup: int = 0) -> float:
    """The fastest of ``repeats`` calls of ``fn()`` in seconds (after ``warmup`` untimed calls)."""
    check_int("repeats", repeats, 1)
    for _ in range(warmup):
        fn()
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return best
