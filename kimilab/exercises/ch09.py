"""Chapter 9's checked exercises: what context-parallel KDA exchanges, and where to cut."""

from kimilab import cp
from kimilab.exercises import exercise


@exercise("9.1", "bytes of one rank's transition", hint="(M, C): H K (K + V) values of 4 bytes each in float32.")
def _():
    return 32 * 128 * (128 + 128) * 4


@exercise("9.2", "critical-path steps of the sequential pass at P = 16",
          hint="cp.scheme_costs(16, H, K, V)['sequential']['steps']: each rank waits for the one before.")
def _():
    return cp.scheme_costs(16, 1, 1, 1)["sequential"]["steps"]


@exercise("9.3", "rank 0's tokens in a balanced split", hint="cp.split_bounds(10_000, 4, cp.balanced_weights(4, 2.0))[1]")
def _():
    return cp.split_bounds(10_000, 4, cp.balanced_weights(4, 2.0))[1]
