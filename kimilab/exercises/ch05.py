"""Chapter 5's checked exercises: block caches on real traffic."""

from pathlib import Path

import numpy as np

from kimilab import costs
from kimilab.config import kimi_linear_48b
from kimilab.exercises import exercise
from kimilab.traffic import MOONCAKE_CONVERSATION, load_trace

DATA = Path(__file__).resolve().parent.parent.parent / "data"


@exercise("5.1", "whole blocks",
          hint=("A block cache can only serve blocks that were complete in the earlier prompt.",
                "Count the full 512-token blocks in the earlier prompt."))
def _():
    return (2900 // 512) * 512


@exercise("5.2", "GB of 48B KV for a million cached tokens", rtol=1e-3,
          hint=("KV bytes grow linearly with the tokens held; this model keeps KV only in its global layers.",
                "Multiply the 48B model's KV bytes per token by a million and express it in decimal GB."))
def _():
    return costs.kv_bytes_per_token(kimi_linear_48b, costs.ONE_H200) * 1e6 / 1e9


@exercise("5.3", "the real trace's ceiling with a five-minute idle timeout", rtol=1e-3,
          hint=("An unbounded cache that drops a block after five minutes without use still misses a block the"
                " first time, and again whenever it comes back after a longer gap.",
                "Walk the trace in arrival order, remembering when each block id was last used; a block hits if"
                " it was used at most 300 s before. Weight by tokens."))
def _():
    last_used: dict[int, int] = {}
    hit = total = 0
    for r in load_trace(DATA / MOONCAKE_CONVERSATION, 512):
        for h, n in zip(r.hash_ids, r.block_lengths(512)):
            hit += int(n) if h in last_used and r.arrival_ms - last_used[h] <= 300_000 else 0
            total += int(n)
        last_used.update(dict.fromkeys(r.hash_ids, r.arrival_ms))
    return hit / total


@exercise("5.4", "the share of the real trace no whole-block cache can serve", rtol=1e-3,
          hint=("A whole-block cache stores only complete blocks; what is left after the last full block of a "
                "prompt is never stored.",
                "Sum each prompt's tokens past its last full 512-token block, over all prompt tokens."))
def _():
    lengths = np.array([r.input_length for r in load_trace(DATA / MOONCAKE_CONVERSATION, 512)])
    return float((lengths % 512).sum() / lengths.sum())
