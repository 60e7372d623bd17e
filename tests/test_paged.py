"""PagedHybridCache == contiguous HybridCache exactly; truncate and free return every page they should."""

import numpy as np
import pytest
from hypothesis import given, settings, strategies as st
from fuzzing import examples

from kimilab import config
from kimilab.model import HybridCache
from kimilab.pool.paged_cache import PagedHybridCache
from kimilab.pool.pages import PagePool, PoolError, PoolExhausted

CFG = config.tiny
ROW = 2 * CFG.attn_kv_heads_eff * CFG.attn_head_dim_eff * 8  # bytes of one token row, one layer


@pytest.fixture(scope="module")
def model(tiny_model):
    return tiny_model  # conftest: Model(config.tiny, seed=0)


def _tokens(n, seed):
    return np.random.default_rng(seed).integers(0, 256, size=n).tolist()


@settings(max_examples=examples(8), deadline=None)
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
    _same(paged, contiguous)
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
    with pytest.raises(PoolError, match="freed"):
        p.kda_state(0)
    assert pool.n_free == pool.n_pages
    with pytest.raises(PoolExhausted, match="kda_state"):
        PagedHybridCache(CFG, PagePool(4, 4096))


def _same(paged, contiguous):
    assert paged.seq_len == contiguous.seq_len and paged.nbytes_by_kind() == contiguous.nbytes_by_kind()
    for i in CFG.attn_layers:
        for x, y in zip(paged.kv(i), contiguous.kv(i)):
            assert np.array_equal(x, y)
    for i in CFG.kda_layers:
        assert np.array_equal(paged.kda_state(i), contiguous.kda_state(i))
        assert np.array_equal(paged.conv_state(i), contiguous.conv_state(i))


@settings(max_examples=examples(6), deadline=None)
@given(page_rows=st.sampled_from([1, 3, 16]), block_tokens=st.sampled_from([1, 5, 16]),
       n=st.integers(0, 30), extra=st.integers(1, 20), seed=st.integers(0, 99))
def test_truncate_frees_blocks_and_equals_never_going_past(model, page_rows, block_tokens, n, extra, seed):
    pool = PagePool(600, page_rows * ROW)
    paged = PagedHybridCache(CFG, pool, block_tokens=block_tokens)
    ref = HybridCache(CFG)
    toks = _tokens(n + 2 * extra, seed)
    model.prefill(toks[:n], paged), model.prefill(toks[:n], ref)
    ckpt, used_at_n = paged.checkpoint(), pool.n_used
    model.prefill(toks[n:n + extra], paged)
    model.decode(toks[n + extra], paged)
    paged.truncate(n, ckpt)
    pool.check_invariants()
    blocks = -(-n // block_tokens)
    assert all(len(paged.block_table(i)) == blocks for i in CFG.attn_layers)
    assert pool.n_used == used_at_n == paged.n_pages  # whole blocks past n went back, nothing leaked
    _same(paged, ref)
    again = toks[n + extra:]  # a different continuation from n
    assert np.array_equal(model.prefill(again, paged), model.prefill(again, ref))
    _same(paged, ref)
    paged.free()
    pool.check_invariants()
    assert pool.n_free == pool.n_pages


def test_from_blocks_shares_pages_and_truncate_copies_a_shared_block(model):
    """A second cache on the first one's KV blocks; rolling it back never touches the first's rows."""
    pool = PagePool(400, 16 * ROW)  # a page holds one 16-token block of one layer
    a = PagedHybridCache(CFG, pool, block_tokens=16, owner="a")
    toks = _tokens(64, 4)
    model.prefill(toks[:20], a)
    at20 = a.checkpoint()
    model.prefill(toks[20:32], a)
    a_kv = {i: tuple(x.copy() for x in a.kv(i)) for i in CFG.attn_layers}
    blocks = {i: list(a._blocks[i]) for i in CFG.attn_layers}
    b = PagedHybridCache.from_blocks(CFG, pool, block_tokens=16, blocks=blocks, checkpoint=a.checkpoint(), owner="b")
    assert b.seq_len == 32 and all(blk.refcount == 2 for layer in blocks.values() for blk in layer)
    ref = HybridCache(CFG)
    model.prefill(toks[:20], ref), model.prefill(toks[20:32], ref)  # the same pieces as a
    assert np.array_equal(model.decode(toks[32], b), model.decode(toks[32], ref))  # row 32: a new private block
    b.truncate(20, at20)  # block 2 is shared and partly kept: b copies it first
    assert [blk.refcount for blk in blocks[CFG.attn_layers[0]]] == [2, 1]
    ref.truncate(20, at20)
    other = toks[40:64]
    assert np.array_equal(model.prefill(other, b), model.prefill(other, ref))
    _same(b, ref)
    for i in CFG.attn_layers:  # a's rows are untouched
        assert all(np.array_equal(x, y) for x, y in zip(a.kv(i), a_kv[i]))
    pool.check_invariants()
    with pytest.raises(ValueError, match="blocks: expected block lists"):
        PagedHybridCache.from_blocks(CFG, pool, block_tokens=16, blocks={})
    with pytest.raises(ValueError, match=r"blocks\[3\]\[0\]: expected a 'kv' Allocation"):
        PagedHybridCache.from_blocks(CFG, pool, block_tokens=16, blocks={i: [a._kda[0]] for i in CFG.attn_layers})
    with pytest.raises(ValueError, match="cannot hold seq_len=32"):
        PagedHybridCache.from_blocks(CFG, pool, block_tokens=16, blocks={i: blocks[i][:1] for i in CFG.attn_layers},
                                     checkpoint=a.checkpoint())
    a.free(), b.free()
    pool.check_invariants()
    assert pool.n_free == pool.n_pages
