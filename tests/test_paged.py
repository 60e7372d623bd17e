"""PagedHybridCache == contiguous HybridCache exactly, and freeing returns every page."""

import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from kimilab import config
from kimilab.model.cache import HybridCache
from kimilab.model import Model
from kimilab.pool.paged_cache import PagedHybridCache
from kimilab.pool.pages import PagePool, PoolExhausted

CFG = config.tiny
ROW = 2 * CFG.attn_kv_heads_eff * CFG.attn_head_dim_eff * 8  # bytes of one token row, one layer


@pytest.fixture(scope="module")
def model():
    return Model(CFG, seed=0)


def _tokens(n, seed):
    return np.random.default_rng(seed).integers(0, 256, size=n).tolist()


@settings(max_examples=8, deadline=None)
@given(page_rows=st.sampled_from([1, 2, 3, 16]), block_tokens=st.sampled_from([1, 5, 16]),
       prompt=st.integers(1, 40), steps=st.integers(0, 4), seed=st.integers(0, 99))
def test_paged_equals_contiguous(model, page_rows, block_tokens, prompt, steps, seed):
    pool = PagePool(600, page_rows * ROW)
    fresh = pool.stats()
    contiguous = HybridCache(CFG)
    paged = PagedHybridCache(CFG, pool, block_tokens=block_tokens)
    toks = _tokens(prompt + steps, seed)
    a = model.prefill(toks[:prompt], contiguous)
    b = model.prefill(toks[:prompt], paged)
    assert np.array_equal(a, b)
    for t in toks[prompt:]:
        assert np.array_equal(model.decode(t, contiguous), model.decode(t, paged))
    assert paged.seq_len == contiguous.seq_len
    assert paged.nbytes_by_kind() == contiguous.nbytes_by_kind()
    for i in CFG.attn_layers:
        for x, y in zip(paged.kv(i), contiguous.kv(i)):
            assert np.array_equal(x, y)
    for i in CFG.kda_layers:
        assert np.array_equal(paged.kda_state(i), contiguous.kda_state(i))
        assert np.array_equal(paged.conv_state(i), contiguous.conv_state(i))
    paged.free()
    pool.check_invariants()
    assert pool.n_free == pool.n_pages and pool.stats().pages_by_kind == fresh.pages_by_kind


def test_two_requests_interleaved_on_one_pool(model):
    """Pages of two requests interleave in the arena; each still matches its twin."""
    pool = PagePool(400, 4096)
    reqs = [(_tokens(30, 1), HybridCache(CFG), PagedHybridCache(CFG, pool)),
            (_tokens(45, 2), HybridCache(CFG), PagedHybridCache(CFG, pool))]
    for step in range(0, 45, 9):  # prefill in interleaved pieces
        for toks, c, p in reqs:
            piece = toks[step:step + 9]
            if piece:
                assert np.array_equal(model.prefill(piece, c), model.prefill(piece, p))
    for toks, c, p in reqs:
        assert np.array_equal(model.decode(7, c), model.decode(7, p))
    layer = CFG.attn_layers[0]
    pages0 = set(np.concatenate([a.pages for a in reqs[0][2]._blocks[layer]]))
    pages1 = set(np.concatenate([a.pages for a in reqs[1][2]._blocks[layer]]))
    assert not pages0 & pages1
    for _, _, p in reqs:
        p.free()
    assert pool.n_free == pool.n_pages


def test_clone_checkpoint_and_from_checkpoint(model):
    pool = PagePool(600, 4096)
    c, p = HybridCache(CFG), PagedHybridCache(CFG, pool)
    toks = _tokens(20, 3)
    model.prefill(toks, c), model.prefill(toks, p)
    q = p.clone()
    ckpt = p.checkpoint()
    kv = {i: p.kv(i) for i in CFG.attn_layers}
    r = PagedHybridCache.from_checkpoint(CFG, ckpt, kv, pool=pool)
    expected = model.decode(5, c)
    for cache in (p, q, r):
        assert np.array_equal(model.decode(5, cache), expected)
    assert ckpt.seq_len == 20 and ckpt.nbytes == c.checkpoint().nbytes
    for cache in (p, q, r):
        cache.free()
    assert pool.n_free == pool.n_pages


def test_state_reads_are_snapshots_and_writes_stay_in_the_arena():
    pool = PagePool(80, 4096)
    p = PagedHybridCache(CFG, pool)
    i = CFG.kda_layers[0]
    before = p.kda_state(i)
    assert not before.flags.writeable and np.all(before == 0)
    p.set_kda_state(i, np.ones(before.shape))
    assert np.all(before == 0) and np.all(p.kda_state(i) == 1)  # old read unchanged
    raw = pool.arena()[p._kda[i].pages].reshape(-1).view(np.float64)
    assert np.all(raw[: before.size] == 1)
    p.free()


def test_errors(model):
    pool = PagePool(80, 4096)  # 66 pages of states, room for one 16-token block per layer
    p = PagedHybridCache(CFG, pool)
    with pytest.raises(ValueError, match="not a KDA layer"):
        p.kda_state(CFG.attn_layers[0])
    with pytest.raises(ValueError, match=r"expected shape \[H, K, V\]"):
        p.set_kda_state(0, np.zeros((1, 2, 3)))
    with pytest.raises(ValueError, match="backed"):
        PagedHybridCache(CFG, PagePool(10, 4096, backed=False))
    with pytest.raises(ValueError, match="at least one KV token row"):
        PagedHybridCache(CFG, PagePool(200, ROW // 2))
    with pytest.raises(ValueError, match="shapes only"):
        PagedHybridCache(config.kimi_linear_48b, pool)
    free_before = pool.n_free
    with pytest.raises(PoolExhausted, match="'kv'"):
        model.prefill(_tokens(200, 0), p)  # needs more KV blocks than the pool has
    assert pool.n_free == free_before  # the failing append took nothing
    p.free()
    with pytest.raises(Exception, match="freed"):
        p.kda_state(0)
    assert pool.n_free == pool.n_pages
    with pytest.raises(PoolExhausted, match="kda_state"):
        PagedHybridCache(CFG, PagePool(4, 4096))
