"""Chapter 7's checked exercises: what per-position snapshots cost per GPU, what a window yields,
and the two notions of acceptance."""

from kimilab import costs
from kimilab.config import kimi_linear_48b, tiny
from kimilab.costs import spec as spec_costs
from kimilab.exercises import exercise


@exercise("7.1", "copy-back snapshot MB per GPU at k=4, default deployment", rtol=0.01,
          hint=("Each verified position may become the committed state, so each needs its own copy of the "
                "states -- of this GPU's share of them.",
                "k drafts plus the last committed token are verified; count their checkpoints on one device of "
                "the default deployment, in decimal MB."))
def _():
    return 5 * costs.checkpoint_bytes(kimi_linear_48b, costs.DEFAULT_DEPLOYMENT) / 1e6


@exercise("7.2", "tokens per verify step at alpha 0.7, k=4", rtol=1e-3,
          hint=("Drafts are accepted in order until the first rejection, and the target always adds one "
                "token.",
                "Sum the probabilities that each prefix of drafts survives: a geometric series."))
def _():
    return spec_costs.expected_tokens_per_step(0.7, 4)


@exercise("7.3", "scratch pages of one snapshot step at k=8",
          hint=("A snapshot slot is page-aligned: its bytes are rounded up to whole pages.",
                "One slot per verified position (k + 1), each the tiny checkpoint's bytes in whole 4,096-byte"
                " pages."))
def _():
    return 9 * -(-costs.checkpoint_bytes(tiny, costs.LOCAL) // 4096)


@exercise("7.4", "alpha behind an accepted fraction of 0.45 at k=4", rtol=1e-3,
          hint=("The accepted fraction averages the survival probabilities of the k drafts; alpha is the "
                "per-position probability behind them.",
                "Solve (a + a^2 + a^3 + a^4) / 4 = 0.45 for a, for instance by bisection on [0, 1]."))
def _():
    return spec_costs.alpha_from_accepted_fraction(0.45, 4)


@exercise("7.5", "states slot selection holds beyond copy-back's, per request",
          hint=("Copy-back keeps its per-position states beside the request's own state; slot selection "
                "makes the request's own state one of the slots.",
                "Count all states a request holds under each design for the same k, and subtract."))
def _():
    return -1
