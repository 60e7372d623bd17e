"""Trace-driven simulation on deterministic simulated time: one loop, one result type, and sweeps of it."""

from kimilab.sim.loop import simulate
from kimilab.sim.result import SimResult
from kimilab.sim.sweep import Replay, replay, replay_many

__all__ = ["simulate", "SimResult", "Replay", "replay", "replay_many"]
