"""Chapter 7's checked exercises: what per-position snapshots cost, and what a window yields."""

from kimilab import costs
from kimilab.config import kimi_linear_48b, tiny
from kimilab.costs import spec as spec_costs
from kimilab.exercises import exercise


@exercise("7.1", "snapshot MB at k=4", rtol=0.01,
          hint="k+1 positions are verified, each keeps one checkpoint: (k + 1) x checkpoint_bytes / 1e6.")
def _():
    return 5 * costs.checkpoint_bytes(kimi_linear_48b, costs.ONE_H200) / 1e6


@exercise("7.2", "tokens per verify step at alpha 0.6, k=4", rtol=1e-3,
          hint="1 + a + a^2 + ... + a^k = (1 - a^(k+1)) / (1 - a).")
def _():
    return spec_costs.expected_tokens_per_step(0.6, 4)


@exercise("7.3", "scratch pages of one snapshot step at k=8",
          hint="one slot per verified position (k+1), each ceil(checkpoint_bytes / page_bytes) pages.")
def _():
    return 9 * -(-costs.checkpoint_bytes(tiny, costs.LOCAL) // 4096)
