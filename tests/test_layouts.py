"""VllmPaddedPages is costs.vllm_hybrid_pages: one derivation of vLLM's pages, used by the pool."""

import pytest

from kimilab import config
from kimilab.costs import ONE_H200, CacheShapes, vllm_hybrid_pages, vllm_pages_of
from kimilab.pool import PoolExhausted, RequestAllocator, VllmPaddedPages

S48 = CacheShapes.from_config(config.kimi_linear_48b, ONE_H200)
NEAR = config.tiny.with_(name="near", layer_pattern="KA" * 12 + "K")  # groups of 13, one padded slot
CONFIGS = [config.kimi_linear_48b, config.tiny, NEAR]


@pytest.mark.parametrize("align", [1, 16, 64])
@pytest.mark.parametrize("cfg", CONFIGS, ids=lambda c: c.name)
def test_the_layout_is_the_costs_derivation(cfg, align):
    shapes = CacheShapes.from_config(cfg, ONE_H200)
    p, layout = vllm_hybrid_pages(cfg, ONE_H200, align_tokens=align), VllmPaddedPages(align_tokens=align)
    assert layout.pages(shapes) == p == vllm_pages_of(shapes, align_tokens=align)
    assert layout.block_tokens(shapes) == p.block_tokens
    assert layout.page_bytes(shapes) == {"main": p.block_bytes}  # a pool page = one block id
    assert layout.kv_block_pages(shapes) == p.attn_groups
    for n in (0, 1, p.block_tokens - 1, p.block_tokens, p.block_tokens + 1, 5 * p.block_tokens + 3):
        fp = layout.footprint(shapes, n)
        assert fp.requested_bytes == shapes.request_bytes(n)
        assert fp.reserved["kv"] == p.kv_blocks(n) * p.block_bytes
        assert fp.reserved["kda_state"] == p.checkpoint_page_bytes  # one block in each KDA group
        assert fp.reserved_bytes == p.request_blocks(n) * p.block_bytes
        if n % p.block_tokens == 0:  # full blocks: waste = the states' padding + empty attention slots
            attn_slots = p.attn_groups * p.group_size - p.n_attn_layers
            assert fp.waste_bytes == p.checkpoint_padding_bytes + n // p.block_tokens * attn_slots * p.page_bytes


def test_kimi_48b_pays_for_the_padded_layer_slot():
    p = VllmPaddedPages().pages(S48)
    assert (p.block_tokens, p.group_size, p.kda_groups, p.kda_padded_slots) == (1888, 7, 3, 1)
    fp = VllmPaddedPages().footprint(S48, 1888)
    # 21 state pages reserved for 20 layers' states: the 21st page is pure waste
    assert fp.reserved["kda_state"] == 21 * p.page_bytes
    assert fp.waste_bytes == p.page_bytes + 20 * p.state_padding_bytes == p.checkpoint_padding_bytes
    assert VllmPaddedPages(align_tokens=64).block_tokens(S48) == 1920  # later vLLM's MLA alignment


def test_the_pool_counts_block_ids_like_vllm():
    p = VllmPaddedPages().pages(S48)
    budget = 4 * 2**30
    alloc = RequestAllocator(VllmPaddedPages(), S48, budget)
    assert alloc.pools["main"].n_pages == budget // p.block_bytes
    admitted = 0
    with pytest.raises(PoolExhausted):
        while True:
            alloc.admit(admitted, 100)  # 1 KV block + 3 state blocks each
            admitted += 1
    assert admitted == (budget // p.block_bytes) // (1 + p.checkpoint_blocks)
    assert alloc.reserved_bytes == admitted * 4 * p.block_bytes
    alloc.pools["main"].check_invariants()


def test_errors_name_the_problem():
    with pytest.raises(ValueError, match="needs both KDA and attention"):
        VllmPaddedPages().block_tokens(CacheShapes.from_config(config.all_mla_27, ONE_H200))
    with pytest.raises(ValueError, match="shapes: expected a kimilab.costs.CacheShapes"):
        vllm_pages_of(config.kimi_linear_48b)
