"""kimilab.cp: the zigzag layout for global attention (exact, balanced, counted) and the whole-model
CP cost model (schedules, layouts, cuts, the regime it names)."""

from __future__ import annotations

import numpy as np
import pytest

from kimilab import costs, cp
from kimilab.config import kimi_linear_48b
from kimilab.cp.model_costs import model_cp_prefill
from kimilab.cp.ring import ring_attention_rank
from kimilab.cp.zigzag import causal_work, contiguous_layout, layout_positions, relayout, zigzag_layout
from kimilab.ops.attention import reference_causal_attention


def maxdiff(a, b):
    return float(np.max(np.abs(a - b), initial=0.0))


@pytest.mark.parametrize("T,P", [(23, 3), (40, 4), (7, 4), (64, 2), (100, 5)])
def test_zigzag_ring_attention_equals_causal_attention_and_counts_its_work(T, P):
    """Rows go contiguous -> zigzag (all-to-all), ring attention on the zigzag runs, outputs go back:
    equal to one rank's causal attention; the scores each rank computed equal causal_work."""
    r = np.random.default_rng(T)
    q, k, v = (r.standard_normal((T, 2, 4)) for _ in range(3))
    ref = reference_causal_attention(q, k, v)
    bounds = cp.split_bounds(T, P)
    home = contiguous_layout(bounds)
    for layout in (home, zigzag_layout(T, P)):
        def body(comm):
            mine = [x[bounds[comm.rank]:bounds[comm.rank + 1]] for x in (q, k, v)]
            zq, zk, zv = (relayout(comm, x, home, layout) for x in mine)
            stats = {}
            o = ring_attention_rank(comm, zq, zk, zv, positions=layout_positions(layout[comm.rank]), stats=stats)
            return relayout(comm, o, layout, home), stats["score_entries"]

        results, _ = cp.run_local(P, body)
        assert maxdiff(np.concatenate([o for o, _ in results]), ref) <= 1e-10
        assert [w for _, w in results] == causal_work(layout)


def test_zigzag_balances_causal_work_and_the_contiguous_split_does_not():
    T, P = 8 * 1024, 8
    contiguous = causal_work(contiguous_layout(cp.split_bounds(T, P)))
    zigzag = causal_work(zigzag_layout(T, P))
    assert max(contiguous) / np.mean(contiguous) == pytest.approx(2 * P / (P + 1))  # tiles: P vs (P + 1) / 2
    assert max(zigzag) / np.mean(zigzag) < 1.07
    assert zigzag_layout(3, 2) == [[(0, 2)], [(2, 3)]]  # fewer tokens than chunks: contiguous


@pytest.mark.parametrize("cut", [{"ranks": 2}, {"ranks": 5}, {"bounds": [0, 1, 2, 40, 90]}])
def test_whole_model_prefill_with_zigzag_attention_equals_one_rank(tiny_model, cut):
    tokens = np.random.default_rng(8).integers(0, tiny_model.config.vocab_size, 90)
    ref_cache = tiny_model.new_cache()
    ref = tiny_model.prefill(tokens, ref_cache)
    stats = []
    logits, cache = cp.context_parallel_prefill(tiny_model, tokens, **cut, layout="zigzag", stats=stats)
    assert maxdiff(logits, ref) <= 1e-10
    for layer in tiny_model.layers:
        if layer.kind == "A":
            assert all(maxdiff(a, b) <= 1e-10 for a, b in zip(cache.kv(layer.index), ref_cache.kv(layer.index)))
    nxt = int(np.argmax(ref[-1]))
    assert maxdiff(tiny_model.decode(nxt, cache), tiny_model.decode(nxt, ref_cache)) <= 1e-10
    P = len(stats)
    per_layer = causal_work(zigzag_layout(90, P))
    n_attn = len(tiny_model.config.attn_layers)
    assert [s["score_entries"] for s in stats] == [n_attn * w for w in per_layer]
    with pytest.raises(ValueError, match="layout"):
        cp.context_parallel_prefill(tiny_model, tokens, ranks=2, layout="striped")


def test_model_cost_regimes_schedules_and_bad_input():
    cfg, dep = kimi_linear_48b, costs.VLLM_TP8_H200
    one = model_cp_prefill(cfg, 2**15, 1, deployment=dep)
    assert one["speedup"] == pytest.approx(1.0) and one["seconds"] == pytest.approx(one["one_device_seconds"])
    long = {(s, lay): model_cp_prefill(cfg, 2**20, 8, deployment=dep, schedule=s, layout=lay)
            for s, lay in (("exchange", "contiguous"), ("exchange", "zigzag"), ("relay", "zigzag"),
                           ("relay-pipelined", "contiguous"))}
    assert long[("exchange", "zigzag")]["speedup"] > long[("exchange", "contiguous")]["speedup"]
    assert long[("exchange", "zigzag")]["speedup"] > long[("relay", "zigzag")]["speedup"]  # the relay serialises KDA
    for v in long.values():
        assert v["efficiency"] == pytest.approx(v["speedup"] / 8) and 1 < v["speedup"] <= 8
        assert v["link"] == dep.intra_link.name and v["scope"].startswith("whole model (20 KDA : 7 MLA")
    assert model_cp_prefill(cfg, 2**20, 16, deployment=dep)["link"] == dep.inter_link.name  # two nodes
    with pytest.raises(ValueError, match="layout"):
        model_cp_prefill(cfg, 2**15, 4, deployment=dep, schedule="relay-pipelined", layout="zigzag")
    with pytest.raises(ValueError, match="affine_cost"):
        model_cp_prefill(cfg, 2**15, 4, deployment=dep, affine_cost=0.9)
    with pytest.raises(ValueError, match="schedule"):
        model_cp_prefill(cfg, 2**15, 4, deployment=dep, schedule="ring")
    verdict = cp.costs.kda_layer_verdict(8, 2**20, 32, 128, 128, deployment=dep, affine_cost=1.4)
    assert verdict["efficiency"] == pytest.approx(verdict["speedup"] / 8) and verdict["T"] == 2**20
    with pytest.raises(ValueError, match="affine_cost"):
        cp.predicted_speedup(2, 1024, 4, 8, 8, deployment=dep, affine_cost=0.95)


def test_one_device_parts_add_up_to_the_one_device_prefill():
    cfg, dep = kimi_linear_48b, costs.VLLM_TP8_H200
    for T in (2**12, 2**18):
        parts = cp.model_costs.one_device_parts(cfg, T, deployment=dep)
        assert sum(parts.values()) == pytest.approx(model_cp_prefill(cfg, T, 1, deployment=dep)["seconds"])
        assert all(v >= 0 for v in parts.values())
    short, long = (cp.model_costs.one_device_parts(cfg, T, deployment=dep) for T in (2**12, 2**20))
    assert long["attention"] / sum(long.values()) > short["attention"] / sum(short.values())  # quadratic
