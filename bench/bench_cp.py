"""Context-parallel KDA: ``mpiexec -n 2`` against one rank, measured in the same run.

T = 65,536, H = 4, K = V = 64, float32, one BLAS thread per rank (issue 12: must be
>= 1.4x, goal >= 1.6x). The machine is shared, so inside each launch the one-rank
reference and the two-rank run alternate REPEATS times after a warm-up, and the
speedup is the ratio of their medians; every time is printed.
"""

from __future__ import annotations

REPEATS = 7


def main() -> None:
    from kimilab.cp.launch import launch

    balanced = []
    for split in ("balanced", "balanced", "even"):
        out = launch(2, 65_536, heads=4, dim=64, dtype="float32", repeats=REPEATS,
                     extra=("--even",) if split == "even" else ())
        print(f"{split:>8}: one rank median {out['seconds_one_rank']:.3f} s "
              f"({' '.join(f'{x:.3f}' for x in out['seconds_one_rank_each'])}), P=2 median "
              f"{out['seconds_p_ranks']:.3f} s ({' '.join(f'{x:.3f}' for x in out['seconds_p_ranks_each'])}); "
              f"speedup {out['speedup']:.2f}x; bytes/rank {out['bytes_sent_per_rank']}; "
              f"max err {out['max_abs_error']:.1e}", flush=True)
        if split == "balanced":
            balanced.append(out["speedup"])
    print(f"balanced P=2 speedup (ratio of medians of {REPEATS} interleaved runs), per launch: "
          f"{' '.join(f'{s:.2f}x' for s in balanced)} (must >= 1.4x, goal >= 1.6x; wall clock on a shared machine)")
