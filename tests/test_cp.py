"""kimilab.cp: context-parallel KDA == one rank (float64), schemes, splits, bad input, costs."""

from __future__ import annotations

import threading

import numpy as np
import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st
from fuzzing import examples

from kimilab import cp, kda
from kimilab.cp.ladder import RUNGS, ladder_cp, ladder_reference, transition_values
from kimilab.cp.regimes import lifetime_tokens, m_lifetime, regime_inputs
from kimilab.kda.affine import apply_affine_outputs, chunk_kda_affine
from kimilab.kda.prepared import prepare_kda, prepared_transition, run_prepared
from kimilab.kda.testing import GATES, random_inputs


def maxdiff(a, b):
    return float(np.max(np.abs(a - b), initial=0.0))


@settings(max_examples=examples(60), deadline=None)
@given(st.integers(0, 2**16), st.integers(1, 150), st.integers(1, 3), st.integers(1, 9), st.integers(1, 9),
       st.integers(1, 40), st.sampled_from(sorted(GATES)))
# found by make fuzz: M flushed before a one-chunk slab with V = 1, where numpy 2.4's in-place
# np.negative on the strided V' view wrote the wrong elements
@example(seed=0, T=43, H=3, K=7, V=1, chunk=1, gate="extreme")
def test_affine_pass_equals_chunk_kda_from_any_state(seed, T, H, K, V, chunk, gate):
    (q, k, v, g, beta), S0 = random_inputs(T, H, K, V, seed=seed, gate=gate)
    o, S = kda.chunk_kda(q, k, v, g, beta, initial_state=S0, chunk_size=chunk)
    o0, Qt, M, C = chunk_kda_affine(q, k, v, g, beta, chunk_size=chunk)
    assert maxdiff(apply_affine_outputs(o0, Qt, S0), o) <= 1e-10
    assert maxdiff(M @ S0 + C, S) <= 1e-10
    M2, C2 = kda.segment_transition(k, v, g, beta, chunk_size=chunk)
    assert maxdiff(M, M2) <= 1e-10 and maxdiff(C, C2) <= 1e-10


@settings(max_examples=examples(40), deadline=None)
@given(st.integers(0, 2**16), st.integers(1, 150), st.integers(1, 3), st.integers(1, 9), st.integers(1, 9),
       st.integers(1, 40), st.sampled_from(sorted(GATES)), st.booleans())
def test_shared_preparation_two_passes_equal_transition_and_chunk_kda(seed, T, H, K, V, chunk, gate, start):
    """fla's KCP shape: one preparation, a transition pre-pass and a main pass == segment_transition
    and chunk_kda (the preparation is shared, not recomputed)."""
    (q, k, v, g, beta), S0 = random_inputs(T, H, K, V, seed=seed, gate=gate)
    S0 = S0 if start else None
    prepared = prepare_kda(q, k, v, g, beta, chunk_size=chunk)
    M, C = prepared_transition(prepared)
    M2, C2 = kda.segment_transition(k, v, g, beta, chunk_size=chunk)
    assert maxdiff(M, M2) <= 1e-10 and maxdiff(C, C2) <= 1e-10
    o, S = run_prepared(prepared, S0)
    o2, S2 = kda.chunk_kda(q, k, v, g, beta, initial_state=S0, chunk_size=chunk)
    assert maxdiff(o, o2) <= 1e-10 and maxdiff(S, S2) <= 1e-10
    assert maxdiff(run_prepared(prepared, S0)[0], o) == 0.0  # the preparation is read, never changed


def test_prepared_pass_checks_its_state():
    prepared = prepare_kda(*random_inputs(10, 2, 4, 3, seed=0)[0])
    with pytest.raises(ValueError, match="initial_state"):
        run_prepared(prepared, np.zeros((2, 3, 4)))


@pytest.mark.parametrize("method", sorted(cp.kda_cp.METHODS))
@pytest.mark.parametrize("scheme", sorted(cp.SCHEMES))
@pytest.mark.parametrize("with_state", [False, True])
def test_every_scheme_equals_one_rank_for_p_1_to_8(scheme, method, with_state):
    (q, k, v, g, beta), S0 = random_inputs(200, 2, 8, 6, seed=4)
    S0 = S0 if with_state else None
    o, S = kda.chunk_kda(q, k, v, g, beta, initial_state=S0)
    for P in range(1, 9):
        oc, Sc, comms = cp.context_parallel_kda(q, k, v, g, beta, ranks=P, initial_state=S0, scheme=scheme,
                                                method=method)
        assert maxdiff(oc, o) <= 1e-10 and maxdiff(Sc, S) <= 1e-10, (scheme, P)
        assert len(comms) == P


