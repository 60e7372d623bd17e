"""Dual-granularity prefix cache: policies, accounting invariants, exactness on the tiny model, CLI."""

import json
import subprocess
import sys

import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from kimilab import costs as memory
from kimilab.model.cache import HybridCache
from kimilab.config import kimi_linear_48b, tiny
from kimilab.model import Model
from kimilab.pool.pages import PagePool
from kimilab.prefix.hybrid import (Align, CacheCosts, Dual, EveryBlock, HybridPrefixCache, KVOnly,
                            ModelPrefixCache, make_policy, main, replay)
from kimilab.prefix.radix import RadixTree
from kimilab.traffic.trace import TraceRecord, write_trace

BS = 4
CFG = kimi_linear_48b


def records_from_paths(paths, shorts=None):
    """Chained hash ids from little 'paths' of choices; a block id names its whole prefix."""
    out = []
    for t, p in enumerate(paths):
        short = 0 if shorts is None else shorts[t]
        # a partial last block is different content, hence a different id
        ids = tuple(hash((tuple(p[: j + 1]), short if j == len(p) - 1 else 0)) % 10**9
                    for j in range(len(p)))
        out.append(TraceRecord(t, len(p) * BS - short, 1, ids))
    return out


def make_cache(policy, capacity_tokens=400, partial_blocks=False):
    return HybridPrefixCache.for_budget(CFG, policy, block_size=BS, capacity_tokens=capacity_tokens,
                                        partial_blocks=partial_blocks)


