"""kimilab.kda: chunked == recurrent, split/carry, affine composition, gates, errors."""

from __future__ import annotations

import importlib.util
import math
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from fuzzing import examples

from kimilab import kda
from kimilab.kda import chunk
from kimilab.kda.testing import GATES, PROPERTY_EXAMPLES, random_inputs

FAST = settings(max_examples=examples(PROPERTY_EXAMPLES), deadline=None)


def drawn_inputs(p, T=None):
    """``random_inputs`` for a drawn ``shapes`` example (``T`` overridable)."""
    T = p["T"] if T is None else T
    return random_inputs(T, p["H"], p["K"], p["V"], seed=p["seed"], gate=p["gate"], batch=p["batch"])


shapes = st.fixed_dictionaries(
    {
        "seed": st.integers(0, 2**16),
        "T": st.integers(0, 90),
        "H": st.integers(1, 3),
        "K": st.integers(1, 12),
        "V": st.integers(1, 12),
        "chunk": st.integers(1, 40),
        "batch": st.sampled_from([None, 1, 2]),
        "with_state": st.booleans(),
        "gate": st.sampled_from(sorted(GATES)),
    }
)


def maxdiff(a, b):
    return float(np.max(np.abs(a - b), initial=0.0))


@FAST
@given(shapes)
def test_chunked_equals_recurrent_float64(p):
    (q, k, v, g, beta), S0 = drawn_inputs(p)
    S0 = S0 if p["with_state"] else None
    o_r, s_r = kda.recurrent_kda(q, k, v, g, beta, initial_state=S0)
    o_c, s_c = kda.chunk_kda(q, k, v, g, beta, initial_state=S0, chunk_size=p["chunk"])
    assert o_c.shape == o_r.shape == v.shape and o_c.dtype == np.float64
    assert s_c.shape == s_r.shape
    assert maxdiff(o_c, o_r) <= 1e-10
    assert maxdiff(s_c, s_r) <= 1e-10


one_head = st.fixed_dictionaries(
    {
        "seed": st.integers(0, 2**16),
        "T": st.integers(0, 70),
        "K": st.integers(1, 8),
        "V": st.integers(1, 8),
        "chunk": st.integers(1, 24),
        "with_state": st.booleans(),
        "gate": st.sampled_from(sorted(GATES)),
    }
)


@settings(max_examples=examples(60), deadline=None)
@given(one_head)
def test_naive_chunk_equals_recurrent_and_chunk(p):
    """The readable one-head twin == the recurrence == the optimised kernel, in float64."""
    (q, k, v, g, beta), S0 = random_inputs(p["T"], 1, p["K"], p["V"], seed=p["seed"], gate=p["gate"])
    S0 = S0 if p["with_state"] else None
    o_r, s_r = kda.recurrent_kda(q, k, v, g, beta, initial_state=S0)
    o_n, s_n = kda.naive_chunk_kda(q[:, 0], k[:, 0], v[:, 0], g[:, 0], beta[:, 0],
                                   initial_state=None if S0 is None else S0[0], chunk_size=p["chunk"])
    o_c, s_c = kda.chunk_kda(q, k, v, g, beta, initial_state=S0, chunk_size=p["chunk"])
    assert o_n.shape == (p["T"], p["V"]) and s_n.shape == (p["K"], p["V"]) and o_n.dtype == np.float64
    assert maxdiff(o_n, o_r[:, 0]) <= 1e-10 and maxdiff(s_n, s_r[0]) <= 1e-10
    assert maxdiff(o_n, o_c[:, 0]) <= 1e-10 and maxdiff(s_n, s_c[0]) <= 1e-10


def test_naive_chunk_checks_one_head_and_leaves_inputs_alone():
    (q, k, v, g, beta), S0 = random_inputs(10, 1, 3, 2, seed=1)
    args = [x[:, 0] for x in (q, k, v, g, beta)]
    keep = [x.copy() for x in args] + [S0[0].copy()]
    kda.naive_chunk_kda(*args, initial_state=S0[0], chunk_size=4)
    assert all(np.array_equal(a, b) for a, b in zip(args + [S0[0]], keep))
    with pytest.raises(ValueError, match=r"q: expected one head, shape \[10, 3\], got \(10, 1, 3\)"):
        kda.naive_chunk_kda(q, *args[1:])
    with pytest.raises(ValueError, match=r"beta: expected one head, shape \[10\]"):
        kda.naive_chunk_kda(*args[:4], beta)
    with pytest.raises(ValueError, match=r"initial_state: expected one head, shape \[3, 2\]"):
        kda.naive_chunk_kda(*args, initial_state=S0)
    with pytest.raises(ValueError, match=r"chunk_size=0"):
        kda.naive_chunk_kda(*args, chunk_size=0)


