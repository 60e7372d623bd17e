"""Speculative decoding == greedy decoding, token for token and state for state, for every rollback,
on chains and on token trees; and the bytes each strategy holds and moves == the cost model's."""

import numpy as np
import pytest
from hypothesis import given, settings, strategies as st
from fuzzing import examples

from kimilab import speculative as spec
from kimilab.config import tiny
from kimilab.costs import LOCAL, spec as spec_costs
from kimilab.model import HybridCache, Model
from kimilab.pool import PagedHybridCache, PagePool

EXACT = spec.EXACT_ROLLBACKS
TREES = [None, (2,), (2, 1), (1, 2), (2, 2), (3, 1, 1)]


@pytest.fixture(scope="module")
def model(tiny_model):
    return tiny_model


def _greedy_states(model, prompt, n_new):
    """Greedy tokens, per seq_len the (KDA, conv) states of a plain decode run, and its cache."""
    ref = spec.GreedyReference(model, prompt, n_new)
    return ref.tokens, ref.states, ref.cache


def _same_states(cache, ckpt, tol=1e-10):
    for i in tiny.kda_layers:
        assert np.max(np.abs(cache.kda_state(i) - ckpt.kda_states[i])) <= tol, f"KDA state, layer {i}"
        assert np.max(np.abs(cache.conv_state(i) - ckpt.conv_states[i])) <= tol, f"conv state, layer {i}"


def _run(model, prompt, n_new, drafter, k, rollback, cache, states, pool=None, **kw):
    seen = []

    def on_step(c, stats):
        _same_states(c, states[c.seq_len])
        if pool is not None:
            pool.check_invariants()
        seen.append(stats)

    result = spec.speculative_generate(model, prompt, n_new, drafter, k, rollback, cache, on_step=on_step, **kw)
    assert len(seen) == len(result.steps)
    return result


@settings(max_examples=examples(24), deadline=None)
@given(prompt_len=st.integers(1, 20), seed=st.integers(0, 999), k=st.integers(1, 6),
       corruption=st.sampled_from([0.0, 0.2, 0.5, 1.0]), decay=st.sampled_from([1.0, 0.7]),
       n_new=st.integers(1, 14), rollback=st.sampled_from(EXACT), paged=st.booleans(), spare=st.integers(0, 3),
       tree=st.sampled_from(TREES))
def test_speculative_equals_greedy_controlled(model, prompt_len, seed, k, corruption, decay, n_new, rollback, paged,
                                              spare, tree):
    prompt = np.random.default_rng(seed).integers(0, tiny.vocab_size, prompt_len).tolist()
    k = k if tree is None else len(tree)
    ref, states, ref_cache = _greedy_states(model, prompt, n_new)
    pool = PagePool(1400, 4096) if paged else None
    cache = PagedHybridCache(tiny, pool, block_tokens=4) if paged else HybridCache(tiny)
    drafter = spec.ControlledDrafter(model, prompt, n_new + k, corruption, seed=seed, decay=decay)
    nodes = k + 1 if tree is None else len(spec.DraftTree.shape(tree)) + 1
    kw = {"tree": tree}
    if rollback == "ring":
        kw["window"] = nodes + spare  # a ring may be wider than the verify
    if rollback == "lazy-ring":
        kw["ring_len"] = nodes + 2 * spare  # the shortest ring writes back every step
    result = _run(model, prompt, n_new, drafter, k, rollback, cache, states, pool, **kw)
    assert result.tokens == ref
    assert cache.seq_len == ref_cache.seq_len
    _same_states(cache, states[cache.seq_len])  # finish() left the true state in the cache
    for i in tiny.attn_layers:
        assert np.max(np.abs(cache.kv(i)[0] - ref_cache.kv(i)[0])) <= 1e-10
    assert all(s.accepted <= s.drafted and s.emitted <= s.accepted + 1 for s in result.steps)
    if rollback not in ("ring", "lazy-ring") or not spare:
        assert all(s.moved_bytes == spec.predicted_moved(model, rollback, k, s, nodes) for s in result.steps)
    if paged:
        assert pool.stats().pages_by_kind["scratch"] == 0
        cache.free()
        pool.check_invariants()
        assert pool.n_free == pool.n_pages


