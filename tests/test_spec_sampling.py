"""Speculative sampling keeps the target's distribution: a chi-square test on the reduced model.

The target is the tiny model, the drafter a 2-layer model with other weights (they disagree: the
total-variation distance between their next-token distributions is about 0.8). 20,000 draws of
the first two output tokens, seed 0: the correct rule must pass Pearson's test at p > 0.001 on
both tokens' distributions; a broken rule (keep every draft) must fail it at p < 1e-9. The seed
is fixed, so the result is the same on every run: not flaky.
"""

import numpy as np
import pytest

from kimilab import speculative as spec
from kimilab.config import tiny
from kimilab.model import HybridCache, Model
from kimilab.speculative import sampling

T = 0.5  # temperature: the most likely first token has about 6% of the mass
PROMPT = list(range(10, 40))


@pytest.fixture(scope="module")
def tables(tiny_model):
    draft = Model(tiny.with_(name="tiny-draft", layer_pattern="KA"), seed=1)

    def of(model):
        cache = model.new_cache()
        p1 = sampling.softmax(model.prefill(PROMPT, cache)[-1], T)
        p2 = np.stack([sampling.softmax(model.decode(x, cache.clone()), T) for x in range(tiny.vocab_size)])
        return p1, p2

    (p1, p2), (q1, q2) = of(tiny_model), of(draft)
    return p1, q1, p2, q2


def _always_accept(drafts, q, p, rng):
    return len(drafts), int(rng.choice(p.shape[1], p=p[len(drafts)]))


def test_speculative_sampling_keeps_the_target_distribution(tables):
    p1, q1, p2, q2 = tables
    assert 0.5 * np.abs(p1 - q1).sum() > 0.5  # the drafter is far from the target
    draws = sampling.first_tokens(p1, q1, p2, q2, 20_000, seed=0)
    _, df, p_first = sampling.chi_square(draws[:, 0], p1)
    _, _, p_second = sampling.chi_square(draws[:, 1], p1 @ p2)  # the second token's marginal
    assert df > 100 and p_first > 1e-3 and p_second > 1e-3
    broken = sampling.first_tokens(p1, q1, p2, q2, 20_000, seed=0, rule=_always_accept)
    assert sampling.chi_square(broken[:, 0], p1)[2] < 1e-9
    assert sampling.chi_square(broken[:, 1], p1 @ p2)[2] < 1e-9


def test_chi_square_against_a_known_case():
    rng = np.random.default_rng(0)
    probs = np.full(50, 1 / 50)
    stat, df, p = sampling.chi_square(rng.integers(0, 50, 10_000), probs)
    assert df == 49 and 0.01 < p < 0.99
    _, _, p_bad = sampling.chi_square(rng.integers(0, 40, 10_000), probs)
    assert p_bad < 1e-12
    with pytest.raises(ValueError, match="samples"):
        sampling.chi_square(np.zeros(3, dtype=int), probs)


@pytest.mark.parametrize("rollback", spec.EXACT_ROLLBACKS)
def test_speculative_sample_keeps_exact_states(tiny_model, rollback):
    """Whatever was sampled, the cache ends exactly where plain decoding of the same tokens ends."""
    draft = Model(tiny.with_(name="tiny-draft", layer_pattern="KA"), seed=1)
    cache = HybridCache(tiny)
    r = sampling.speculative_sample(tiny_model, PROMPT, 9, draft, 3, 1.0, seed=4, rollback=rollback, cache=cache)
    assert len(r.tokens) == 9 and r.steps
    ref = HybridCache(tiny)
    tiny_model.prefill(PROMPT + r.tokens[:-1], ref)
    assert cache.seq_len == ref.seq_len
    for i in tiny.kda_layers:
        assert np.max(np.abs(cache.kda_state(i) - ref.kda_state(i))) <= 1e-10
        assert np.max(np.abs(cache.conv_state(i) - ref.conv_state(i))) <= 1e-10
    with pytest.raises(ValueError, match="temperature=0"):
        sampling.softmax(np.zeros(3), 0.0)


def test_accept_sampled_rule():
    rng = np.random.default_rng(1)
    p = np.array([[0.5, 0.5, 0.0], [0.2, 0.3, 0.5]])
    q = np.array([[1.0, 0.0, 0.0]])
    counts = np.zeros(3)
    for _ in range(4000):
        j, t = spec.sampling.accept_sampled([0], q, p, rng)
        counts[0 if j == 1 else t] += 1  # the first output token
    assert counts[2] == 0 and counts / counts.sum() == pytest.approx([0.5, 0.5, 0.0], abs=0.03)
