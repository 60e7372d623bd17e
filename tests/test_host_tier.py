"""The host-memory tier under the hybrid prefix cache (kimilab.prefix.host): exact against the cache
without it (an empty or useless tier) and against an HBM cache with no limit (an unbounded tier on a
free link), with its invariants held on random traffic."""

import math

import pytest
from hypothesis import given, settings, strategies as st
from fuzzing import examples

from kimilab.config import kimi_linear_48b
from kimilab.costs import ONE_H200
from kimilab.prefix import HybridPrefixCache, make_policy
from kimilab.prefix.host import HostTier, TieredPrefixCache
from kimilab.prefix.offload import HOST_DRAM, Tier
from kimilab.sim import simulate
from test_prefix import BS, PATHS, records_from_paths

FREE = Tier("free", math.inf, 0.0)
USELESS = Tier("a link that never pays", 1.0, 1e9)
_ONE = HybridPrefixCache.for_budget(kimi_linear_48b, make_policy("ends"), deployment=ONE_H200, block_size=BS,
                                    capacity_tokens=BS)
KV_BYTES, CK = _ONE.page_bytes, _ONE.checkpoint_pages  # one block's KV; the pages of one state checkpoint
# HBM budgets in blocks: room for one to four checkpoints, and a few blocks beside them
BUDGETS = st.builds(lambda states, blocks: states * CK + blocks, st.integers(1, 4), st.integers(6, 40))
# room for any one request's blocks and states at once (a path has at most 6 blocks): no admission fails
ROOMY = st.builds(lambda states, blocks: states * CK + blocks, st.integers(6, 8), st.integers(6, 40))


def _replay(recs, policy, capacity_tokens, host_bytes=None, link=HOST_DRAM, check=False):
    if host_bytes is None:
        cache = HybridPrefixCache.for_budget(kimi_linear_48b, make_policy(policy), deployment=ONE_H200,
                                             block_size=BS, capacity_tokens=capacity_tokens)
    else:
        cache = TieredPrefixCache.for_budget(kimi_linear_48b, make_policy(policy), deployment=ONE_H200,
                                             block_size=BS, capacity_tokens=capacity_tokens,
                                             host_bytes=host_bytes, link=link)
    outs = []
    for r in recs:
        outs.append(cache.serve(r.hash_ids, r.input_length))
        if check:
            cache.check_invariants()
    return outs, cache


@settings(max_examples=examples(30), deadline=None)
@given(PATHS, BUDGETS, st.sampled_from(["ends", "dual", "every-block", "kv-only"]),
       st.sampled_from([(0.0, HOST_DRAM), (math.inf, USELESS)]))
def test_an_empty_or_useless_tier_changes_nothing(paths, capacity_blocks, policy, tier):
    recs = records_from_paths(paths)
    plain, _ = _replay(recs, policy, capacity_blocks * BS)
    tiered, cache = _replay(recs, policy, capacity_blocks * BS, *tier)
    assert tiered == plain
    assert cache.loads == 0


@settings(max_examples=examples(30), deadline=None)
@given(PATHS, ROOMY, st.sampled_from(["ends", "every-block", "align", "kv-only"]))
def test_an_unbounded_tier_on_a_free_link_is_an_unbounded_cache(paths, capacity_blocks, policy):
    """Everything HBM evicts is kept and loads cost nothing, so every usable hit is the one an HBM cache
    with no limit finds (for policies that place states by the prompt and its usable hit alone, and an
    HBM that can hold any one request: a state HBM could never admit is on no tier)."""
    recs = records_from_paths(paths)
    unbounded, _ = _replay(recs, policy, None)
    tiered, cache = _replay(recs, policy, capacity_blocks * BS, math.inf, FREE, check=True)
    assert [o.usable_hit for o in tiered] == [o.usable_hit for o in unbounded]
    assert cache.host.evictions == 0


@settings(max_examples=examples(40), deadline=None)
@given(PATHS, BUDGETS, st.integers(0, 3 * CK), st.sampled_from(["ends", "dual", "ends+branch", "kv-only"]),
       st.sampled_from([HOST_DRAM, FREE]))
def test_invariants_hold_and_a_tier_never_costs_a_hit(paths, capacity_blocks, host_blocks, policy, link):
    """Bounded tiers: pool and host invariants after every request; the load decision only takes a hit
    that pays, and what it counts adds up."""
    recs = records_from_paths(paths)
    tiered, cache = _replay(recs, policy, capacity_blocks * BS, host_blocks * KV_BYTES, link, check=True)
    assert cache.host.used_bytes <= cache.host.capacity_bytes
    assert cache.loaded_bytes == cache.loaded_blocks * KV_BYTES + cache.loaded_checkpoints * cache.costs.checkpoint_bytes
    assert cache.saved_seconds >= 0.0 and cache.host_tokens >= 0
    assert all(o.usable_hit <= o.kv_hit < o.n_tokens for o in tiered)


