"""The one analytic cost model, kimilab.costs: cache bytes, weights, FLOPs, roofline decode,
and the records the pool (CacheShapes) and the prefix cache (CacheCosts) read from it."""

import re

import numpy as np
import pytest
from hypothesis import given, settings, strategies as st
from fuzzing import examples

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


@settings(max_examples=examples(30), deadline=None)
@given(a=st.integers(0, 10**7), b=st.integers(0, 10**7))
def test_linear_and_monotone_in_context(a, b):
    for cfg in (kimi_linear_48b, all_mla_27, gqa_8b, tiny):
        fixed = m.request_total_bytes(cfg, 0)
        assert m.request_total_bytes(cfg, a + b) + fixed == m.request_total_bytes(cfg, a) + m.request_total_bytes(cfg, b)
        if a <= b:
            assert m.request_total_bytes(cfg, a) <= m.request_total_bytes(cfg, b)
            assert m.decode_flops_per_token(cfg, a) <= m.decode_flops_per_token(cfg, b)
            assert m.decode_step_bytes(cfg, a) <= m.decode_step_bytes(cfg, b)


@settings(max_examples=examples(30), deadline=None)
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


TP8 = m.Deployment(m.H800_CLASS, 8, "tp")
DP8 = m.Deployment(m.H800_CLASS, 8, "dp")


def test_default_deployment_is_tensor_parallel():
    assert m.DEFAULT_DEPLOYMENT == TP8 and m.DEFAULT_DEPLOYMENT.attention == "tp"
    assert TP8.with_attention("dp") == DP8
    with pytest.raises(ValueError, match="attention='sp'"):
        m.Deployment(m.H800_CLASS, 8, "sp")


def test_what_each_rank_holds():
    # MLA has one latent KV head: TP replicates it; KDA states shard by head.
    assert m.kv_rank_fraction(kimi_linear_48b, TP8) == 1.0
    assert m.state_rank_fraction(kimi_linear_48b, TP8) == 4 / 32
    assert m.request_rank_bytes(kimi_linear_48b, M, TP8) == M * 8064 + m.checkpoint_bytes(kimi_linear_48b) // 8
    assert m.kv_rank_fraction(gqa_8b, TP8) == 1 / 8  # 8 KV heads over 8 ranks
    assert m.kv_rank_fraction(gqa_8b, m.Deployment(m.H800_CLASS, 16)) == 1 / 8  # at least one head per rank
    # DP-attention: the request's rank holds all of it; the mixers' weights are replicated.
    assert m.request_rank_bytes(kimi_linear_48b, M, DP8) == m.request_total_bytes(kimi_linear_48b, M)
    mixers = m.mixer_params(kimi_linear_48b) * 2
    assert m.rank_weight_bytes(kimi_linear_48b, DP8) == pytest.approx(mixers + (96e9 - mixers) / 8)
    assert m.rank_weight_bytes(kimi_linear_48b, TP8) == pytest.approx(96e9 / 8)
    assert [m.requests_on_busiest_rank(b, DP8) for b in (1, 8, 9)] == [1, 1, 2]
    assert m.requests_on_busiest_rank(9, TP8) == 9


def test_batch_that_fits_tp_and_dp():
    for dep in (TP8, DP8):
        free = dep.device.hbm_bytes - m.rank_weight_bytes(kimi_linear_48b, dep)
        per = m.request_rank_bytes(kimi_linear_48b, M, dep)
        per_rank = m.max_batch(kimi_linear_48b, M, dep) // (1 if dep.attention == "tp" else 8)
        assert per_rank * per <= free < (per_rank + 1) * per
    # 1M-token requests: the reviewer's TP numbers, and DP-attention's.
    assert (m.max_batch(kimi_linear_48b, M, TP8), m.max_batch(all_mla_27, M, TP8)) == (8, 2)
    assert (m.max_batch(kimi_linear_48b, M, DP8), m.max_batch(all_mla_27, M, DP8)) == (56, 16)
    assert m.max_batch(kimi_linear_48b, M, m.Deployment(m.H800_CLASS, 1)) == 0  # 96 GB of weights > 80 GB
    with pytest.raises(ValueError, match="not one request"):
        m.decode_point(kimi_linear_48b, M, deployment=m.Deployment(m.H800_CLASS, 1))


