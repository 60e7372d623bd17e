"""Radix tree over token blocks: matching, pinning, leaf-first LRU, pool accounting."""

import numpy as np
import pytest
from hypothesis import given, settings, strategies as st
from fuzzing import examples

from kimilab.pool import PagePool
from kimilab.prefix import RadixTree, block_token_counts
from kimilab.sim import simulate
from kimilab.traffic import Request

BS = 4


def make_tree(n_pages=64, **kw):
    pool = PagePool(n_pages, 64, backed=False)
    return RadixTree(pool, BS, **kw), pool


def kv_pages(pool):
    return pool.stats().pages_by_kind["kv"]


def test_block_token_counts():
    assert block_token_counts(10, 3, 4) == [4, 4, 2]
    assert block_token_counts(8, 2, 4) == [4, 4]
    assert block_token_counts(0, 0, 4) == []
    with pytest.raises(ValueError, match="expected ceil"):
        block_token_counts(10, 2, 4)


def test_hash_id_prefix_match_and_partial_block_rules():
    tree, pool = make_tree()
    tree.serve([1, 2, 3], 10)  # blocks 4, 4, 2 -> the partial block is not cached by default
    assert tree.n_nodes == 2
    assert tree.match([1, 2, 9], 12).hit_tokens == 8
    assert tree.match([1, 7], 8).hit_tokens == 4
    assert tree.match([5], 4).hit_tokens == 0
    tree2, _ = make_tree(partial_blocks=True)
    tree2.serve([1, 2, 3], 10)
    assert tree2.n_nodes == 3
    assert tree2.match([1, 2, 3], 10).hit_tokens == 10
    assert tree2.match([1, 2, 4], 12).hit_tokens == 8  # different last block, no tokens known


def test_token_exact_matching_inside_a_block():
    tree, _ = make_tree(partial_blocks=True)
    tree.serve(tokens=[1, 2, 3, 4, 5, 6, 7])  # [1 2 3 4] [5 6 7]
    m = tree.match(tokens=[1, 2, 3, 4, 5, 6, 9, 9])
    assert m.block_tokens == 4 and m.partial_tokens == 2 and m.hit_tokens == 6
    tree_blocks, _ = make_tree(partial_blocks=False)
    tree_blocks.serve(tokens=[1, 2, 3, 4, 5, 6, 7])
    assert tree_blocks.match(tokens=[1, 2, 3, 4, 5, 6, 9, 9]).hit_tokens == 4


def test_bad_keys_name_the_argument():
    tree, _ = make_tree()
    with pytest.raises(ValueError, match="keys"):
        tree.serve([1, 2], 20)
    with pytest.raises(ValueError, match="block_size"):
        RadixTree(PagePool(4, 64, backed=False), 0)
    with pytest.raises(ValueError, match="tokens"):
        tree.match(tokens=np.zeros((2, 2), dtype=np.int64))


def test_lru_evicts_leaves_oldest_first_and_respects_pins():
    tree, pool = make_tree(n_pages=4)
    tree.serve([1, 2], 8)  # path A: 1 -> 2
    tree.serve([3, 4], 8)  # path B: 3 -> 4 (pool now full)
    tree.serve([1, 2], 8)  # touch A: B is now the oldest
    tree.serve([5], 4)  # needs one page: evicts B's leaf (4), not A
    assert tree.match([3, 4], 8).hit_tokens == 4
    assert tree.match([1, 2], 8).hit_tokens == 8
    m = tree.match([1, 2], 8)
    tree.pin(m.nodes)
    tree.serve([6, 7, 8], 12)  # 3 pages wanted, only 3 (not the pinned 2) can go
    assert tree.match([1, 2], 8).hit_tokens == 8
    tree.unpin(m.nodes)
    with pytest.raises(ValueError, match="not pinned"):
        tree.unpin(m.nodes)
    tree.check_invariants()


def test_insert_stops_cleanly_when_everything_is_pinned():
    tree, pool = make_tree(n_pages=2)
    _, path, complete = tree.insert([1, 2], 8, pin=True)
    assert complete and len(path) == 2
    _, path2, complete2 = tree.insert([3], 4)
    assert not complete2 and path2 == []
    assert kv_pages(pool) == 2 == tree.n_pages
    tree.unpin(path)
    tree.evict_all()
    assert pool.n_free == pool.n_pages and tree.n_nodes == 0


OPS = st.lists(
    st.tuples(
        st.sampled_from(["serve", "pin", "unpin", "evict"]),
        st.lists(st.integers(0, 2), min_size=1, max_size=5),  # a path in a small tree
        st.integers(0, BS - 1),  # tokens missing from the last block
    ),
    min_size=1,
    max_size=40,
)


