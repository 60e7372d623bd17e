"""What a speculative run is held to: plain greedy decoding, one token at a time.

Speculative decoding is exact only if, after every step, its tokens and its KDA and conv
states equal those of decoding one token at a time. :class:`GreedyReference` runs that
plain decode once and keeps its states at every cache length, so a check -- a test, a
chapter's table -- compares any step's cache with the same position;
:func:`predicted_moved` is what :mod:`kimilab.costs.spec` says a step moved, from the
step's own record, to hold a strategy's byte count to.
"""

from __future__ import annotations

from typing import Sequence

import numpy as np

from kimilab.costs import LOCAL, Deployment
from kimilab.costs.spec import moved_bytes
from kimilab.model import Model
from kimilab.speculative.loop import StepStats
from kimilab.validate import check_int

__all__ = ["GreedyReference", "predicted_moved"]


class GreedyReference:
    """``model``'s greedy continuation of ``prompt`` (``tokens``, ``n_new`` of them) and the
    states of the plain decode that produced it, per cache length (``states``)."""

    def __init__(self, model: Model, prompt: Sequence[int], n_new: int):
        n_new = check_int("n_new", n_new, 1, unit="tokens")
        self.kda_layers = tuple(model.config.kda_layers)
        self.cache = cache = model.new_cache()
        logits = model.prefill(list(prompt), cache)[-1]
        self.tokens: list[int] = []
        self.states: dict = {}
        while True:
            self.states[cache.seq_len] = cache.checkpoint()
            self.tokens.append(int(np.argmax(logits)))
            if len(self.tokens) == n_new:
                break
            logits = model.decode(self.tokens[-1], cache)

    def state_error(self, cache) -> float:
        """Largest ``|difference|`` between ``cache``'s KDA and conv states and plain decoding's at the
        same length (0.0 for an exact step)."""
        ref = self.states.get(cache.seq_len)
        if ref is None:
            raise ValueError(f"cache.seq_len={cache.seq_len}: expected a length the reference decoded "
                             f"({min(self.states)}..{max(self.states)})")
        return max(max(float(np.abs(cache.kda_state(i) - ref.kda_states[i]).max()),
                       float(np.abs(cache.conv_state(i) - ref.conv_states[i]).max())) for i in self.kda_layers)


def predicted_moved(model: Model, rollback: str, k: int, stats: StepStats, nodes: int | None = None, *,
                    deployment: Deployment = LOCAL, act_bytes: int = 8) -> int:
    """The bytes :func:`kimilab.costs.spec.moved_bytes` predicts for one recorded step of ``rollback``
    (``act_bytes=8``: the reduced model computes in float64)."""
    kept = len(stats.path)
    return moved_bytes(model.config, deployment, rollback, k, kept, nodes=nodes, history=stats.history,
                       flush=stats.flushed, gathered=list(stats.path) != list(range(kept)), act_bytes=act_bytes)