@pytest.mark.parametrize("bounds", [[0, 1, 200], [0, 199, 200], [0, 1, 2, 3, 200], [0, 10, 11, 80, 200],
                                    [0, 63, 64, 65, 129, 200]])
def test_ragged_splits_one_token_and_short_slices(bounds):
    (q, k, v, g, beta), S0 = random_inputs(200, 2, 5, 4, seed=5, gate="logsigmoid")
    o, S = kda.chunk_kda(q, k, v, g, beta, initial_state=S0)
    for scheme in cp.SCHEMES:
        oc, Sc, _ = cp.context_parallel_kda(q, k, v, g, beta, bounds=bounds, initial_state=S0, scheme=scheme)
        assert maxdiff(oc, o) <= 1e-10 and maxdiff(Sc, S) <= 1e-10


@settings(max_examples=examples(40), deadline=None)
@given(st.data())
def test_hypothesis_over_p_t_and_split_points(data):
    T = data.draw(st.integers(1, 160))
    P = data.draw(st.integers(1, min(8, T)))
    cuts = sorted(data.draw(st.sets(st.integers(1, T - 1), min_size=P - 1, max_size=P - 1))) if P > 1 else []
    gate = data.draw(st.sampled_from(sorted(GATES)))
    chunk = data.draw(st.integers(1, 40))
    (q, k, v, g, beta), S0 = random_inputs(T, 2, 4, 3, seed=data.draw(st.integers(0, 999)), gate=gate)
    S0 = S0 if data.draw(st.booleans()) else None
    scheme = data.draw(st.sampled_from(sorted(cp.SCHEMES)))
    method = data.draw(st.sampled_from(sorted(cp.kda_cp.METHODS)))
    o, S = kda.chunk_kda(q, k, v, g, beta, initial_state=S0, chunk_size=chunk)
    oc, Sc, _ = cp.context_parallel_kda(q, k, v, g, beta, bounds=[0, *cuts, T], initial_state=S0,
                                        chunk_size=chunk, scheme=scheme, method=method)
    assert maxdiff(oc, o) <= 1e-10 and maxdiff(Sc, S) <= 1e-10


@settings(max_examples=examples(40), deadline=None)
@given(st.data())
def test_ladder_every_rung_equals_one_rank(data):
    """LASP-2 -> scalar decay -> per-channel decay -> KDA: one pass from zero, one all-gather of
    (m, C), a fold and a correction equal the token-by-token recurrence (float64), for any P and
    cuts; what each rank sends is C plus M in the rung's form (nothing, 1, K or K x K per head)."""
    T = data.draw(st.integers(1, 90))
    P = data.draw(st.integers(1, min(6, T)))
    cuts = sorted(data.draw(st.sets(st.integers(1, T - 1), min_size=P - 1, max_size=P - 1))) if P > 1 else []
    rung = data.draw(st.sampled_from(sorted(RUNGS)))
    H, K, V = data.draw(st.integers(1, 3)), data.draw(st.integers(1, 6)), data.draw(st.integers(1, 5))
    (q, k, v, g, beta), S0 = random_inputs(T, H, K, V, seed=data.draw(st.integers(0, 999)),
                                           gate=data.draw(st.sampled_from(["kimi-init", "logsigmoid", "strong"])))
    S0 = S0 if data.draw(st.booleans()) else None
    o, S = ladder_reference(rung, q, k, v, g, beta, S0)
    oc, Sc, comms = ladder_cp(rung, q, k, v, g, beta, bounds=[0, *cuts, T], initial_state=S0)
    assert maxdiff(oc, o) <= 1e-10 and maxdiff(Sc, S) <= 1e-10
    sent = (P - 1) * (transition_values(rung, H, K) + H * K * V) * 8
    assert all(c.bytes_sent == sent for c in comms[1:]) and comms[0].bytes_sent == (P - 1) * H * K * V * 8


