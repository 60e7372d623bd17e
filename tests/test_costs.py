"""The one cost model, kimilab.costs, on named deployments: bytes per device, FLOPs, one forward
pass per step, memory, vLLM's pages, and the records the pool (CacheShapes) and the prefix cache
(CacheCosts) read from it."""

import inspect
import re

import numpy as np
import pytest
from hypothesis import given, settings, strategies as st
from fuzzing import examples

from kimilab import costs as m
from kimilab.config import CACHE_KINDS, PRESETS, all_mla_27, gqa_8b, kimi_linear_48b, qwen3_next_80b, tiny
from kimilab.costs import spec as spec_costs
from kimilab.ops.attention import KVCache, attention_flops

M = 1 << 20  # 1M tokens
K128 = 128 * 1024
ONE, TP4, TP8, DP4 = m.ONE_H200, m.VLLM_TP4_H200, m.VLLM_TP8_H200, m.DP4_EP4_H200
ALL = (ONE, TP4, TP8, DP4, m.REPORT_TP4_H800)


# ----- the one object: named deployments ---------------------------------------------

def test_the_default_is_vllms_published_recipe_and_dp_attention_is_named():
    assert m.DEFAULT_DEPLOYMENT is TP4 and TP4.attention == "tp" and TP4.n_devices == 4 and TP4.tp == 4
    assert "tensor-parallel-size 4" in TP4.source and "recipes" in TP4.source
    assert DP4.attention == "dp" and DP4.experts == "ep" and DP4.tp == 1
    assert m.deployment("dp4-ep4-h200") is DP4 and set(m.DEPLOYMENTS) >= {TP4.name, TP8.name, DP4.name}
    assert TP4.describe().startswith("vllm-tp4-h200: 4 x H200") and "TP4" in TP4.describe()
    with pytest.raises(ValueError, match="deployment='tp3'"):
        m.deployment("tp3")
    with pytest.raises(ValueError, match="attention"):
        m.Deployment("x", m.H200, 4, "sp")
    with pytest.raises(ValueError, match="n_devices"):
        m.Deployment("x", m.H200, 0)
    with pytest.raises(ValueError, match="Kernels.gemm"):
        m.Kernels(gemm=0.0, attention=0.5, kda=0.5, bandwidth=0.5, replay=0.5, layer_overhead_s=0.0)
    with pytest.raises(ValueError, match="Kernels.layer_overhead_s"):
        m.Kernels(gemm=0.5, attention=0.5, kda=0.5, bandwidth=0.5, replay=0.5, layer_overhead_s=2.0)
    with pytest.raises(ValueError, match="Kernels.gemm_half_ridge"):
        m.Kernels(gemm=0.5, attention=0.5, kda=0.5, bandwidth=0.5, replay=0.5, layer_overhead_s=0.0, gemm_half_ridge=-1)


def test_every_public_byte_or_time_function_takes_the_deployment_without_a_default():
    """No cost result can mix two deployments: every public function of kimilab.costs (and its
    spec and the CP prediction) that returns bytes or seconds asks for the deployment, and has no
    default for it. FLOPs are work (the same on any deployment); the rest is model facts or lookups."""
    from kimilab.cp import costs as cp_costs

    deployment_free = {"linear_flops_per_token", "prefill_flops", "attention_prefill_flops", "kda_prefill_flops",
                       "mixer_prefill_flops", "decode_flops_per_token", "attention_decode_flops",
                       "kda_decode_flops", "mixer_decode_flops", "estimate_params", "mixer_params", "weight_model",
                       "deployment", "replay_flops", "reverify_flops", "record_elems_per_layer",
                       "expected_tokens_per_step", "scheme_costs", "ring_attention_bytes",
                       "expected_tokens_per_step_tree", "accepted_fraction", "alpha_from_accepted_fraction",
                       "lazy_cycle", "lazy_flops", "lazy_steps"}
    checked = 0
    for module in (m, spec_costs, cp_costs):
        for name in module.__all__:
            fn = getattr(module, name)
            if not inspect.isfunction(fn) or name in deployment_free:
                continue
            params = inspect.signature(fn).parameters
            if "shapes" in params:  # CacheShapes: an object built from one deployment
                assert params["shapes"].annotation in ("CacheShapes", m.CacheShapes), name
                continue
            assert "deployment" in params, f"{module.__name__}.{name} prices bytes or time without a deployment"
            assert params["deployment"].default is inspect.Parameter.empty, f"{name} defaults its deployment"
            checked += 1
    for builder in (m.CacheShapes.from_config, m.CacheCosts.of, m.StepTimer):
        p = inspect.signature(builder).parameters["deployment"]
        assert p.default is inspect.Parameter.empty
    assert checked >= 30