@pytest.mark.parametrize("cfg", [kimi_linear_48b, all_mla_27, gqa_8b], ids=lambda c: c.name)
def test_one_device_tp_equals_dp(cfg):
    tp, dp = m.Deployment(m.H800_CLASS, 2, "tp"), m.Deployment(m.H800_CLASS, 2, "dp")
    one_tp, one_dp = m.Deployment(m.H800_CLASS, 1, "tp"), m.Deployment(m.H800_CLASS, 1, "dp")
    for L in (1000, K128):
        assert m.max_batch(cfg, L, one_tp) == m.max_batch(cfg, L, one_dp)
        assert m.decode_step_seconds(cfg, L, 3, one_tp) == m.decode_step_seconds(cfg, L, 3, one_dp)
        assert m.decode_step_seconds(cfg, L, 1, tp) > 0 and m.decode_step_seconds(cfg, L, 1, dp) > 0


def test_decode_at_1m_batch_one_and_throughput():
    # Batch 1 under TP: every rank reads the whole latent of the all-MLA model.
    h1, b1 = m.decode_point(kimi_linear_48b, M, 1), m.decode_point(all_mla_27, M, 1)
    assert 3.5 < b1.step_seconds / h1.step_seconds < 3.7
    assert h1.rank_bytes == m.decode_rank_bytes(kimi_linear_48b, M, 1)
    assert h1.step_seconds == pytest.approx(h1.rank_bytes / m.HBM_BANDWIDTH_BYTES_PER_S)  # memory-bound
    for dep in (TP8, DP8):
        h, b = m.decode_point(kimi_linear_48b, M, None, dep), m.decode_point(all_mla_27, M, None, dep)
        gain = h.tokens_per_second / b.tokens_per_second  # throughput, not TPOT
        assert 3.0 < gain < m.kv_bytes_per_token(all_mla_27) / m.kv_bytes_per_token(kimi_linear_48b)
        assert h.seconds_per_token == pytest.approx(1 / h.tokens_per_second)
    # At its larger batch the hybrid's step (each request's TPOT) is NOT shorter under TP.
    assert m.decode_point(kimi_linear_48b, M).step_seconds > m.decode_point(all_mla_27, M).step_seconds


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
    assert lines[0].startswith("deployment: 8 x H800-class") and lines[0].endswith("tp attention")
    assert len(lines) == 2 + 2 + 5
    row = {line[:36].strip(): line[36:].split() for line in lines[2:]}
    assert row["KV bytes per token"] == ["8,064", "31,104", "3.86x"]
    assert row["@1,048,576: largest batch"][:2] == ["8", "2"]
    assert m.summary(kimi_linear_48b, all_mla_27, DP8, contexts=(M,))[5].split()[-3:-1] == ["56", "16"]
    one = m.summary(kimi_linear_48b, all_mla_27, m.Deployment(m.H800_CLASS, 1), contexts=(M,))
    assert one[-1].split()[-3:] == ["-", "-", "-"]  # the 48B weights alone fill one device


# ----- the weight model lives on the config ---------------------------------------

def test_weight_model_survives_a_rename():
    renamed = kimi_linear_48b.with_(name="my_48b")
    assert m.weight_bytes(renamed) == 96_000_000_000 == m.weight_bytes(kimi_linear_48b)
    one_to_one = kimi_linear_48b.with_(name="kimi-1to1", layer_pattern="KA" * 13 + "A")
    assert m.weight_model(one_to_one) is kimi_linear_48b.weights
    assert m.PUBLISHED_WEIGHTS["kimi_linear_48b"] is kimi_linear_48b.weights  # old name still there


