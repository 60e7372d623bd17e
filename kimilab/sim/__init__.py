"""Trace-driven simulation on deterministic simulated time: one loop, one result type, and sweeps of it."""

from kimilab.sim.loop import simulate
from kimilab.sim.rekey import rekey
from kimilab.sim.result import SimResult
from kimilab.sim.sweep import CACHES, SGLANG_RATIO, Replay, replay, replay_many, simulate_many, vllm_align_interval

__all__ = ["simulate", "SimResult", "Replay", "replay", "replay_many", "CACHES", "SGLANG_RATIO", "rekey",
           "vllm_align_interval", "simulate_many"]
