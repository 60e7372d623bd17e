"""The one analytic cost model, kimilab.costs: cache bytes, weights, FLOPs, roofline decode,
and the records the pool (CacheShapes) and the prefix cache (CacheCosts) read from it."""

import re

import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from kimilab import costs as m
from kimilab.ops.attention import KVCache, attention_flops
from kimilab.config import CACHE_KINDS, PRESETS, all_mla_27, gqa_8b, kimi_linear_48b, tiny

M = 1 << 20  # 1M tokens
K128 = 128 * 1024


def test_kv_bytes_per_token_real_shapes():
    assert m.kv_bytes_per_token_layer(kimi_linear_48b) == (512 + 64) * 2
    assert m.kv_bytes_per_token(kimi_linear_48b) == 8064  # 7 MLA layers
    assert m.kv_bytes_per_token(all_mla_27) == 31104  # 27 MLA layers
    assert m.kv_bytes_per_token(gqa_8b) == 32 * 2 * 8 * 128 * 2
    assert m.kv_bytes_per_token(tiny) == 2 * 2 * 4 * 32 * 8


def test_fixed_state_bytes():
    assert m.kda_state_bytes_per_layer(kimi_linear_48b) == 32 * 128 * 128 * 4
    assert m.kda_state_bytes(kimi_linear_48b) == 20 * 32 * 128 * 128 * 4
    assert m.conv_state_bytes(kimi_linear_48b) == 20 * 3 * (3 * 32 * 128) * 2
    assert m.checkpoint_bytes(kimi_linear_48b) == m.kda_state_bytes(kimi_linear_48b) + m.conv_state_bytes(kimi_linear_48b)
    assert m.kda_state_bytes(all_mla_27) == m.conv_state_bytes(all_mla_27) == m.checkpoint_bytes(all_mla_27) == 0


def test_request_bytes_by_kind():
    got = m.request_bytes(kimi_linear_48b, 1000)
    assert list(got) == list(CACHE_KINDS)
    assert got["kv"] == 8064 * 1000
    assert m.request_total_bytes(kimi_linear_48b, 1000) == sum(got.values())
    assert m.request_bytes(all_mla_27, 0) == {"kv": 0, "kda_state": 0, "conv_state": 0}
    assert m.request_bytes(tiny, np.int64(5))["kv"] == 5 * 4096  # numpy ints accepted


def test_measured_cache_matches_analytic_for_tiny():
    layer = tiny.attn_layers[0]
    assert tiny.layer_pattern[layer] == "A"
    caches = [KVCache(tiny.attn_kv_heads_eff, tiny.attn_head_dim_eff, dtype=tiny.dtype) for _ in tiny.attn_layers]
    rng = np.random.default_rng(0)
    for c in caches:
        c.append(rng.standard_normal((37, c.n_kv_heads, c.head_dim)), rng.standard_normal((37, c.n_kv_heads, c.value_dim)))
    assert sum(c.nbytes for c in caches) == m.request_bytes(tiny, 37)["kv"]


@pytest.mark.parametrize("L, lo, hi", [(K128, 0.26, 0.28), (M, 0.255, 0.265)])
def test_hybrid_uses_about_a_quarter_of_all_mla(L, lo, hi):
    ratio = m.request_total_bytes(kimi_linear_48b, L) / m.request_total_bytes(all_mla_27, L)
    assert lo < ratio < hi  # the report's "up to 75% less KV cache"
    assert ratio > 7 / 27  # the fixed states keep it just above the layer-count limit


@settings(max_examples=30, deadline=None)
@given(a=st.integers(0, 10**7), b=st.integers(0, 10**7))
def test_linear_and_monotone_in_context(a, b):
    for cfg in (kimi_linear_48b, all_mla_27, gqa_8b, tiny):
        fixed = m.request_total_bytes(cfg, 0)
        assert m.request_total_bytes(cfg, a + b) + fixed == m.request_total_bytes(cfg, a) + m.request_total_bytes(cfg, b)
        if a <= b:
            assert m.request_total_bytes(cfg, a) <= m.request_total_bytes(cfg, b)
            assert m.decode_flops_per_token(cfg, a) <= m.decode_flops_per_token(cfg, b)
            assert m.decode_step_bytes(cfg, a) <= m.decode_step_bytes(cfg, b)


