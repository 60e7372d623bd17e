"""Speculative decoding == greedy decoding, token for token and state for state, for every rollback."""

import numpy as np
import pytest
from hypothesis import given, settings, strategies as st
from fuzzing import examples

from kimilab import speculative as spec
from kimilab.config import tiny
from kimilab.model import HybridCache, Model
from kimilab.pool import PagedHybridCache, PagePool

EXACT = ("snapshot", "replay", "ring")


@pytest.fixture(scope="module")
def model(tiny_model):
    return tiny_model


def _greedy_states(model, prompt, n_new):
    """Greedy tokens and, per seq_len, the (KDA, conv) states of a plain decode run."""
    cache = HybridCache(tiny)
    logits = model.prefill(prompt, cache)[-1]
    tokens, states = [], {}
    while True:
        states[cache.seq_len] = cache.checkpoint()
        tokens.append(int(np.argmax(logits)))
        if len(tokens) == n_new:
            return tokens, states, cache
        logits = model.decode(tokens[-1], cache)


def _same_states(cache, ckpt, tol=1e-10):
    for i in tiny.kda_layers:
        assert np.max(np.abs(cache.kda_state(i) - ckpt.kda_states[i])) <= tol, f"KDA state, layer {i}"
        assert np.max(np.abs(cache.conv_state(i) - ckpt.conv_states[i])) <= tol, f"conv state, layer {i}"


def _run(model, prompt, n_new, drafter, k, rollback, cache, states, pool=None, window=None):
    seen = []

    def on_step(c, stats):
        _same_states(c, states[c.seq_len])
        if pool is not None:
            pool.check_invariants()
        seen.append(stats)

    result = spec.speculative_generate(model, prompt, n_new, drafter, k, rollback, cache, window=window,
                                       on_step=on_step)
    assert len(seen) == len(result.steps)
    return result


@settings(max_examples=examples(20), deadline=None)
@given(prompt_len=st.integers(1, 20), seed=st.integers(0, 999), k=st.integers(1, 8),
       corruption=st.sampled_from([0.0, 0.2, 0.5, 1.0]), n_new=st.integers(1, 14),
       rollback=st.sampled_from(EXACT), paged=st.booleans(), spare=st.integers(0, 3))
def test_speculative_equals_greedy_controlled(model, prompt_len, seed, k, corruption, n_new, rollback, paged,
                                              spare):
    prompt = np.random.default_rng(seed).integers(0, tiny.vocab_size, prompt_len).tolist()
    ref, states, ref_cache = _greedy_states(model, prompt, n_new)
    pool = PagePool(900, 4096) if paged else None
    cache = PagedHybridCache(tiny, pool, block_tokens=4) if paged else HybridCache(tiny)
    drafter = spec.ControlledDrafter(model, prompt, n_new + k, corruption, seed=seed)
    window = k + 1 + spare if rollback == "ring" else None  # a ring may be wider than the verify
    result = _run(model, prompt, n_new, drafter, k, rollback, cache, states, pool, window)
    assert result.tokens == ref
    assert cache.seq_len == ref_cache.seq_len
    _same_states(cache, states[cache.seq_len])
    for i in tiny.attn_layers:
        assert np.max(np.abs(cache.kv(i)[0] - ref_cache.kv(i)[0])) <= 1e-10
    assert all(s.accepted <= s.drafted <= k and s.emitted <= s.accepted + 1 for s in result.steps)
    if paged:
        assert pool.stats().pages_by_kind["scratch"] == 0
        cache.free()
        pool.check_invariants()
        assert pool.n_free == pool.n_pages


@settings(max_examples=examples(6), deadline=None)
@given(seed=st.integers(0, 999), k=st.integers(1, 8), rollback=st.sampled_from(EXACT),
       drafter=st.sampled_from(["ngram", "draft-model"]))
