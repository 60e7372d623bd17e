"""Causal depthwise conv: sequence form == step-by-step twin; chunked with carried state == whole."""

import numpy as np
import pytest
from hypothesis import given, settings, strategies as st
from fuzzing import examples

from kimilab.ops.conv import causal_conv1d, causal_conv1d_step


def _naive(x, weight, state):
    """Obvious definition: y[t, c] = sum_j weight[c, j] * input[t - (W-1) + j, c]."""
    W = weight.shape[1]
    padded = np.concatenate([state, x])
    T, C = x.shape
    y = np.zeros((T, C))
    for t in range(T):
        for c in range(C):
            y[t, c] = sum(weight[c, j] * padded[t + j, c] for j in range(W))
    return y


@settings(max_examples=examples(30), deadline=None)
@given(T=st.integers(1, 20), C=st.integers(1, 6), W=st.integers(1, 5), seed=st.integers(0, 2**16))
def test_sequence_matches_definition_and_steps(T, C, W, seed):
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((T, C))
    w = rng.standard_normal((C, W))
    s0 = rng.standard_normal((W - 1, C))
    y, s1 = causal_conv1d(x, w, s0)
    np.testing.assert_allclose(y, _naive(x, w, s0), rtol=0, atol=1e-12)
    state = s0
    for t in range(T):
        yt, state = causal_conv1d_step(x[t], w, state)
        assert np.max(np.abs(yt - y[t])) <= 1e-12
    np.testing.assert_array_equal(state, s1)


@settings(max_examples=examples(40), deadline=None)
@given(T=st.integers(1, 30), data=st.data(), seed=st.integers(0, 2**16))
def test_split_with_carried_state_is_exact(T, data, seed):
    rng = np.random.default_rng(seed)
    C, W = 5, 4
    x = rng.standard_normal((T, C))
    w = rng.standard_normal((C, W))
    y_whole, s_whole = causal_conv1d(x, w)
    cuts = sorted(data.draw(st.lists(st.integers(0, T), max_size=4)))
    bounds = [0] + cuts + [T]
    state, ys = None, []
    for a, b in zip(bounds[:-1], bounds[1:]):
        y, state = causal_conv1d(x[a:b], w, state)  # empty pieces keep the state
        ys.append(y)
    assert np.max(np.abs(np.concatenate(ys) - y_whole)) <= 1e-12
    np.testing.assert_array_equal(state, s_whole)


def test_state_is_last_inputs_and_zero_start():
    x = np.arange(12.0).reshape(6, 2)
    w = np.ones((2, 4))
    y, s = causal_conv1d(x, w)
    np.testing.assert_array_equal(s, x[-3:])
    assert y[0].tolist() == x[0].tolist()  # zeros before the first token
    _, s_short = causal_conv1d(x[:1], w, s)
    np.testing.assert_array_equal(s_short, np.concatenate([x[-2:], x[:1]]))


def test_float32_stays_float32():
    x = np.ones((3, 2), np.float32)
    y, s = causal_conv1d(x, np.ones((2, 4), np.float32))
    assert y.dtype == np.float32 and s.dtype == np.float32


@pytest.mark.parametrize("args, word", [
    ((np.ones(3), np.ones((3, 4))), "x"),
    ((np.ones((2, 3)), np.ones((2, 4))), "weight"),
    ((np.ones((2, 3)), np.ones((3, 4)), np.ones((2, 3))), "state"),
])
def test_bad_shapes_name_the_argument(args, word):
    with pytest.raises(ValueError, match=rf"\({word}\)"):
        causal_conv1d(*args)


def test_step_bad_shape():
    with pytest.raises(ValueError, match=r"\(x\).*\[C\]"):
        causal_conv1d_step(np.ones((1, 3)), np.ones((3, 4)))
