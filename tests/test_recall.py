"""kimilab.recall: associative recall of a KV cache, linear attention, the delta rule and KDA."""

import numpy as np
import pytest

from kimilab import recall as R
from kimilab.kda import l2_normalize


def test_orthonormal_keys_read_back_exactly_from_every_state_memory():
    """With N <= K orthonormal keys, linear attention and the delta rule give every value back
    exactly (float64), and a sharp softmax over the cache nearly so."""
    r = np.random.default_rng(0)
    K, N = 32, 20
    keys = np.linalg.qr(r.standard_normal((K, K)))[0][:N][None]
    values = r.standard_normal((1, N, 16))
    for memory in ("linear", "delta"):
        assert np.abs(R.read_back(memory, keys, values) - values).max() < 1e-10, memory
    assert np.abs(R.read_back("softmax", keys, values, sharpness=200.0) - values).max() < 1e-6  # float32


def test_a_kv_cache_recalls_everything_and_a_state_saturates():
    assert R.recall("softmax", 1024, seeds=range(3)).mean == 1.0
    small, big = R.recall("delta", 64, seeds=range(3)), R.recall("delta", 1024, seeds=range(3))
    assert small.mean > 0.95 > 0.3 > big.mean
    assert big.by_distance.shape == (1024,) and big.by_distance[:32].mean() > big.by_distance[-256:].mean()
    gated = R.recall("kda", 256, seeds=range(3))
    assert gated.mean < R.recall("delta", 256, seeds=range(3)).mean  # forgetting costs capacity too


def test_the_delta_rule_updates_a_rebound_key_and_sums_cannot():
    assert R.rebinding("delta", 64, seeds=range(3))[0] == 1.0
    linear, softmax = R.rebinding("linear", 64, seeds=range(3))[0], R.rebinding("softmax", 64, seeds=range(3))[0]
    assert 0.3 < linear < 0.7 and 0.3 < softmax < 0.7  # old and new value mixed: a coin flip


def test_capacity_is_the_last_n_above_the_threshold():
    kw = dict(seeds=range(3), d_k=16, d_v=16, vocab=256)
    n = R.capacity("delta", 0.5, hi=512, **kw)
    assert R.recall("delta", n, **kw).mean >= 0.5 > R.recall("delta", n + 1, **kw).mean
    assert R.capacity("softmax", 0.5, hi=256, **kw) is None  # holds everywhere in the sweep


def test_bad_arguments():
    with pytest.raises(ValueError, match="memory='lstm'"):
        R.recall("lstm", 4)
    with pytest.raises(ValueError, match="n_pairs"):
        R.recall("delta", 0)
    with pytest.raises(ValueError, match="seeds"):
        R.recall("delta", 4, seeds=[])
    with pytest.raises(ValueError, match="vocab"):
        R.recall("delta", 4, vocab=1)
    keys = l2_normalize(np.ones((1, 2, 4)))
    with pytest.raises(ValueError, match="memory"):
        R.read_back("rnn", keys, keys)
