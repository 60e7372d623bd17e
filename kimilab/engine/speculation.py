"""Speculative decoding inside the batched engine: what a step verifies, what it yields, what it costs.

With ``speculation=Speculation(k, alpha)`` every decoding request, every step, has ``k`` draft
tokens verified: the step is ONE forward pass in which each decoder is a chunk of ``k + 1``
positions on its context (beside the step's prefill chunks), then each decoder's state is rolled
back to the drafts it keeps (chapter 8's strategy, timed at the batch by
:func:`~kimilab.costs.spec_time.rollback_seconds`), and the drafter runs ``k`` forwards of its
one layer (:mod:`kimilab.costs.drafter`). A decoder then holds ``k`` more KV slots than it has
tokens (the verify writes them before it knows which it keeps).

**Acceptance is a swept parameter, not a measurement.** The book's models are untrained, so no
drafter of ours agrees with them as a trained MTP head agrees with its model. Each draft is
accepted with probability ``alpha`` given every draft before it was (a chain), so a step yields
1 to k+1 tokens, (1 - alpha^(k+1)) / (1 - alpha) on average. The draw is a hash of (seed, step
index), and **every decoder of a step keeps the same number**: each request's own sequence of
tokens per step has the right distribution (independent across steps, truncated geometric), but
requests in one batch never disagree. That keeps the engine's decode clock (every decoder makes
the same tokens a step, :mod:`kimilab.engine.clock`) and its cost per step O(events); what it
leaves out is the spread of finish times inside a batch.

A step's tokens reach the client as one chunk, so a decoder's gap between tokens is recorded once
per step (as vLLM's serving benchmark records inter-token latency per streamed chunk): speculation
lowers time per output token and raises the gap between chunks.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import lru_cache

from kimilab.config import ModelConfig
from kimilab.costs import Deployment, StepTimer
from kimilab.costs.drafter import DRAFTERS, mtp_config, spec_capacity_tokens
from kimilab.costs.spec_bytes import ROLLBACK_STRATEGIES
from kimilab.costs.spec_time import expected_tokens_per_step, rollback_seconds
from kimilab.speculative.drafters import _draw
from kimilab.validate import check_choice, check_float, check_int

__all__ = ["Speculation", "SpecTimer", "cheapest_rollback", "decode_speedup", "spec_timer"]

CHOOSE_AT_BATCH = 64  # the batch at which the default rollback is chosen (chapter 8's middle batch)


@dataclass(frozen=True)
class Speculation:
    """``k`` drafts a step, each accepted with probability ``alpha`` (given the ones before it);
    ``rollback`` one of chapter 8's strategies (None: the cheapest at the batch,
    :func:`cheapest_rollback`); ``drafter`` ``"mtp"`` (one more layer, its KV and forwards
    counted) or ``"ngram"`` (free); ``seed`` picks the acceptance draws."""

    k: int = 3
    alpha: float = 0.7
    rollback: str | None = None
    drafter: str = "mtp"
    seed: int = 0

    def __post_init__(self) -> None:
        check_int("k", self.k, 1, unit="draft tokens per step")
        a = check_float("alpha", self.alpha, minimum=0.0)
        if a > 1.0:
            raise ValueError(f"alpha={self.alpha!r}: expected an acceptance probability in [0, 1]")
        if self.rollback is not None:
            check_choice("rollback", self.rollback, ROLLBACK_STRATEGIES)
        check_choice("drafter", self.drafter, DRAFTERS)
        check_int("seed", self.seed, 0)

    @property
    def mean_tokens(self) -> float:
        """Tokens a step yields per decoder on average: (1 - alpha^(k+1)) / (1 - alpha)."""
        return expected_tokens_per_step(self.alpha, self.k)

    def tokens(self, step: int) -> int:
        """Tokens every decoder keeps in the engine's step number ``step`` (1 to k+1): the drafts
        accepted before the first rejected one, plus the target's own token."""
        a = self.alpha
        if a >= 1.0:
            return self.k + 1
        if a <= 0.0:
            return 1
        u = _draw(self.seed, step)
        accepted = self.k if u <= 0.0 else int(math.log(u) / math.log(a))  # P(accepted >= j) = a^j
        return 1 + min(self.k, accepted)

    def run_tokens(self, first_step: int, n_steps: int) -> list[int]:
        """:meth:`tokens` of ``n_steps`` steps from ``first_step``."""
        return [self.tokens(first_step + i) for i in range(n_steps)]

    def steps_to(self, first_step: int, need: int, limit: int) -> tuple[int, list[int]]:
        """The fewest steps from ``first_step`` (at most ``limit``, at least one) whose tokens add up
        to ``need``, and their tokens."""
        got, out = 0, []
        while len(out) < max(1, limit) and (got < need or not out):
            m = self.tokens(first_step + len(out))
            out.append(m)
            got += m
        return len(out), out

    def capacity_tokens(self, cfg: ModelConfig, deployment: Deployment) -> int:
        """The pool in tokens when the drafter's weights and KV share the HBM
        (:func:`~kimilab.costs.drafter.spec_capacity_tokens`)."""
        return spec_capacity_tokens(cfg, deployment, self.drafter)

    def label(self) -> str:
        return f"k={self.k}, alpha={self.alpha:g}, {self.drafter}"