@settings(max_examples=examples(6), deadline=None)
@given(seed=st.integers(0, 999), k=st.integers(1, 6), rollback=st.sampled_from(EXACT),
       drafter=st.sampled_from(["ngram", "draft-model", "draft-tree"]))
def test_speculative_equals_greedy_real_drafters(model, seed, k, rollback, drafter):
    rng = np.random.default_rng(seed)
    motif = rng.integers(0, tiny.vocab_size, 4).tolist()
    prompt = (motif * 3 + rng.integers(0, tiny.vocab_size, 3).tolist())
    n_new = 10
    ref, states, _ = _greedy_states(model, prompt, n_new)
    draft = Model(tiny.with_(name="draft", layer_pattern="KA"), seed=1)
    d = spec.NgramDrafter() if drafter == "ngram" else spec.DraftModelDrafter(draft)
    tree = (2, 1) if drafter == "draft-tree" else None
    result = _run(model, prompt, n_new, d, 2 if tree else k, rollback, HybridCache(tiny), states, tree=tree)
    assert result.tokens == ref


@settings(max_examples=examples(20), deadline=None)
@given(seed=st.integers(0, 9999), n=st.integers(1, 12), branchy=st.floats(0.0, 1.0))
def test_tree_kda_equals_node_by_node_and_every_path_a_chain(seed, n, branchy):
    from kimilab import kda
    rng = np.random.default_rng(seed)
    parents = [-1] + [int(rng.integers(0, i)) if rng.random() < branchy else i - 1 for i in range(1, n)]
    win = spec.Window(parents)
    H, K = 3, 8
    q, k = (kda.l2_normalize(rng.standard_normal((n, H, K))) for _ in range(2))
    v = rng.standard_normal((n, H, K))
    g = -0.5 * np.abs(rng.standard_normal((n, H, K)))
    beta = rng.uniform(0.05, 0.95, (n, H))
    S0 = rng.standard_normal((H, K, K))
    o, d = spec.tree_kda(q, k, v, g, beta, win, S0)
    o_ref, states = spec.tree_kda_recurrent(q, k, v, g, beta, win, S0)
    assert np.max(np.abs(o - o_ref)) <= 1e-10
    assert np.max(np.abs(spec.node_states(S0, k, v, g, beta, win) - states)) <= 1e-10
    for leaf in range(n):
        p = win.path(leaf)
        o_chain, S_chain = kda.chunk_kda(q[p], k[p], v[p], g[p], beta[p], initial_state=S0)
        assert np.max(np.abs(o[p] - o_chain)) <= 1e-10
        assert np.max(np.abs(spec.fold(S0, d[p], k[p], g[p]) - S_chain)) <= 1e-10


@settings(max_examples=examples(8), deadline=None)
@given(seed=st.integers(0, 999), widths=st.sampled_from([(2,), (2, 2), (3, 1), (1, 3, 1)]))
def test_tree_verify_equals_the_chain_verify_of_every_path(model, seed, widths):
    rng = np.random.default_rng(seed)
    cache = HybridCache(tiny)
    model.prefill(rng.integers(0, tiny.vocab_size, 9).tolist(), cache)
    parents = spec.DraftTree.shape(widths)
    draft = spec.DraftTree(tuple(rng.integers(0, tiny.vocab_size, len(parents)).tolist()), parents)
    win = spec.Window.of(draft)
    tokens = [int(rng.integers(tiny.vocab_size))] + list(draft.tokens)
    c1 = cache.clone()
    logits, caps, view = spec.verify_tree(model, tokens, win, c1)
    assert c1.seq_len == cache.seq_len + len(tokens)
    _same_states(c1, cache.checkpoint(), tol=0.0)  # output-only: no state written
    for leaf in range(len(win)):
        p = win.path(leaf)
        chain_logits, chain_caps, _ = spec.verify(model, [tokens[j] for j in p], cache.clone())
        assert np.max(np.abs(logits[p] - chain_logits)) <= 1e-10
        for i in tiny.kda_layers:
            assert np.max(np.abs(caps[i].k[p] - chain_caps[i].k)) <= 1e-12


