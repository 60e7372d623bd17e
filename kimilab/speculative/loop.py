"""The speculative decoding loop: draft -> verify -> accept -> roll back, greedy and exact.

The cache always holds every emitted token but the last (the *pending* one), exactly
as :meth:`kimilab.model.Model.generate` leaves it. One step:

1. the drafter proposes up to k tokens d_1..d_k after the text so far;
2. verify ``[pending, d_1..d_k]`` in one chunked forward from the committed state;
3. accept the drafts the target's argmax agrees with (j of them), plus the target's own
   token after them: j+1 new tokens (cut at ``max_new_tokens``, which may fall inside a
   window);
4. the rollback strategy moves the cache to committed + (tokens kept) positions.

So the output is the target's greedy output token for token, whatever the drafter
proposes; a drafter only changes how many tokens each forward pass yields.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Sequence

import numpy as np

from kimilab.model import CacheProtocol, Model
from kimilab.pool import PagedHybridCache, PagePool
from kimilab.speculative.drafters import Drafter
from kimilab.speculative.replay import ReplayRollback, RingRollback
from kimilab.speculative.rollback import Rollback, SnapshotRollback, TrimOnly
from kimilab.speculative.verify import greedy_accept, verify
from kimilab.validate import check_choice, check_int

__all__ = ["ROLLBACKS", "StepStats", "SpecResult", "make_rollback", "speculative_generate"]

# "none" is the broken trim, kept only to show what goes wrong without a rollback.
ROLLBACKS = ("snapshot", "replay", "ring", "none")
SCRATCH_PAGE_BYTES = 4096  # page size of the private scratch pool a contiguous cache gets


@dataclass(frozen=True)
class StepStats:
    """One verify step: where it started, drafts proposed, accepted, tokens emitted, scratch held."""

    position: int  # cache.seq_len before the verify
    drafted: int
    accepted: int  # drafts kept (<= drafted)
    emitted: int  # new tokens this step (accepted + 1, or fewer at max_new_tokens)
    rollback_bytes: int  # scratch bytes the strategy held for this step (data, no padding)
    scratch_pages: int  # pool pages of kind "scratch" in use after the step


@dataclass(frozen=True)
class SpecResult:
    """The generated tokens and what every step did."""

    tokens: list[int]
    steps: tuple[StepStats, ...]
    rollback: str
    k: int
    seconds: dict = field(default_factory=dict, compare=False)  # wall clock in save / restore

    @property
    def drafted(self) -> int:
        return sum(s.drafted for s in self.steps)

    @property
    def accepted(self) -> int:
        return sum(s.accepted for s in self.steps)

    @property
    def acceptance_rate(self) -> float:
        """Accepted drafts / proposed drafts (0 if none were proposed)."""
        return self.accepted / self.drafted if self.drafted else 0.0

    @property
    def tokens_per_step(self) -> float:
        """Mean tokens per verify forward (plain decoding: 1)."""
        return sum(s.emitted for s in self.steps) / len(self.steps) if self.steps else 0.0

    @property
    def peak_rollback_bytes(self) -> int:
        return max((s.rollback_bytes for s in self.steps), default=0)

    def __repr__(self) -> str:
        return (f"SpecResult(tokens={len(self.tokens)}, steps={len(self.steps)}, rollback={self.rollback!r}, "
                f"k={self.k}, acceptance={self.acceptance_rate:.3f}, tokens/step={self.tokens_per_step:.2f})")


def make_rollback(name: str, model: Model, pool: PagePool | None, k: int, *, window: int | None = None,
                  owner=None) -> Rollback:
    """The rollback strategy ``name`` (one of :data:`ROLLBACKS`) for verifies of up to k+1 positions."""
    check_choice("rollback", name, ROLLBACKS)
    if name == "none":
        return TrimOnly(model.config, pool, k, owner)
    if name == "snapshot":
        return SnapshotRollback(model.config, pool, k, owner)
    if name == "replay":
        return ReplayRollback(model.config, pool, k, owner)
    return RingRollback(model.config, pool, k, window, owner)


def _scratch_pool(model: Model, cache, name: str, k: int, window) -> tuple[PagePool, bool]:
    """The pool scratch pages come from: a paged cache's own, else a private one just big enough."""
    if isinstance(cache, PagedHybridCache):
        return cache.pool, False
    probe = make_rollback(name, model, None, k, window=window)
    pages = max(1, probe.scratch_pages(SCRATCH_PAGE_BYTES))
    return PagePool(pages, SCRATCH_PAGE_BYTES, name="scratch"), True


