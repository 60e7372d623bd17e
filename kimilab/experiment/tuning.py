"""Tune a baseline before comparing with it: the strongest baseline is a tuned one.

A serving engineer sets two scheduler knobs before measuring goodput: the step's token
budget (vLLM's ``--max-num-batched-tokens``, which also sets the prefill chunk) and the most
requests running at once (``--max-num-seqs``). A small budget keeps every decode's step short
(the time between tokens) but prefills slowly; a large one the reverse. Which wins depends on
the model, the traffic and the SLO, so each variant is compared at its own best setting.

:func:`tune` is the grid search, nothing more: the caller's ``measure`` builds the deployment
(``dep.with_(**changes)``) and runs whatever it measures, so this module imports no simulator.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from kimilab.validate import check_int

__all__ = ["BUDGETS", "SEQS", "Tuned", "tune"]

BUDGETS = (2048, 4096, 8192, 16384)  # tokens per step, the 2K-16K
SEQS = (256, 1024)  # requests running at once: vLLM's older default and its H100/H200 default


@dataclass(frozen=True)
class Tuned:
    """The best setting found (``changes``: the Deployment fields to set), its ``value``, and every
    grid point as a row ``{"max_batched_tokens", "max_num_seqs", "value"}`` in the order measured."""

    changes: dict
    value: float
    rows: tuple

    def table(self) -> list[list]:
        """The grid as rows of [budget, seqs, value] (for a chapter's table or a heat map)."""
        return [[r["max_batched_tokens"], r["max_num_seqs"], r["value"]] for r in self.rows]


def _grid(name: str, values) -> tuple:
    values = tuple(check_int(name, v, 1) for v in values)
    if not values or len(set(values)) != len(values):
        raise ValueError(f"{name}={list(values)!r}: expected distinct positive ints, at least one")
    return values


def tune(measure, *, budgets=BUDGETS, seqs=SEQS) -> Tuned:
    """Measure every (budget, seqs) pair and return the best: ``measure(changes) -> float``, higher
    is better, where ``changes = {"max_batched_tokens": b, "max_num_seqs": s}``.

    Deterministic: the grid runs budgets then seqs in the order given; a tie goes to the smaller
    budget, then the fewer sequences (the cheaper setting). A NaN value counts as the worst."""
    if not callable(measure):
        raise ValueError(f"measure={measure!r}: expected a function of the deployment changes")
    budgets, seqs = _grid("budgets", budgets), _grid("seqs", seqs)
    rows, best, best_key = [], None, None
    for b in budgets:
        for s in seqs:
            changes = {"max_batched_tokens": b, "max_num_seqs": s}
            value = measure(dict(changes))
            try:
                value = float(value)
            except (TypeError, ValueError):
                raise ValueError(f"measure({changes}) returned {value!r}: expected a number") from None
            rows.append({**changes, "value": value})
            key = (-math.inf if math.isnan(value) else value, -b, -s)
            if best_key is None or key > best_key:
                best, best_key = (changes, value), key
    return Tuned(best[0], best[1], tuple(rows))