def test_ladder_additive_rung_sums_in_any_order_and_bad_rungs_are_named():
    (q, k, v, g, beta), _ = random_inputs(64, 2, 4, 4, seed=3)
    o, S = ladder_reference("additive", q, k, v, g, beta)
    assert maxdiff(S, kda.linear_attention_state(k, v)) <= 1e-10  # LASP-2's state is linear attention's sum
    with pytest.raises(ValueError, match="rung"):
        ladder_cp("gla", q, k, v, g, beta, ranks=2)


def test_m_flushes_with_random_keys_and_lives_with_low_rank_keys_and_a_slow_gate():
    """The two regimes of chapter 9: random unit keys and Kimi's gate kill M within a few thousand
    tokens; keys in a 16-dim subspace of 64 and a slow gate keep it near 1."""
    (_, k, v, g, beta), _ = regime_inputs(4096, 1, 64, 8, seed=0, regime="flushed")
    tokens, top = m_lifetime(k, v, g, beta, block=512)
    assert lifetime_tokens(tokens, top) is not None and lifetime_tokens(tokens, top) <= 4096
    (_, k, v, g, beta), _ = regime_inputs(4096, 1, 64, 8, seed=0, regime="living")
    tokens, top = m_lifetime(k, v, g, beta, block=512)
    assert lifetime_tokens(tokens, top) is None and top[-1] > 0.5
    assert np.linalg.matrix_rank(k[:, 0]) == 16
    with pytest.raises(ValueError, match="key_rank"):
        regime_inputs(8, 1, 8, 8, seed=0, keys="low-rank", key_rank=9)


def test_memoised_helpers_match_what_they_summarise():
    """Chapter 9's key results call these; they must equal the loops they replace."""
    life = cp.regime_lifetimes(1024, 1, 16, seed=0, block=256)
    assert list(life) == [(k, g) for k in ("random", "low-rank") for g in ("kimi-init", "slow")]
    (_, k, v, g, beta), _ = regime_inputs(1024, 1, 16, 8, seed=0, keys="low-rank", gate="slow")
    tokens, top = m_lifetime(k, v, g, beta, block=256)
    assert np.array_equal(life["low-rank", "slow"][0], tokens) and np.array_equal(life["low-rank", "slow"][1], top)
    assert cp.regime_lifetimes(1024, 1, 16, seed=0, block=256) is life  # memoised
    with pytest.raises(ValueError):
        life["random", "slow"][1][0] = 1.0  # read-only: the cache is shared
    assert cp.worst_cp_difference(130, 1, 4, 3, seed=0, ranks=(2, 3), ragged=(0, 1, 65)) <= 1e-10


def test_needed_scheme_sends_only_the_neighbours_state_once_m_has_flushed():
    (q, k, v, g, beta), _ = regime_inputs(12_288, 2, 32, 16, seed=1, regime="flushed", dtype=np.float32)
    o, S = kda.chunk_kda(q, k, v, g, beta)
    oc, Sc, comms = cp.context_parallel_kda(q, k, v, g, beta, ranks=3, scheme="needed")
    assert maxdiff(oc, o) <= 1e-4 and maxdiff(Sc, S) <= 1e-4
    counted = cp.scheme_costs(3, 2, 32, 16, flushed=True)["needed"]["bytes"]
    shape_check = 2 * 40  # the collective shape check: 5 numbers of 8 bytes to each other rank
    assert [c.bytes_sent - shape_check for c in comms] == [counted, counted, 16]  # the last rank: flags only


def test_scheme_byte_counts_match_what_the_ranks_sent():
    """scheme_costs (busiest rank) against the in-process backend's count, every scheme, P = 2..5;
    and the tree sends MORE than the all-gather at P = 2 and 3, fewer from P = 4."""
    (q, k, v, g, beta), _ = regime_inputs(512, 2, 8, 8, seed=2, regime="living", key_rank=2, dtype=np.float32)
    for P in range(2, 6):
        counted = cp.scheme_costs(P, 2, 8, 8)
        for scheme in cp.SCHEMES:
            _, _, comms = cp.context_parallel_kda(q, k, v, g, beta, ranks=P, scheme=scheme)
            busiest = max(c.bytes_sent for c in comms) - (P - 1) * 40
            assert busiest == counted[scheme]["bytes"], (scheme, P)
    tree_fewer = [P for P in range(2, 9) if cp.scheme_costs(P, 4, 64, 64)["tree"]["bytes"]
                  < cp.scheme_costs(P, 4, 64, 64)["allgather"]["bytes"]]
    assert tree_fewer[0] == 4