def test_a_loaded_prefix_is_found_in_hbm_and_counted():
    """HBM holds one state and 6 blocks. A prompt of 4 blocks leaves a state at its end; another prompt
    pushes that state out. The first prompt plus one block then loads the state, and the blocks HBM
    lost, from the host, and resumes at token 16."""
    a, b = (1, 2, 3, 4), (10, 11, 12, 13)
    plain, _ = _replay([_req(a), _req(b), _req(a + (5,))], "ends", (CK + 6) * BS)
    outs, cache = _replay([_req(a), _req(b), _req(a + (5,))], "ends", (CK + 6) * BS, math.inf, FREE)
    assert plain[2].usable_hit == 0 and outs[2].usable_hit == 4 * BS
    assert cache.loads == cache.loaded_checkpoints == 1 and cache.host_tokens == 4 * BS
    assert cache.loaded_bytes == cache.loaded_blocks * KV_BYTES + cache.costs.checkpoint_bytes
    assert cache.saved_seconds > 0


def _req(keys):
    from kimilab.traffic import Request

    return Request(0, 0, len(keys) * BS, 1, hash_ids=keys)


def test_bad_arguments_name_what_is_expected():
    with pytest.raises(ValueError, match="capacity_bytes"):
        HostTier(-1.0)
    with pytest.raises(ValueError, match="link"):
        HostTier(1e9, link="dram")
    cache = TieredPrefixCache.for_budget(kimi_linear_48b, make_policy("ends"), deployment=ONE_H200,
                                         block_size=BS, capacity_tokens=10 * BS)
    with pytest.raises(ValueError, match="tokens"):
        cache.begin([1], 3, tokens=[1, 2, 3])
    with pytest.raises(ValueError, match="partial_blocks"):
        TieredPrefixCache.for_budget(kimi_linear_48b, make_policy("ends"), deployment=ONE_H200, block_size=BS,
                                     capacity_tokens=10 * BS, partial_blocks=True)
    with pytest.raises(ValueError, match="host"):
        TieredPrefixCache(cache.pool, BS, make_policy("ends"), cache.costs, host=None)


def test_on_the_real_trace_an_unbounded_tier_on_a_free_link_is_an_unbounded_cache():
    from kimilab.sim.sweep import load_records

    recs = load_records("data/mooncake_conversation.jsonl", 512)[:2000]

    def run(**kw):
        kind = TieredPrefixCache if kw else HybridPrefixCache
        cache = kind.for_budget(kimi_linear_48b, make_policy("ends"), deployment=ONE_H200, block_size=512, **kw)
        return simulate(recs, cache=cache, keep_per_request=True), cache

    unbounded, _ = run(capacity_tokens=None)
    small, _ = run(capacity_tokens=1_000_000)  # room for any one request of these (at most 131K tokens)
    tiered, cache = run(capacity_tokens=1_000_000, host_bytes=math.inf, link=FREE)
    assert [o.usable_hit for o in tiered.per_request] == [o.usable_hit for o in unbounded.per_request]
    assert small.usable_hit_rate < tiered.usable_hit_rate and cache.loads > 0


# ----- a store shared across instances (write-through), and loads overlapped with compute -----

def _shared(policy, capacity_tokens, n, store):
    """``n`` tiered caches, each with its own HBM pool, over one shared write-through ``store``."""
    caches = []
    for _ in range(n):
        own = TieredPrefixCache.for_budget(kimi_linear_48b, make_policy(policy), deployment=ONE_H200, block_size=BS,
                                           capacity_tokens=capacity_tokens, host_bytes=0.0)
        caches.append(TieredPrefixCache(own.pool, BS, own.policy, own.costs, store, write_through=True))
    return caches


@settings(max_examples=examples(30), deadline=None)
@given(PATHS, ROOMY, st.sampled_from(["ends", "every-block", "align", "kv-only"]), st.integers(1, 3),
       st.randoms(use_true_random=False))
def test_a_shared_unbounded_store_on_a_free_link_is_one_unbounded_cache(paths, capacity_blocks, policy, n, rnd):
    """Instances that each hold little but write every computed block and state through to one store
    with no limit, free to load from: wherever each request goes, its usable hit is the one a single
    HBM cache with no limit finds for the whole stream."""
    recs = records_from_paths(paths)
    unbounded, _ = _replay(recs, policy, None)
    store = HostTier(math.inf, FREE)
    caches = _shared(policy, capacity_blocks * BS, n, store)
    outs = []
    for r in recs:
        cache = caches[rnd.randrange(n)]
        outs.append(cache.serve(r.hash_ids, r.input_length))
        cache.check_invariants()
    assert [o.usable_hit for o in outs] == [o.usable_hit for o in unbounded]
    assert store.evictions == 0 and store.loads == sum(c.loads for c in caches)


