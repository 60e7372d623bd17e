"""Chapter 5's checked exercises: block caches on real traffic."""

from pathlib import Path

from kimilab import costs
from kimilab.config import kimi_linear_48b
from kimilab.exercises import exercise
from kimilab.traffic import MOONCAKE_CONVERSATION, load_trace, reuse_upper_bound

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


@exercise("5.3", "the real trace's reuse ceiling", rtol=1e-3,
          hint=("An infinite cache misses only the first time a block is seen.",
                "Weight by tokens: the blocks of each prompt that some earlier prompt already contained, over"
                 " all prompt blocks."))
def _():
    return reuse_upper_bound(load_trace(DATA / MOONCAKE_CONVERSATION, 512), 512)