# ----- bytes per device ---------------------------------------------------------------

def test_one_device_holds_the_whole_model():
    assert m.kv_bytes_per_token_layer(kimi_linear_48b, ONE) == (512 + 64) * 2
    assert m.kv_bytes_per_token(kimi_linear_48b, ONE) == 8064  # 7 MLA layers
    assert m.kv_bytes_per_token(all_mla_27, ONE) == 31104  # 27 MLA layers
    assert m.kv_bytes_per_token(gqa_8b, ONE) == 32 * 2 * 8 * 128 * 2
    assert m.kv_bytes_per_token(tiny, m.LOCAL) == 2 * 2 * 4 * 32 * 8
    assert m.kda_state_bytes(kimi_linear_48b, ONE) == 20 * 32 * 128 * 128 * 4
    assert m.conv_state_bytes(kimi_linear_48b, ONE) == 20 * 3 * (3 * 32 * 128) * 2
    assert m.checkpoint_bytes(kimi_linear_48b, ONE) == 43_417_600
    assert m.checkpoint_bytes(all_mla_27, ONE) == 0


def test_tensor_parallel_shards_states_but_replicates_mlas_latent():
    whole = m.checkpoint_bytes(kimi_linear_48b, ONE)
    for dep, n in ((TP4, 4), (TP8, 8)):
        assert m.kv_bytes_per_token(kimi_linear_48b, dep) == 8064  # MLA: one latent head, held whole
        assert m.checkpoint_bytes(kimi_linear_48b, dep) == whole // n
    assert m.checkpoint_bytes(kimi_linear_48b, TP4) == 10_854_400
    # A checkpoint in 512-token KV pages per device: 10.5 on one device, 2.6 at TP4, 1.3 at TP8.
    pages = {d.name: m.checkpoint_bytes(kimi_linear_48b, d) / (512 * m.kv_bytes_per_token(kimi_linear_48b, d))
             for d in (ONE, TP4, TP8)}
    assert pages == pytest.approx({ONE.name: 10.516, TP4.name: 2.629, TP8.name: 1.314}, abs=1e-3)
    assert m.kv_bytes_per_token(gqa_8b, TP8) == m.kv_bytes_per_token(gqa_8b, ONE) // 8  # 8 KV heads over 8
    sixteen = m.Deployment("tp16", m.H200, 16)
    assert m.kv_bytes_per_token(gqa_8b, sixteen) == m.kv_bytes_per_token(gqa_8b, ONE) // 8  # at least one head
    # DP-attention: the request's device holds all of it.
    assert m.request_total_bytes(kimi_linear_48b, DP4, M) == m.request_total_bytes(kimi_linear_48b, ONE, M)


def test_request_bytes_by_kind():
    got = m.request_bytes(kimi_linear_48b, TP4, 1000)
    assert list(got) == list(CACHE_KINDS)
    assert got["kv"] == 8064 * 1000 and got["kda_state"] == m.kda_state_bytes(kimi_linear_48b, TP4)
    assert m.request_total_bytes(kimi_linear_48b, TP4, 1000) == sum(got.values())
    assert m.request_bytes(all_mla_27, TP4, 0) == {"kv": 0, "kda_state": 0, "conv_state": 0}
    assert m.request_bytes(tiny, m.LOCAL, np.int64(5))["kv"] == 5 * 4096  # numpy ints accepted


def test_measured_cache_matches_analytic_for_tiny():
    caches = [KVCache(tiny.attn_kv_heads_eff, tiny.attn_head_dim_eff, dtype=tiny.dtype) for _ in tiny.attn_layers]
    rng = np.random.default_rng(0)
    for c in caches:
        c.append(rng.standard_normal((37, c.n_kv_heads, c.head_dim)), rng.standard_normal((37, c.n_kv_heads, c.value_dim)))
    assert sum(c.nbytes for c in caches) == m.request_bytes(tiny, m.LOCAL, 37)["kv"]


@pytest.mark.parametrize("L, lo, hi", [(K128, 0.26, 0.28), (M, 0.255, 0.265)])
def test_hybrid_uses_about_a_quarter_of_all_mla_on_one_device(L, lo, hi):
    ratio = m.request_total_bytes(kimi_linear_48b, ONE, L) / m.request_total_bytes(all_mla_27, ONE, L)
    assert lo < ratio < hi  # the report's "up to 75% less KV cache"