def test_pass_counts_and_timings():
    """pass_flops: the affine pass does the plain pass's work once M flushed from the start; KCP always
    adds its pre-pass; preparing twice adds one preparation; more live tokens cost more. pass_seconds
    times every pass once per round."""
    from kimilab.cp.passes import PASSES, cost_ratios, pass_flops, pass_seconds

    dead, half, live = (pass_flops(1000, 2, 16, 8, alive=a) for a in (0, 500, None))
    assert dead["affine"] == dead["plain"] == live["plain"] < dead["kcp"] < dead["kcp-recompute"]
    assert dead["kcp-recompute"] - dead["kcp"] == live["kcp-recompute"] - live["kcp"]  # one more preparation
    for name in ("affine", "kcp"):
        assert dead[name] <= half[name] <= live[name]
    assert live["plain"] == kda.chunk_kda_flops(1000, 2, 16, 8)
    seconds = pass_seconds(random_inputs(64, 1, 4, 4, seed=0, dtype=np.float32)[0], rounds=2)
    assert set(seconds) == set(PASSES) and all(len(s) == 2 for s in seconds.values())
    assert cost_ratios(seconds)["plain"] == (1.0, 1.0, 1.0)
    with pytest.raises(ValueError, match="passes"):
        pass_seconds(random_inputs(8, 1, 4, 4, seed=0)[0], passes=("fast",))


def test_bytes_exchanged_do_not_grow_with_t():
    sent = []
    for T in (64, 512, 2048):
        (q, k, v, g, beta), _ = random_inputs(T, 2, 8, 8, seed=1, dtype=np.float32)
        _, _, comms = cp.context_parallel_kda(q, k, v, g, beta, ranks=4)
        sent.append([c.bytes_sent for c in comms])
    assert sent[0] == sent[1] == sent[2]


def test_split_bounds_and_balance():
    assert cp.split_bounds(10, 2) == [0, 5, 10]
    assert cp.split_bounds(3, 3) == [0, 1, 2, 3]
    b = cp.split_bounds(1000, 2, cp.balanced_weights(2, 1.5))
    assert b == [0, 600, 1000]
    with pytest.raises(ValueError, match="only T=2 tokens"):
        cp.split_bounds(2, 3)
    with pytest.raises(ValueError, match="weights"):
        cp.split_bounds(10, 2, [1, -1])
    with pytest.raises(ValueError, match="bounds"):
        (q, k, v, g, beta), _ = random_inputs(10, 1, 2, 2, seed=0)
        cp.context_parallel_kda(q, k, v, g, beta, bounds=[0, 5, 5, 10])


def test_mismatched_shapes_raise_on_every_rank_without_hanging():
    (q, k, v, g, beta), _ = random_inputs(20, 2, 4, 4, seed=0)
    parts = [tuple(x[:10] for x in (q, k, v, g, beta)), tuple(x[10:, :1] for x in (q, k, v, g, beta))]
    errors = [None, None]

    def body(comm):
        try:
            cp.cp_kda_rank(comm, *parts[comm.rank])
        except ValueError as exc:
            errors[comm.rank] = str(exc)

    cp.run_local(2, body, timeout=10)
    assert all(e and "disagree" in e for e in errors), errors
    bad = [tuple(x[:10] for x in (q, k, v, g, beta)), (q[10:], k[10:], v[10:], g[10:, :, :2], beta[10:])]
    with pytest.raises(ValueError, match="rank 1"):
        cp.run_local(2, lambda comm: cp.cp_kda_rank(comm, *bad[comm.rank]), timeout=10)


def test_a_rank_that_never_arrives_is_a_timeout_not_a_hang():
    def body(comm):
        if comm.rank == 0:
            return comm.recv(1)
        return None

    with pytest.raises(TimeoutError):
        cp.run_local(2, body, timeout=0.5)
    assert threading.active_count() < 50


