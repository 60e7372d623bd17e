"""Chapter 7's checked exercises: what per-position snapshots cost, and what a window yields."""

from kimilab import costs
from kimilab.config import kimi_linear_48b, tiny
from kimilab.costs import spec as spec_costs
from kimilab.exercises import exercise


@exercise("7.1", "snapshot MB at k=4", rtol=0.01,
          hint=("Each verified position may become the committed state, so each needs its own copy of the "
                 "states.",
                "k drafts plus the last committed token are verified; count their checkpoints in decimal MB."))
def _():
    return 5 * costs.checkpoint_bytes(kimi_linear_48b, costs.ONE_H200) / 1e6


@exercise("7.2", "tokens per verify step at alpha 0.6, k=4", rtol=1e-3,
          hint=("Drafts are accepted in order until the first rejection, and the target always adds one "
                 "token.",
                "Sum the probabilities that each prefix of drafts survives: a geometric series."))
def _():
    return spec_costs.expected_tokens_per_step(0.6, 4)


@exercise("7.3", "scratch pages of one snapshot step at k=8",
          hint=("A snapshot slot is page-aligned: its bytes are rounded up to whole pages.",
                "One slot per verified position (k + 1), each the tiny checkpoint's bytes in whole 4,096-byte"
                 " pages."))
def _():
    return 9 * -(-costs.checkpoint_bytes(tiny, costs.LOCAL) // 4096)
