"""Context-parallel KDA: ``mpiexec -n 2`` against one rank, measured in the same run, in both regimes.

T = 65,536, H = 4, K = V = 64, float32, one BLAS thread per rank. Two input regimes
(``cp.REGIMES``): "flushed" (random keys, Kimi's gate: M is 0 after ~2K tokens) and
"living" (keys in 16 of 64 dims, a slow gate: M stays near 1). First the passes a rank
runs are timed on one slice (T / 2 tokens) in interleaved rounds: each pass's cost over
the plain pass, median and range. Then, per regime and method, ``mpiexec -n 2`` alternates
the one-rank reference and the two-rank run REPEATS times after a warm-up; the speedup
is the ratio of their medians, printed with the per-repeat range; the cut comes from the
measured cost of that method (and once even, for contrast). The machine is shared: the
load average is printed first.
"""

from __future__ import annotations

REPEATS = 7
ROUNDS = 7
T, HEADS, DIM = 65_536, 4, 64


def main() -> None:
    import os

    import numpy as np

    from kimilab import cp
    from kimilab.cp.launch import launch
    from kimilab.cp.passes import cost_ratios, pass_seconds

    print(f"load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} cores; T = {T:,}, {HEADS} heads of {DIM}, "
          f"float32; {ROUNDS} rounds, {REPEATS} repeats", flush=True)
    costs = {}
    for regime in cp.REGIMES:
        x, _ = cp.regime_inputs(T // 2, HEADS, DIM, DIM, seed=0, regime=regime, dtype=np.float32)
        costs[regime] = cost_ratios(pass_seconds(x, rounds=ROUNDS))
        print(f"pass cost over the plain pass, {regime:>8}, slice {T // 2:,}: " + "  ".join(
            f"{name} {m:.2f} [{lo:.2f}-{hi:.2f}]" for name, (m, lo, hi) in costs[regime].items() if name != "plain"),
            flush=True)
    for regime in cp.REGIMES:
        for method, split in (("affine", "balanced"), ("kcp", "balanced"), ("affine", "even")):
            cost = max(1.0, costs[regime][method][0])
            out = launch(2, T, heads=HEADS, dim=DIM, inputs=regime, method=method, repeats=REPEATS,
                         affine_cost=cost if split == "balanced" else None)
            ones, walls = np.array(out["seconds_one_rank_each"]), np.array(out["seconds_p_ranks_each"])
            ratios = ones / walls
            print(f"{regime:>8} {method:>6} {split:>8} (cut {out['bounds'][1]:,}): one rank {np.median(ones):.3f} s, "
                  f"P=2 {np.median(walls):.3f} s -> {out['speedup']:.2f}x [{ratios.min():.2f}-{ratios.max():.2f}], "
                  f"efficiency {out['speedup'] / 2:.0%}; wire bytes/rank {out['wire_bytes_sent_per_rank']}; "
                  f"max err {out['max_abs_error']:.1e}", flush=True)


if __name__ == "__main__":
    main()