@settings(max_examples=examples(30), deadline=None)
@given(PATHS, BUDGETS, st.integers(0, 3 * CK), st.sampled_from(["ends", "dual", "ends+branch", "kv-only"]),
       st.integers(1, 3), st.randoms(use_true_random=False))
def test_a_bounded_shared_store_keeps_every_invariant(paths, capacity_blocks, store_blocks, policy, n, rnd):
    """A store too small for the traffic, evicting what one instance wrote while another reads near it:
    every pool's and the store's invariants hold after each request, and its counters add up."""
    store = HostTier(store_blocks * KV_BYTES, HOST_DRAM)
    caches = _shared(policy, capacity_blocks * BS, n, store)
    for r in records_from_paths(paths):
        cache = caches[rnd.randrange(n)]
        out = cache.serve(r.hash_ids, r.input_length)
        assert out.usable_hit <= out.kv_hit < out.n_tokens
        cache.check_invariants()
    assert store.used_bytes <= store.capacity_bytes
    assert store.loaded_bytes == sum(c.loaded_bytes for c in caches)
    assert store.hit_tokens == sum(c.host_tokens for c in caches) and store.saved_seconds >= 0.0


def test_write_through_puts_a_prefix_in_the_store_before_any_eviction():
    """Instance A computes a prompt and keeps it in HBM; B, with an empty HBM, finds it in the store
    and loads it. Without write-through (the host tier's write-back) B finds nothing: A evicted nothing."""
    a = (1, 2, 3, 4)
    for through, expected in ((True, 4 * BS), (False, 0)):
        store = HostTier(math.inf, HOST_DRAM)
        one, two = (TieredPrefixCache(c.pool, BS, c.policy, c.costs, store, write_through=through)
                    for c in _shared("ends", (CK + 10) * BS, 2, store))
        one.serve(a, 4 * BS)
        assert one.kv_pages == 4 and (store.used_bytes > 0) == through
        assert two.serve(a + (5,), 5 * BS).usable_hit == expected


def _pipeline(compute_s: float, load_s: float, n: int) -> float:
    """The slow twin of an overlapped step: layer j computes once its load is in and layer j - 1 is done."""
    c, ld, done = compute_s / n, load_s / n, 0.0
    for j in range(1, n + 1):
        done = max(done, j * ld) + c
    return done


@given(st.floats(0.0, 10.0), st.floats(0.0, 10.0), st.booleans())
def test_an_overlapped_step_is_the_layer_pipeline(compute_s, load_s, overlap):
    from kimilab.engine import InstanceMemory

    mem = InstanceMemory(kimi_linear_48b, deployment=ONE_H200, capacity_tokens=100 * BS, host_bytes=0.0,
                         overlap_loads=overlap)
    got = mem.step_seconds(compute_s, load_s)
    if not overlap:
        assert got == compute_s + load_s
        return
    assert got == pytest.approx(_pipeline(compute_s, load_s, kimi_linear_48b.n_layers), rel=1e-12, abs=1e-15)
    assert max(compute_s, load_s) <= got + 1e-15 and got <= compute_s + load_s + 1e-15


def test_a_store_is_refused_beside_quotas_or_a_host_tier():
    from kimilab.engine import InstanceMemory

    kw = dict(deployment=ONE_H200, capacity_tokens=100 * BS)
    with pytest.raises(ValueError, match="quotas"):
        InstanceMemory(kimi_linear_48b, quotas={"a": 0.5}, store=HostTier(1e9), **kw)
    with pytest.raises(ValueError, match="host_bytes, store"):
        InstanceMemory(kimi_linear_48b, host_bytes=1e9, store=HostTier(1e9), **kw)
    with pytest.raises(ValueError, match="store"):
        InstanceMemory(kimi_linear_48b, store=1e9, **kw)


def test_a_transformer_loads_a_last_block_up_to_the_prompts_last_token():
    """kv-only uses a cached block that ends past the last prompt token up to that token (HybridPrefixCache.hits);
    the tier's load must too. HBM holds one block: a 2-block prompt, pushed out by another, comes back whole."""
    a, b = (1, 2), (10, 11)
    unbounded, _ = _replay([_req(a), _req(b), _req(a)], "kv-only", None)
    outs, cache = _replay([_req(a), _req(b), _req(a)], "kv-only", 2 * BS, math.inf, FREE, check=True)
    assert unbounded[2].usable_hit == 2 * BS - 1
    assert outs[2].usable_hit == 2 * BS - 1 and cache.host_tokens == 2 * BS - 1
