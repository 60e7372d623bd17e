"""Token trees: a drafter's proposal as a tree, the window a tree verify reads, and greedy acceptance.

A chain of k drafts is the special case of a tree in which every node has one child.
A *tree* lets a drafter hedge: several candidates for the next token, each continued
by its own guesses. The target checks every node in ONE forward pass; then acceptance
walks down from the root, at each node following the child whose token equals the
target's own choice, and stops where no child agrees.

Conventions (those of SGLang's ``chunk_tree_verify.py`` and vLLM's ``IS_EAGLE_TREE``):
nodes are topologically ordered, a parent's index is smaller than its child's, and
node 0 is the *root* -- in a verify window, the last committed token, whose parent is
the committed state (parent -1). :class:`DraftTree` is what a drafter returns (its own
nodes, parent -1 = "child of the root"); :class:`Window` is the verify window
``[root] + draft`` with the ancestor mask every tree kernel uses.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import numpy as np

from kimilab.validate import check_int

__all__ = ["DraftTree", "Window", "greedy_accept_tree"]


@dataclass(frozen=True)
class DraftTree:
    """Draft tokens as a tree: ``tokens[i]`` is a guess that follows ``parents[i]``'s token
    (-1: follows the last committed token). A chain is ``parents = (-1, 0, 1, ...)``."""

    tokens: tuple
    parents: tuple

    def __post_init__(self) -> None:
        tokens = tuple(int(t) for t in self.tokens)
        parents = tuple(int(p) for p in self.parents)
        if len(tokens) != len(parents):
            raise ValueError(f"parents: expected one parent per token ({len(tokens)}), got {len(parents)}")
        for i, p in enumerate(parents):
            if not -1 <= p < i:
                raise ValueError(f"parents[{i}]={p}: expected -1 (the root) or an earlier node 0..{i - 1}")
        object.__setattr__(self, "tokens", tokens)
        object.__setattr__(self, "parents", parents)

    @classmethod
    def chain(cls, tokens: Sequence[int]) -> "DraftTree":
        """k drafts in a row (what a chain drafter proposes)."""
        return cls(tuple(tokens), tuple(range(-1, len(tokens) - 1)))

    @classmethod
    def shape(cls, widths: Sequence[int]) -> tuple:
        """The parents of a full tree: every node at depth d has ``widths[d]`` children
        (depth 0 = the root). ``(1,) * k`` is a chain of k; ``(2, 2)`` has 2 + 4 nodes."""
        parents, level = [], [-1]
        for depth, w in enumerate(widths):
            w = check_int(f"widths[{depth}]", w, 1)
            nxt = []
            for p in level:
                for _ in range(w):
                    parents.append(p)
                    nxt.append(len(parents) - 1)
            level = nxt
        return tuple(parents)

    def __len__(self) -> int:
        return len(self.tokens)

    @property
    def is_chain(self) -> bool:
        return self.parents == tuple(range(-1, len(self.tokens) - 1))

    @property
    def depth(self) -> int:
        """Nodes on the longest root-to-leaf path (a chain of k: k)."""
        return int(Window.of(self).depths.max(initial=0))


class Window:
    """A verify window's topology: ``parents[0] == -1`` (the root, the last committed token),
    ``parents[i] < i``. Holds the ancestor-or-self mask and each node's root path."""

    def __init__(self, parents: Sequence[int]) -> None:
        parents = tuple(int(p) for p in parents)
        if not parents or parents[0] != -1:
            raise ValueError(f"parents={list(parents)}: expected node 0 (the root) with parent -1")
        for i, p in enumerate(parents[1:], 1):
            if not 0 <= p < i:
                raise ValueError(f"parents[{i}]={p}: expected an earlier node 0..{i - 1}")
        self.parents = parents
        n = len(parents)
        anc = np.eye(n, dtype=bool)
        for i in range(1, n):
            anc[i] |= anc[parents[i]]
        self.ancestors = anc  # [i, j]: j is i itself or one of its ancestors
        self.depths = anc.sum(axis=1) - 1  # root 0

    @classmethod
    def of(cls, draft: DraftTree) -> "Window":
        return cls((-1,) + tuple(p + 1 for p in draft.parents))

    @classmethod
    def chain(cls, n: int) -> "Window":
        return cls(tuple(range(-1, check_int("n", n, 1) - 1)))

    def __len__(self) -> int:
        return len(self.parents)

    @property
    def is_chain(self) -> bool:
        return self.parents == tuple(range(-1, len(self.parents) - 1))

    def path(self, i: int) -> list[int]:
        """Nodes from the root to ``i``, both included."""
        return [int(j) for j in np.flatnonzero(self.ancestors[i])]

    def children(self, i: int) -> list[int]:
        return [j for j, p in enumerate(self.parents) if p == i]

    def __repr__(self) -> str:
        return f"Window(nodes={len(self)}, depth={int(self.depths.max())}, chain={self.is_chain})"


def greedy_accept_tree(window_tokens: Sequence[int], window: Window, logits: np.ndarray) -> tuple[list[int], int]:
    """(accepted path, next token): walk from the root, following the child whose token is the
    target's argmax at the current node; stop where none is. The path starts at node 0 (the
    root); its drafts are ``path[1:]``. On a chain this is :func:`~kimilab.speculative.greedy_accept`."""
    targets = np.argmax(logits, axis=-1)
    path, node = [0], 0
    while True:
        want = int(targets[node])
        nxt = next((c for c in window.children(node) if int(window_tokens[c]) == want), None)
        if nxt is None:
            return path, want
        path.append(nxt)
        node = nxt