def test_costs_come_from_the_memory_model():
    costs = CacheCosts.of(CFG)
    assert costs.kv_bytes_per_token == 8064 == memory.kv_bytes_per_token(CFG)
    assert costs.checkpoint_bytes == memory.checkpoint_bytes(CFG)
    cache = HybridPrefixCache.for_budget(CFG, Dual(), block_size=512, capacity_tokens=2**20)
    assert cache.pool.n_pages == 2048 and cache.page_bytes == 512 * 8064
    assert cache.checkpoint_pages == -(-memory.checkpoint_bytes(CFG) // (512 * 8064)) == 11
    assert make_cache(KVOnly()).checkpoint_pages == 0
    for n_new, n_cached in [(0, 0), (0, 9), (1, 0), (700, 0), (1000, 600), (64, 4096), (65, 1)]:
        assert costs.prefill_flops(n_new, n_cached) == memory.prefill_flops(CFG, n_new, n_cached)
        assert CacheCosts.of(tiny).prefill_flops(n_new, n_cached) == memory.prefill_flops(tiny, n_new, n_cached)
    assert costs.flops_saved(1000, 0) == 0
    assert costs.flops_saved(1000, 600) == memory.prefill_flops(CFG, 1000) - memory.prefill_flops(CFG, 400, 600)


def test_bad_arguments_name_what_is_expected():
    with pytest.raises(ValueError, match="policy='nope'"):
        make_policy("nope")
    with pytest.raises(ValueError, match="multiple of block_size"):
        make_cache(Align(interval=6))
    with pytest.raises(ValueError, match="capacity_tokens"):
        make_cache(Dual(), capacity_tokens=2)
    with pytest.raises(ValueError, match="alpha"):
        Dual(alpha=-1.0)
    with pytest.raises(ValueError, match="page_bytes"):
        HybridPrefixCache(PagePool(4, 100, backed=False), BS, Dual(), CacheCosts.of(CFG))
    with pytest.raises(ValueError, match="kv-only"):
        ModelPrefixCache(Model(tiny, seed=0), "kv-only", block_size=BS, capacity_tokens=64)


def test_dual_discovers_a_branch_point_and_align_does_not():
    # A and B share two blocks then diverge; C shares the same two blocks.
    recs = records_from_paths([[0, 0, 1, 1], [0, 0, 2], [0, 0, 3, 3]])
    dual = make_cache(Dual(), capacity_tokens=10**5)
    outs = [dual.serve(r.hash_ids, r.input_length) for r in recs]
    assert [o.kv_hit for o in outs] == [0, 8, 8]
    assert [o.usable_hit for o in outs] == [0, 0, 8]  # B recomputes through the branch, C reuses it
    assert 8 in outs[1].checkpoint_positions
    align = make_cache(Align(interval=64), capacity_tokens=10**5)
    assert [align.serve(r.hash_ids, r.input_length).usable_hit for r in recs] == [0, 0, 0]
    every = make_cache(EveryBlock(), capacity_tokens=10**5)
    assert [every.serve(r.hash_ids, r.input_length).usable_hit for r in recs] == [0, 8, 8]


def test_a_hit_always_leaves_one_token_to_compute():
    recs = records_from_paths([[0, 1], [0, 1]])  # the same 8-token prompt twice
    # kv-only recomputes the last token; every-block resumes at the block before;
    # dual has a state only at the end (8), which would leave nothing to compute
    for policy, usable in ((KVOnly(), 7), (EveryBlock(), 4), (Dual(), 0)):
        cache = make_cache(policy, capacity_tokens=10**5)
        outs = [cache.serve(r.hash_ids, r.input_length) for r in recs]
        assert outs[1].kv_hit == 7
        assert outs[1].usable_hit == usable


def _replay_paths(paths, shorts, policy, capacity):
    return replay(records_from_paths(paths, shorts), policy, config=CFG, block_size=BS,
                  capacity_tokens=capacity, keep_per_request=True)


PATHS = st.lists(st.lists(st.integers(0, 2), min_size=1, max_size=6), min_size=1, max_size=30)


@settings(max_examples=40, deadline=None)
@given(PATHS, st.integers(1, 60), st.data())
def test_kv_only_equals_the_radix_tree_twin(paths, capacity_blocks, data):
    shorts = data.draw(st.lists(st.integers(0, BS - 1), min_size=len(paths), max_size=len(paths)))
    recs = records_from_paths(paths, shorts)
    res = _replay_paths(paths, shorts, KVOnly(), capacity_blocks * BS)
    tree = RadixTree(PagePool(capacity_blocks, BS * 8064, backed=False), BS)
    for r, out in zip(recs, res.per_request):
        hit = tree.serve(r.hash_ids, r.input_length).hit_tokens
        assert out.kv_hit == out.usable_hit == min(hit, r.input_length - 1)


@settings(max_examples=25, deadline=None)
@given(PATHS, st.integers(1, 200))
def test_align_at_block_interval_is_every_block(paths, capacity_blocks):
    a = _replay_paths(paths, None, Align(interval=BS), capacity_blocks * BS)
    b = _replay_paths(paths, None, EveryBlock(), capacity_blocks * BS)
    assert [o.usable_hit for o in a.per_request] == [o.usable_hit for o in b.per_request]


@settings(max_examples=25, deadline=None)
@given(PATHS)
def test_with_unbounded_memory_every_block_reaches_the_attention_bound(paths):
    big = 10**6
    a = _replay_paths(paths, None, EveryBlock(), big)
    b = _replay_paths(paths, None, KVOnly(), big)
    # states at every block boundary: the attention bound, rounded down to a block
    assert [o.usable_hit for o in a.per_request] == [o.usable_hit // BS * BS for o in b.per_request]
    assert a.kv_hit_tokens == b.kv_hit_tokens
    d = _replay_paths(paths, None, Dual(), big)
    assert d.usable_hit_tokens <= b.usable_hit_tokens and d.kv_hit_tokens == b.kv_hit_tokens


@settings(max_examples=50, deadline=None)
@given(PATHS, st.integers(1, 80), st.sampled_from(["every-block", "align", "dual", "kv-only"]),
       st.booleans(), st.data())
def test_invariants_hold_under_random_traffic(paths, capacity_blocks, name, partial, data):
    """Pool pages == tree KV + checkpoints; usable <= KV hit < prompt; pinned paths survive; no leaks."""
    kwargs = {"interval": 2 * BS} if name == "align" else {}
    if name == "dual" and data.draw(st.booleans()):
        kwargs = {"interval": 2 * BS, "alpha": data.draw(st.sampled_from([0.0, 1.0, 50.0]))}
    cache = make_cache(make_policy(name, **kwargs), capacity_blocks * BS, partial_blocks=partial)
    shorts = data.draw(st.lists(st.integers(0, BS - 1), min_size=len(paths), max_size=len(paths)))
    held = []
    for r in records_from_paths(paths, shorts):
        ends_before = {n.end for n in cache.tree.nodes() if n.payload is not None}
        out, path, usable_node, added = cache.begin(r.hash_ids, r.input_length)
        assert 0 <= out.usable_hit <= out.kv_hit <= r.input_length - 1
        assert out.usable_hit == 0 or out.usable_hit in ends_before or cache.policy.free_states
        assert all(n.alive for n in path)
        if data.draw(st.booleans()) and len(held) < 3:
            held.append(path)  # a running request keeps its blocks pinned
        else:
            cache.finish(path)
        if held and data.draw(st.booleans()):
            cache.finish(held.pop(0))
        for p in held:
            assert all(n.alive for n in p)
        cache.check_invariants()
        cache.pool.check_invariants()
    for p in held:
        cache.finish(p)
    # the eviction queues alone can empty the cache: nothing unpinned is ever stranded
    assert cache.tree.reclaim(cache.pool.n_pages)
    assert cache.pool.n_free == cache.pool.n_pages and cache.n_checkpoints == 0
    assert cache.tree.n_nodes == 0
    cache.check_invariants()


def test_evict_all_clears_everything_unpinned():
    cache = make_cache(Dual(), 40 * BS)
    recs = records_from_paths([[0, 1, 2], [0, 1, 3], [0, 4]])
    out, path, _, _ = cache.begin(recs[0].hash_ids, recs[0].input_length)
    for r in recs[1:]:
        cache.serve(r.hash_ids, r.input_length)
    cache.evict_all()
    assert all(n.alive for n in path) and cache.tree.n_nodes == len(path)
    cache.finish(path)
    cache.evict_all()
    assert cache.pool.n_free == cache.pool.n_pages
    cache.check_invariants()


def test_dual_keeps_live_branch_points():
    # one shared block with many branches, then a flood of unrelated long prompts
    recs = records_from_paths([[0, i, i] for i in range(1, 4)] + [[9, i, i, i, i] for i in range(30)])
    cache = make_cache(Dual(alpha=0.0), capacity_tokens=60 * BS)
    for r in recs:
        cache.serve(r.hash_ids, r.input_length)
        shared = cache.tree.root.children.get(recs[0].hash_ids[0])
        if shared is not None and len(shared.children) >= 2:
            assert shared.payload is not None


# ----- exactness on the tiny model -------------------------------------------------

MODEL = Model(tiny, seed=0)


def _assert_same_cache(a: HybridCache, b: HybridCache):
    assert a.seq_len == b.seq_len
    for i in tiny.attn_layers:
        for x, y in zip(a.kv(i), b.kv(i)):
            assert x.shape == y.shape and np.abs(x - y).max() <= 1e-10
    for i in tiny.kda_layers:
        assert np.abs(a.kda_state(i) - b.kda_state(i)).max() <= 1e-10
        assert np.abs(a.conv_state(i) - b.conv_state(i)).max() <= 1e-10


@settings(max_examples=8, deadline=None)
@given(st.integers(0, 10**6), st.sampled_from(["every-block", "align", "dual"]),
       st.integers(6, 40), st.booleans())
def test_prefill_from_a_hit_equals_a_cold_prefill(seed, name, capacity_blocks, partial):
    """Restored state + shared KV blocks give the cold prefill's logits and final cache."""
    rng = np.random.default_rng(seed)
    block = 4
    kwargs = {"interval": 2 * block} if name == "align" else {}
    store = ModelPrefixCache(MODEL, make_policy(name, **kwargs), block_size=block,
                             capacity_tokens=capacity_blocks * block, partial_blocks=partial)
    prompts = [rng.integers(0, 256, int(rng.integers(2, 20)))]
    for _ in range(4):  # branch from / extend earlier prompts: a small random trace
        parent = prompts[int(rng.integers(len(prompts)))]
        cut = int(rng.integers(1, len(parent) + 1))
        prompts.append(np.concatenate([parent[:cut], rng.integers(0, 256, int(rng.integers(1, 12)))]))
    reused = 0
    for p in prompts:
        logits, cache, out = store.prefill(p)
        cold = HybridCache(tiny)
        cold_logits = MODEL.prefill(p, cold)
        assert logits.shape == (len(p) - out.usable_hit, tiny.vocab_size)
        assert np.abs(logits - cold_logits[out.usable_hit:]).max() <= 1e-10
        _assert_same_cache(cache, cold)
        reused += out.usable_hit
        store.cache.check_invariants()


def test_prefill_from_a_hit_really_reuses():
    store = ModelPrefixCache(MODEL, "dual", block_size=4, capacity_tokens=400)
    base = np.arange(13) % 250
    store.prefill(base)
    logits, cache, out = store.prefill(np.concatenate([base, [7, 8, 9]]))
    assert out.usable_hit == 12 and logits.shape[0] == 4


# ----- CLI -------------------------------------------------------------------------

KEYS = {"requests", "prompt_tokens", "kv_hit_tokens", "usable_hit_tokens", "recomputed_tokens",
        "kv_hit_rate", "usable_hit_rate", "checkpoint_bytes_peak", "kv_bytes_peak",
        "prefill_flops_saved", "wall_seconds"}


@pytest.fixture()
def trace(tmp_path):
    recs = records_from_paths([[0, 1, 2], [0, 1, 3, 4], [0, 5], [0, 1, 3, 4, 6]], [0, 1, 2, 3])
    recs = [TraceRecord(r.timestamp, r.input_length * 128, 1, r.hash_ids) for r in recs]  # 512-token blocks
    return write_trace(tmp_path / "t.jsonl", recs)


def test_cli_main_prints_one_json_object(trace, capsys):
    assert main([str(trace), "--block-size", "512", "--capacity-tokens", "100000",
                 "--policy", "dual"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert KEYS <= set(out)
    assert out["requests"] == 4 and out["policy"] == "dual" and out["model"] == "kimi_linear_48b"
    assert out["usable_hit_tokens"] <= out["kv_hit_tokens"]
    assert out["recomputed_tokens"] == out["prompt_tokens"] - out["usable_hit_tokens"]


def test_cli_subprocess_and_kv_only(trace):
    proc = subprocess.run([sys.executable, "-m", "kimilab.prefix", str(trace), "--capacity-tokens",
                           "100000", "--policy", "kv-only"], capture_output=True, text=True, check=True)
    out = json.loads(proc.stdout)
    assert out["checkpoint_bytes_peak"] == 0 and out["usable_hit_tokens"] == out["kv_hit_tokens"]


@pytest.mark.parametrize("argv, message", [
    (["--capacity-tokens", "1000", "--policy", "lru"], "invalid choice"),
    (["--capacity-tokens", "-5", "--policy", "dual"], "must be a positive int"),
    (["--capacity-tokens", "100", "--policy", "dual"], "at least one block"),
    (["--capacity-tokens", "10000", "--policy", "dual", "--model", "nope"], "--model"),
    (["--capacity-tokens", "10000", "--policy", "align", "--interval", "700"], "multiple of block_size"),
    (["--policy", "dual"], "--capacity-tokens"),
])
def test_cli_bad_arguments_exit_with_a_clear_error(trace, capsys, argv, message):
    with pytest.raises(SystemExit) as exc:
        main([str(trace)] + argv)
    assert exc.value.code == 2
    assert message in capsys.readouterr().err


def test_cli_bad_trace_names_the_line(tmp_path, capsys):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"timestamp": 0, "input_length": 10, "output_length": 1, "hash_ids": [0]}\n'
                   '{"timestamp": 1, "input_length": 10, "output_length": 1}\n')
    with pytest.raises(SystemExit):
        main([str(bad), "--capacity-tokens", "10000", "--policy", "dual"])
    assert "line 2" in capsys.readouterr().err