def test_the_memory_crossover_depends_on_the_deployment():
    """On one device (or under DP) the hybrid holds less than all-MLA from 1,885 tokens; at TP4
    its per-device state is a quarter, so it holds less from 472."""
    for dep, want in ((ONE, 1885), (DP4, 1885), (TP4, 472), (TP8, 236)):
        n = m.crossover_tokens(kimi_linear_48b, all_mla_27, dep)
        assert n == want, dep.name
        assert m.request_total_bytes(kimi_linear_48b, dep, n) < m.request_total_bytes(all_mla_27, dep, n)
        assert m.request_total_bytes(kimi_linear_48b, dep, n - 1) >= m.request_total_bytes(all_mla_27, dep, n - 1)
    bf16 = kimi_linear_48b.with_(name="kimi-bf16-state", state_bytes=2)
    assert m.crossover_tokens(bf16, all_mla_27, ONE) == 975
    assert m.crossover_tokens(all_mla_27, kimi_linear_48b, ONE) is None


@settings(max_examples=examples(30), deadline=None)
@given(a=st.integers(0, 10**7), b=st.integers(0, 10**7), dep=st.sampled_from(ALL))
def test_bytes_are_linear_and_monotone_in_context(a, b, dep):
    for cfg in (kimi_linear_48b, all_mla_27, gqa_8b):
        fixed = m.request_total_bytes(cfg, dep, 0)
        assert (m.request_total_bytes(cfg, dep, a + b) + fixed
                == m.request_total_bytes(cfg, dep, a) + m.request_total_bytes(cfg, dep, b))
        if a <= b:
            assert m.request_total_bytes(cfg, dep, a) <= m.request_total_bytes(cfg, dep, b)
            assert m.decode_flops_per_token(cfg, a) <= m.decode_flops_per_token(cfg, b)


def test_cache_anatomy_rows():
    rows = m.cache_anatomy(kimi_linear_48b, TP4)
    assert [r["kind"] for r in rows] == list(CACHE_KINDS)
    assert rows[1]["bytes_per_layer"] == 32 * 128 * 128 * 4 // 4
    assert [r["kind"] for r in m.cache_anatomy(all_mla_27, TP4)] == ["kv"]


@pytest.mark.parametrize("name", sorted(PRESETS))
@pytest.mark.parametrize("dep", [ONE, TP4], ids=lambda d: d.name)
def test_cache_shapes_are_the_functions_bytes(name, dep):
    cfg = PRESETS[name]
    s = m.CacheShapes.from_config(cfg, dep)
    assert (s.name, s.deployment, s.tensor_parallel) == (cfg.name, dep.name, dep.tp)
    assert s.kv_token_bytes == m.kv_bytes_per_token_layer(cfg, dep)
    assert s.kv_bytes_per_token == m.kv_bytes_per_token(cfg, dep)
    assert s.fixed_bytes == m.checkpoint_bytes(cfg, dep)
    for n in (0, 1, 1000, M):
        assert s.request_bytes(n) == m.request_total_bytes(cfg, dep, n)
    with pytest.raises(ValueError, match="cfg: expected a kimilab.config.ModelConfig"):
        m.CacheShapes.from_config(name, dep)
    with pytest.raises(ValueError, match="deployment: expected"):
        m.CacheShapes.from_config(cfg, "vllm-tp4-h200")


# ----- FLOPs: work, the same on any deployment ------------------------------------------

@settings(max_examples=examples(30), deadline=None)
@given(n_cached=st.integers(0, 5000), a=st.integers(0, 3000), b=st.integers(0, 3000))
def test_prefill_flops_properties(n_cached, a, b):
    for cfg in (kimi_linear_48b, tiny):
        f = m.prefill_flops(cfg, a, n_cached)
        assert isinstance(f, int) and f >= 0
        assert m.prefill_flops(cfg, a + 1, n_cached) > f
        assert m.prefill_flops(cfg, a, n_cached + 1) >= f
        assert m.mixer_prefill_flops(cfg, a, n_cached) == (m.attention_prefill_flops(cfg, a, n_cached)
                                                           + m.kda_prefill_flops(cfg, a))
    C = tiny.chunk_size
    a, b = a - a % C, b - b % C
    assert m.prefill_flops(tiny, a, n_cached) + m.prefill_flops(tiny, b, n_cached + a) == m.prefill_flops(tiny, a + b, n_cached)