def cheapest_rollback(cfg: ModelConfig, deployment: Deployment, k: int, alpha: float,
                      batch: int = CHOOSE_AT_BATCH) -> str:
    """Chapter 8's choice: the strategy whose rollback costs least at ``batch`` requests, keeping the
    mean tokens of a step (ties, as for a model without KDA layers, go to the first in
    :data:`~kimilab.costs.spec_bytes.ROLLBACK_STRATEGIES` order)."""
    mean = expected_tokens_per_step(alpha, k)
    kept = max(1, min(k + 1, int(round(mean))))
    cost = {s: rollback_seconds(cfg, deployment, s, k, kept, batch=batch, tokens_per_step=mean)
            for s in ROLLBACK_STRATEGIES}
    return min(ROLLBACK_STRATEGIES, key=lambda s: (round(cost[s], 15), ROLLBACK_STRATEGIES.index(s)))


class SpecTimer:
    """Seconds of speculative steps on one deployment: the verify forward (decoders as chunks of
    k+1, :meth:`StepTimer.step` with ``positions``), each decoder's rollback at the batch, and the
    drafter's ``k`` one-layer forwards (none for n-gram). Shared, below the scheduler, by the
    engine and its reference twin."""

    def __init__(self, cfg: ModelConfig, deployment: Deployment, spec: Speculation, timer: StepTimer):
        if not isinstance(spec, Speculation):
            raise ValueError(f"speculation: expected a kimilab.engine.Speculation, got {type(spec).__name__}")
        self.spec, self.timer, self.cfg, self.deployment = spec, timer, cfg, deployment
        self.strategy = spec.rollback or cheapest_rollback(cfg, deployment, spec.k, spec.alpha)
        self._draft = StepTimer(mtp_config(cfg), deployment) if spec.drafter == "mtp" else None
        self._rollback = lru_cache(maxsize=65536)(self._rollback_seconds)

    def _rollback_seconds(self, kept: int, batch: int) -> float:
        return rollback_seconds(self.cfg, self.deployment, self.strategy, self.spec.k, kept, batch=batch,
                                tokens_per_step=self.spec.mean_tokens)

    def draft_seconds(self, n_decode: int, context_sum: int) -> float:
        """The drafter's forwards in a step: one over each decoder's k+1 verified positions, then k-1
        of one token each."""
        if self._draft is None or n_decode == 0:
            return 0.0
        k, d = self.spec.k, self._draft
        first = d.step(n_decode, context_sum, positions=k + 1)
        return first + (k - 1) * d.step(n_decode, context_sum + n_decode * (k + 1))

    def step(self, n_decode: int, context_sum: int, chunks, kept: list[int]) -> float:
        """Mean seconds of ``len(kept)`` speculative steps at the same batch, timed at ``context_sum``
        (the run's middle), ``kept[i]`` tokens kept by every decoder in step i."""
        k = self.spec.k
        if n_decode == 0:
            return self.timer.step(0, 0, chunks)
        forward = self.timer.step(n_decode, context_sum, chunks, positions=k + 1)
        back = sum(self._rollback(m, n_decode) for m in kept) / len(kept)
        return forward + back + self.draft_seconds(n_decode, context_sum)


def decode_speedup(cfg: ModelConfig, deployment: Deployment, spec: Speculation, batch: int, context_len: int,
                   steps: int = 4096) -> float:
    """Output tokens per second of a batch of ``batch`` decoders at ``context_len`` tokens each with
    ``spec``, over the same batch decoding plainly: the mean tokens a step over the mean step time,
    both over ``steps`` acceptance draws (what a decode-only engine sees; no prefill shares the step)."""
    batch = check_int("batch", batch, 1)
    ctx = check_int("context_len", context_len, 0, unit="tokens") * batch
    timer = StepTimer(cfg, deployment)
    kept = spec.run_tokens(0, check_int("steps", steps, 1))
    verify = SpecTimer(cfg, deployment, spec, timer).step(batch, ctx, (), kept)
    return (sum(kept) / len(kept)) / verify * timer.step(batch, ctx)


def spec_timer(cfg: ModelConfig, deployment: Deployment, speculation: Speculation | None, timer: StepTimer,
               dp: bool) -> SpecTimer | None:
    """An engine's :class:`SpecTimer` (None without speculation); refused under DP-attention, whose
    rollback would be charged for the whole instance's batch on each device."""
    if speculation is None:
        return None
    if dp:
        raise ValueError(f"speculation: not modelled under DP-attention (deployment={deployment.name!r}); "
                         "use a tensor-parallel deployment")
    return SpecTimer(cfg, deployment, speculation, timer)
