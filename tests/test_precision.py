"""Cheaper checkpoints (bytes, rounding, what a hit from one costs) and a second tier's load times."""

import numpy as np
import pytest
from hypothesis import given, settings, strategies as st
from fuzzing import examples

from kimilab import costs
from kimilab.config import kimi_linear_48b
from kimilab.costs import DP4_EP4_H200, ONE_H200, VLLM_TP4_H200
from kimilab.prefix import RunPrefixCache, make_policy
from kimilab.prefix.fidelity import hit_chain_errors, rounded
from kimilab.prefix.offload import HOST_DRAM, NVME_SSD, break_even_tokens, load_seconds
from kimilab.prefix.precision import PRECISIONS, checkpoint_bytes, int8_dequantize, int8_quantize, round_state, to_bf16

CFG = kimi_linear_48b


@pytest.mark.parametrize("dep", [VLLM_TP4_H200, DP4_EP4_H200, ONE_H200])
def test_checkpoint_bytes_per_precision(dep):
    native, bf16, int8 = (checkpoint_bytes(CFG, dep, p) for p in PRECISIONS)
    assert native == costs.checkpoint_bytes(CFG, dep)
    conv = costs.conv_state_bytes(CFG, dep)
    heads = -(-CFG.n_heads // dep.tp)
    elems = len(CFG.kda_layers) * heads * CFG.head_dim ** 2
    assert bf16 - conv == 2 * elems and native - conv == 4 * elems
    assert int8 - conv == elems + len(CFG.kda_layers) * heads * CFG.head_dim * 4  # an fp32 scale per (head, k)
    with pytest.raises(ValueError, match="precision"):
        checkpoint_bytes(CFG, dep, "fp8")


def test_bf16_rounds_to_nearest_even():
    x = np.array([1.0, 1 + 2**-8, 1 + 3 * 2**-8, -3.0, 1 + 2**-7 + 2**-9])
    assert to_bf16(x).tolist() == [1.0, 1.0, 1 + 2**-6, -3.0, 1 + 2**-7]


@settings(max_examples=examples(50), deadline=None)
@given(st.integers(0, 10**6), st.floats(1e-3, 1e3))
def test_int8_error_is_half_a_step_per_head_and_key_channel(seed, magnitude):
    s = np.random.default_rng(seed).normal(size=(3, 4, 5)) * magnitude
    q, scale = int8_quantize(s)
    assert q.dtype == np.int8 and scale.shape == (3, 4, 1) and np.abs(q).max() <= 127
    assert np.all(np.abs(int8_dequantize(q, scale) - s) <= scale / 2 * (1 + 1e-6))
    assert np.allclose(np.abs(q).max(axis=-1), 127)  # the largest |S| of each (head, key) row sets its scale
    assert np.array_equal(round_state(s, "int8"), int8_dequantize(q, scale))


def test_a_hit_from_a_rounded_state_costs_little_and_more_when_coarser(tiny_model):
    tokens = np.random.default_rng(3).integers(0, 256, 48)
    rows = hit_chain_errors(tiny_model, tokens, [16, 32], PRECISIONS, decode=3)
    err = {(r["precision"], r["hits"]): r["max_rel"] for r in rows}
    assert set(err) == {(p, c) for p in PRECISIONS for c in (1, 2)}
    for c in (1, 2):
        assert err["native", c] < 1e-6 < err["bf16", c] < err["int8", c] < 0.1
    assert all(0.0 <= r["agree"] <= 1.0 for r in rows)
    with pytest.raises(ValueError, match="hits"):
        hit_chain_errors(tiny_model, tokens, [32, 16], PRECISIONS)


def test_rounded_keeps_conv_windows(tiny_model):
    from kimilab.model import HybridCache

    cache = HybridCache(tiny_model.config)
    tiny_model.prefill(np.arange(20), cache)
    ck = cache.checkpoint()
    r = rounded(ck, "int8")
    assert all(np.array_equal(r.conv_states[i], ck.conv_states[i]) for i in ck.conv_states)
    assert any(not np.array_equal(r.kda_states[i], ck.kda_states[i]) for i in ck.kda_states)


def test_run_cache_prices_checkpoints_at_their_precision():
    pages = {p: RunPrefixCache(CFG, make_policy("ends"), deployment=DP4_EP4_H200, block_size=512,
                               capacity_tokens=10**6, precision=p).checkpoint_pages for p in PRECISIONS}
    assert pages == {"native": 11, "bf16": 6, "int8": 3}


def test_a_second_tier_loads_faster_than_recompute():
    for dep in (VLLM_TP4_H200, DP4_EP4_H200):
        assert load_seconds(CFG, dep, HOST_DRAM, 0) == 0.0
        a, b = load_seconds(CFG, dep, HOST_DRAM, 4096), load_seconds(CFG, dep, NVME_SSD, 4096)
        assert 0 < a < b
        assert load_seconds(CFG, dep, HOST_DRAM, 4096, "int8") < a
        assert break_even_tokens(CFG, dep, HOST_DRAM, 8192) == 512
    slow = HOST_DRAM.__class__("a slow link", 1e6, 1.0)
    assert break_even_tokens(CFG, VLLM_TP4_H200, slow, 4096) is None