def test_shapes_only_config_without_weights_raises():
    bare = kimi_linear_48b.with_(name="bare", weights=None)
    with pytest.raises(ValueError, match="'bare' is shapes only and has no weight model"):
        m.weight_bytes(bare)
    assert m.weight_model(tiny).total_params == m.estimate_params(tiny)  # runnable: estimated, dense
    assert m.weight_model(tiny).bytes_per_param == 8


def test_served_dtype_is_bf16_and_runnable_models_need_numpy_dtypes():
    assert kimi_linear_48b.dtype == "bfloat16" and kimi_linear_48b.itemsize == 2
    with pytest.raises(ValueError, match="dtype"):
        tiny.with_(dtype="bfloat16")
    with pytest.raises(ValueError, match="weights"):
        kimi_linear_48b.with_(weights=96e9)


# ----- crossover, bf16 state ---------------------------------------------------------

def test_crossover_fp32_and_bf16_state():
    bf16 = kimi_linear_48b.with_(name="kimi-bf16-state", state_bytes=2)
    for cfg, want in ((kimi_linear_48b, 1885), (bf16, 975)):
        n = m.crossover_tokens(cfg, all_mla_27)
        assert n == want
        assert m.request_total_bytes(cfg, n) < m.request_total_bytes(all_mla_27, n)
        assert m.request_total_bytes(cfg, n - 1) >= m.request_total_bytes(all_mla_27, n - 1)
    assert m.crossover_tokens(all_mla_27, kimi_linear_48b) is None
    assert m.crossover_tokens(tiny, tiny) is None
    all_attn = tiny.with_(name="all-attn", layer_pattern="A" * 8)
    first = next(n for n in range(10_000) if m.request_total_bytes(tiny, n) < m.request_total_bytes(all_attn, n))
    assert m.crossover_tokens(tiny, all_attn) == first


# ----- vLLM's hybrid pages -----------------------------------------------------------

def test_vllm_hybrid_pages_for_kimi():
    p = m.vllm_hybrid_pages(kimi_linear_48b)
    assert isinstance(p, m.VllmHybridPages)
    assert p.kv_token_bytes == 1152 and p.state_bytes == 32 * 128 * 128 * 4 + 3 * 12288 * 2 == 2_170_880
    assert p.block_tokens == 1888 and p.block_tokens % 16 == 0
    assert p.page_bytes >= p.state_bytes > (p.block_tokens - 16) * p.kv_token_bytes  # smallest that fits
    assert (p.group_size, p.attn_groups, p.kda_groups, p.padded_layers) == (7, 1, 3, 1)
    assert p.checkpoint_blocks == 3 and p.state_to_kv_blocks == 3.0
    assert p.kv_blocks(1888) == 1 and p.kv_blocks(1889) == 2 and p.request_blocks(4000) == 3 + 3
    assert p.block_bytes == 7 * p.page_bytes and p.checkpoint_page_bytes == 3 * p.block_bytes
    # vs a whole-model checkpoint counted in 512-token KV blocks of all 7 MLA layers: 10.5
    assert m.checkpoint_bytes(kimi_linear_48b) / (512 * m.kv_bytes_per_token(kimi_linear_48b)) == pytest.approx(10.516, abs=1e-3)


def test_vllm_hybrid_pages_alignment_tp_and_errors():
    assert m.vllm_hybrid_pages(kimi_linear_48b, align_tokens=64).block_tokens == 1920
    tp8 = m.vllm_hybrid_pages(kimi_linear_48b, tensor_parallel=8)
    assert tp8.state_bytes == 2_170_880 // 8 and tp8.kv_token_bytes == 1152 and tp8.block_tokens == 240
    t = m.vllm_hybrid_pages(tiny)
    assert (t.group_size, t.attn_groups, t.kda_groups, t.padded_layers) == (2, 1, 3, 0)
    with pytest.raises(ValueError, match="needs both KDA and attention"):
        m.vllm_hybrid_pages(all_mla_27)
    with pytest.raises(ValueError, match="tensor_parallel=3"):
        m.vllm_hybrid_pages(kimi_linear_48b, tensor_parallel=3)
    # 13 of one kind and 12 of the other: vLLM pads to groups of 13 (max < 1.5 x min).
    near = tiny.with_(name="near", layer_pattern="KA" * 12 + "K")
    assert (m.vllm_hybrid_pages(near).group_size, m.vllm_hybrid_pages(near).padded_layers) == (13, 1)


