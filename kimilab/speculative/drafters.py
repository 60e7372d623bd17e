"""Drafters: cheap guesses of the next k tokens, behind one small interface.

``drafter.propose(tokens, k)`` gets every token so far (prompt + generated) and returns
at most ``k`` guesses. Three kinds:

* :class:`NgramDrafter` -- prompt lookup: find the last n tokens earlier in the text and
  propose what followed them (the idea of vLLM's ``ngram`` proposer). Free to run.
* :class:`DraftModelDrafter` -- a smaller model's greedy continuation.
* :class:`ControlledDrafter` -- a *test instrument*, not a drafter anyone would deploy:
  it proposes the target's own greedy continuation, each token replaced by a wrong one
  with probability ``corruption`` (seeded). Our models are untrained, so a real draft
  model agrees with the target about as often as chance; this drafter is how the book
  sweeps the acceptance rate from 0 to 1 on purpose.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Sequence

import numpy as np

from kimilab.model import Model
from kimilab.validate import check_float, check_int

__all__ = ["Drafter", "NgramDrafter", "DraftModelDrafter", "ControlledDrafter"]


class Drafter(ABC):
    """Proposes up to ``k`` next tokens after ``tokens`` (prompt + generated so far)."""

    name = "drafter"

    @abstractmethod
    def propose(self, tokens: Sequence[int], k: int) -> list[int]:
        """At most ``k`` guessed token ids (possibly none)."""

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
    """The greedy continuation of a smaller ``draft`` model (same vocabulary as the target).

    Each proposal re-reads the whole text from scratch: simple, and on the tiny model
    cheap. A serving engine keeps the draft model's cache too -- and must roll *it* back
    after every verify, the same problem in small.
    """

    name = "draft-model"

    def __init__(self, draft: Model) -> None:
        if not isinstance(draft, Model):
            raise ValueError(f"draft: expected a kimilab.model.Model, got {type(draft).__name__}")
        self.draft = draft

    def propose(self, tokens: Sequence[int], k: int) -> list[int]:
        k = check_int("k", k, 0)
        return self.draft.generate(list(tokens), k) if k else []

    def __repr__(self) -> str:
        return f"DraftModelDrafter({self.draft!r})"


class ControlledDrafter(Drafter):
    """The target's greedy continuation of ``prompt_tokens``, corrupted at a seeded rate.

    ``reference`` is the target's own greedy output (``n_tokens`` of it, from
    ``target.generate``). The draft for continuation position p is ``reference[p]``,
    replaced with probability ``corruption`` by a different token; the choice depends
    only on (seed, p), so asking twice gives the same guess. Past the reference it
    proposes nothing. Each draft is accepted with probability 1 - corruption as long as
    the text so far is the target's greedy text.
    """

    name = "controlled"

    def __init__(self, target: Model, prompt_tokens: Sequence[int], n_tokens: int, corruption: float,
                 seed: int = 0) -> None:
        if not isinstance(target, Model):
            raise ValueError(f"target: expected a kimilab.model.Model, got {type(target).__name__}")
        c = check_float("corruption", corruption, minimum=0.0)
        if c > 1.0:
            raise ValueError(f"corruption={corruption!r}: expected a probability in [0, 1]")
        self.corruption, self.seed = c, check_int("seed", seed, 0)
        self.prompt_len = len(list(prompt_tokens))
        self.vocab = target.config.vocab_size
        self.reference = target.generate(list(prompt_tokens), check_int("n_tokens", n_tokens, 0))

    def with_corruption(self, corruption: float, seed: int | None = None) -> "ControlledDrafter":
        """The same reference, another corruption rate (and seed): no second greedy run."""
        c = check_float("corruption", corruption, minimum=0.0)
        if c > 1.0:
            raise ValueError(f"corruption={corruption!r}: expected a probability in [0, 1]")
        out = object.__new__(ControlledDrafter)
        out.__dict__.update(self.__dict__)
        out.corruption = c
        out.seed = self.seed if seed is None else check_int("seed", seed, 0)
        return out

    def guess(self, p: int) -> int:
        """The draft for continuation position ``p`` (0 = the first generated token)."""
        rng = np.random.default_rng([self.seed, p])
        true = self.reference[p]
        if rng.random() < self.corruption:
            return int((true + 1 + rng.integers(self.vocab - 1)) % self.vocab)
        return int(true)

    def propose(self, tokens: Sequence[int], k: int) -> list[int]:
        k = check_int("k", k, 0)
        p = len(tokens) - self.prompt_len
        if p < 0:
            raise ValueError(f"tokens: expected at least the {self.prompt_len} prompt tokens, got {len(tokens)}")
        return [self.guess(q) for q in range(p, min(p + k, len(self.reference)))]

    def __repr__(self) -> str:
        return (f"ControlledDrafter(corruption={self.corruption}, seed={self.seed}, "
                f"reference={len(self.reference)} tokens)")
