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
    assert {r["status"] for r in rows} <= set(costs.inputs.__globals__["STATUSES"])
    status = {r["name"]: r["status"] for r in rows}
    assert status["GEMM efficiency (asymptote)"] == "measured" and status["replay efficiency"] == "assumed"
    assert status["attention efficiency"] == "fitted" and status["KDA efficiency"] == "measured"
    assert status["link latency"] == "fitted" and all(r["source"] for r in rows)


def test_the_ensemble_is_every_combination_with_the_calibrated_kernels_first():
    ms = costs.members()
    n = 1
    for _, options in costs.AXES:
        n *= len(options)
    assert len(ms) == n == len({m.choices for m in ms})
    assert ms[0].kernels == costs.CALIBRATED and ms[0].differs() == "central"
    assert all(m.kernels.replay == costs.CALIBRATED.replay for m in ms)
    kda = {m.kernels.kda for m in ms}
    assert min(kda) < costs.CALIBRATED.kda < max(kda)


def test_a_band_labels_its_verdict_and_knows_a_byte_count():
    from kimilab.config import all_mla_27, kimi_linear_48b

    dep = costs.DEFAULT_DEPLOYMENT
    ratio = lambda d: costs.prefill_seconds(all_mla_27, d, 128_000) / costs.prefill_seconds(kimi_linear_48b, d, 128_000)  # noqa: E731
    b = costs.band(ratio, dep, lambda x: x > 1)
    assert b.lo <= b.central <= b.hi and b.lo < b.hi and b.label == "holds across the band"
    flip = costs.band(ratio, dep, lambda x: x > b.central)  # the central itself fails: members above flip it
    assert flip.label.startswith("flips under")
    graph_only = costs.band(ratio, dep, lambda x: x > 1, only=lambda m: m.choices[3] == "CUDA graphs")
    assert b.lo <= graph_only.lo <= graph_only.hi <= b.hi and graph_only.central == b.central
    nbytes = costs.band(lambda d: costs.kv_bytes_per_token(kimi_linear_48b, d), dep, lambda x: x > 0)
    assert nbytes.lo == nbytes.hi and nbytes.label.startswith("byte-driven")