def test_prefill_attention_term_matches_attention_counter():
    n, c = 300, 700
    attn = m.prefill_flops(gqa_8b, n, c) - n * m.linear_flops_per_token(gqa_8b)
    assert attn == gqa_8b.n_layers * attention_flops(n, n + c, gqa_8b.attn_heads_eff, gqa_8b.attn_head_dim_eff)
    assert m.prefill_flops(gqa_8b, 0, 123) == 0
    for L in (0, 1, 1000):
        assert m.decode_flops_per_token(gqa_8b, L) == m.prefill_flops(gqa_8b, 1, L)
    d0, d1 = m.decode_flops_per_token(kimi_linear_48b, 0), m.decode_flops_per_token(kimi_linear_48b, 1000)
    assert (d1 - d0) / 1000 == 7 * 2 * 32 * (512 + 64 + 512)  # only the 7 MLA layers grow


# ----- one forward pass per step --------------------------------------------------------

def test_the_weights_are_read_once_per_step_with_the_experts_at_the_steps_token_count():
    w = m.weight_model(kimi_linear_48b)
    reads = [m.device_weight_bytes_read(kimi_linear_48b, TP4, t) for t in (1, 2, 8, 64, 10_000)]
    assert reads == sorted(reads) and reads[0] == pytest.approx(6e9 / 4)  # 3B active, bf16, over 4
    assert reads[-1] <= m.device_weight_bytes(kimi_linear_48b, TP4) and abs(w.params_read(10_000) - 48e9) < 1e3
    one = m.step_work(kimi_linear_48b, TP4, decode=(64, 64 * 8192))
    assert one.weight_bytes == m.device_weight_bytes_read(kimi_linear_48b, TP4, 64)
    assert one.cache_bytes == 64 * 8192 * 8064 + 64 * (8064 + 2 * m.checkpoint_bytes(kimi_linear_48b, TP4))


def test_splitting_a_prefill_into_chunks_inside_one_step_adds_no_weight_read():
    """Chunks in one step share the weight read: two chunks of 4,096 read what one of 8,192 does,
    and the step costs less than two steps of one chunk each."""
    for dep in (TP4, TP8, ONE):
        whole = m.step_work(kimi_linear_48b, dep, chunks=[(8192, 0)])
        split = m.step_work(kimi_linear_48b, dep, chunks=[(4096, 0), (4096, 4096)])
        assert split.weight_bytes == whole.weight_bytes and split.weight_flops == whole.weight_flops
        assert split.attention_flops == whole.attention_flops and split.kda_flops == whole.kda_flops
        two_steps = (m.step_seconds(kimi_linear_48b, dep, chunks=[(4096, 0)])
                     + m.step_seconds(kimi_linear_48b, dep, chunks=[(4096, 4096)]))
        assert m.step_seconds(kimi_linear_48b, dep, chunks=[(4096, 0), (4096, 4096)]) < two_steps


@settings(max_examples=examples(40), deadline=None)
@given(batch=st.integers(1, 512), extra=st.integers(1, 64), ctx=st.integers(0, 300_000),
       chunk=st.integers(0, 16_384), more=st.integers(1, 4096), dep=st.sampled_from(ALL),
       cfg=st.sampled_from([kimi_linear_48b, all_mla_27, qwen3_next_80b]))
def test_step_time_is_monotone_in_batch_and_tokens(batch, extra, ctx, chunk, more, dep, cfg):
    chunks = [(chunk, ctx)] if chunk else []
    t = m.step_seconds(cfg, dep, decode=(batch, batch * ctx), chunks=chunks)
    assert t > 0
    assert m.step_seconds(cfg, dep, decode=(batch + extra, (batch + extra) * ctx), chunks=chunks) >= t
    assert m.step_seconds(cfg, dep, decode=(batch, batch * (ctx + more)), chunks=chunks) >= t
    bigger = [(chunk + more, ctx)]
    assert m.step_seconds(cfg, dep, decode=(batch, batch * ctx), chunks=bigger) >= t


@settings(max_examples=examples(40), deadline=None)
@given(n_dec=st.integers(0, 300), ctx=st.integers(0, 200_000), chunks=st.lists(
    st.tuples(st.integers(1, 9000), st.integers(0, 500_000)), max_size=3), dep=st.sampled_from(ALL),
    cfg=st.sampled_from([kimi_linear_48b, all_mla_27, gqa_8b]))
