"""Chapter 5's checked exercises: block caches on real traffic."""

from pathlib import Path

from kimilab import costs
from kimilab.config import kimi_linear_48b
from kimilab.exercises import exercise
from kimilab.traffic import MOONCAKE_CONVERSATION, load_trace, reuse_upper_bound

DATA = Path(__file__).resolve().parent.parent.parent / "data"


@exercise("5.1", "whole blocks", hint="only full blocks of the previous prompt are cached: count them, times 512.")
def _():
    return (2900 // 512) * 512


@exercise("5.2", "GB of 48B KV for a million cached tokens", rtol=1e-3,
          hint="costs.kv_bytes_per_token(kimi_linear_48b) x 1e6, in GB (1e9 bytes).")
def _():
    return costs.kv_bytes_per_token(kimi_linear_48b, costs.ONE_H200) * 1e6 / 1e9


@exercise("5.3", "the real trace's reuse ceiling", rtol=1e-3,
          hint="wl.reuse_upper_bound of the whole Mooncake trace at 512-token blocks (an infinite cache's hit rate).")
def _():
    return reuse_upper_bound(load_trace(DATA / MOONCAKE_CONVERSATION, 512), 512)
