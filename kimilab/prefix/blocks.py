"""How a prompt is cut into block keys: the unit a prefix cache stores and matches.

Two kinds of key: Mooncake hash ids (one id per block, standing for the whole
prefix up to it), or token blocks (the block's token bytes). Only full blocks
are cached unless ``partial_blocks`` is on.
"""

from __future__ import annotations

import numpy as np

__all__ = ["block_token_counts", "split_prompt"]


def block_token_counts(n_tokens: int, n_blocks: int, block_size: int) -> list[int]:
    """Tokens in each block of an ``n_tokens`` prompt split into ``n_blocks`` blocks.

    All blocks are full except possibly the last; raises if the counts disagree.
    """
    if n_tokens < 0:
        raise ValueError(f"n_tokens={n_tokens}: expected >= 0")
    expected = -(-n_tokens // block_size)
    if n_blocks != expected:
        raise ValueError(
            f"keys: got {n_blocks} block keys for n_tokens={n_tokens} with "
            f"block_size={block_size}; expected ceil(n_tokens / block_size) = {expected}"
        )
    if n_blocks == 0:
        return []
    counts = [block_size] * n_blocks
    counts[-1] = n_tokens - block_size * (n_blocks - 1)
    return counts


def _token_blocks(tokens, block_size: int) -> tuple[list, list[int], list]:
    arr = np.ascontiguousarray(np.asarray(tokens), dtype=np.int64)
    if arr.ndim != 1:
        raise ValueError(f"tokens: expected a 1-D sequence of token ids, got shape {arr.shape}")
    blocks = [arr[i : i + block_size] for i in range(0, len(arr), block_size)]
    keys = [b.tobytes() for b in blocks]
    return keys, [len(b) for b in blocks], blocks


def split_prompt(keys, n_tokens, tokens, block_size: int, partial_blocks: bool):
    """(keys, per-block token counts, per-block token arrays or None) of one prompt.

    Give ``tokens``, or ``keys`` (one per block) together with ``n_tokens``.
    Without ``partial_blocks`` a trailing partial block is dropped.
    """
    if tokens is not None:
        tkeys, counts, blocks = _token_blocks(tokens, block_size)
        if n_tokens is not None and n_tokens != len(tokens):
            raise ValueError(f"n_tokens={n_tokens}: expected len(tokens) = {len(tokens)}")
        if keys is not None:
            keys = list(keys)
            block_token_counts(len(tokens), len(keys), block_size)
        else:
            keys = tkeys
    else:
        if keys is None or n_tokens is None:
            raise ValueError("give either tokens=..., or keys=... together with n_tokens=...")
        keys = list(keys)
        counts = block_token_counts(int(n_tokens), len(keys), block_size)
        blocks = None
    if not partial_blocks and counts and counts[-1] < block_size:
        keys, counts = keys[:-1], counts[:-1]
        blocks = blocks[:-1] if blocks is not None else None
    return keys, counts, blocks
