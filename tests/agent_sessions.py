"""Small closed-loop agent sessions for the fleet and engine tests (test_engine, test_disagg)."""

from __future__ import annotations

import numpy as np

from kimilab.fleet.closed import Turn

__all__ = ["random_sessions"]


def random_sessions(seed: int = 1, n_sessions: int = 6, n_turns: int = 5, block: int = 512) -> list[list[Turn]]:
    """Sessions whose every turn re-sends the last one's blocks plus 1-3 new ones (its own hash ids),
    waits for the previous turn and thinks up to a second."""
    rng = np.random.default_rng(seed)
    sessions = []
    for s in range(n_sessions):
        ids, turns = [], []
        for j in range(n_turns):
            ids = ids + [10**6 * (s + 1) + len(ids) + i for i in range(int(rng.integers(1, 4)))]
            n_in = (len(ids) - 1) * block + int(rng.integers(1, block))
            turns.append(Turn(n_in, int(rng.integers(1, 600)), tuple(ids), j - 1, float(rng.uniform(0, 1))))
        sessions.append(turns)
    return sessions