def test_the_step_timer_equals_the_direct_function(n_dec, ctx, chunks, dep, cfg):
    timer = m.StepTimer(cfg, dep)
    ctx_sum = n_dec * ctx
    want = m.step_seconds(cfg, dep, decode=(n_dec, ctx_sum), chunks=chunks)
    for _ in range(2):  # the second call is served from the memo
        assert timer.step(n_dec, ctx_sum, chunks) == pytest.approx(want, rel=1e-12, abs=0.0)
    if chunks:
        n_new, n_cached = chunks[0]
        assert timer.prefill(n_new, n_cached) == pytest.approx(m.prefill_seconds(cfg, dep, n_new, n_cached), rel=1e-12)
        hit = min(n_cached, n_new)
        assert timer.prefill_saved(n_new, hit) == pytest.approx(m.prefill_seconds_saved(cfg, dep, n_new, hit),
                                                                rel=1e-9, abs=1e-15)


def test_a_lone_prefill_is_one_step_per_chunk_and_decode_is_a_step_of_decodes():
    assert m.prefill_chunks(TP4, 20_000, 100) == [(8192, 100), (8192, 8292), (3616, 16484)]
    assert m.prefill_seconds(kimi_linear_48b, TP4, 20_000, 100) == pytest.approx(
        sum(m.step_seconds(kimi_linear_48b, TP4, chunks=[c]) for c in m.prefill_chunks(TP4, 20_000, 100)))
    assert m.prefill_seconds(kimi_linear_48b, TP4, 0, 500) == 0.0
    assert m.decode_step_seconds(kimi_linear_48b, TP4, 4096, 8) == m.step_seconds(kimi_linear_48b, TP4,
                                                                                   decode=(8, 8 * 4096))
    saved = m.prefill_seconds_saved(kimi_linear_48b, TP4, 10_000, 6_000)
    assert 0 < saved < m.prefill_seconds(kimi_linear_48b, TP4, 10_000)
    with pytest.raises(ValueError, match="hit=11"):
        m.prefill_seconds_saved(kimi_linear_48b, TP4, 10, 11)
    with pytest.raises(ValueError, match=r"chunks\[0\]"):
        m.step_seconds(kimi_linear_48b, TP4, chunks=[(0, 10)])


def test_communication_and_overhead_are_charged():
    """Decode at batch 1 is not free: 27 layers of overhead plus 2 all-reduces a layer under TP."""
    w = m.step_work(kimi_linear_48b, TP4, decode=(1, 4096))
    parts = w.parts()
    assert parts["overhead"] == pytest.approx(27 * TP4.kernels.layer_overhead_s)
    assert parts["communication"] == pytest.approx(2 * 27 * TP4.link.all_reduce_seconds(2304 * 2, 4))
    assert parts["communication"] >= 2 * 27 * m.NVLINK_H100.latency  # >= 1.6 ms: the review's 0.54 ms and more
    assert m.step_work(kimi_linear_48b, ONE, decode=(1, 4096)).comm_seconds == 0.0
    assert m.decode_step_seconds(kimi_linear_48b, TP4, 4096) > 3e-3  # ~5 ms, as the report measures
    ep = m.step_work(kimi_linear_48b, DP4, decode=(64, 64 * 4096))
    assert ep.comm_seconds == pytest.approx(2 * 27 * DP4.link.all_to_all_seconds(16 * 8 * 2304 * 2, 4))


def test_dp_attention_keeps_a_prefill_on_one_device():
    one_request = m.prefill_seconds(kimi_linear_48b, DP4, 100_000)
    assert one_request > m.prefill_seconds(kimi_linear_48b, TP4, 100_000)  # its mixers stay on one device
    assert m.step_work(kimi_linear_48b, DP4, decode=(64, 64 * 4096)).cache_bytes == pytest.approx(
        m.step_work(kimi_linear_48b, ONE, decode=(16, 16 * 4096)).cache_bytes)  # 64 requests over 4 devices


def test_checkpoint_write_seconds():
    bw = TP4.device.hbm_bandwidth * TP4.kernels.bandwidth
    assert m.checkpoint_write_seconds(kimi_linear_48b, TP4) == pytest.approx(2 * 10_854_400 / bw)
    assert m.checkpoint_write_seconds(all_mla_27, TP4) == 0.0


# ----- memory: the budget, the pool, the batch that fits ----------------------------------