@settings(max_examples=30, deadline=None)
@given(n_cached=st.integers(0, 5000), a=st.integers(0, 3000), b=st.integers(0, 3000))
def test_prefill_flops_properties(n_cached, a, b):
    for cfg in (kimi_linear_48b, tiny):
        f = m.prefill_flops(cfg, a, n_cached)
        assert isinstance(f, int) and f >= 0
        assert m.prefill_flops(cfg, a + 1, n_cached) > f  # more new tokens cost more
        assert m.prefill_flops(cfg, a, n_cached + 1) >= f  # a longer cached prefix never helps
    # Attention is the only part that sees the cached prefix, and splitting at a chunk
    # boundary gives the same KDA work, so two pieces cost what the whole costs.
    C = tiny.chunk_size
    a, b = a - a % C, b - b % C
    whole = m.prefill_flops(tiny, a + b, n_cached)
    assert m.prefill_flops(tiny, a, n_cached) + m.prefill_flops(tiny, b, n_cached + a) == whole


def test_prefill_attention_term_matches_attention_counter():
    cfg = gqa_8b  # all global layers, plain GQA
    n, c = 300, 700
    attn = m.prefill_flops(cfg, n, c) - n * m.linear_flops_per_token(cfg)
    per_layer = attention_flops(n, n + c, cfg.attn_heads_eff, cfg.attn_head_dim_eff)
    assert attn == cfg.n_layers * per_layer
    assert m.prefill_flops(cfg, 0, 123) == 0


def test_decode_flops_is_prefill_of_one_token_for_attention_models():
    for L in (0, 1, 1000):
        assert m.decode_flops_per_token(gqa_8b, L) == m.prefill_flops(gqa_8b, 1, L)


def test_kda_work_is_independent_of_context():
    d0 = m.decode_flops_per_token(kimi_linear_48b, 0)
    d1 = m.decode_flops_per_token(kimi_linear_48b, 1000)
    per_key = (d1 - d0) / 1000
    assert per_key == 7 * 2 * 32 * (512 + 64 + 512)  # only the 7 MLA layers grow


def test_weights_and_roofline():
    w = m.weight_model(kimi_linear_48b)
    assert m.weight_bytes(kimi_linear_48b) == 96_000_000_000
    assert m.weight_bytes_read(kimi_linear_48b, 1) == 6_000_000_000  # 3B active, bf16
    reads = [m.weight_bytes_read(kimi_linear_48b, b) for b in (1, 2, 8, 64, 10_000)]
    assert reads == sorted(reads) and reads[-1] <= m.weight_bytes(kimi_linear_48b)
    assert abs(w.params_read(10_000) - w.total_params) < 1e3
    assert m.weight_bytes_read(gqa_8b, 7) == m.weight_bytes(gqa_8b)  # dense: all every step
    # A step reads weights once plus every request's cache.
    L, B = 4096, 3
    assert m.decode_step_bytes(kimi_linear_48b, L, B) == m.weight_bytes_read(kimi_linear_48b, B) + B * m.request_total_bytes(kimi_linear_48b, L)
    assert m.decode_bytes_per_token(kimi_linear_48b, L, B) == m.decode_step_bytes(kimi_linear_48b, L, B) / B
    one = m.Deployment(m.H800_CLASS, 1)
    t = m.decode_step_seconds(all_mla_27, M, 1, one)
    assert t == pytest.approx(m.decode_step_bytes(all_mla_27, M) / m.HBM_BANDWIDTH_BYTES_PER_S)


def test_batch_that_fits():
    node = m.DEFAULT_DEPLOYMENT
    free = node.hbm_bytes - m.weight_bytes(kimi_linear_48b)
    b = m.max_batch(kimi_linear_48b, M)
    assert b * m.request_total_bytes(kimi_linear_48b, M) <= free < (b + 1) * m.request_total_bytes(kimi_linear_48b, M)
    assert m.max_batch(kimi_linear_48b, M) > 3 * m.max_batch(all_mla_27, M)
    assert m.max_batch(kimi_linear_48b, M, m.Deployment(m.H800_CLASS, 1)) == 0  # 96 GB of weights > 80 GB
    with pytest.raises(ValueError, match="not one request"):
        m.decode_point(kimi_linear_48b, M, deployment=m.Deployment(m.H800_CLASS, 1))


def test_tpot_gap_at_1m_is_computed_not_asserted():
    # Batch 1: the hybrid reads fewer cache bytes per token, diluted by the weights.
    h1, b1 = m.decode_point(kimi_linear_48b, M, 1), m.decode_point(all_mla_27, M, 1)
    assert 2.0 < b1.step_seconds / h1.step_seconds < 3.0
    # Largest batches: per-token cost gap approaches (not exceeds) the cache-byte ratio.
    h, b = m.decode_point(kimi_linear_48b, M), m.decode_point(all_mla_27, M)
    gap = b.seconds_per_token / h.seconds_per_token
    assert b1.step_seconds / h1.step_seconds < gap < m.kv_bytes_per_token(all_mla_27) / m.kv_bytes_per_token(kimi_linear_48b)