def _check_drafts(drafts, k: int, vocab: int) -> list[int]:
    drafts = [int(t) for t in drafts]
    if len(drafts) > k or any(not 0 <= t < vocab for t in drafts):
        raise ValueError(f"drafter proposed {drafts}: expected at most k={k} token ids in 0..{vocab - 1}")
    return drafts


def speculative_generate(model: Model, prompt_tokens: Sequence[int], max_new_tokens: int, drafter: Drafter,
                         k: int, rollback: str = "snapshot", cache: CacheProtocol | None = None, *,
                         window: int | None = None,
                         on_step: Callable[[CacheProtocol, StepStats], None] | None = None) -> SpecResult:
    """Greedy speculative decoding of ``max_new_tokens`` tokens; equals ``model.generate`` token for token.

    ``drafter`` proposes up to ``k`` tokens per step; ``rollback`` is "snapshot", "replay"
    or "ring" (``window`` positions, default k+1), or "none" (the broken trim, for
    demonstration). ``cache`` (a fresh HybridCache if None) ends as ``generate`` leaves it;
    scratch pages come from a PagedHybridCache's pool, or from a private pool.
    ``on_step(cache, stats)`` is called after every step (tests check invariants there).
    """
    if not isinstance(model, Model):
        raise ValueError(f"model: expected a kimilab.model.Model, got {type(model).__name__}")
    if not isinstance(drafter, Drafter):
        raise ValueError(f"drafter: expected a kimilab.speculative.Drafter, got {type(drafter).__name__}")
    max_new_tokens = check_int("max_new_tokens", max_new_tokens, 0)
    k = check_int("k", k, 1, unit="draft tokens per step")
    check_choice("rollback", rollback, ROLLBACKS)
    if window is not None and rollback != "ring":
        raise ValueError(f"window={window!r}: only rollback='ring' takes a window, not {rollback!r}")
    prompt = [int(t) for t in prompt_tokens]
    if not prompt:
        raise ValueError("prompt_tokens: expected at least one token id")
    cache = model.new_cache() if cache is None else cache
    pool, private = _scratch_pool(model, cache, rollback, k, window)
    strategy = make_rollback(rollback, model, pool, k, window=window, owner="spec")
    logits = model.prefill(prompt, cache)[-1]
    out: list[int] = [int(np.argmax(logits))] if max_new_tokens else []
    steps: list[StepStats] = []
    try:
        while len(out) < max_new_tokens:
            drafts = _check_drafts(drafter.propose(prompt + out, k), k, model.config.vocab_size)
            position = cache.seq_len
            logits, captures, view = verify(model, [out[-1]] + drafts, cache)
            strategy.save(view, captures)
            held = strategy.held_bytes
            j, bonus = greedy_accept(drafts, logits)
            new = (drafts[:j] + [bonus])[:max_new_tokens - len(out)]
            strategy.restore(cache, len(new))
            out += new
            stats = StepStats(position, len(drafts), min(j, len(new)), len(new), held,
                              pool.stats().pages_by_kind["scratch"])
            steps.append(stats)
            if on_step is not None:
                on_step(cache, stats)
    finally:
        strategy.close()
    if private:
        pool.check_invariants()
    return SpecResult(out, tuple(steps), rollback, k, dict(strategy.seconds))
