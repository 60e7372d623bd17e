"""How long one engine step takes at real model sizes: decodes and prefill chunks on one roofline.

A step runs every decoding request's next token plus the prefill chunks admitted
into it. Its time is the decode step of ``costs.decode_step_seconds`` (batch at
the mean context) plus each chunk's ``costs.PrefillTimer`` time on top of the
tokens the request already holds. Summing the two reads the weights twice when
both run; we accept that (it overcharges mixed steps by one weight read) to keep
both terms the book's one cost model. Memoised: a trace repeats batch sizes.
"""

from __future__ import annotations

from kimilab.config import ModelConfig
from kimilab.costs import DEFAULT_DEPLOYMENT, Deployment, PrefillTimer, decode_step_seconds

__all__ = ["StepTimer"]

_CONTEXT_BUCKET = 1024  # decode time is read at the mean context rounded up to this many tokens


class StepTimer:
    """Simulated seconds of one continuous-batching step on a :class:`~kimilab.costs.Deployment`."""

    def __init__(self, config: ModelConfig, deployment: Deployment = DEFAULT_DEPLOYMENT):
        self.config, self.deployment = config, deployment
        self.prefill = PrefillTimer(config, deployment)
        self._decode: dict = {}

    def decode(self, batch: int, mean_context: float) -> float:
        """One decode step of ``batch`` requests at about ``mean_context`` tokens each."""
        if batch <= 0:
            return 0.0
        ctx = max(1, -(-int(mean_context) // _CONTEXT_BUCKET)) * _CONTEXT_BUCKET
        key = (batch, ctx)
        t = self._decode.get(key)
        if t is None:
            t = self._decode[key] = decode_step_seconds(self.config, ctx, batch, self.deployment)
        return t

    def chunk(self, n_new: int, n_cached: int) -> float:
        """One prefill chunk of ``n_new`` tokens on ``n_cached`` tokens already in the cache."""
        return self.prefill.seconds(n_new, n_cached)