@pytest.mark.parametrize("bad", [-1, 1.5, "10", None, True])
def test_bad_context_lengths(bad):
    with pytest.raises(ValueError, match=re.escape(f"context_len={bad!r}: expected an int >= 0 (tokens)")):
        m.request_bytes(kimi_linear_48b, bad)
    with pytest.raises(ValueError, match="context_len"):
        m.decode_flops_per_token(kimi_linear_48b, bad)


def test_other_bad_arguments():
    with pytest.raises(ValueError, match="n_new"):
        m.prefill_flops(tiny, -3)
    with pytest.raises(ValueError, match="n_cached"):
        m.prefill_flops(tiny, 3, -1)
    with pytest.raises(ValueError, match="batch"):
        m.decode_step_bytes(tiny, 10, 0)
    with pytest.raises(ValueError, match="cfg: expected a kimilab.config.ModelConfig"):
        m.kv_bytes_per_token("kimi_linear_48b")
    with pytest.raises(ValueError, match="n_devices"):
        m.Deployment(m.H800_CLASS, 0)
    with pytest.raises(ValueError, match="batch"):
        m.weight_model(kimi_linear_48b).params_read(0)


def test_cache_anatomy_rows():
    rows = m.cache_anatomy(kimi_linear_48b)
    assert [r["kind"] for r in rows] == list(CACHE_KINDS)
    assert rows[0]["grows_with_context"] and not rows[1]["grows_with_context"]
    assert [r["kind"] for r in m.cache_anatomy(all_mla_27)] == ["kv"]


def test_summary_compares_two_configs():
    lines = m.summary(kimi_linear_48b, all_mla_27, contexts=(M,))
    assert lines[0].startswith("deployment: 8 x H800-class")
    assert len(lines) == 2 + 2 + 4
    row = {line[:36].strip(): line[36:].split() for line in lines[2:]}
    assert row["KV bytes per token"] == ["8,064", "31,104", "3.86x"]
    assert row["@1,048,576: largest batch"][:2] == ["64", "16"]
    one = m.summary(kimi_linear_48b, all_mla_27, m.Deployment(m.H800_CLASS, 1), contexts=(M,))
    assert one[-1].split()[-3:] == ["-", "-", "-"]  # the 48B weights alone fill one device


# ----- CacheShapes: the pool's record of the same bytes --------------------------

@pytest.mark.parametrize("name", sorted(PRESETS))
def test_cache_shapes_are_the_functions_bytes(name):
    cfg = PRESETS[name]
    s = m.CacheShapes.from_config(cfg)
    assert s.name == cfg.name
    assert s.kv_token_bytes == m.kv_bytes_per_token_layer(cfg)
    assert s.state_bytes == m.kda_state_bytes_per_layer(cfg)
    assert s.conv_bytes == m.conv_state_bytes_per_layer(cfg)
    assert s.kv_bytes_per_token == m.kv_bytes_per_token(cfg)
    assert s.fixed_bytes == m.checkpoint_bytes(cfg)
    for n in (0, 1, 1000, M):
        assert s.request_bytes(n) == m.request_total_bytes(cfg, n)
    with pytest.raises(ValueError, match="cfg: expected a kimilab.config.ModelConfig"):
        m.CacheShapes.from_config(name)


# ----- CacheCosts: the prefix cache's memoised FLOPs -----------------------------

def test_cache_costs_come_from_the_functions():
    costs = m.CacheCosts.of(kimi_linear_48b)
    assert costs.config is kimi_linear_48b
    assert costs.kv_bytes_per_token == 8064 == m.kv_bytes_per_token(kimi_linear_48b)
    assert costs.checkpoint_bytes == m.checkpoint_bytes(kimi_linear_48b)
    assert costs.pair_flops == m.prefill_flops(kimi_linear_48b, 1, 1) - m.prefill_flops(kimi_linear_48b, 1, 0)


@pytest.mark.parametrize("cfg", [kimi_linear_48b, tiny, gqa_8b], ids=lambda c: c.name)
def test_memoised_prefill_flops_equal_the_direct_call(cfg):
    costs = m.CacheCosts.of(cfg)
    grid = [0, 1, 63, 64, 65, 600, 1000, 4096]
    for _ in range(2):  # second pass answers from the memo
        for n_new in grid:
            for n_cached in grid:
                assert costs.prefill_flops(n_new, n_cached) == m.prefill_flops(cfg, n_new, n_cached)


def test_flops_saved():
    costs = m.CacheCosts.of(kimi_linear_48b)
    assert costs.flops_saved(1000, 0) == 0
    assert costs.flops_saved(1000, 600) == m.prefill_flops(kimi_linear_48b, 1000) - m.prefill_flops(kimi_linear_48b, 400, 600)
    assert costs.flops_saved(1000, 1000) == m.prefill_flops(kimi_linear_48b, 1000)
    assert 0 < costs.flops_saved(1000, 600) < costs.flops_saved(1000, 601)