def test_trim_only_diverges_and_exact_strategies_do_not(model):
    """The mlx-lm trim() bug: keep the state that saw rejected drafts -> the text drifts."""
    prompt = list(range(5, 25))
    ref = model.generate(prompt, 20)
    out = {}
    for name in ("none",) + EXACT:
        d = spec.ControlledDrafter(model, prompt, 28, 0.5, seed=3)
        out[name] = spec.speculative_generate(model, prompt, 20, d, 4, name).tokens
    assert out["none"] != ref
    assert all(out[name] == ref for name in EXACT)


def test_max_new_tokens_inside_a_window_and_zero(model):
    prompt = [1, 2, 3]
    ref = model.generate(prompt, 5)
    for name in EXACT:
        d = spec.ControlledDrafter(model, prompt, 13, 0.0)
        cache = HybridCache(tiny)
        r = spec.speculative_generate(model, prompt, 5, d, 8, name, cache)
        assert r.tokens == ref and len(r.steps) == 1 and r.steps[0].drafted == 8 and r.steps[0].emitted == 4
        assert cache.seq_len == len(prompt) + 4
    assert spec.speculative_generate(model, prompt, 0, spec.NgramDrafter(), 3).tokens == []


@pytest.mark.parametrize("tree", [None, (2, 2)])
def test_rollback_bytes_match_the_cost_model(model, tree):
    prompt = list(range(30))
    k = 5 if tree is None else 2
    nodes = k + 1 if tree is None else 7
    for name in EXACT:
        d = spec.ControlledDrafter(model, prompt, 12, 0.0)
        r = spec.speculative_generate(model, prompt, 4, d, k, name, tree=tree)
        assert r.steps[0].rollback_bytes == spec_costs.rollback_bytes(tiny, LOCAL, name, k, act_bytes=8, nodes=nodes)


def test_lazy_ring_writes_back_as_the_cycle_predicts(model):
    """Flushes per step of a long run against the steady state of costs.spec.lazy_cycle."""
    prompt = list(range(40, 60))
    d = spec.ControlledDrafter(model, prompt, 130, 0.0)
    r = spec.speculative_generate(model, prompt, 120, d, 3, "lazy-ring", ring_len=12)
    h, rate = spec_costs.lazy_cycle(4, 12, r.tokens_per_step)
    assert r.flushes == sum(s.flushed for s in r.steps)
    walk = spec_costs.lazy_steps([s.emitted for s in r.steps], 4, 12)
    assert walk == [(s.history, s.flushed) for s in r.steps]  # the discrete walk is the loop's
    assert r.flushes / len(r.steps) == pytest.approx(rate, rel=0.1)
    assert np.mean([s.history for s in r.steps]) == pytest.approx(h, rel=0.15)


def test_ring_window_and_lazy_ring_too_small_are_errors(model):
    with pytest.raises(ValueError, match="window=4.*k\\+1=5"):
        spec.speculative_generate(model, [1, 2], 4, spec.NgramDrafter(), 4, "ring", window=4)
    with pytest.raises(ValueError, match="ring_len=4"):
        spec.speculative_generate(model, [1, 2], 4, spec.NgramDrafter(), 4, "lazy-ring", ring_len=4)
    pool = PagePool(200, 4096)
    ring = spec.RingRollback(tiny, pool, 2, window=3)
    cache = HybridCache(tiny)
    model.prefill([1, 2, 3], cache)
    _, caps, view = spec.verify(model, [4, 5, 6, 7], cache)  # 4 positions > window 3
    with pytest.raises(ValueError, match="4 positions"):
        ring.save(view, caps)
    ring.close()
    pool.check_invariants()
    assert pool.n_free == pool.n_pages