@settings(max_examples=examples(60), deadline=None)
@given(shapes, st.data())
def test_split_anywhere_and_carry_state(p, data):
    (q, k, v, g, beta), S0 = drawn_inputs(p)
    S0 = S0 if p["with_state"] else None
    o_all, s_all = kda.chunk_kda(q, k, v, g, beta, initial_state=S0, chunk_size=p["chunk"])
    cut = data.draw(st.integers(0, p["T"]))
    t_axis = 0 if p["batch"] is None else 1
    first = [np.take(x, np.arange(cut), axis=t_axis) for x in (q, k, v, g, beta)]
    second = [np.take(x, np.arange(cut, p["T"]), axis=t_axis) for x in (q, k, v, g, beta)]
    o1, s1 = kda.chunk_kda(*first, initial_state=S0, chunk_size=p["chunk"])
    o2, s2 = kda.recurrent_kda(*second, initial_state=s1)  # mix the two kernels on purpose
    assert maxdiff(np.concatenate([o1, o2], axis=t_axis), o_all) <= 1e-10
    assert maxdiff(s2, s_all) <= 1e-10


@settings(max_examples=examples(60), deadline=None)
@given(shapes, st.data())
def test_affine_composition_of_two_segments(p, data):
    (q, k, v, g, beta), S0 = drawn_inputs(p)
    cut = data.draw(st.integers(0, p["T"]))
    t_axis = 0 if p["batch"] is None else 1
    part = lambda lo, hi: [np.take(x, np.arange(lo, hi), axis=t_axis) for x in (k, v, g, beta)]  # noqa: E731
    M_a, C_a = kda.segment_transition(*part(0, cut), chunk_size=p["chunk"])
    M_b, C_b = kda.segment_transition(*part(cut, p["T"]), chunk_size=p["chunk"])
    M, C = kda.compose_transitions((M_a, C_a), (M_b, C_b))
    _, s_whole = kda.recurrent_kda(q, k, v, g, beta, initial_state=S0)
    assert maxdiff(kda.apply_transition(M, C, S0), s_whole) <= 1e-10
    # C is the state reached from zero; M alone carries the initial state.
    _, s_zero = kda.recurrent_kda(q, k, v, g, beta)
    assert maxdiff(C, s_zero) <= 1e-10


def test_transition_of_whole_equals_composition_and_identity():
    (q, k, v, g, beta), S0 = random_inputs(100, 2, 6, 5, seed=3)
    M, C = kda.segment_transition(k, v, g, beta, chunk_size=16)
    _, s = kda.chunk_kda(q, k, v, g, beta, initial_state=S0)
    assert maxdiff(kda.apply_transition(M, C, S0), s) <= 1e-10
    eye, Z = kda.identity_transition(2, 6, 5)
    M2, C2 = kda.compose_transitions((eye, Z), (M, C))
    assert maxdiff(M2, M) == 0 and maxdiff(C2, C) == 0


@settings(max_examples=examples(40), deadline=None)
@given(shapes)
def test_step_loop_equals_recurrent(p):
    (q, k, v, g, beta), S0 = drawn_inputs(p, T=min(p["T"], 30))
    o_ref, s_ref = kda.recurrent_kda(q, k, v, g, beta, initial_state=S0)
    t_axis = 0 if p["batch"] is None else 1
    S = S0.copy()
    outs = []
    for t in range(q.shape[t_axis]):
        pick = lambda x: np.take(x, t, axis=t_axis)  # noqa: E731
        before = S.copy()
        o, S = kda.kda_step(pick(q), pick(k), pick(v), pick(g), pick(beta), S)
        outs.append(o)
        assert not np.shares_memory(o, S)
        del before
    if outs:
        assert maxdiff(np.stack(outs, axis=t_axis), o_ref) <= 1e-12
    assert maxdiff(S, s_ref) <= 1e-12


