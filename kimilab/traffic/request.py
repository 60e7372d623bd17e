"""The one request type: what arrives at a server, its prompt as tokens, block ids or a length.

Every piece of traffic in the book is a :class:`Request`: an arrival time in
simulated milliseconds, a prompt length and how many tokens it will generate.
What the prompt *is* comes in one of two forms, or both, or neither:

* ``tokens`` — the token ids (int32, read-only), for experiments that run or
  match real ids (the generators in :mod:`kimilab.traffic.generators`);
* ``hash_ids`` — one chained block id per ``block_size`` tokens, one line of a
  Mooncake trace (:mod:`kimilab.traffic.trace`), for traces too large to hold
  as tokens;
* neither — an admission simulation only counts tokens (``mixed_workload``).

``session`` groups the turns of one conversation, task or reader; ``tenant``
says who sent the request (for per-tenant fairness); ``kind`` labels the
workload it came from ("chat", "document", ...).
"""

from __future__ import annotations

import json
from dataclasses import KW_ONLY, dataclass

import numpy as np

from kimilab.validate import check_int

__all__ = ["Request", "DEFAULT_BLOCK_SIZE"]

DEFAULT_BLOCK_SIZE = 512  # tokens per hash block, Mooncake's


@dataclass(frozen=True, eq=False)
class Request:
    """One prompt arriving at a server; see the module docstring for the prompt's forms."""

    request_id: int
    arrival_ms: int  # simulated time, integer milliseconds
    input_length: int  # prompt tokens (== tokens.size when tokens are given)
    output_length: int  # tokens the request generates
    _: KW_ONLY
    tokens: np.ndarray | None = None  # int32 [input_length], read-only
    hash_ids: tuple[int, ...] | None = None  # chained block ids, ceil(input_length / block_size)
    session: int = 0  # which conversation / task / document reader it belongs to
    tenant: str = "default"
    kind: str = ""  # workload label: "chat", "document", ...

    def __post_init__(self) -> None:
        for name in ("request_id", "arrival_ms", "input_length", "output_length", "session"):
            object.__setattr__(self, name, check_int(f"Request.{name}", getattr(self, name)))
        if not isinstance(self.tenant, str) or not self.tenant:
            raise ValueError(f"Request.tenant={self.tenant!r}: expected a non-empty str")
        if not isinstance(self.kind, str):
            raise ValueError(f"Request.kind={self.kind!r}: expected a str")
        if self.tokens is not None:
            tokens = np.asarray(self.tokens)
            if tokens.ndim != 1 or not np.issubdtype(tokens.dtype, np.integer):
                raise ValueError(
                    f"Request.tokens: expected a 1-D integer array, got dtype={tokens.dtype} "
                    f"shape={tokens.shape}"
                )
            if tokens.size and (tokens.min() < 0 or tokens.max() > np.iinfo(np.int32).max):
                raise ValueError("Request.tokens: expected ids in [0, 2**31 - 1]")
            if tokens.size != self.input_length:
                raise ValueError(f"Request.input_length={self.input_length}: expected "
                                 f"len(tokens)={tokens.size}")
            tokens = tokens.astype(np.int32, copy=True)
            tokens.setflags(write=False)
            object.__setattr__(self, "tokens", tokens)
        if self.hash_ids is not None:
            ids = tuple(check_int(f"Request.hash_ids[{j}]", h) for j, h in enumerate(self.hash_ids))
            object.__setattr__(self, "hash_ids", ids)

    def _key(self) -> tuple:
        tokens = None if self.tokens is None else self.tokens.tobytes()
        return (self.request_id, self.arrival_ms, self.input_length, self.output_length, tokens,
                self.hash_ids, self.session, self.tenant, self.kind)

    def __eq__(self, other) -> bool:
        if other.__class__ is not self.__class__:
            return NotImplemented
        return self._key() == other._key()

    def __hash__(self) -> int:
        return hash(self._key())

    def n_blocks(self, block_size: int = DEFAULT_BLOCK_SIZE) -> int:
        """Blocks of ``block_size`` tokens the prompt spans (the last may be partial)."""
        return -(-self.input_length // check_int("block_size", block_size, 1))

    def block_lengths(self, block_size: int = DEFAULT_BLOCK_SIZE) -> np.ndarray:
        """Tokens in each block (all ``block_size`` except possibly the last)."""
        n = self.n_blocks(block_size)
        lengths = np.full(n, block_size, dtype=np.int64)
        if n:
            lengths[-1] = self.input_length - (n - 1) * block_size
        return lengths

    def to_json(self) -> str:
        """This request as one Mooncake trace line (no newline); needs ``hash_ids``."""
        if self.hash_ids is None:
            raise ValueError(f"Request {self.request_id}: hash_ids=None; a trace line needs block ids "
                             "(to_trace computes them from tokens)")
        return json.dumps(
            {
                "timestamp": self.arrival_ms,
                "input_length": self.input_length,
                "output_length": self.output_length,
                "hash_ids": list(self.hash_ids),
            }
        )