def test_speculative_equals_greedy_real_drafters(model, seed, k, rollback, drafter):
    rng = np.random.default_rng(seed)
    motif = rng.integers(0, tiny.vocab_size, 4).tolist()
    prompt = (motif * 3 + rng.integers(0, tiny.vocab_size, 3).tolist())
    n_new = 10
    ref, states, _ = _greedy_states(model, prompt, n_new)
    d = (spec.NgramDrafter() if drafter == "ngram"
         else spec.DraftModelDrafter(Model(tiny.with_(name="draft", layer_pattern="KA"), seed=1)))
    result = _run(model, prompt, n_new, d, k, rollback, HybridCache(tiny), states)
    assert result.tokens == ref


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


def test_rollback_bytes_match_the_cost_model(model):
    from kimilab.costs import LOCAL, spec as spec_costs

    prompt = list(range(30))
    for name in EXACT:
        d = spec.ControlledDrafter(model, prompt, 12, 0.0)
        r = spec.speculative_generate(model, prompt, 4, d, 5, name)
        assert r.steps[0].rollback_bytes == spec_costs.rollback_bytes(tiny, LOCAL, name, 5, act_bytes=8)


def test_ring_window_too_small_is_an_error(model):
    with pytest.raises(ValueError, match="window=4.*k\\+1=5"):
        spec.speculative_generate(model, [1, 2], 4, spec.NgramDrafter(), 4, "ring", window=4)
    pool = PagePool(200, 4096)
    ring = spec.RingRollback(tiny, pool, 2, window=3)
    cache = HybridCache(tiny)
    model.prefill([1, 2, 3], cache)
    _, caps, view = spec.verify(model, [4, 5, 6, 7], cache)  # 4 positions > window 3
    with pytest.raises(ValueError, match="overflows the ring window=3"):
        ring.save(view, caps)
    ring.close()
    pool.check_invariants()
    assert pool.n_free == pool.n_pages


def test_ring_reuses_its_pages(model):
    pool = PagePool(900, 4096)
    cache = PagedHybridCache(tiny, pool)
    used = []
    d = spec.ControlledDrafter(model, [9, 8, 7], 20, 0.5, seed=2)
    spec.speculative_generate(model, [9, 8, 7], 12, d, 3, "ring", cache,
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
    with pytest.raises(ValueError, match="max_n"):
        spec.NgramDrafter(max_n=1, min_n=2)


def test_ngram_drafter_looks_up_the_latest_match():
    d = spec.NgramDrafter(max_n=2)
    assert d.propose([1, 2, 3, 9, 1, 2, 4, 5, 1, 2], 3) == [4, 5, 1]
    assert d.propose([7, 8], 3) == []
    assert d.propose([5, 6, 5], 4) == [6, 5]


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
    with pytest.raises(ValueError, match="slots"):
        slots.read(4)
    slots.free()
    pool.check_invariants()


def test_rollback_timings_report_save_and_restore(model):
    t = spec.rollback_timings(model, "ring", 3, [1, 4], repeats=1)
    assert set(t) == {1, 4} and all(v["save"] > 0 and v["restore"] > 0 for v in t.values())
    with pytest.raises(ValueError, match="keeps"):
        spec.rollback_timings(model, "replay", 3, [5], repeats=1)


def test_with_corruption_shares_the_reference(model):
    d = spec.ControlledDrafter(model, [4, 5, 6], 10, 0.0, seed=1)
    e = d.with_corruption(1.0, seed=2)
    assert e.reference is d.reference and e.corruption == 1.0 and d.corruption == 0.0
    assert d.propose([4, 5, 6], 3) == d.reference[:3]
    assert all(a != b for a, b in zip(e.propose([4, 5, 6], 3), d.reference))


def test_spec_plot_keys_are_distinct():
    from kimilab import plots
    for keys in (("snapshot", "replay", "ring", "trim-only"), ("spec-k2", "spec-k4", "spec-k8", "plain-decode")):
        assert len({plots.color(k) for k in keys}) == len(keys)
