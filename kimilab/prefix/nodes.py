"""The prefix trees' parts: a cached block (:class:`Node`), a lookup's result (:class:`Match`), and
the run tree's run of blocks (:class:`Run`) with its checkpoints (:class:`RunCheckpoint`)."""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["Node", "Match", "Run", "RunCheckpoint"]


class Node:
    """One cached block. ``end`` = prefix length (tokens) up to and including it."""

    __slots__ = ("key", "parent", "children", "n_tokens", "end", "alloc", "refcount", "last_access", "priority",
                 "touched", "heap_serial", "tokens", "alive", "payload", "block_data", "node_id", "computed")

    def __init__(self, key, parent, n_tokens, end, alloc, node_id, tokens=None):
        self.key = key
        self.parent = parent
        self.children: dict = {}
        self.n_tokens = n_tokens
        self.end = end
        self.alloc = alloc
        self.refcount = 0
        self.last_access = 0
        self.priority = 0.0
        self.touched = 0  # the request clock at its last use: with ``end``, it breaks ties between equal ranks
        self.heap_serial = -1
        self.tokens = tokens
        self.alive = True
        self.payload = None  # free slot for higher layers (a state checkpoint)
        self.block_data = None  # free slot for the block's contents (KV arrays), if kept
        self.node_id = node_id
        self.computed = True  # False while a prefill that inserted it has not reached its end

    @property
    def is_leaf(self) -> bool:
        return not self.children

    def __repr__(self) -> str:
        return f"Node(id={self.node_id}, end={self.end}, n_tokens={self.n_tokens}, ref={self.refcount})"


@dataclass
class Match:
    """Result of looking a prompt up. ``nodes`` are whole cached blocks on the path.

    ``partial_tokens`` counts tokens matched token-exactly inside a sibling's
    block beyond the last whole node (only with ``partial_blocks`` and tokens).
    """

    nodes: list
    partial_tokens: int = 0

    @property
    def block_tokens(self) -> int:
        return self.nodes[-1].end if self.nodes else 0

    @property
    def hit_tokens(self) -> int:
        return self.block_tokens + self.partial_tokens

    # An attention model reuses every cached token: its usable hit is its KV hit.
    kv_hit = usable_hit = hit_tokens


class Run:
    """Blocks at depths ``lo..hi`` of one path (block d ends at token d * block_size)."""

    __slots__ = ("key", "keys", "lo", "hi", "parent", "children", "refcount", "last_access", "touched",
                 "version", "checkpoints", "parked", "alive")

    def __init__(self, keys: list, lo: int, parent, last_access: float, touched: int):
        self.key = keys[0] if keys else None
        self.keys = keys
        self.lo, self.hi = lo, lo + len(keys) - 1
        self.parent = parent
        self.children: dict = {}
        self.refcount = 0
        self.last_access, self.touched = last_access, touched
        self.version = -1  # its leaf-queue entry; -1: none
        self.checkpoints: dict = {}  # depth -> RunCheckpoint
        self.parked: list = []  # its checkpoints taken off the queue while they could not be evicted
        self.alive = True


class RunCheckpoint:
    """A state checkpoint at the end of block ``depth`` of ``run`` (None once evicted)."""

    __slots__ = ("run", "depth", "last_access", "touched", "version")

    def __init__(self, run: Run, depth: int, last_access: float, touched: int):
        self.run, self.depth, self.last_access, self.touched = run, depth, last_access, touched
        self.version = -1  # its checkpoint-queue entry; -1: none (new, or parked on its run)
