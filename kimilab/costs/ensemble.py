"""Every plausible set of kernel numbers, and a verdict's band over them.

A time, a goodput or a price rests on kernel numbers that measurements pin only to a range:
the GEMM curve's measured spread, the KDA kernel carried from an H20 to an H100 (no H100
measurement exists), the report's unstated hardware (4 or 8 H800s fit almost equally), and
CUDA-graph against eager execution. :func:`members` is every combination of those, the
central one being :data:`~kimilab.costs.deployment.CALIBRATED`. :func:`band` computes a number
under each and says whether a verdict holds across all of them or where it flips. A number
made of bytes alone does not move with any of this: :func:`band` says so when it sees no spread.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from functools import lru_cache
from typing import Callable

from kimilab.costs.deployment import CALIBRATED, Deployment, Kernels

__all__ = ["Member", "members", "member_deployments", "Band", "band", "AXES"]

# Each axis: (name, [(label, changes to CALIBRATED)]); the first choice of each is the central one.
# Numbers: the GEMM spread is operators.gemm_spread on Vidur's H100 rows (10th/90th percentiles at
# >= 256 tokens); KDA is operators.KDA_ON_H100; the hardware rows are calibration.fit_report's two
# best fits; the eager overhead is the 4 x H800 fit's. Tests recompute each.
AXES: tuple[tuple[str, tuple[tuple[str, dict], ...]], ...] = (
    ("GEMM", (("Vidur curve", {}), ("10th pct", {"gemm": 0.739 * 0.824}), ("90th pct", {"gemm": min(1.0, 0.739 * 1.155)}))),
    ("KDA", (("central", {}), ("H100 = H20 speed", {"kda": 0.030}), ("FlashKDA share", {"kda": 0.402}))),
    ("report hardware", (("4 x H800", {}), ("8 x H800", {"attention": 0.44, "bandwidth": 0.759}))),
    ("overhead", (("CUDA graphs", {}), ("eager", {"layer_overhead_s": 1.17e-04}))),
)


@dataclass(frozen=True)
class Member:
    """One plausible set of kernel numbers: ``choices`` names the pick on each axis."""

    choices: tuple[str, ...]
    kernels: Kernels

    @property
    def name(self) -> str:
        return ", ".join(f"{axis}: {c}" for (axis, _), c in zip(AXES, self.choices))

    def differs(self) -> str:
        """Only the axes where this member leaves the central choice ("central" if none)."""
        out = [f"{axis} {c}" for (axis, opts), c in zip(AXES, self.choices) if c != opts[0][0]]
        return ", ".join(out) or "central"


@lru_cache(maxsize=1)
def members() -> tuple[Member, ...]:
    """Every combination of the axes' choices (central first)."""
    combos = [((), {})]
    for _, options in AXES:
        combos = [(names + (label,), changes | more) for names, changes in combos for label, more in options]
    return tuple(Member(names, dataclasses.replace(CALIBRATED, **changes)) for names, changes in combos)


def member_deployments(deployment: Deployment) -> list[Deployment]:
    """``deployment`` under each member's kernels (the central one first)."""
    return [deployment.with_(kernels=m.kernels) for m in members()]


@dataclass(frozen=True)
class Band:
    """A number's central value and its range over the members, and what that does to a verdict."""

    central: float
    lo: float
    hi: float
    lo_member: str
    hi_member: str
    label: str  # "holds across the band", "flips: ...", or "byte-driven: no kernel moves it"

    def describe(self, fmt: str = "{:.3g}", unit: str = "") -> str:
        u = f" {unit}" if unit else ""
        if self.lo == self.hi:
            return f"{fmt.format(self.central)}{u} ({self.label})"
        return f"{fmt.format(self.central)}{u} [{fmt.format(self.lo)}-{fmt.format(self.hi)}] ({self.label})"


def band(value: Callable[[Deployment], float], deployment: Deployment,
         verdict: Callable[[float], bool] | None = None, *, rel_tol: float = 1e-9,
         only: Callable[[Member], bool] | None = None) -> Band:
    """``value`` under every member (or those ``only`` keeps; the central one always). With
    ``verdict`` (a test on the value, e.g. ``lambda x: x > 1``) the label says whether it holds
    across the band or under how many members it flips, and the member nearest the centre that
    flips it (fewest axes changed)."""
    ms = members()
    if only is not None:
        ms = (ms[0],) + tuple(m for m in ms[1:] if only(m))
    vals = [float(value(deployment.with_(kernels=m.kernels))) for m in ms]
    central = vals[0]
    i_lo = min(range(len(vals)), key=vals.__getitem__)
    i_hi = max(range(len(vals)), key=vals.__getitem__)
    lo, hi = vals[i_lo], vals[i_hi]
    if hi - lo <= rel_tol * max(abs(hi), abs(lo), 1e-300):
        label = "byte-driven: no kernel number moves it"
    elif verdict is None:
        label = "range over the kernel band"
    else:
        want = verdict(central)
        flips = [i for i, v in enumerate(vals) if verdict(v) != want]
        if not flips:
            label = "holds across the band"
        else:
            nearest = min(flips, key=lambda i: sum(c != opts[0][0] for (_, opts), c in zip(AXES, ms[i].choices)))
            label = f"flips under {len(flips)} of {len(vals)} sets, e.g. {ms[nearest].differs()}"
    return Band(central, lo, hi, ms[i_lo].differs(), ms[i_hi].differs(), label)