@settings(max_examples=examples(60), deadline=None)
@given(OPS, st.integers(1, 12), st.booleans())
def test_invariants_under_random_operations(ops, n_pages, partial):
    """Pinned nodes survive, tree pages == pool pages, nothing leaks at the end."""
    tree, pool = make_tree(n_pages=n_pages, partial_blocks=partial)
    pinned = []  # lists of nodes we hold a reference on
    for op, choices, short in ops:
        # chained ids: a block's id encodes its whole prefix
        keys = [hash((tuple(choices[: j + 1]), short if j == len(choices) - 1 else 0))
                for j in range(len(choices))]
        n_tokens = len(keys) * BS - short
        if op == "serve":
            tree.serve(keys, n_tokens)
        elif op == "pin":
            m = tree.match(keys, n_tokens)
            k, c, b = tree._split(keys, n_tokens, None)  # the general path, to which match's hash-id walk is a twin
            assert m.nodes == tree.match_blocks(k, c, b).nodes
            if m.nodes:
                tree.pin(m.nodes)
                pinned.append(m.nodes)
        elif op == "unpin" and pinned:
            tree.unpin(pinned.pop(0))
        elif op == "evict":
            tree.evict(pool.n_pages)
        for nodes in pinned:
            assert all(node.alive for node in nodes)
        assert kv_pages(pool) == tree.n_pages == pool.n_used
        tree.check_invariants()
        pool.check_invariants()
    for nodes in pinned:
        tree.unpin(nodes)
    tree.evict_all()
    assert tree.n_nodes == 0 and pool.n_free == pool.n_pages
    pool.check_invariants()


def _slow_hit_rate(records, capacity_blocks):
    """Obvious twin: an ordered list of cached prefixes (by id), LRU over leaves."""
    cached = {}  # id -> (parent id, last use)
    hit = total = 0
    for t, r in enumerate(sorted(records, key=lambda r: r.arrival_ms)):
        full = r.input_length // BS
        ids = list(r.hash_ids[:full])
        j = 0
        while j < len(ids) and ids[j] in cached:
            j += 1
        hit += j * BS
        total += r.input_length
        for k, h in enumerate(ids):
            if h not in cached:
                while len(cached) >= capacity_blocks:
                    parents = {p for p, _ in cached.values()}
                    leaves = [(use, h2) for h2, (p, use) in cached.items()
                              if h2 not in parents and h2 not in ids[:k]]
                    if not leaves:
                        break
                    del cached[min(leaves)[1]]
                if len(cached) >= capacity_blocks:
                    break
            cached[h] = (ids[k - 1] if k else None, (t, k))
    return hit / total


@settings(max_examples=examples(30), deadline=None)
@given(st.lists(st.lists(st.integers(0, 2), min_size=1, max_size=5), min_size=1, max_size=25),
       st.integers(1, 10))
def test_replay_hit_rate_matches_obvious_twin(paths, capacity):
    records = [
        Request(t, t, len(p) * BS, 1, hash_ids=tuple(hash(tuple(p[: j + 1])) % 10**9 for j in range(len(p))))
        for t, p in enumerate(paths)
    ]
    stats = simulate(records, cache=RadixTree(PagePool(capacity, 64, backed=False), BS))
    assert stats.kv_hit_rate == pytest.approx(_slow_hit_rate(records, capacity), abs=1e-12)
    assert stats.prompt_tokens == sum(r.input_length for r in records)


def test_a_node_can_hold_one_page_per_global_layer():
    """allocs_per_node=2: each block is two one-page allocations (a paged model's two KV layers)."""
    pool = PagePool(7, 64, backed=False)
    tree = RadixTree(pool, BS, allocs_per_node=2)
    m, path, complete = tree.insert(tokens=np.arange(4 * BS))
    assert not complete and len(path) == 3  # 7 pages hold 3 whole blocks; the odd page is not used
    assert all(isinstance(n.alloc, tuple) and len(n.alloc) == 2 for n in path)
    assert tree.n_pages == pool.n_used == 6
    tree.check_invariants()
    tree.evict_all()
    assert pool.n_used == 0
    pool.check_invariants()


def test_eviction_never_hands_out_pages_someone_else_still_holds():
    """A running request that shares a cached block's pages (pool.share) keeps them when the tree
    evicts the block: reclaiming hands the next allocation only pages nobody else holds."""
    tree, pool = make_tree(n_pages=3)
    _, path, _ = tree.insert(keys=(1, 2), n_tokens=2 * BS, pin=True)
    held = pool.share(path[1].alloc)  # a running request reads the last block's pages
    tree.unpin(path)
    got = tree.allocate_many("checkpoint", 1, 2)  # two pages: one free, the rest by evicting
    assert len(got) == 2 and tree.n_nodes == 0  # both leaves went, but only one of them freed a page
    assert held.pages[0] not in {int(a.pages[0]) for a in got}
    assert held.refcount == 1 and pool.n_used == 3
    pool.check_invariants()
