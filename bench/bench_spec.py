"""Speculative rollback benchmarks: bytes held and moved per GPU at 48B sizes, the verify kernel for
chains (chunked prefill vs the tree kernel with a chain mask), and rollback time on the reduced model.

Bytes are analytic (kimilab.costs.spec) at Kimi-Linear-48B shapes on the default deployment:
KDA states fp32, conv state bf16, records and ring entries in bf16 (the ring's gates fp32).
Times are CPU seconds of the numpy implementations, measured side by side in this process
(best of a few runs); ratios are the result, absolute times depend on the machine.
"""

from __future__ import annotations

from kimilab import config, costs, speculative
from kimilab.costs import DEFAULT_DEPLOYMENT as DEPLOYMENT, spec as spec_costs
from kimilab.model import Model
from kimilab.speculative import rollback_timings
from kimilab.timing import best_seconds

K = 8


def bench_bytes() -> None:
    cfg = config.kimi_linear_48b
    S = costs.checkpoint_bytes(cfg, DEPLOYMENT)
    snap = spec_costs.rollback_bytes(cfg, DEPLOYMENT, "snapshot", K)
    print(f"48B rollback bytes per request per GPU ({DEPLOYMENT.describe()}) at k={K}; one state {S / 1e6:.2f} MB")
    for strategy in spec_costs.ROLLBACK_STRATEGIES:
        held = spec_costs.rollback_bytes(cfg, DEPLOYMENT, strategy, K)
        moved = spec_costs.mean_moved_bytes(cfg, DEPLOYMENT, strategy, K, K + 1)
        print(f"  {strategy:<10s} held {held / 1e6:7.2f} MB (copy-back/{strategy} ratio={snap / held:.1f}x), "
              f"moved per step {moved / S:.2f} states (plain decoding 2)")


def bench_verify_kernel(model: Model, repeats: int = 7) -> None:
    cache = model.new_cache()
    model.prefill(list(range(64)), cache)
    for n in (2, 5, 9):
        window = list(range(100, 100 + n))
        chunk = best_seconds(lambda: speculative.verify(model, window, cache.clone()), repeats=repeats)
        tree = best_seconds(lambda: speculative.verify_tree(model, window, speculative.Window.chain(n), cache.clone()),
                            repeats=repeats)
        print(f"tiny verify of {n} positions: tree kernel / chunked prefill ratio={tree / chunk:.2f}x "
              f"(prefill {1e3 * chunk:.2f} ms)")


def bench_rollback_time(model: Model, repeats: int = 5) -> None:
    keeps = (1, K + 1)
    t = {name: rollback_timings(model, name, K, keeps, repeats=repeats) for name in speculative.EXACT_ROLLBACKS}
    for keep in keeps:
        base = sum(t["snapshot"][keep].values())
        print(f"tiny rollback at k={K}, keep {keep} (current+save+restore): "
              + ", ".join(f"{name}/snapshot ratio={sum(t[name][keep].values()) / base:.2f}x"
                          for name in speculative.EXACT_ROLLBACKS[1:])
              + f" (snapshot {1e3 * base:.2f} ms)")


def main() -> None:
    bench_bytes()
    model = Model(config.tiny, seed=0)
    bench_verify_kernel(model)
    bench_rollback_time(model)


if __name__ == "__main__":
    main()
