"""kimilab.cp: context-parallel KDA == one rank (float64), schemes, splits, bad input, costs."""

from __future__ import annotations

import threading

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from fuzzing import examples

from kimilab import cp, kda
from kimilab.kda.affine import apply_affine_outputs, chunk_kda_affine
from kimilab.kda.testing import GATES, random_inputs


def maxdiff(a, b):
    return float(np.max(np.abs(a - b), initial=0.0))


@settings(max_examples=examples(60), deadline=None)
@given(st.integers(0, 2**16), st.integers(1, 150), st.integers(1, 3), st.integers(1, 9), st.integers(1, 9),
       st.integers(1, 40), st.sampled_from(sorted(GATES)))
def test_affine_pass_equals_chunk_kda_from_any_state(seed, T, H, K, V, chunk, gate):
    (q, k, v, g, beta), S0 = random_inputs(T, H, K, V, seed=seed, gate=gate)
    o, S = kda.chunk_kda(q, k, v, g, beta, initial_state=S0, chunk_size=chunk)
    o0, Qt, M, C = chunk_kda_affine(q, k, v, g, beta, chunk_size=chunk)
    assert maxdiff(apply_affine_outputs(o0, Qt, S0), o) <= 1e-10
    assert maxdiff(M @ S0 + C, S) <= 1e-10
    M2, C2 = kda.segment_transition(k, v, g, beta, chunk_size=chunk)
    assert maxdiff(M, M2) <= 1e-10 and maxdiff(C, C2) <= 1e-10


@pytest.mark.parametrize("scheme", sorted(cp.SCHEMES))
@pytest.mark.parametrize("with_state", [False, True])
def test_every_scheme_equals_one_rank_for_p_1_to_8(scheme, with_state):
    (q, k, v, g, beta), S0 = random_inputs(200, 2, 8, 6, seed=4)
    S0 = S0 if with_state else None
    o, S = kda.chunk_kda(q, k, v, g, beta, initial_state=S0)
    for P in range(1, 9):
        oc, Sc, comms = cp.context_parallel_kda(q, k, v, g, beta, ranks=P, initial_state=S0, scheme=scheme)
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
    o, S = kda.chunk_kda(q, k, v, g, beta, initial_state=S0, chunk_size=chunk)
    oc, Sc, _ = cp.context_parallel_kda(q, k, v, g, beta, bounds=[0, *cuts, T], initial_state=S0,
                                        chunk_size=chunk, scheme=scheme)
    assert maxdiff(oc, o) <= 1e-10 and maxdiff(Sc, S) <= 1e-10


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