def test_the_cache_budget_per_device_and_the_batch_that_fits():
    for dep in (TP4, TP8, DP4):
        budget = m.cache_budget_bytes(kimi_linear_48b, dep)
        assert budget == pytest.approx(0.9 * 141e9 - m.device_weight_bytes(kimi_linear_48b, dep) - 4e9)
        per = m.request_total_bytes(kimi_linear_48b, dep, M)
        per_device = m.max_batch(kimi_linear_48b, dep, M) // (4 if dep.attention == "dp" else 1)
        assert per_device * per <= budget < (per_device + 1) * per
    assert m.capacity_tokens(kimi_linear_48b, TP4) == int(m.cache_budget_bytes(kimi_linear_48b, TP4) // 8064)
    assert m.capacity_tokens(kimi_linear_48b, DP4) == 4 * int(m.cache_budget_bytes(kimi_linear_48b, DP4) // 8064)
    assert m.max_batch(kimi_linear_48b, m.Deployment("one-h800", m.H800, 1), M) == 0  # 96 GB > 0.9 x 80 GB
    with pytest.raises(ValueError, match="not one request"):
        m.decode_point(kimi_linear_48b, m.Deployment("one-h800", m.H800, 1), M)
    with pytest.raises(ValueError, match="no KV cache"):
        m.capacity_tokens(tiny.with_(name="all-kda", layer_pattern="K" * 8), m.LOCAL)


def test_summary_names_its_deployment():
    lines = m.summary(kimi_linear_48b, all_mla_27, TP4, contexts=(M,))
    assert lines[0] == f"deployment: {TP4.describe()}" and len(lines) == 2 + 2 + 5
    row = {line[:38].strip(): line[38:].split() for line in lines[2:]}
    assert row["KV bytes per token per device"] == ["8,064", "31,104", "3.86x"]
    hybrid, mla = (int(x.replace(",", "")) for x in row["@1,048,576: largest batch"][:2])
    assert hybrid > 3 * mla > 0


# ----- vLLM's hybrid pages, per device ---------------------------------------------------

def test_vllm_hybrid_pages_depend_on_the_deployment():
    p = m.vllm_hybrid_pages(kimi_linear_48b, ONE)
    assert p.kv_token_bytes == 1152 and p.state_bytes == 2_170_880 and p.block_tokens == 1888
    assert (p.group_size, p.attn_groups, p.kda_groups, p.padded_layers) == (7, 1, 3, 1)
    assert p.kv_blocks(1888) == 1 and p.kv_blocks(1889) == 2 and p.request_blocks(4000) == 3 + 3
    assert m.vllm_hybrid_pages(kimi_linear_48b, ONE, align_tokens=64).block_tokens == 1920
    assert m.vllm_hybrid_pages(kimi_linear_48b, DP4).block_tokens == 1888
    assert m.vllm_hybrid_pages(kimi_linear_48b, TP4).block_tokens == 480
    tp8 = m.vllm_hybrid_pages(kimi_linear_48b, TP8)
    assert tp8.state_bytes == 2_170_880 // 8 and tp8.block_tokens == 240 and tp8.tensor_parallel == 8
    shapes = m.CacheShapes.from_config(kimi_linear_48b, TP8)
    assert m.vllm_pages_of(shapes) == tp8
    with pytest.raises(ValueError, match="needs both KDA and attention"):
        m.vllm_hybrid_pages(all_mla_27, ONE)
    with pytest.raises(ValueError, match="TP3 does not divide"):
        m.vllm_hybrid_pages(kimi_linear_48b, m.Deployment("tp3", m.H200, 3))
    with pytest.raises(ValueError, match="deployment: expected"):
        m.vllm_hybrid_pages(kimi_linear_48b, None)
    near = tiny.with_(name="near", layer_pattern="KA" * 12 + "K")
    assert (m.vllm_hybrid_pages(near, m.LOCAL).group_size, m.vllm_hybrid_pages(near, m.LOCAL).padded_layers) == (13, 1)


# ----- CacheCosts: the prefix cache's record on one deployment ------------------------------

def test_cache_costs_come_from_the_functions():
    c = m.CacheCosts.of(kimi_linear_48b, TP4)
    assert c.config is kimi_linear_48b and c.deployment is TP4
    assert c.kv_bytes_per_token == 8064 and c.checkpoint_bytes == m.checkpoint_bytes(kimi_linear_48b, TP4)
    grid = [0, 1, 63, 64, 65, 600, 4096]
    for _ in range(2):
        for n_new in grid:
            for n_cached in grid:
                assert c.prefill_flops(n_new, n_cached) == m.prefill_flops(kimi_linear_48b, n_new, n_cached)
    assert c.flops_saved(1000, 1000) == m.prefill_flops(kimi_linear_48b, 1000) and c.flops_saved(1000, 0) == 0


# ----- bad input ---------------------------------------------------------------------------

@pytest.mark.parametrize("bad", [-1, 1.5, "10", None, True])
def test_bad_context_lengths(bad):
    with pytest.raises(ValueError, match=re.escape(f"context_len={bad!r}: expected an int >= 0 (tokens)")):
        m.request_bytes(kimi_linear_48b, TP4, bad)
    with pytest.raises(ValueError, match="context_len"):
        m.decode_step_seconds(kimi_linear_48b, TP4, bad)


def test_other_bad_arguments():
    with pytest.raises(ValueError, match="n_new"):
        m.prefill_flops(tiny, -3)
    with pytest.raises(ValueError, match="batch"):
        m.decode_step_seconds(tiny, m.LOCAL, 10, 0)
    with pytest.raises(ValueError, match="cfg: expected a kimilab.config.ModelConfig"):
        m.kv_bytes_per_token("kimi_linear_48b", TP4)
    with pytest.raises(ValueError, match="deployment: expected a kimilab.costs.Deployment"):
        m.kv_bytes_per_token(kimi_linear_48b, None)
    with pytest.raises(ValueError, match="batch"):
        m.weight_model(kimi_linear_48b).params_read(0)
    bare = kimi_linear_48b.with_(name="bare", weights=None)
    with pytest.raises(ValueError, match="'bare' is shapes only and has no weight model"):
        m.device_weight_bytes(bare, TP4)
    assert m.weight_model(tiny).total_params == m.estimate_params(tiny)


# ----- calibration against published measurements ---------------------------------------------

def test_the_gemm_curve_is_the_fit_to_vidurs_measured_gemms_and_carries_to_the_a100():
    import dataclasses

    from kimilab.costs import operators

    h100 = operators.fit_gemm("H100")
    assert h100.peak_fraction == pytest.approx(m.CALIBRATED.gemm, rel=0.01)
    assert h100.half_ridge == pytest.approx(m.CALIBRATED.gemm_half_ridge, rel=0.01)
    assert h100.rms_log_error < 0.2
    # held out: the H100 curve on the A100's rows (ridge-scaled) is nearly as good as the A100's own fit
    a100 = operators.gemm_rows("A100")
    carried = np.sqrt(np.mean(operators.gemm_log_errors(dataclasses.replace(h100, gpu="A100"), a100) ** 2))
    assert carried < 1.1 * operators.fit_gemm("A100").rms_log_error
    # a GEMM over few tokens is bandwidth bound: 1 token on an H100 reaches well under 1% of peak
    assert m.CALIBRATED.gemm_efficiency(1, m.H800) < 0.01 < 0.5 < m.CALIBRATED.gemm_efficiency(4096, m.H800)
    lo, hi = operators.gemm_spread(h100, operators.gemm_rows("H100"))
    axis = dict(m.AXES)["GEMM"]
    assert axis[1][1]["gemm"] == pytest.approx(m.CALIBRATED.gemm * lo, rel=0.01)
    assert axis[2][1]["gemm"] == pytest.approx(min(1.0, m.CALIBRATED.gemm * hi), rel=0.01)


def test_the_kda_and_overhead_numbers_come_from_the_operator_measurements():
    from kimilab.costs import operators

    kda = operators.KDA_ON_H100
    assert kda["central"] == pytest.approx(m.CALIBRATED.kda, rel=0.01)
    axis = dict(m.AXES)["KDA"]
    assert axis[1][1]["kda"] == pytest.approx(kda["low"], rel=0.02) and axis[2][1]["kda"] == pytest.approx(kda["high"], rel=0.02)
    assert 0.15 < operators.kda_h20_efficiency("fla_chunk_kda") < operators.kda_h20_efficiency("flash_kda") < 0.5
    assert operators.graph_layer_overhead_s() == pytest.approx(m.CALIBRATED.layer_overhead_s, rel=0.01)
    with pytest.raises(ValueError, match="kernel="):
        operators.kda_h20_efficiency("nope")


def test_the_report_fit_picks_four_h800s_and_the_held_out_rows_land_on_both_sides():
    from kimilab.costs import calibration

    best = calibration.fit_report("4 x H800, TP4", "eager")
    assert best.kernels.attention == pytest.approx(m.CALIBRATED.attention, abs=0.01)
    assert best.kernels.bandwidth == pytest.approx(m.CALIBRATED.bandwidth, rel=0.02)
    assert best.kernels.layer_overhead_s == pytest.approx(m.REPORT_KERNELS.layer_overhead_s, rel=0.03)
    assert best.rms < 0.2 and len(best.fit_errors) == 36
    held = [e for _, e in best.held_out]
    assert len(held) == 5 and min(held) < 0 < max(held) and sum(abs(e) <= 0.25 for e in held) >= 4
    eight = calibration.fit_report("8 x H800, TP8", "eager")
    axis = dict(m.AXES)["report hardware"][1][1]
    assert eight.kernels.attention == pytest.approx(axis["attention"], abs=0.01)
    assert eight.kernels.bandwidth == pytest.approx(axis["bandwidth"], rel=0.02)
    assert eight.rms < 1.2 * best.rms < calibration.fit_report("2 x H800, TP2", "eager").rms
    assert calibration.fit_report("4 x H800, TP4", "graph").rms > best.rms  # the report ran eager
    with pytest.raises(ValueError, match="hardware="):
        calibration.fit_report("1 x TPU")
    rows = calibration.table()
    one_m = {r["model"]: r for r in rows if r["fitted"] and r["what"] == "TPOT s" and r["tokens"] == M}
    assert one_m["kimi_linear_48b"]["measured"] == pytest.approx(7.99e-3, abs=1e-4)  # Figure 7(b), digitised
    assert one_m["all_mla_27"]["measured"] / one_m["kimi_linear_48b"]["measured"] == pytest.approx(2.2, abs=0.05)


def test_the_nvlink_numbers_are_the_fit_to_vidurs_all_reduces():
    from kimilab.costs import calibration

    for n in (4, 8):
        bw, latency = calibration.fit_link(n)
        assert bw == pytest.approx(m.NVLINK_H100.bandwidth, rel=0.15)
        assert latency == pytest.approx(m.NVLINK_H100.latency, rel=0.15)


# ----- the decode-step crossover (chapter 3) --------------------------------------------------

@pytest.mark.parametrize("dep", [ONE, TP4, DP4], ids=lambda d: d.name)
@pytest.mark.parametrize("batch", [1, 64, 512])
def test_the_decode_crossover_is_where_the_step_stops_being_slower(dep, batch):
    """Bisection == a scan: slower below the crossover, no slower at it and (on a grid) above it."""
    n = m.decode_crossover_tokens(kimi_linear_48b, all_mla_27, dep, batch)
    assert n is not None and n > 0

    def no_slower(L):
        return (m.decode_step_seconds(kimi_linear_48b, dep, L, batch)
                <= m.decode_step_seconds(all_mla_27, dep, L, batch))

    assert no_slower(n) and not no_slower(n - 1)
    grid = np.unique(np.geomspace(1, M, 60).astype(int))
    assert all(no_slower(int(L)) == (L >= n) for L in grid)


def test_the_decode_crossover_values_by_deployment():
    """Under TP it does not move with the batch: a step reads the state and writes it back, the KV is
    read once, so it sits at twice the memory crossover. Under DP-attention the replicated mixer
    weights (KDA's are larger than MLA's) push it out at small batch."""
    for dep, want in ((ONE, 3768), (TP4, 942), (TP8, 471)):
        assert {m.decode_crossover_tokens(kimi_linear_48b, all_mla_27, dep, b) for b in (1, 16, 256)} == {want}
        assert abs(want - 2 * m.crossover_tokens(kimi_linear_48b, all_mla_27, dep)) <= 2
    dp = [m.decode_crossover_tokens(kimi_linear_48b, all_mla_27, DP4, b) for b in (1, 16, 64, 256, 512)]
    assert dp == sorted(dp, reverse=True) and dp[0] > 100_000 and abs(dp[-1] - 3768) < 0.06 * 3768
    assert m.decode_crossover_tokens(kimi_linear_48b, kimi_linear_48b, TP4, 8) == 0
    assert m.decode_crossover_tokens(all_mla_27, kimi_linear_48b, TP4, 64) is None
    assert m.decode_crossover_tokens(kimi_linear_48b, all_mla_27, DP4, 1, max_tokens=10_000) is None
    with pytest.raises(ValueError, match="batch"):
        m.decode_crossover_tokens(kimi_linear_48b, all_mla_27, TP4, 0)
    with pytest.raises(ValueError, match="max_tokens"):
        m.decode_crossover_tokens(kimi_linear_48b, all_mla_27, TP4, 1, max_tokens=-1)
