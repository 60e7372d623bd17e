"""The speculative decoding loop: draft -> verify -> accept -> roll back, greedy and exact.

The cache always holds every emitted token but the last (the *pending* one), exactly
as :meth:`kimilab.model.Model.generate` leaves it. One step:

1. the drafter proposes a chain d_1..d_k (or, with ``tree=widths``, a token tree);
2. verify ``[pending, drafts]`` in one forward pass from the committed state (a tree
   through :func:`~kimilab.speculative.verify_tree`, with its ancestor mask);
3. accept the drafts the target's argmax agrees with -- on a tree, the path down which
   every child agrees -- plus the target's own token after them (cut at ``max_new_tokens``);
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
from kimilab.speculative.lazy import LazyRingRollback
from kimilab.speculative.replay import ReplayRollback, RingRollback
from kimilab.speculative.rollback import Rollback, SnapshotRollback, TrimOnly
from kimilab.speculative.slots import SlotRollback
from kimilab.speculative.tree import DraftTree, Window, greedy_accept_tree
from kimilab.speculative.tree_verify import verify_tree
from kimilab.speculative.verify import greedy_accept, verify
from kimilab.validate import check_choice, check_int

__all__ = ["ROLLBACKS", "EXACT_ROLLBACKS", "StepStats", "SpecResult", "make_rollback", "speculative_generate"]

# "none" is the broken trim, kept only to show what goes wrong without a rollback.
EXACT_ROLLBACKS = ("snapshot", "slot", "replay", "ring", "lazy-ring")
ROLLBACKS = EXACT_ROLLBACKS + ("none",)
SCRATCH_PAGE_BYTES = 4096  # page size of the private scratch pool a contiguous cache gets


@dataclass(frozen=True)
class StepStats:
    """One verify step: where it started, drafts proposed and accepted, tokens emitted, and what
    the rollback held and moved."""

    position: int  # cache.seq_len before the verify
    drafted: int  # draft tokens verified (a tree: its nodes)
    accepted: int  # drafts kept (<= drafted)
    emitted: int  # new tokens this step (accepted + 1, or fewer at max_new_tokens)
    rollback_bytes: int  # scratch bytes the strategy held for this step (data, no padding)
    scratch_pages: int  # pool pages of kind "scratch" in use after the step
    moved_bytes: int = 0  # state / snapshot / record bytes the strategy read or wrote this step
    history: int = 0  # lazy ring: committed entries folded before the verify
    flushed: bool = False  # lazy ring: the state was written back this step
    path: tuple = ()  # the window nodes kept (node 0 = the pending token); a chain's are 0, 1, ...


@dataclass(frozen=True)
class SpecResult:
    """The generated tokens and what every step did."""

    tokens: list[int]
    steps: tuple[StepStats, ...]
    rollback: str
    k: int
    seconds: dict = field(default_factory=dict, compare=False)  # wall clock in save / restore
    flushes: int = 0  # state write-backs (the lazy ring)

    @property
    def drafted(self) -> int:
        return sum(s.drafted for s in self.steps)

    @property
    def accepted(self) -> int:
        return sum(s.accepted for s in self.steps)

    @property
    def accepted_fraction(self) -> float:
        """Accepted drafts / proposed drafts (0 if none were proposed) -- not the per-position
        acceptance probability alpha (see :mod:`kimilab.speculative.drafters`)."""
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
                f"k={self.k}, accepted_fraction={self.accepted_fraction:.3f}, "
                f"tokens/step={self.tokens_per_step:.2f})")


def make_rollback(name: str, model: Model, pool: PagePool | None, k: int, *, window: int | None = None,
                  ring_len: int | None = None, max_nodes: int | None = None, owner=None) -> Rollback:
    """The rollback strategy ``name`` (one of :data:`ROLLBACKS`) for verifies of up to ``max_nodes``
    positions (default k+1); ``window`` sizes the ring, ``ring_len`` the lazy ring."""
    check_choice("rollback", name, ROLLBACKS)
    if window is not None and name != "ring":
        raise ValueError(f"window={window!r}: only rollback='ring' takes a window, not {name!r}")
    if ring_len is not None and name != "lazy-ring":
        raise ValueError(f"ring_len={ring_len!r}: only rollback='lazy-ring' takes a ring_len, not {name!r}")
    c = model.config
    if name == "ring":
        return RingRollback(c, pool, k, window, owner, max_nodes=max_nodes)
    if name == "lazy-ring":
        return LazyRingRollback(c, pool, k, ring_len, owner, max_nodes=max_nodes)
    kinds = {"none": TrimOnly, "snapshot": SnapshotRollback, "slot": SlotRollback, "replay": ReplayRollback}
    return kinds[name](c, pool, k, owner, max_nodes=max_nodes)


def _scratch_pool(model: Model, cache, name: str, k: int, **kw) -> tuple[PagePool, bool]:
    """The pool scratch pages come from: a paged cache's own, else a private one just big enough."""
    if isinstance(cache, PagedHybridCache):
        return cache.pool, False
    pages = max(1, make_rollback(name, model, None, k, **kw).scratch_pages(SCRATCH_PAGE_BYTES))
    return PagePool(pages, SCRATCH_PAGE_BYTES, name="scratch"), True