def test_step_does_not_modify_state():
    (q, k, v, g, beta), S0 = random_inputs(1, 2, 4, 3, seed=1)
    keep = S0.copy()
    kda.kda_step(q[0], k[0], v[0], g[0], beta[0], S0)
    assert np.array_equal(S0, keep)


def test_recurrent_matches_the_definition_for_one_head():
    """The loop written out per head, straight from the three lines of kda.recurrent's docstring."""
    (q, k, v, g, beta), S0 = random_inputs(9, 1, 3, 2, seed=7)
    S = S0[0].copy()
    outs = []
    for t in range(9):
        S = np.diag(np.exp(g[t, 0])) @ S
        S = S + beta[t, 0] * np.outer(k[t, 0], v[t, 0] - S.T @ k[t, 0])
        outs.append(S.T @ (3**-0.5 * q[t, 0]))
    o, s = kda.recurrent_kda(q, k, v, g, beta, initial_state=S0)
    assert maxdiff(o[:, 0], np.array(outs)) <= 1e-12
    assert maxdiff(s[0], S) <= 1e-12


@pytest.mark.parametrize("gate", ["kimi-init", "logsigmoid", "extreme"])
def test_float32_follows_dtype_and_stays_close(gate):
    (q, k, v, g, beta), S0 = random_inputs(300, 2, 32, 16, seed=11, dtype=np.float32, gate=gate)
    o_r, s_r = kda.recurrent_kda(q, k, v, g, beta, initial_state=S0)
    o_c, s_c = kda.chunk_kda(q, k, v, g, beta, initial_state=S0)
    assert o_c.dtype == s_c.dtype == np.float32
    assert np.all(np.isfinite(o_c)) and np.all(np.isfinite(s_c))
    assert maxdiff(o_c, o_r) <= 1e-4 * max(1.0, float(np.abs(o_r).max()))
    assert maxdiff(s_c, s_r) <= 1e-4 * max(1.0, float(np.abs(s_r).max()))


def test_block_size_shrinks_with_strong_gates_and_stays_exact():
    for gate, expect_small in (("zero", False), ("extreme", True)):
        (q, k, v, g, beta), _ = random_inputs(128, 1, 8, 8, seed=5, gate=gate)
        G = np.cumsum(chunk._slab(g[None], 0, 2, 64), axis=1)
        s = int(chunk._block_sizes(G, 64, decaying=True).min())
        assert (s < 64) == expect_small
        o_r, _ = kda.recurrent_kda(q, k, v, g, beta)
        o_c, _ = kda.chunk_kda(q, k, v, g, beta)
        assert maxdiff(o_c, o_r) <= 1e-10


