"""Speculative rollback benchmarks: bytes kept at 48B sizes, and rollback time on the reduced model.

Bytes are analytic (kimilab.costs.spec) at Kimi-Linear-48B shapes: KDA states fp32, conv
state bf16, captured activations in bf16 (as engines keep them) and, for comparison,
fp32. Times are CPU seconds of the numpy strategies, measured side by side in this
process (best of a few runs); ratios are the result, absolute times depend on the machine.
"""

from __future__ import annotations

from kimilab import config
from kimilab.costs import DEFAULT_DEPLOYMENT as DEPLOYMENT, spec as spec_costs
from kimilab.model import Model
from kimilab.speculative import rollback_timings

K = 8


def bench_bytes() -> None:
    cfg = config.kimi_linear_48b
    snap = spec_costs.rollback_bytes(cfg, DEPLOYMENT, "snapshot", K)
    print(f"48B rollback bytes per request per device ({DEPLOYMENT.describe()}) at k={K}: snapshot={snap / 1e6:.1f} MB "
          f"({K + 1} checkpoints, states fp32, conv bf16)")
    for act_bytes, dtype in ((2, "bf16"), (4, "fp32")):
        for keep in spec_costs.RECORD_KEEPS:
            for strategy in ("replay", "ring"):
                b = spec_costs.rollback_bytes(cfg, DEPLOYMENT, strategy, K, keep=keep, act_bytes=act_bytes)
                print(f"  {strategy:<6s} {keep:<9s} activations {dtype}: {b / 1e6:6.2f} MB  "
                      f"snapshot/{strategy} ratio={snap / b:.1f}x")


def bench_rollback_time(model: Model, repeats: int = 7) -> None:
    keeps = (1, 5, K + 1)
    t = {name: rollback_timings(model, name, K, keeps, repeats=repeats) for name in ("snapshot", "replay", "ring")}
    for keep in keeps:
        s, r, g = t["snapshot"][keep], t["replay"][keep], t["ring"][keep]
        print(f"tiny rollback at k={K}, keep {keep}: restore replay/snapshot ratio="
              f"{r['restore'] / s['restore']:.2f}x, ring/snapshot={g['restore'] / s['restore']:.2f}x; "
              f"save+restore replay/snapshot ratio={(r['save'] + r['restore']) / (s['save'] + s['restore']):.2f}x "
              f"(snapshot {1e3 * (s['save'] + s['restore']):.2f} ms, replay {1e3 * (r['save'] + r['restore']):.2f} ms)")


def main() -> None:
    bench_bytes()
    bench_rollback_time(Model(config.tiny, seed=0))


if __name__ == "__main__":
    main()