def _check_drafts(drafts, k: int, vocab: int) -> list[int]:
    drafts = [int(t) for t in drafts]
    if len(drafts) > k or any(not 0 <= t < vocab for t in drafts):
        raise ValueError(f"drafter proposed {drafts}: expected at most k={k} token ids in 0..{vocab - 1}")
    return drafts


def _check_tree(tree, shape: tuple, vocab: int) -> DraftTree:
    if not isinstance(tree, DraftTree) or tree.parents != shape:
        raise ValueError(f"drafter proposed {tree!r}: expected a DraftTree of parents {list(shape)}")
    if any(not 0 <= t < vocab for t in tree.tokens):
        raise ValueError(f"drafter proposed tokens {list(tree.tokens)}: expected ids in 0..{vocab - 1}")
    return tree


def speculative_generate(model: Model, prompt_tokens: Sequence[int], max_new_tokens: int,
                         drafter: Drafter, k: int, rollback: str = "snapshot",
                         cache: CacheProtocol | None = None, *,
                         tree: Sequence[int] | None = None, window: int | None = None,
                         ring_len: int | None = None,
                         on_step: Callable[[CacheProtocol, StepStats], None] | None = None,
                         ) -> SpecResult:
    """Greedy speculative decoding of ``max_new_tokens`` tokens; equals ``model.generate`` token for token.

    ``drafter`` proposes up to ``k`` tokens per step, or with ``tree`` (children per node at
    each depth, ``len(tree) == k``) a token tree of that shape. ``rollback`` is one of
    :data:`ROLLBACKS` ("ring" takes ``window``, "lazy-ring" ``ring_len``; "none" is the
    broken trim, chains only). ``cache`` (a fresh HybridCache if None) ends as ``generate``
    leaves it; scratch pages come from a PagedHybridCache's pool, or from a private pool.
    ``on_step(request, stats)`` is called after every step with the request as the model sees
    it (its true states, wherever the strategy keeps them); tests check invariants there.
    """
    if not isinstance(model, Model):
        raise ValueError(f"model: expected a kimilab.model.Model, got {type(model).__name__}")
    if not isinstance(drafter, Drafter):
        raise ValueError(f"drafter: expected a kimilab.speculative.Drafter, "
                         f"got {type(drafter).__name__}")
    max_new_tokens = check_int("max_new_tokens", max_new_tokens, 0)
    k = check_int("k", k, 1, unit="draft tokens per step")
    check_choice("rollback", rollback, ROLLBACKS)
    shape = None
    if tree is not None:
        shape = DraftTree.shape(tree)
        if len(tuple(tree)) != k:
            raise ValueError(f"tree={list(tree)}: expected k={k} depths (the tree's depth is k)")
        if rollback == "none" and any(w != 1 for w in tree):
            raise ValueError("rollback='none': the broken trim works on chains only")
    prompt = [int(t) for t in prompt_tokens]
    if not prompt:
        raise ValueError("prompt_tokens: expected at least one token id")
    kw = dict(window=window, ring_len=ring_len, max_nodes=None if shape is None else len(shape) + 1)
    cache = model.new_cache() if cache is None else cache
    pool, private = _scratch_pool(model, cache, rollback, k, **kw)
    strategy = make_rollback(rollback, model, pool, k, owner="spec", **kw)
    vocab = model.config.vocab_size
    logits = model.prefill(prompt, cache)[-1]
    out: list[int] = [int(np.argmax(logits))] if max_new_tokens else []
    steps: list[StepStats] = []
    try:
        while len(out) < max_new_tokens:
            moved = strategy.moved_bytes
            request = strategy.current(cache)
            position = cache.seq_len
            if shape is None:
                drafts = _check_drafts(drafter.propose(prompt + out, k), k, vocab)
                window_tokens = [out[-1]] + drafts
                logits, captures, view = verify(model, window_tokens, request)
                strategy.save(view, captures)
                j, bonus = greedy_accept(drafts, logits)
                path = list(range(j + 1))
            else:
                draft = _check_tree(drafter.propose_tree(prompt + out, tree), shape, vocab)
                win = Window.of(draft)
                window_tokens = [out[-1]] + list(draft.tokens)
                logits, captures, view = verify_tree(model, window_tokens, win, request)
                strategy.save(view, captures, win)
                path, bonus = greedy_accept_tree(window_tokens, win, logits)
            new = ([window_tokens[p] for p in path[1:]] + [bonus])[:max_new_tokens - len(out)]
            held = strategy.held_bytes
            strategy.restore(cache, path[:len(new)])
            out += new
            stats = StepStats(position, len(window_tokens) - 1, min(len(path) - 1, len(new)),
                              len(new), held, pool.stats().pages_by_kind["scratch"],
                              strategy.moved_bytes - moved, strategy.last_history,
                              strategy.last_flush, tuple(path[:len(new)]))
            steps.append(stats)
            if on_step is not None:
                on_step(strategy.peek(cache), stats)
        strategy.finish(cache)
    finally:
        strategy.close()
    if private:
        pool.check_invariants()
    return SpecResult(out, tuple(steps), rollback, k, dict(strategy.seconds), strategy.flushes)
