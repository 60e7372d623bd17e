"""Trace-driven simulation on deterministic simulated time: one loop, one result type."""

from kimilab.sim.loop import simulate
from kimilab.sim.result import SimResult

__all__ = ["simulate", "SimResult"]
