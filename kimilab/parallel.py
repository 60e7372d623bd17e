"""Independent jobs spread over processes, or run here where no process can start.

The book's sweeps (replays, memory-budget runs, fleet runs, the policy map, Part B's rows) are
embarrassingly parallel and deterministic: a job's result does not depend on the process that ran
it. So one helper serves them all. Python in the browser (JupyterLite's Pyodide,
``sys.platform == "emscripten"``) starts no processes; there every job runs in this process, one
after another, with the same results. The pool is imported only when it is used, for the same
reason.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable, Sequence

__all__ = ["CAN_START_PROCESSES", "default_workers", "pool_map"]

CAN_START_PROCESSES = sys.platform != "emscripten"


def default_workers(jobs: int, cap: int = 2) -> int:
    """How many processes ``jobs`` jobs get by default: one per core, at most ``cap``; 1 in the browser."""
    if not CAN_START_PROCESSES:
        return 1
    return max(1, min(cap, jobs, os.cpu_count() or 1))


def pool_map(fn: Callable, items: Sequence, workers: int, *, on_done: Callable[[int, int, object], None] | None = None) -> list:
    """``[fn(x) for x in items]`` on ``workers`` processes, results in the items' order.

    One worker, fewer than two items, or no processes (the browser) run the jobs here. ``on_done(i, k, result)``
    (if given) hears that item ``i`` finished, the ``k``-th to finish, with its result. ``fn`` must be importable by name
    (a module-level function), as a process pool requires.
    """
    items = list(items)
    done = [None] * len(items)
    if workers <= 1 or len(items) < 2 or not CAN_START_PROCESSES:
        for i, item in enumerate(items):
            done[i] = fn(item)
            if on_done is not None:
                on_done(i, i + 1, done[i])
        return done
    from concurrent.futures import ProcessPoolExecutor, as_completed  # lazily: the browser has no processes

    with ProcessPoolExecutor(max_workers=workers) as pool:
        futures = {pool.submit(fn, item): i for i, item in enumerate(items)}
        for k, future in enumerate(as_completed(futures), start=1):
            i = futures[future]
            done[i] = future.result()
            if on_done is not None:
                on_done(i, k, done[i])
    return done