def _load_bench():
    """bench/bench_kda.py by path (bench/ is not a package), as bench/run.py loads it."""
    path = Path(__file__).resolve().parents[1] / "bench" / "bench_kda.py"
    spec = importlib.util.spec_from_file_location("bench_kda", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


BENCH = _load_bench()


@settings(max_examples=examples(30), deadline=None)
@given(st.integers(1, 70), st.integers(0, 2**16))
def test_unit_lower_inverse(n, seed):
    """The block-doubling inverse the benchmark times against chunk_kda's solve."""
    rng = np.random.default_rng(seed)
    L = np.tril(rng.standard_normal((3, n, n)) * 0.3, -1)
    X = BENCH.unit_lower_inverse(L)
    expected = np.linalg.inv(np.eye(n) + L)
    assert X.shape == (3, n, n)
    assert maxdiff(X, expected) <= 1e-9 * max(1.0, float(np.abs(expected).max()))


@settings(max_examples=examples(30), deadline=None)
@given(st.integers(1, 70), st.integers(1, 9), st.integers(1, 20), st.integers(0, 2**16))
def test_unit_lower_solve_matches_dense_solve(n, m, block, seed):
    rng = np.random.default_rng(seed)
    L = np.tril(rng.standard_normal((2, n, n)) * 0.3, -1)
    R = rng.standard_normal((2, n, m))
    X = chunk._unit_lower_solve(L, R, block)
    expected = np.linalg.solve(np.eye(n) + L, R)
    assert X.shape == (2, n, m)
    assert maxdiff(X, expected) <= 1e-9 * max(1.0, float(np.abs(expected).max()))


@settings(max_examples=examples(40), deadline=None)
@given(shapes)
def test_chunked_equals_recurrent_with_growing_gates(p):
    """Some g > 0 (the state may grow): the general block-size rule and flush levels."""
    (q, k, v, _, beta), S0 = drawn_inputs(p)
    g = np.random.default_rng(p["seed"] + 1).uniform(-3.0, 0.3, k.shape)
    o_r, s_r = kda.recurrent_kda(q, k, v, g, beta, initial_state=S0)
    o_c, s_c = kda.chunk_kda(q, k, v, g, beta, initial_state=S0, chunk_size=p["chunk"])
    scale = max(1.0, float(np.abs(o_r).max(initial=0.0)), float(np.abs(s_r).max(initial=0.0)))
    assert maxdiff(o_c, o_r) <= 1e-10 * scale
    assert maxdiff(s_c, s_r) <= 1e-10 * scale


@pytest.mark.parametrize("fn", ["chunk_kda", "segment_transition"])
def test_inputs_are_not_modified(fn):
    (q, k, v, g, beta), S0 = random_inputs(5, 1, 3, 2, seed=4)  # one chunk, one head: slabs could be views
    keep = [x.copy() for x in (q, k, v, g, beta, S0)]
    if fn == "chunk_kda":
        kda.chunk_kda(q, k, v, g, beta, initial_state=S0, chunk_size=5)
    else:
        kda.segment_transition(k, v, g, beta, chunk_size=5)
    assert all(np.array_equal(a, b) for a, b in zip((q, k, v, g, beta, S0), keep))


def test_many_slabs_and_mixed_block_sizes():
    """Several slabs of chunks (see kda.chunk._slabs), with strong and weak gates mixed in time."""
    (q, k, v, g, beta), S0 = random_inputs(700, 2, 8, 4, seed=8, batch=2)
    g[:, 300:400] = -np.random.default_rng(0).uniform(0.0, 60.0, g[:, 300:400].shape)
    assert len(chunk._slabs(-(-700 // 8), 4)) > 1
    o_r, s_r = kda.recurrent_kda(q, k, v, g, beta, initial_state=S0)
    o_c, s_c = kda.chunk_kda(q, k, v, g, beta, initial_state=S0, chunk_size=8)
    assert maxdiff(o_c, o_r) <= 1e-10 and maxdiff(s_c, s_r) <= 1e-10


def test_random_inputs_are_seeded_shaped_and_checked():
    (q, k, v, g, beta), S0 = random_inputs(5, 2, 3, 4, seed=9, batch=2, dtype=np.float32)
    assert [x.shape for x in (q, k, v, g, beta, S0)] == [(2, 5, 2, 3)] * 2 + [(2, 5, 2, 4), (2, 5, 2, 3),
                                                                              (2, 5, 2), (2, 2, 3, 4)]
    assert all(x.dtype == np.float32 for x in (q, k, v, g, beta, S0))
    args64, S0_64 = random_inputs(5, 2, 3, 4, seed=9, batch=2)
    assert all(np.array_equal(a, b.astype(np.float32)) for a, b in zip((q, k, v, g, beta, S0), (*args64, S0_64)))
    for gate in GATES:
        (_, _, _, g, beta), _ = random_inputs(30, 2, 4, 3, seed=1, gate=gate)
        assert np.all(g <= 0) and np.all((beta > 0) & (beta < 1))
    with pytest.raises(ValueError, match=r"gate='nope': expected one of"):
        random_inputs(3, 1, 2, 2, seed=0, gate="nope")
    with pytest.raises(ValueError, match=r"K=0: expected an int >= 1"):
        random_inputs(3, 1, 0, 2, seed=0)
    with pytest.raises(ValueError, match=r"dtype=.*: expected float32 or float64"):
        random_inputs(3, 1, 2, 2, seed=0, dtype=np.int64)


# ----------------------------------------------------------------------------- gates


def test_kda_gate_formula():
    rng = np.random.default_rng(0)
    raw = rng.standard_normal((5, 3, 4)) * 4
    A_log = rng.standard_normal(3)
    dt_bias = rng.standard_normal(12)
    g = kda.kda_gate(raw, A_log, dt_bias)
    x = raw + dt_bias.reshape(3, 4)
    expected = -np.exp(A_log)[:, None] * np.log1p(np.exp(x))
    assert maxdiff(g, expected) <= 1e-12
    assert np.all(g <= 0)
    # dt_bias may also be given as [H, K], or left out
    assert maxdiff(kda.kda_gate(raw, A_log, dt_bias.reshape(3, 4)), g) == 0
    assert maxdiff(kda.kda_gate(raw, A_log), -np.exp(A_log)[:, None] * np.log1p(np.exp(raw))) <= 1e-12
    assert kda.kda_gate(raw.astype(np.float32), A_log, dt_bias).dtype == np.float32


def test_lowerbound_gate_formula():
    rng = np.random.default_rng(1)
    raw = rng.standard_normal((6, 2, 5)) * 3
    A_log = rng.standard_normal(2)
    dt_bias = rng.standard_normal(10)
    g = kda.kda_gate_lowerbound(raw, A_log, dt_bias, lower_bound=-3.0)
    expected = -3.0 / (1 + np.exp(-np.exp(A_log)[:, None] * (raw + dt_bias.reshape(2, 5))))
    assert maxdiff(g, expected) <= 1e-12
    assert np.all((g > -3.0) & (g < 0))
    no_A = kda.kda_gate_lowerbound(raw, None, None)
    assert maxdiff(no_A, -5.0 / (1 + np.exp(-raw))) <= 1e-12


def test_beta_sigmoid_softplus_l2_are_stable():
    x = np.array([-1000.0, -30.0, 0.0, 30.0, 1000.0])
    with np.errstate(over="raise", invalid="raise", divide="raise"):
        b = kda.beta_from_logits(x)
        sp = kda.softplus(x)
    assert np.all((b >= 0) & (b <= 1)) and b[2] == 0.5
    assert sp[-1] == 1000.0 and sp[0] == 0.0
    v = np.array([[3.0, 4.0], [0.0, 0.0]])
    n = kda.l2_normalize(v)
    assert maxdiff(n[0], [3 / math.sqrt(25 + 1e-6), 4 / math.sqrt(25 + 1e-6)]) <= 1e-15
    assert np.all(n[1] == 0)


def test_linear_attention_state_adds():
    (q, k, v, g, beta), _ = random_inputs(20, 2, 4, 3, seed=2)
    whole = kda.linear_attention_state(k, v)
    halves = kda.linear_attention_state(k[:7], v[:7]) + kda.linear_attention_state(k[7:], v[7:])
    assert maxdiff(whole, halves) <= 1e-12


def test_flop_counts_and_state_bytes():
    assert kda.recurrent_kda_flops(4096, 4, 64, 64) == 4096 * 4 * (7 * 64 * 64 + 64 + 2 * 64)
    full = kda.chunk_kda_flops(128, 2, 8, 8, 64)
    assert full == 2 * kda.chunk_kda_flops(64, 2, 8, 8, 64)
    assert kda.chunk_kda_flops(100, 1, 8, 8, 64) == kda.chunk_kda_flops(64, 1, 8, 8, 64) + kda.chunk_kda_flops(36, 1, 8, 8, 36)
    assert isinstance(kda.chunk_kda_flops(4096, 4, 64, 64), int)
    assert kda.recurrent_kda_flops(4096, 4, 64, 64) < kda.chunk_kda_flops(4096, 4, 64, 64, 16) \
        < kda.chunk_kda_flops(4096, 4, 64, 64, 64) < kda.chunk_kda_flops(4096, 4, 64, 64, 256)
    assert kda.state_bytes(32, 128, 128, 4) == 32 * 128 * 128 * 4


@pytest.mark.parametrize("n, m", [(64, 128), (37, 10), (16, 8), (5, 3), (1, 4), (256, 128)])
def test_solve_flops_count_the_products_the_solve_runs(n, m, monkeypatch):
    """chunk_kda_flops counts block forward substitution, not an inverse: every matmul of
    _unit_lower_solve is counted here (2 FLOPs per multiply-add), plus its subtractions."""
    counted = [0]
    real = np.matmul

    def counting_matmul(a, b, out=None):
        result = real(a, b)
        counted[0] += 2 * result.size * a.shape[-1]
        if out is None:
            return result
        out[...] = result
        return out

    class CountingNumpy:
        def __getattr__(self, name):
            return counting_matmul if name == "matmul" else getattr(np, name)

    monkeypatch.setattr(chunk, "np", CountingNumpy())
    rng = np.random.default_rng(0)
    chunk._unit_lower_solve(np.tril(rng.random((1, n, n)), -1), rng.random((1, n, m)))
    b = min(16, n)
    subtractions = (-(-n // b) - 1) * b * m
    assert counted[0] + subtractions == chunk._solve_flops(n, m)


# ----------------------------------------------------------------------------- errors


def _good(batch=None, dtype=np.float64):
    (q, k, v, g, beta), S0 = random_inputs(8, 2, 4, 3, seed=0, batch=batch, dtype=dtype)
    return dict(q=q, k=k, v=v, g=g, beta=beta), S0


@pytest.mark.parametrize("fn", [kda.recurrent_kda, kda.chunk_kda])
def test_bad_shapes_name_the_argument_and_layout(fn):
    args, S0 = _good()
    bad = dict(args, k=args["k"][:, :, :3])
    with pytest.raises(ValueError, match=r"k: expected \[T, H, K\] matching q \[T=8, H=2, K=4\], got shape \(8, 2, 3\)"):
        fn(**bad)
    with pytest.raises(ValueError, match=r"v: expected \[T, H, V\] matching q \[T=8, H=2, K=4\]"):
        fn(**dict(args, v=args["v"][:5]))
    with pytest.raises(ValueError, match=r"beta: expected \[T, H\] matching q"):
        fn(**dict(args, beta=args["beta"][:, None]))
    with pytest.raises(ValueError, match=r"g: expected \[T, H, K\]"):
        fn(**dict(args, g=args["g"][:, :1]))
    with pytest.raises(ValueError, match=r"initial_state: expected \[H, K, V\] matching q \[T=8, H=2, K=4, V=3\]"):
        fn(**args, initial_state=S0[:, :, :2])
    with pytest.raises(ValueError, match=r"q: expected \[T, H, K\] or \[B, T, H, K\], got shape \(8, 8\)"):
        fn(**dict(args, q=np.zeros((8, 8))))
    bargs, _ = _good(batch=2)
    with pytest.raises(ValueError, match=r"k: expected \[B, T, H, K\] matching q \[B=2, T=8, H=2, K=4\]"):
        fn(**dict(bargs, k=bargs["k"][:1]))


@pytest.mark.parametrize("fn", [kda.recurrent_kda, kda.chunk_kda])
def test_bad_dtypes_name_the_argument(fn):
    args, _ = _good()
    with pytest.raises(ValueError, match=r"q: expected dtype float32 or float64, got int64"):
        fn(**dict(args, q=np.zeros((8, 2, 4), dtype=np.int64)))
    with pytest.raises(ValueError, match=r"v: expected dtype float64 \(matching q\), got float32"):
        fn(**dict(args, v=args["v"].astype(np.float32)))


def test_other_bad_arguments():
    args, S0 = _good()
    with pytest.raises(ValueError, match=r"chunk_size=0: expected an int >= 1"):
        kda.chunk_kda(**args, chunk_size=0)
    with pytest.raises(ValueError, match=r"scale: expected a finite number"):
        kda.recurrent_kda(**args, scale=float("nan"))
    with pytest.raises(ValueError, match=r"g: expected \[T, H, K\] matching k \[T=8, H=2, K=4\]"):
        kda.segment_transition(args["k"], args["v"], args["g"][:, :, :2], args["beta"])
    q1, k1, v1, g1, b1 = (x[0] for x in args.values())
    with pytest.raises(ValueError, match=r"state: expected \[H, K, V\] matching q \[H=2, K=4, V=3\]"):
        kda.kda_step(q1, k1, v1, g1, b1, S0[:1])
    with pytest.raises(ValueError, match=r"v: expected \[H, V\] matching q \[H=2, K=4\]"):
        kda.kda_step(q1, k1, v1[:1], g1, b1, S0)
    with pytest.raises(ValueError, match=r"A_log: expected \[H\] with H=2"):
        kda.kda_gate(np.zeros((3, 2, 4)), np.zeros(3))
    with pytest.raises(ValueError, match=r"dt_bias: expected \[H\*K\]=8 or \[H, K\]=\(2, 4\)"):
        kda.kda_gate(np.zeros((3, 2, 4)), np.zeros(2), np.zeros(7))
    with pytest.raises(ValueError, match=r"lower_bound: expected a float in \[-5, 0\)"):
        kda.kda_gate_lowerbound(np.zeros((3, 2, 4)), np.zeros(2), None, lower_bound=0.0)
    with pytest.raises(ValueError, match=r"S: expected"):
        kda.apply_transition(np.zeros((2, 4, 4)), np.zeros((2, 4, 3)), np.zeros((2, 4, 2)))
