"""Where a method starts or stops paying: a crossover found by root-finding, with its band.

A verdict "X pays from n tokens" is only honest if n is a crossing of the measured gain
through break-even, found finely -- not the first grid point past it -- and if the sweep
can say "pays everywhere in the sweep" or "never pays in the sweep" when there is no
crossing inside it. :func:`crossover` does that for a gain function of one variable
(bisection on a sign change of ``gain(x) - level``, on a log or linear axis);
:func:`band` repeats it over seeds or over the values an uncertain input may take.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable, Iterable

from kimilab.validate import check_float

__all__ = ["Crossover", "crossover", "band"]


@dataclass(frozen=True)
class Crossover:
    """A crossing at ``x`` (or None), and what the sweep [lo, hi] showed."""

    x: float | None
    kind: str  # "crossing", "pays everywhere in the sweep", "never pays in the sweep"
    lo: float
    hi: float
    rising: bool | None = None  # True: pays above x; False: pays below x

    def describe(self, unit: str = "", fmt: str = "{:,.0f}") -> str:
        if self.x is None:
            return f"{self.kind} ({fmt.format(self.lo)}-{fmt.format(self.hi)}{' ' + unit if unit else ''})"
        side = "from" if self.rising else "up to"
        return f"pays {side} {fmt.format(self.x)}{' ' + unit if unit else ''}"


def crossover(gain: Callable[[float], float], lo: float, hi: float, *, level: float = 0.0,
              log: bool = True, grid: int = 33, tol: float = 1e-3,
              integer: bool = False) -> Crossover:
    """The x in [lo, hi] where ``gain(x)`` crosses ``level`` ("pays" means gain > level).

    A grid of ``grid`` points (log-spaced if ``log``) finds the first sign change; bisection
    then narrows it to a relative ``tol`` (to one unit if ``integer``). With no sign change
    the result says whether the method pays everywhere or nowhere in the sweep. Several
    sign changes: the first, from the low end (the grid must be fine enough to see them).
    """
    lo, hi = check_float("lo", lo), check_float("hi", hi)
    if not (lo < hi and (lo > 0 or not log)):
        raise ValueError(f"lo={lo}, hi={hi}: expected lo < hi (and lo > 0 on a log axis)")
    xs = ([lo * (hi / lo) ** (i / (grid - 1)) for i in range(grid)] if log
          else [lo + (hi - lo) * i / (grid - 1) for i in range(grid)])
    if integer:
        xs = sorted({int(round(x)) for x in xs})
    signs = [gain(x) > level for x in xs]
    if all(signs):
        return Crossover(None, "pays everywhere in the sweep", lo, hi)
    if not any(signs):
        return Crossover(None, "never pays in the sweep", lo, hi)
    i = next(j for j in range(1, len(xs)) if signs[j] != signs[0])
    a, b, rising = xs[i - 1], xs[i], signs[i]
    while (b - a > 1) if integer else (b - a > tol * max(abs(a), abs(b), 1e-300)):
        mid = (a + b) // 2 if integer else (math.sqrt(a * b) if log and a > 0 else (a + b) / 2)
        if (gain(mid) > level) == rising:
            b = mid
        else:
            a = mid
    return Crossover(b if rising else a, "crossing", lo, hi, rising)


def band(results: Iterable[Crossover]) -> tuple[float | None, float | None, float | None, int]:
    """(min, median, max) of the crossings over seeds or inputs, and how many had none."""
    results = list(results)
    xs = sorted(c.x for c in results if c.x is not None)
    missing = sum(c.x is None for c in results)
    if not xs:
        return None, None, None, missing
    return xs[0], xs[len(xs) // 2], xs[-1], missing