@pytest.mark.parametrize("name", ["ring", "slot", "lazy-ring"])
def test_persistent_scratch_is_allocated_once(model, name):
    pool = PagePool(900, 4096)
    cache = PagedHybridCache(tiny, pool)
    used = []
    d = spec.ControlledDrafter(model, [9, 8, 7], 20, 0.5, seed=2)
    spec.speculative_generate(model, [9, 8, 7], 12, d, 3, name, cache,
                              on_step=lambda c, s: used.append(s.scratch_pages))
    assert len(set(used)) == 1 and used[0] > 0  # one allocation, held the whole request
    assert pool.stats().pages_by_kind["scratch"] == 0


def test_verify_keeps_the_committed_state(model):
    cache = HybridCache(tiny)
    model.prefill([3, 1, 4, 1, 5], cache)
    before = cache.checkpoint()
    logits, caps, view = spec.verify(model, [9, 2, 6], cache)
    assert cache.seq_len == 8 and logits.shape == (3, tiny.vocab_size)
    _same_states(cache, before, tol=0.0)
    with pytest.raises(TypeError, match="cannot truncate"):
        view.truncate(5, before)


def test_bad_arguments(model):
    d = spec.NgramDrafter()
    with pytest.raises(ValueError, match="rollback='undo'"):
        spec.speculative_generate(model, [1], 3, d, 2, "undo")
    with pytest.raises(ValueError, match="k=0"):
        spec.speculative_generate(model, [1], 3, d, 0)
    with pytest.raises(ValueError, match="prompt_tokens"):
        spec.speculative_generate(model, [], 3, d, 2)
    with pytest.raises(ValueError, match="drafter"):
        spec.speculative_generate(model, [1], 3, object(), 2)
    with pytest.raises(ValueError, match="corruption=1.5"):
        spec.ControlledDrafter(model, [1], 3, 1.5)
    with pytest.raises(ValueError, match="only rollback='ring' takes a window"):
        spec.speculative_generate(model, [1], 3, d, 2, "replay", window=5)
    with pytest.raises(ValueError, match="only rollback='lazy-ring' takes a ring_len"):
        spec.speculative_generate(model, [1], 3, d, 2, "slot", ring_len=5)
    with pytest.raises(ValueError, match="max_n"):
        spec.NgramDrafter(max_n=1, min_n=2)
    with pytest.raises(ValueError, match="tree=\\[2, 2\\]: expected k=3"):
        spec.speculative_generate(model, [1], 3, d, 3, tree=(2, 2))
    with pytest.raises(ValueError, match="proposes chains only"):
        spec.speculative_generate(model, [1, 2, 1], 3, d, 2, tree=(2, 1))
    with pytest.raises(ValueError, match="chains only"):
        spec.speculative_generate(model, [1], 3, spec.ControlledDrafter(model, [1], 6, 0.0), 2, "none", tree=(2, 1))
    with pytest.raises(ValueError, match="parents\\[1\\]=1"):
        spec.DraftTree((1, 2), (-1, 1))
    with pytest.raises(ValueError, match="keep=\\[0, 2\\]"):
        r = spec.SnapshotRollback(tiny, PagePool(400, 4096), 2)
        cache = HybridCache(tiny)
        model.prefill([1, 2], cache)
        _, caps, view = spec.verify(model, [3, 4, 5], cache)
        r.save(view, caps)
        r.restore(cache, [0, 2])


def test_ngram_drafter_looks_up_the_latest_match():
    d = spec.NgramDrafter(max_n=2)
    assert d.propose([1, 2, 3, 9, 1, 2, 4, 5, 1, 2], 3) == [4, 5, 1]
    assert d.propose([7, 8], 3) == []
    assert d.propose([5, 6, 5], 4) == [6, 5]


def test_controlled_drafter_acceptance_decays_with_depth(model):
    """A draft at depth d is right with probability alpha_d = (1 - corruption) decay^(d-1): counted over
    2,000 positions (seeded), within 0.04 of it; a tree node continues with 1 - (1 - alpha)^w."""
    d = spec.ControlledDrafter(model, [4, 5, 6], 0, 0.2, seed=5, decay=0.8)
    d.reference = list(range(2000))  # any reference: only right / wrong is counted
    for depth in (1, 2, 4):
        right = np.mean([d.guess(p, depth) == p for p in range(2000)])
        assert right == pytest.approx(d.alpha(depth), abs=0.04)
    hits = [any(t == p for t, par in zip(tree.tokens, tree.parents) if par == -1)
            for p in range(0, 1500, 3)
            for tree in [d.propose_tree([4, 5, 6] + [0] * p, (3,))]]
    assert np.mean(hits) == pytest.approx(1 - (1 - d.alpha(1)) ** 3, abs=0.05)


