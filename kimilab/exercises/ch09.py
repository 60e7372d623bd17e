"""Chapter 9's checked exercises: what context-parallel KDA exchanges, where to cut, and why zigzag."""

from kimilab import cp
from kimilab.exercises import exercise


@exercise("9.1", "bytes of one rank's transition",
          hint=("A rank's transition is the pair (M, C): M is K x K and C is K x V, per head.",
                "Count the numbers in M and C over all heads, times 4 bytes."))
def _():
    return 32 * 128 * (128 + 128) * 4


@exercise("9.2", "critical-path steps of the sequential pass at P = 16",
          hint=("In the sequential scheme each rank waits for the state of the rank before it.",
                "Count the hand-offs along the chain of P ranks."))
def _():
    return cp.scheme_costs(16, 1, 1, 1)["sequential"]["steps"]


@exercise("9.3", "rank 0's tokens in a balanced split",
          hint=("Rank 0 starts from the true initial state, so it needs no correction pass.",
                "Give each rank a share of the tokens inversely proportional to its cost per token."))
def _():
    return cp.split_bounds(10_000, 3, cp.balanced_weights(3, 1.8))[1]


@exercise("9.7", "smallest P where the tree sends fewer bytes than the all-gather, at 48B shapes",
          hint=("The all-gather's busiest rank sends P - 1 transitions; the tree's sends one transition per "
                "round, log2 P rounds (rounded up), and then one state.",
                "A transition (M, C) is twice a state here (K = V); try P = 2, 3, 4, ... and compare the two counts."))
def _():
    return next(P for P in range(2, 65) if cp.scheme_costs(P, 32, 128, 128)["tree"]["bytes"]
                < cp.scheme_costs(P, 32, 128, 128)["allgather"]["bytes"])


@exercise("9.8", "busiest / mean causal-attention work with contiguous slices at P = 16", rtol=1e-3,
          hint=("Under a causal mask, rank r's queries see its own block and every earlier rank's block: whole "
                "tiles of equal size.",
                "Rank r computes r + 1 tiles; compare the busiest rank's count with the mean over the P ranks."))
def _():
    w = cp.causal_work(cp.contiguous_layout(cp.split_bounds(16 * 1024, 16)))
    return max(w) / (sum(w) / len(w))
