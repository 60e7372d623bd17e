"""kimilab.verdict: crossovers found by root-finding, with what the sweep could say."""

import math

import pytest

from kimilab import costs
from kimilab.verdict import band, crossover


def test_a_crossing_is_found_to_the_tolerance_and_knows_its_side():
    c = crossover(lambda x: math.log(x) - math.log(1885.3), 16, 2**20)
    assert c.kind == "crossing" and c.rising and c.x == pytest.approx(1885.3, rel=1e-3)
    down = crossover(lambda x: 100.0 - x, 1, 1000, log=False, tol=1e-6)
    assert not down.rising and down.x == pytest.approx(100.0, rel=1e-5)
    assert "up to 100" in down.describe() and "from 1,886" in c.describe()
    n = crossover(lambda x: x - 471.5, 16, 2**20, integer=True)
    assert n.x == 472 and n.rising


def test_no_crossing_says_what_the_sweep_showed():
    assert crossover(lambda x: 1.0, 1, 10).kind == "pays everywhere in the sweep"
    assert crossover(lambda x: -1.0, 1, 10).kind == "never pays in the sweep"
    assert crossover(lambda x: -1.0, 1, 10).describe("tokens") == "never pays in the sweep (1-10 tokens)"
    with pytest.raises(ValueError, match="lo < hi"):
        crossover(lambda x: x, 0, 10)


def test_the_band_over_seeds():
    cs = [crossover(lambda x, s=s: x - 100 * s, 1, 1000) for s in (1, 2, 3)] + [crossover(lambda x: 1.0, 1, 10)]
    lo, mid, hi, missing = band(iter(cs))
    assert (round(lo), round(mid), round(hi), missing) == (100, 200, 300, 1)


def test_every_input_is_marked():
    rows = costs.inputs(costs.DEFAULT_DEPLOYMENT)
    assert {r["status"] for r in rows} <= set(("sourced", "fitted", "assumed"))
    status = {r["name"]: r["status"] for r in rows}
    assert status["GEMM efficiency"] == "fitted" and status["replay efficiency"] == "assumed"
    assert status["link latency"] == "fitted" and all(r["source"] for r in rows)


def test_calibration_variants_move_one_fitted_number_each_way():
    dep = costs.DEFAULT_DEPLOYMENT
    variants = costs.calibration_variants(dep, 0.155)
    assert len(variants) == 10 and len({v.name for v in variants}) == 10
    for v in variants:
        moved = [f for f in ("gemm", "attention", "kda", "bandwidth", "layer_overhead_s")
                 if getattr(v.kernels, f) != getattr(dep.kernels, f)]
        assert len(moved) == 1
        ratio = getattr(v.kernels, moved[0]) / getattr(dep.kernels, moved[0])
        assert ratio == pytest.approx(math.exp(0.155)) or ratio == pytest.approx(math.exp(-0.155)) \
            or getattr(v.kernels, moved[0]) == 1.0
        assert v.kernels.replay == dep.kernels.replay and v.device == dep.device
    assert costs.calibration_variants(dep, 0.0)[0].kernels == dep.kernels
    with pytest.raises(ValueError, match="log_error"):
        costs.calibration_variants(dep, -1)
