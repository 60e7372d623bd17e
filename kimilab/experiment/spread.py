"""One number measured over several orders of the same traffic, and when two of them differ.

A goodput found in one arrival order hangs on which burst or heavy session lands where, so the
experiment measures each in several orders: :class:`Spread` is the mean with its min and max,
and :func:`compare` calls a gap no larger than the spread a tie.
"""

from __future__ import annotations

import dataclasses

import numpy as np

__all__ = ["Spread", "compare"]


@dataclasses.dataclass(frozen=True)
class Spread:
    """One number measured over several orders: its ``mean``, ``min`` and ``max``. Its *spread* is half
    the min-max range, so the reading is mean +- spread."""

    mean: float
    min: float
    max: float

    @classmethod
    def of(cls, values) -> "Spread":
        values = [float(v) for v in values]
        if not values:
            raise ValueError("values: expected at least one")
        return cls(float(np.mean(values)), min(values), max(values))

    @classmethod
    def from_row(cls, row: dict, key: str = "goodput") -> "Spread":
        """A row's ``key``, ``key_min`` and ``key_max`` (a row of :func:`agent_capacity` and the like)."""
        return cls(row[key], row.get(f"{key}_min", row[key]), row.get(f"{key}_max", row[key]))

    @property
    def spread(self) -> float:
        return (self.max - self.min) / 2.0


def compare(a, b, key: str = "goodput") -> str:
    """``"higher"`` or ``"lower"`` (a against b), or ``"tie"`` when the gap between the means is no larger
    than the larger of the two spreads (half a min-max range over orders). ``a`` and ``b``: :class:`Spread`
    or rows holding ``key``, ``key_min``, ``key_max``."""
    a, b = (x if isinstance(x, Spread) else Spread.from_row(x, key) for x in (a, b))
    if abs(a.mean - b.mean) <= max(a.spread, b.spread):
        return "tie"
    return "higher" if a.mean > b.mean else "lower"
