"""Drafters: cheap guesses of the next tokens -- a chain of k, or a tree -- behind one small interface.

``drafter.propose(tokens, k)`` gets every token so far (prompt + generated) and returns
at most ``k`` guesses in a row; ``drafter.propose_tree(tokens, widths)`` returns a
:class:`~kimilab.speculative.tree.DraftTree` in which every node at depth d has
``widths[d]`` children (depth 0: the last committed token). Three kinds:

* :class:`NgramDrafter` -- prompt lookup: find the last n tokens earlier in the text and
  propose what followed them (the idea of vLLM's ``ngram`` proposer). Free to run; chains.
* :class:`DraftModelDrafter` -- a smaller model: its greedy continuation, or a tree of its
  top-ranked tokens at every node (the static trees of Medusa / EAGLE).
* :class:`ControlledDrafter` -- a *test instrument*, not a drafter anyone would deploy:
  it knows the target's own greedy continuation and guesses it right with a chosen
  probability. Our models are untrained, so a real draft model agrees with the target
  about as often as chance; this drafter is how the book sweeps acceptance on purpose.

One name per notion of acceptance: the **acceptance probability** alpha_d is the chance
that the draft at depth d is accepted given every draft before it was (what a drafter
controls); the **accepted fraction** is accepted drafts / proposed drafts, what a run
measures (:attr:`~kimilab.speculative.SpecResult.accepted_fraction`). For a chain with
constant alpha the accepted fraction is (alpha + alpha^2 + ... + alpha^k) / k
(:func:`kimilab.costs.spec.accepted_fraction`).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Sequence

import numpy as np

from kimilab.model import Model
from kimilab.speculative.tree import DraftTree
from kimilab.validate import check_float, check_int

__all__ = ["Drafter", "NgramDrafter", "DraftModelDrafter", "ControlledDrafter"]


_MASK = (1 << 64) - 1


def _draw(*keys: int) -> float:
    """A uniform number in [0, 1) that depends only on ``keys``: splitmix64 over them (a hash,
    cheaper than seeding a numpy generator per guess; the controlled drafter makes many)."""
    z = 0x9E3779B97F4A7C15
    for key in keys:
        z = (z ^ (int(key) & _MASK)) * 0xBF58476D1CE4E5B9 & _MASK
        z = (z ^ (z >> 27)) * 0x94D049BB133111EB & _MASK
        z ^= z >> 31
    return (z >> 11) / float(1 << 53)


def _widths(widths) -> tuple:
    widths = tuple(widths)
    if not widths:
        raise ValueError("widths: expected at least one depth (children per node at each depth)")
    return tuple(check_int(f"widths[{d}]", w, 1) for d, w in enumerate(widths))


def _probability(name: str, value) -> float:
    p = check_float(name, value, minimum=0.0)
    if p > 1.0:
        raise ValueError(f"{name}={value!r}: expected a probability in [0, 1]")
    return p


class Drafter(ABC):
    """Proposes up to ``k`` next tokens after ``tokens`` (prompt + generated so far)."""

    name = "drafter"

    @abstractmethod
    def propose(self, tokens: Sequence[int], k: int) -> list[int]:
        """At most ``k`` guessed token ids in a row (possibly none)."""

    def propose_tree(self, tokens: Sequence[int], widths: Sequence[int]) -> DraftTree:
        """A tree of guesses (``widths[d]`` children per node at depth d). A chain drafter
        can only make the chain ``widths = (1, 1, ...)``."""
        widths = _widths(widths)
        if any(w != 1 for w in widths):
            raise ValueError(f"widths={list(widths)}: {type(self).__name__} proposes chains only")
        return DraftTree.chain(self.propose(tokens, len(widths)))

    def __repr__(self) -> str:
        return f"{type(self).__name__}()"


class NgramDrafter(Drafter):
    """Prompt lookup: match the last n tokens (n from ``max_n`` down to ``min_n``) at their most
    recent earlier occurrence and propose the (up to k) tokens that followed it."""

    name = "ngram"

    def __init__(self, max_n: int = 3, min_n: int = 1) -> None:
        self.min_n = check_int("min_n", min_n, 1)
        self.max_n = check_int("max_n", max_n, self.min_n, unit="at least min_n")

    def propose(self, tokens: Sequence[int], k: int) -> list[int]:
        k = check_int("k", k, 0)
        seq = [int(t) for t in tokens]
        for n in range(min(self.max_n, len(seq) - 1), self.min_n - 1, -1):
            tail = seq[-n:]
            for start in range(len(seq) - n - 1, -1, -1):  # most recent earlier occurrence first
                if seq[start:start + n] == tail:
                    return seq[start + n:start + n + k]
        return []

    def __repr__(self) -> str:
        return f"NgramDrafter(max_n={self.max_n}, min_n={self.min_n})"


class DraftModelDrafter(Drafter):
    """A smaller ``draft`` model (same vocabulary as the target): its greedy continuation, or
    a tree of its top-ranked tokens.

    Each proposal re-reads the text from scratch: simple, and on the tiny model cheap. A
    serving engine keeps the draft model's cache too -- and must roll *it* back after
    every verify, the same problem in small.
    """

    name = "draft-model"

    def __init__(self, draft: Model) -> None:
        if not isinstance(draft, Model):
            raise ValueError(f"draft: expected a kimilab.model.Model, got {type(draft).__name__}")
        self.draft = draft

    def propose(self, tokens: Sequence[int], k: int) -> list[int]:
        k = check_int("k", k, 0)
        return self.draft.generate(list(tokens), k) if k else []

    def propose_tree(self, tokens: Sequence[int], widths: Sequence[int]) -> DraftTree:
        """Every node's children are the draft model's ``widths[d]`` most likely next tokens."""
        widths = _widths(widths)
        text = list(tokens)
        out_tokens, parents, level = [], [], [(-1, [])]
        for w in widths:
            nxt = []
            for parent, path in level:
                logits = self.draft.prefill(text + path, self.draft.new_cache())[-1]
                for t in np.argsort(-logits, kind="stable")[:w]:
                    out_tokens.append(int(t))
                    parents.append(parent)
                    nxt.append((len(out_tokens) - 1, path + [int(t)]))
            level = nxt
        return DraftTree(tuple(out_tokens), tuple(parents))

    def __repr__(self) -> str:
        return f"DraftModelDrafter({self.draft!r})"


class ControlledDrafter(Drafter):
    """The target's greedy continuation of ``prompt_tokens``, guessed right at a chosen rate.

    ``reference`` is the target's own greedy output (``n_tokens`` of it). A draft at depth
    d (1 = the first draft of a step) is the right token with acceptance probability
    ``alpha_d = (1 - corruption) * decay ** (d - 1)`` -- constant when ``decay`` is 1, falling
    with depth otherwise, as a real drafter's does -- and a wrong one otherwise. Draws depend
    only on (seed, continuation position, depth, sibling), so asking twice gives the same
    guesses. Past the reference a chain proposes nothing.

    In a tree, the children of a node on the target's greedy path are tried in order: each
    is the right token with probability alpha_d if no earlier sibling was; so a node with b
    children continues the accepted path with probability 1 - (1 - alpha_d)^b.
    """

    name = "controlled"

    def __init__(self, target: Model, prompt_tokens: Sequence[int], n_tokens: int, corruption: float,
                 seed: int = 0, *, decay: float = 1.0) -> None:
        if not isinstance(target, Model):
            raise ValueError(f"target: expected a kimilab.model.Model, got {type(target).__name__}")
        self.corruption = _probability("corruption", corruption)
        self.decay = _probability("decay", decay)
        self.seed = check_int("seed", seed, 0)
        self.prompt_len = len(list(prompt_tokens))
        self.vocab = target.config.vocab_size
        self.reference = target.generate(list(prompt_tokens), check_int("n_tokens", n_tokens, 0))

    def with_corruption(self, corruption: float, seed: int | None = None, *,
                        decay: float | None = None) -> "ControlledDrafter":
        """The same reference, another corruption rate (and seed, decay): no second greedy run."""
        out = object.__new__(ControlledDrafter)
        out.__dict__.update(self.__dict__)
        out.corruption = _probability("corruption", corruption)
        out.seed = self.seed if seed is None else check_int("seed", seed, 0)
        out.decay = self.decay if decay is None else _probability("decay", decay)
        return out

    def alpha(self, depth: int) -> float:
        """The acceptance probability of a draft at ``depth`` (1 = first)."""
        return (1.0 - self.corruption) * self.decay ** (check_int("depth", depth, 1) - 1)

    def _right(self, p: int, depth: int, sibling: int = 0) -> bool:
        return _draw(self.seed, p, depth, sibling) < self.alpha(depth)

    def _wrong(self, p: int, depth: int, sibling: int, avoid: set) -> int:
        for attempt in range(1, 1 << 20):
            t = int(_draw(self.seed, p, depth, sibling, attempt) * self.vocab)
            if t not in avoid:
                return t
        raise ValueError("avoid: every token is excluded")  # pragma: no cover - vocab > len(avoid)

    def guess(self, p: int, depth: int = 1) -> int:
        """The chain draft for continuation position ``p`` (0 = the first generated token) at ``depth``."""
        true = int(self.reference[p])
        return true if self._right(p, depth) else self._wrong(p, depth, 1000 * (depth - 1), {true})

    def _position(self, tokens: Sequence[int]) -> int:
        p = len(tokens) - self.prompt_len
        if p < 0:
            raise ValueError(f"tokens: expected at least the {self.prompt_len} prompt tokens, got {len(tokens)}")
        return p

    def propose(self, tokens: Sequence[int], k: int) -> list[int]:
        k = check_int("k", k, 0)
        p = self._position(tokens)
        return [self.guess(q, q - p + 1) for q in range(p, min(p + k, len(self.reference)))]

    def propose_tree(self, tokens: Sequence[int], widths: Sequence[int]) -> DraftTree:
        widths = _widths(widths)
        p0 = self._position(tokens)
        out_tokens, parents, level = [], [], [(-1, True)]  # (node, is it on the greedy path?)
        for depth, w in enumerate(widths, 1):
            p, nxt = p0 + depth - 1, []
            true = int(self.reference[p]) if p < len(self.reference) else None
            for parent, on_path in level:
                found = not (on_path and true is not None)  # off the path, nothing can be accepted
                used = set() if true is None else {true}
                for s in range(w):
                    if not found and self._right(p, depth, s):
                        t, right, found = true, True, True
                    else:
                        t, right = self._wrong(p, depth, s + 1000 * (parent + 1), used), False
                    used.add(t)
                    out_tokens.append(t)
                    parents.append(parent)
                    nxt.append((len(out_tokens) - 1, on_path and right))
            level = nxt
        return DraftTree(tuple(out_tokens), tuple(parents))

    def emitted_per_step(self, n_new: int, k: int, widths: Sequence[int] | None = None) -> list[int]:
        """The tokens each step of ``speculative_generate(..., n_new, self, k, tree=widths)`` emits,
        without running the model: the target's text is the reference, so acceptance depends on
        the guesses alone. (A test holds it equal to the real loop's steps.) Needs
        ``n_new <= len(reference)``."""
        n_new = check_int("n_new", n_new, 0)
        if n_new > len(self.reference):
            raise ValueError(f"n_new={n_new}: the reference holds only {len(self.reference)} tokens")
        dummy = [0] * self.prompt_len
        done, out = min(1, n_new), []
        while done < n_new:
            tokens = dummy + [0] * done
            if widths is None:
                drafts = self.propose(tokens, k)
                j = next((i for i, t in enumerate(drafts) if t != self.reference[done + i]), len(drafts))
            else:
                tree, node, j = self.propose_tree(tokens, widths), -1, 0
                while True:
                    want = self.reference[done + j] if done + j < len(self.reference) else None
                    nxt = next((c for c, (t, par) in enumerate(zip(tree.tokens, tree.parents))
                                if par == node and t == want), None)
                    if nxt is None:
                        break
                    node, j = nxt, j + 1
            out.append(min(j + 1, n_new - done))
            done += out[-1]
        return out

    def __repr__(self) -> str:
        return (f"ControlledDrafter(corruption={self.corruption}, decay={self.decay}, seed={self.seed}, "
                f"reference={len(self.reference)} tokens)")
