"""Page pool benchmarks: allocate+free throughput, and a paged vs contiguous decode step.

Both comparisons run side by side in this process; ratios are the result, absolute
times depend on the machine.
"""

from __future__ import annotations

import numpy as np

from kimilab import config
from kimilab.model import HybridCache, Model
from kimilab.pool.paged_cache import PagedHybridCache
from kimilab.pool.pages import PagePool
from kimilab.timing import best_seconds


class _ScanPool:
    """The obvious allocator: a free mask searched on every allocation (O(pool))."""

    def __init__(self, n_pages: int):
        self.free_mask = np.ones(n_pages, dtype=bool)

    def allocate(self, n: int) -> np.ndarray:
        pages = np.flatnonzero(self.free_mask)[:n]
        if pages.shape[0] < n:
            raise MemoryError("exhausted")
        self.free_mask[pages] = False
        return pages

    def free(self, pages: np.ndarray) -> None:
        self.free_mask[pages] = True


def _ops_per_second(fn, n_ops: int, repeats: int = 3) -> float:
    return n_ops / best_seconds(fn, repeats)


def bench_alloc_free(n_pages: int = 1 << 20, pages_per_alloc: int = 1, live: int = 256,
                     rounds: int = 5000) -> None:
    """Keep ``live`` allocations around and churn them: each op = one allocate + one free."""
    pool, scan = PagePool(n_pages, 4096, backed=False), _ScanPool(n_pages)
    held = [pool.allocate("kv", pages_per_alloc) for _ in range(live)]
    held_scan = [scan.allocate(pages_per_alloc) for _ in range(live)]

    def churn_pool():
        for i in range(rounds):
            pool.free(held[i % live])
            held[i % live] = pool.allocate("kv", pages_per_alloc)

    def churn_scan():
        for i in range(rounds // 50):
            scan.free(held_scan[i % live])
            held_scan[i % live] = scan.allocate(pages_per_alloc)

    fast = _ops_per_second(churn_pool, rounds)
    slow = _ops_per_second(churn_scan, rounds // 50)  # it is slow; fewer rounds
    print(f"pool alloc+free ({pages_per_alloc} page(s), {n_pages} pages): free-stack vs scan "
          f"ratio={fast / slow:.1f}x (stack={fast:,.0f} ops/s, scan={slow:,.0f} ops/s)")


def _decode_seconds(model, cache, tokens) -> float:
    """Seconds per decode step over ``tokens`` (one timed pass: decoding changes the cache)."""
    return best_seconds(lambda: [model.decode(int(t), cache) for t in tokens], repeats=1) / len(tokens)


def bench_decode(model, context: int, steps: int = 2, rounds: int = 15) -> None:
    """Median seconds per decode step with each cache, interleaved round by round."""
    cfg = model.config
    rng = np.random.default_rng(0)
    prompt = rng.integers(0, 256, size=context)
    pool = PagePool(8192, 4096)
    contiguous, paged = HybridCache(cfg), PagedHybridCache(cfg, pool, block_tokens=16)
    model.prefill(prompt, contiguous)
    model.prefill(prompt, paged)
    a, b = [], []
    for r in range(rounds):
        toks = rng.integers(0, 256, size=steps)
        a.append(_decode_seconds(model, contiguous, toks))
        b.append(_decode_seconds(model, paged, toks))
    ta, tb = float(np.median(a)), float(np.median(b))
    print(f"decode step tiny @ {context} tokens: paged/contiguous ratio={tb / ta:.2f}x "
          f"(paged={tb * 1e3:.3f} ms, contiguous={ta * 1e3:.3f} ms)")
    paged.free()


def main() -> None:
    bench_alloc_free(pages_per_alloc=1)
    bench_alloc_free(pages_per_alloc=16)
    model = Model(config.tiny, seed=0)
    for context in (64, 512):
        bench_decode(model, context)


if __name__ == "__main__":
    main()
