"""Exactness and validation of kimilab.ops.attention."""

import numpy as np
import pytest
from hypothesis import given, settings, strategies as st
from fuzzing import examples

from kimilab.ops.attention import (
    KVCache, attention_flops, causal_attention, causal_pairs, decode_flops, decode_step,
    projection_flops, reference_causal_attention,
)


def _qkv(rng, L, H, Hkv, D, Dv, dtype=np.float64):
    q = rng.standard_normal((L, H, D)).astype(dtype)
    k = rng.standard_normal((L, Hkv, D)).astype(dtype)
    v = rng.standard_normal((L, Hkv, Dv)).astype(dtype)
    return q, k, v


@settings(max_examples=examples(25), deadline=None)
@given(L=st.integers(1, 70), groups=st.sampled_from([(1, 1), (4, 1), (4, 2), (6, 3), (2, 2)]),
       D=st.integers(1, 9), Dv=st.integers(1, 9), block=st.integers(1, 80), seed=st.integers(0, 2**16))
def test_vectorised_matches_reference(L, groups, D, Dv, block, seed):
    H, Hkv = groups
    q, k, v = _qkv(np.random.default_rng(seed), L, H, Hkv, D, Dv)
    for T in sorted({1, L, max(1, L // 2)}):
        fast = causal_attention(q[L - T:], k, v, query_block=block)
        slow = reference_causal_attention(q[L - T:], k, v)
        assert np.max(np.abs(fast - slow)) <= 1e-10


@settings(max_examples=examples(15), deadline=None)
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


@settings(max_examples=examples(40), deadline=None)
@given(pieces=st.lists(st.integers(0, 9), min_size=1, max_size=4), groups=st.sampled_from([(1, 1), (4, 2), (3, 3)]),
       same_rows=st.booleans(), data=st.data(), seed=st.integers(0, 2**16))
def test_truncate_then_reappend_equals_never_appending(pieces, groups, same_rows, data, seed):
    """Roll back to n tokens, re-append: the cache (and attention over it) is as if the
    dropped tokens were never appended, whether the re-appended rows are the dropped
    ones or others (a rejected speculative draft)."""
    H, Hkv = groups
    rng = np.random.default_rng(seed)
    total = sum(pieces)
    n = data.draw(st.integers(0, total), label="n")
    extra = data.draw(st.integers(0, 6), label="extra")
    q, k, v = _qkv(rng, n + extra, H, Hkv, 4, 3)
    _, k_drop, v_drop = _qkv(rng, total, H, Hkv, 4, 3)
    k_drop[:n], v_drop[:n] = k[:n], v[:n]  # the kept prefix is shared
    if same_rows:
        k_drop[n:n + extra], v_drop[n:n + extra] = k[n:total], v[n:total]
    cache = KVCache(Hkv, 4, 3, capacity=1)
    start = 0
    for size in pieces:  # several appends, so regrowth happens along the way
        cache.append(k_drop[start:start + size], v_drop[start:start + size])
        start += size
    assert cache.truncate(n) == n
    never = KVCache(Hkv, 4, 3, capacity=1)
    never.append(k[:n], v[:n])
    for c in (cache, never):
        assert c.length == n
    assert cache.nbytes == never.nbytes == n * cache.bytes_per_token
    np.testing.assert_array_equal(cache.keys, never.keys)
    np.testing.assert_array_equal(cache.values, never.values)
    for t in range(n, n + extra):  # decode the re-appended tokens on both caches
        rows = slice(t, t + 1)
        o_rolled = decode_step(q[rows], k[rows], v[rows], cache)
        o_never = decode_step(q[rows], k[rows], v[rows], never)
        np.testing.assert_array_equal(o_rolled, o_never)
    assert cache.length == never.length == n + extra and cache.nbytes == never.nbytes
    np.testing.assert_array_equal(cache.keys, k)
    np.testing.assert_array_equal(cache.values, v)


def test_truncate_edges_and_errors():
    cache = KVCache(2, 4)
    cache.append(np.ones((3, 2, 4)), np.ones((3, 2, 4)))
    assert cache.truncate(3) == 3 and cache.length == 3  # n == length: nothing dropped
    assert cache.truncate(0) == 0 and cache.nbytes == 0 and cache.keys.shape == (0, 2, 4)
    for bad in (-1, 1, 2.0, True, "1"):
        with pytest.raises(ValueError, match=r"n=.*: expected an int with 0 <= n <= length=0"):
            cache.truncate(bad)
    cache.append(np.ones((2, 2, 4)), np.ones((2, 2, 4)))
    with pytest.raises(ValueError, match=r"n=3: expected an int with 0 <= n <= length=2"):
        cache.truncate(3)
    assert cache.length == 2  # a refused truncate changes nothing
    assert cache.truncate(np.int64(1)) == 1


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
    with pytest.raises(ValueError, match=r"n_kv_heads=0: expected an int >= 1"):
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
    with pytest.raises(ValueError, match=r"context_len=0: expected an int >= 1"):
        decode_flops(0, n_heads=4, head_dim=32)
    with pytest.raises(ValueError, match=r"T=5: expected T <= L=4"):
        causal_pairs(5, 4)
    with pytest.raises(ValueError, match=r"query_block=0: expected an int >= 1"):
        causal_attention(*_qkv(np.random.default_rng(5), 3, 2, 2, 4, 4), query_block=0)
