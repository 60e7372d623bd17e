"""Rollback wall-clock time on the reduced model: what ``current``, ``save`` and ``restore`` cost.

CPU seconds of numpy code, measured side by side in one process (best of a few runs):
useful as ratios between strategies on this machine, not as GPU predictions. The
analytic times at 48B sizes are :func:`kimilab.costs.spec.rollback_seconds`.
"""

from __future__ import annotations

from typing import Iterable

import numpy as np

from kimilab.model import Model
from kimilab.pool import PagePool
from kimilab.speculative.loop import make_rollback
from kimilab.speculative.verify import verify
from kimilab.validate import check_int

__all__ = ["rollback_timings"]

_PAGE_BYTES = 4096
_WARM = 2  # untimed steps first: the rings' one-time allocation, and a lazy ring's history


def rollback_timings(model: Model, rollback: str, k: int, keeps: Iterable[int], *, prompt_len: int = 64,
                     repeats: int = 5, seed: int = 0, ring_len: int | None = None) -> dict[int, dict[str, float]]:
    """{keep: {"current": s, "save": s, "restore": s}}: best seconds of one step's parts.

    Each run clones a prefilled cache, makes a fresh strategy, does a few untimed steps
    keeping one position, then times a verify of k+1 random tokens: ``current`` (a lazy
    ring's fold of its history), ``save``, and ``restore`` keeping ``keep`` positions.
    """
    k = check_int("k", k, 1)
    repeats = check_int("repeats", repeats, 1)
    rng = np.random.default_rng(seed)
    vocab = model.config.vocab_size
    base = model.new_cache()
    model.prefill(rng.integers(0, vocab, check_int("prompt_len", prompt_len, 1)).tolist(), base)
    windows = [rng.integers(0, vocab, k + 1).tolist() for _ in range(_WARM + 1)]
    kw = {"ring_len": ring_len} if rollback == "lazy-ring" else {}
    out = {}
    for keep in keeps:
        keep = check_int("keep", keep, 1)
        if keep > k + 1:
            raise ValueError(f"keeps: {keep} > k+1={k + 1} verified positions")
        best = {"current": float("inf"), "save": float("inf"), "restore": float("inf")}
        for _ in range(repeats):
            cache = base.clone()
            pages = make_rollback(rollback, model, None, k, **kw).scratch_pages(_PAGE_BYTES)
            strategy = make_rollback(rollback, model, PagePool(max(1, pages), _PAGE_BYTES), k, **kw)
            try:
                for step, window in enumerate(windows):
                    if step == _WARM:
                        strategy.seconds = dict.fromkeys(strategy.seconds, 0.0)
                    _, captures, view = verify(model, window, strategy.current(cache))
                    strategy.save(view, captures)
                    strategy.restore(cache, keep if step == _WARM else 1)
            finally:
                strategy.close()
            for part in best:
                best[part] = min(best[part], strategy.seconds[part])
        out[keep] = best
    return out