def test_scratch_slots_round_trip():
    pool = PagePool(50, 64)
    layout = spec.record_layout(tiny)
    with pytest.raises(Exception):
        spec.ScratchSlots(pool, layout, 10)  # does not fit: the pool is left unchanged
    pool.check_invariants()
    small = spec.SlotLayout(((("a", 0), (3,)), (("b", 0), (2, 5))), np.dtype("float64"))
    slots = spec.ScratchSlots(pool, small, 4)
    data = np.arange(4 * 13, dtype=float).reshape(4, 13)
    slots.write([2, 0, 1, 3], data)
    assert np.array_equal(slots.read([0, 1, 2, 3]), data[[1, 2, 0, 3]])
    assert np.array_equal(small.unpack(slots.read(3))["b", 0][0], data[3, 3:].reshape(2, 5))
    assert slots.bytes_written == 4 * small.nbytes and slots.bytes_read == 5 * small.nbytes
    with pytest.raises(ValueError, match="slots"):
        slots.read(4)
    slots.free()
    pool.check_invariants()


def test_rollback_timings_report_every_part(model):
    t = spec.rollback_timings(model, "lazy-ring", 3, [1, 4], repeats=1)
    assert set(t) == {1, 4} and all(v["save"] > 0 and v["restore"] > 0 and v["current"] > 0 for v in t.values())
    with pytest.raises(ValueError, match="keeps"):
        spec.rollback_timings(model, "replay", 3, [5], repeats=1)


def test_with_corruption_shares_the_reference(model):
    d = spec.ControlledDrafter(model, [4, 5, 6], 10, 0.0, seed=1)
    e = d.with_corruption(1.0, seed=2)
    assert e.reference is d.reference and e.corruption == 1.0 and d.corruption == 0.0
    assert d.propose([4, 5, 6], 3) == d.reference[:3]
    assert all(a != b for a, b in zip(e.propose([4, 5, 6], 3), d.reference))
    assert d.propose_tree([4, 5, 6], (1, 1, 1)) == spec.DraftTree.chain(d.reference[:3])


def test_spec_plot_keys_are_distinct():
    from kimilab import plots
    for keys in (("snapshot", "slot", "replay", "ring", "lazy-ring", "trim-only"),
                 ("spec-k1", "spec-k2", "spec-k4", "spec-k8", "plain-decode")):
        assert len({plots.color(k) for k in keys}) == len(keys)


@pytest.mark.parametrize("tree", [None, (2, 2, 1)])
def test_emitted_per_step_needs_no_model(model, tree):
    """The controlled drafter's acceptance depends on its guesses alone: its model-free count of
    tokens per step equals the real loop's, so chapter 7 can average over many seeds cheaply."""
    prompt = list(range(50, 70))
    d = spec.ControlledDrafter(model, prompt, 40, 0.3, seed=9, decay=0.9)
    k = 4 if tree is None else 3
    r = spec.speculative_generate(model, prompt, 30, d, k, "slot", tree=tree)
    assert [s.emitted for s in r.steps] == d.emitted_per_step(30, k, tree)


def test_greedy_reference_names_what_it_cannot_compare(model):
    ref = spec.GreedyReference(model, [1, 2, 3], 4)
    assert ref.tokens == model.generate([1, 2, 3], 4)
    assert ref.state_error(ref.cache) == 0.0
    with pytest.raises(ValueError, match=r"cache.seq_len=2: expected a length the reference decoded \(3..6\)"):
        c = HybridCache(tiny)
        model.prefill([1, 2], c)
        ref.state_error(c)
    with pytest.raises(ValueError, match="n_new"):
        spec.GreedyReference(model, [1, 2, 3], 0)
