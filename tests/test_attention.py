"""Exactness and validation of kimilab.attention."""

import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from kimilab.ops.attention import (
    KVCache, attention_flops, causal_attention, causal_pairs, decode_flops, decode_step,
    projection_flops, reference_causal_attention,
)


def _qkv(rng, L, H, Hkv, D, Dv, dtype=np.float64):
    q = rng.standard_normal((L, H, D)).astype(dtype)
    k = rng.standard_normal((L, Hkv, D)).astype(dtype)
    v = rng.standard_normal((L, Hkv, Dv)).astype(dtype)
    return q, k, v


@settings(max_examples=25, deadline=None)
@given(L=st.integers(1, 70), groups=st.sampled_from([(1, 1), (4, 1), (4, 2), (6, 3), (2, 2)]),
       D=st.integers(1, 9), Dv=st.integers(1, 9), block=st.integers(1, 80), seed=st.integers(0, 2**16))
def test_vectorised_matches_reference(L, groups, D, Dv, block, seed):
    H, Hkv = groups
    q, k, v = _qkv(np.random.default_rng(seed), L, H, Hkv, D, Dv)
    for T in sorted({1, L, max(1, L // 2)}):
        fast = causal_attention(q[L - T:], k, v, query_block=block)
        slow = reference_causal_attention(q[L - T:], k, v)
        assert np.max(np.abs(fast - slow)) <= 1e-10


@settings(max_examples=15, deadline=None)
@given(L=st.integers(1, 90), groups=st.sampled_from([(1, 1), (4, 1), (4, 2), (3, 3)]),
       seed=st.integers(0, 2**16))
def test_cached_decode_equals_recompute_every_step(L, groups, seed):
    H, Hkv = groups
    q, k, v = _qkv(np.random.default_rng(seed), L, H, Hkv, 8, 6)
    cache = KVCache(Hkv, 8, 6, capacity=1)  # capacity 1 forces several regrowths
    for t in range(L):
        o_cached = decode_step(q[t:t + 1], k[t:t + 1], v[t:t + 1], cache)
        o_full = causal_attention(q[: t + 1], k[: t + 1], v[: t + 1])  # no cache: whole prefix
        assert np.max(np.abs(o_cached[0] - o_full[-1])) <= 1e-10
    assert cache.length == L
    np.testing.assert_array_equal(cache.keys, k)
    np.testing.assert_array_equal(cache.values, v)


@pytest.mark.parametrize("split", [1, 5, 17, 31])
def test_prefill_then_decode_equals_one_prefill(split):
    q, k, v = _qkv(np.random.default_rng(split), 32, 4, 2, 8, 8)
    cache = KVCache(2, 8)
    head = decode_step(q[:split], k[:split], v[:split], cache)
    tail = [decode_step(q[t:t + 1], k[t:t + 1], v[t:t + 1], cache) for t in range(split, 32)]
    got = np.concatenate([head] + tail)
    assert np.max(np.abs(got - causal_attention(q, k, v))) <= 1e-10


def test_float32_stays_float32_and_is_close():
    q, k, v = _qkv(np.random.default_rng(0), 20, 4, 4, 16, 16)
    o32 = causal_attention(q.astype(np.float32), k.astype(np.float32), v.astype(np.float32))
    assert o32.dtype == np.float32
    assert np.max(np.abs(o32 - causal_attention(q, k, v))) < 1e-5


def test_softmax_is_max_subtracted():
    q, k, v = _qkv(np.random.default_rng(1), 6, 2, 2, 4, 4)
    o = causal_attention(q * 1e3, k * 1e3, v)  # scores ~1e6: exp would overflow unshifted
    assert np.all(np.isfinite(o))


def test_first_position_attends_only_to_itself():
    q, k, v = _qkv(np.random.default_rng(2), 5, 2, 1, 3, 4)
    o = causal_attention(q, k, v)
    np.testing.assert_allclose(o[0], np.repeat(v[0], 2, axis=0), atol=1e-15)


def test_cache_bytes_and_growth():
    cache = KVCache(2, 8, 4, dtype="float32", capacity=2)
    assert cache.nbytes == 0 and cache.length == 0
    rng = np.random.default_rng(3)
    for n in (1, 3, 0, 5):
        cache.append(rng.standard_normal((n, 2, 8)).astype(np.float32),
                     rng.standard_normal((n, 2, 4)).astype(np.float32))
    assert cache.length == 9
    assert cache.nbytes == 9 * 2 * (8 + 4) * 4 == 9 * cache.bytes_per_token
    assert cache.capacity_nbytes >= cache.nbytes
    with pytest.raises(ValueError):
        cache.keys[0, 0, 0] = 1.0  # read-only view: append-only


@pytest.mark.parametrize("bad, match", [
    (lambda q, k, v: (q[0], k, v), r"q: expected layout \[T, H, D\]"),
    (lambda q, k, v: (q, k[:, :, :3], v), r"k: expected key dim D=8"),
    (lambda q, k, v: (q, k, v[:-1]), r"v: expected \[L=6, Hkv=2, Dv\]"),
    (lambda q, k, v: (q[:, :3], k, v), r"k: expected Hkv dividing H=3"),
    (lambda q, k, v: (np.concatenate([q, q]), k, v), r"q: expected 1 <= T <= L=6"),
    (lambda q, k, v: (q.astype(np.float32), k, v), r"q, k, v: expected one dtype"),
    (lambda q, k, v: (q.astype(np.int64), k, v), r"q: expected dtype float32 or float64"),
    (lambda q, k, v: (q.tolist(), k, v), r"q: expected a numpy array"),
])
def test_attention_errors_name_the_argument(bad, match):
    q, k, v = _qkv(np.random.default_rng(4), 6, 4, 2, 8, 8)
    with pytest.raises(ValueError, match=match):
        causal_attention(*bad(q, k, v))


def test_cache_errors_name_the_argument():
    cache = KVCache(2, 8, 4)
    k = np.zeros((3, 2, 8))
    v = np.zeros((3, 2, 4))
    with pytest.raises(ValueError, match=r"k: expected \[T, Hkv=2, D=8\]"):
        cache.append(np.zeros((3, 1, 8)), v)
    with pytest.raises(ValueError, match=r"v: expected \[T, Hkv=2, Dv=4\]"):
        cache.append(k, np.zeros((3, 2, 5)))
    with pytest.raises(ValueError, match=r"v: expected T=3 tokens"):
        cache.append(k, v[:2])
    with pytest.raises(ValueError, match=r"expected the cache dtype float64"):
        cache.append(k.astype(np.float32), v.astype(np.float32))
    with pytest.raises(ValueError, match=r"k: expected layout"):
        cache.append(k[0], v)
    with pytest.raises(ValueError, match="n_kv_heads"):
        KVCache(0, 8)
    with pytest.raises(ValueError, match="dtype"):
        KVCache(2, 8, dtype="int32")
    with pytest.raises(ValueError, match="cache: expected a KVCache"):
        decode_step(np.zeros((1, 2, 8)), k[:1], v[:1], cache=None)
    with pytest.raises(ValueError, match=r"q: expected T=1 new queries"):
        decode_step(np.zeros((2, 2, 8)), k[:1], v[:1], cache)
    with pytest.raises(ValueError, match=r"q: expected \[T, H, D=8\]"):
        decode_step(np.zeros((1, 3, 8)), k[:1], v[:1], cache)
    assert cache.length == 0  # nothing half-appended


def test_flop_counters():
    assert causal_pairs(4, 4) == 10 and causal_pairs(1, 9) == 9 and causal_pairs(3, 10) == 3 * 7 + 6
    assert attention_flops(1, 100, 4, 32) == 2 * 100 * 4 * 64
    assert attention_flops(100, 100, 4, 32) == 2 * 5050 * 4 * 64
    assert projection_flops(1, 128, 4, 4, 32) == 2 * 128 * 4 * 128
    cached = [decode_flops(L, n_heads=4, head_dim=32, d_model=128) for L in (10, 20, 40)]
    assert cached[2] - cached[1] == 2 * (cached[1] - cached[0])  # linear in L
    uncached = [decode_flops(L, n_heads=4, head_dim=32, d_model=128, cached=False) for L in (10, 20, 40)]
    assert all(u > c for u, c in zip(uncached, cached))
    assert decode_flops(1, n_heads=4, head_dim=32, cached=False) == decode_flops(1, n_heads=4, head_dim=32)
    with pytest.raises(ValueError, match="context_len"):
        decode_flops(0, n_heads=4, head_dim=32)
    with pytest.raises(ValueError, match="T: expected T <= L"):
        causal_pairs(5, 4)