# ----- prefill time and checkpoint copies ---------------------------------------------

def test_prefill_seconds_is_a_roofline():
    n = 10_000
    t = m.prefill_seconds(kimi_linear_48b, n)
    flops = m.prefill_flops(kimi_linear_48b, n) / 8
    compute = flops / (m.PEAK_BF16_FLOPS_PER_S * m.PREFILL_EFFICIENCY)
    memory = (m.rank_weight_bytes_read(kimi_linear_48b, n, TP8)
              + m.request_rank_bytes(kimi_linear_48b, n, TP8)) / m.HBM_BANDWIDTH_BYTES_PER_S
    assert t == pytest.approx(max(compute, memory)) and compute > memory  # 10k tokens: compute-bound
    assert m.prefill_seconds(kimi_linear_48b, n, efficiency=0.25) == pytest.approx(2 * t)
    assert m.prefill_seconds(kimi_linear_48b, 0, 500) == 0.0
    assert m.prefill_seconds(kimi_linear_48b, n, 0, DP8) > t  # one request's mixers stay on one rank
    assert m.prefill_seconds(all_mla_27, n) > t
    with pytest.raises(ValueError, match="efficiency"):
        m.prefill_seconds(kimi_linear_48b, n, efficiency=0.0)


@settings(max_examples=examples(30), deadline=None)
@given(n=st.integers(1, 200_000), frac=st.floats(0, 1))
def test_prefill_seconds_saved(n, frac):
    hit = int(n * frac)
    saved = m.prefill_seconds_saved(kimi_linear_48b, n, hit)
    cold = m.prefill_seconds(kimi_linear_48b, n)
    assert -1e-12 <= saved <= cold + 1e-12
    assert m.prefill_seconds_saved(kimi_linear_48b, n, n) == pytest.approx(cold)
    assert m.prefill_seconds_saved(kimi_linear_48b, n, 0) == 0.0


@settings(max_examples=examples(60), deadline=None)
@given(n_new=st.integers(0, 300_000), n_cached=st.integers(0, 1_000_000), dp=st.booleans(),
       eff=st.sampled_from([0.5, 0.25, 1.0]), mla=st.booleans())
def test_prefill_timer_equals_prefill_seconds(n_new, n_cached, dp, eff, mla):
    """The memoised twin used by trace replays gives the direct function's numbers."""
    cfg, dep = (all_mla_27 if mla else kimi_linear_48b), (DP8 if dp else TP8)
    timer = m.PrefillTimer(cfg, dep, efficiency=eff)
    for _ in range(2):  # the second call is served from the memo
        assert timer.seconds(n_new, n_cached) == pytest.approx(
            m.prefill_seconds(cfg, n_new, n_cached, dep, efficiency=eff), rel=1e-12, abs=0.0)
    hit = min(n_cached, n_new)
    assert timer.seconds_saved(n_new, hit) == pytest.approx(
        m.prefill_seconds_saved(cfg, n_new, hit, dep, efficiency=eff), rel=1e-9, abs=1e-15)
    with pytest.raises(ValueError, match="n_new=-1"):
        timer.seconds(-1, 0)


def test_checkpoint_write_seconds():
    b = m.checkpoint_bytes(kimi_linear_48b)
    assert m.checkpoint_write_seconds(kimi_linear_48b) == pytest.approx(2 * b / 8 / m.HBM_BANDWIDTH_BYTES_PER_S)
    assert m.checkpoint_write_seconds(kimi_linear_48b, DP8) == pytest.approx(2 * b / m.HBM_BANDWIDTH_BYTES_PER_S)
    assert m.checkpoint_write_seconds(all_mla_27) == 0.0
    with pytest.raises(ValueError, match="hit=11"):
        m.prefill_seconds_saved(kimi_linear_48b, 10, 11)


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