def test_fold_in_float32_tracks_float64():
    (q, k, v, g, beta), _ = random_inputs(256, 2, 8, 8, seed=2)
    trans = [kda.segment_transition(*(x[s] for x in (k, v, g, beta))) for s in cp.slices(cp.split_bounds(256, 4))]
    exact = cp.fold_states(trans)
    f32 = cp.fold_states([(M.astype(np.float32), C.astype(np.float32)) for M, C in trans])
    assert f32[-1].dtype == np.float32 and maxdiff(f32[-1], exact[-1]) <= 1e-5


@pytest.mark.parametrize("P", [1, 2, 3, 5])
def test_ring_attention_equals_causal_attention(P):
    from kimilab.cp.ring import merge_partials, partial_attention, ring_attention_rank
    from kimilab.ops.attention import reference_causal_attention

    r = np.random.default_rng(P)
    q, k, v = (r.standard_normal((23, 2, 4)) for _ in range(3))
    ref = reference_causal_attention(q, k, v)
    bounds = cp.split_bounds(23, P)
    outs, _ = cp.run_local(P, lambda c: ring_attention_rank(c, *(x[bounds[c.rank]:bounds[c.rank + 1]] for x in (q, k, v)),
                                                            start=bounds[c.rank]))
    assert maxdiff(np.concatenate(outs), ref) <= 1e-10
    pos = np.arange(23)
    a = partial_attention(q, k[:10], v[:10], pos, pos[:10])
    b = partial_attention(q, k[10:], v[10:], pos, pos[10:])
    ab, ba = merge_partials(a, b), merge_partials(b, a)
    assert maxdiff(ab[0], ba[0]) == 0.0 and maxdiff(ab[0], ref) <= 1e-10


@pytest.mark.parametrize("cut", [{"ranks": 1}, {"ranks": 3}, {"ranks": 8}, {"bounds": [0, 1, 2, 4, 70, 90]}])
def test_whole_model_prefill_equals_one_rank(tiny_model, cut):
    tokens = np.random.default_rng(7).integers(0, tiny_model.config.vocab_size, 90)
    ref_cache = tiny_model.new_cache()
    ref = tiny_model.prefill(tokens, ref_cache)
    logits, cache = cp.context_parallel_prefill(tiny_model, tokens, **cut)
    assert maxdiff(logits, ref) <= 1e-10 and cache.seq_len == ref_cache.seq_len == 90
    for layer in tiny_model.layers:
        i = layer.index
        if layer.kind == "A":
            assert all(maxdiff(a, b) <= 1e-10 for a, b in zip(cache.kv(i), ref_cache.kv(i)))
        else:
            assert maxdiff(cache.kda_state(i), ref_cache.kda_state(i)) <= 1e-10
            assert maxdiff(cache.conv_state(i), ref_cache.conv_state(i)) <= 1e-10
    # the cache continues exactly: one more token decodes to the same logits
    nxt = int(np.argmax(ref[-1]))
    assert maxdiff(tiny_model.decode(nxt, cache), tiny_model.decode(nxt, ref_cache)) <= 1e-10


def test_rank_counts_and_cut_points_are_checked():
    """ranks=0 is an error (it once ran silently on one rank); bounds and ranks must agree."""
    from kimilab.config import tiny
    from kimilab.model import Model

    q, k, v, g, beta = random_inputs(16, 1, 4, 4, seed=0)[0]
    for bad in (0, -1, 2.5):
        with pytest.raises(ValueError, match="ranks"):
            cp.context_parallel_kda(q, k, v, g, beta, ranks=bad)
    with pytest.raises(ValueError, match="ranks"):
        cp.context_parallel_prefill(Model(tiny, seed=0), np.arange(8), ranks=0)
    with pytest.raises(ValueError, match="ranks=3"):
        cp.cut_points(16, 3, [0, 8, 16])
    with pytest.raises(ValueError, match="bounds"):
        cp.cut_points(16, None, [0, 16, 16])
    assert cp.cut_points(16) == [0, 16] and cp.cut_points(16, 2) == [0, 8, 16]
    with pytest.raises(ValueError, match="affine_cost"):
        cp.balanced_weights(2, float("inf"))
