"""Trace-driven simulation of a serving cache on deterministic simulated time."""
