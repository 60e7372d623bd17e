"""Speculative *sampling*: draft from q, keep the target's distribution p exactly.

Greedy verification keeps a draft when it equals the target's argmax. With sampling
(temperature > 0) the rule of Leviathan et al. and Chen et al. (2023) keeps the output
distributed exactly as if the target had sampled alone: draft x ~ q is accepted with
probability min(1, p(x) / q(x)); at the first rejection the token is drawn from the
residual max(0, p - q), renormalised; if every draft is accepted, one more token comes
from p. Then P(first token = y) = q(y) min(1, p(y)/q(y)) + (1 - sum_x min(p, q)) *
(p(y) - q(y))^+ / sum (p - q)^+ = min(q, p)(y) + (p(y) - q(y))^+ = p(y).

:func:`accept_sampled` is that rule; :func:`speculative_sample` runs it on the model with any
rollback strategy (the states stay exact: they follow the tokens kept);
:func:`first_tokens` draws the first two output tokens many times from tables of p and q,
which is how the tests and chapter 7 check the distribution against the target's own.
"""

from __future__ import annotations

import math
from typing import Sequence

import numpy as np

from kimilab.model import Model
from kimilab.speculative.loop import SpecResult, StepStats, _scratch_pool, make_rollback
from kimilab.speculative.verify import verify
from kimilab.validate import check_float, check_int

__all__ = ["softmax", "accept_sampled", "draft_sampled", "speculative_sample", "first_tokens", "chi_square"]


def softmax(logits: np.ndarray, temperature: float) -> np.ndarray:
    """Probabilities of ``logits`` [..., vocab] at ``temperature`` > 0 (max subtracted first)."""
    t = check_float("temperature", temperature, minimum=0.0)
    if t == 0.0:
        raise ValueError("temperature=0: greedy decoding has no distribution; use speculative_generate")
    z = np.asarray(logits, dtype=np.float64) / t
    z = np.exp(z - z.max(axis=-1, keepdims=True))
    return z / z.sum(axis=-1, keepdims=True)


def accept_sampled(drafts: Sequence[int], q: np.ndarray, p: np.ndarray,
                   rng: np.random.Generator) -> tuple[int, int]:
    """(j, next token): drafts d_1..d_j accepted, then one token from the residual or from p.

    ``q`` [k, vocab]: the drafter's distribution at each draft; ``p`` [k+1, vocab]: the
    target's at each window position.
    """
    for i, x in enumerate(drafts):
        if rng.random() * q[i, x] < p[i, x]:  # accept with probability min(1, p/q)
            continue
        residual = np.maximum(p[i] - q[i], 0.0)
        return i, int(rng.choice(len(residual), p=residual / residual.sum()))
    return len(drafts), int(rng.choice(p.shape[1], p=p[len(drafts)]))


def draft_sampled(draft: Model, tokens: Sequence[int], k: int, temperature: float,
                  rng: np.random.Generator) -> tuple[list[int], np.ndarray]:
    """k tokens sampled from the ``draft`` model after ``tokens``, and its distribution at each."""
    cache = draft.new_cache()
    logits = draft.prefill(list(tokens), cache)[-1]
    out, q = [], []
    for _ in range(check_int("k", k, 1)):
        dist = softmax(logits, temperature)
        out.append(int(rng.choice(len(dist), p=dist)))
        q.append(dist)
        if len(out) < k:
            logits = draft.decode(out[-1], cache)
    return out, np.array(q)


def speculative_sample(model: Model, prompt_tokens: Sequence[int], max_new_tokens: int, draft: Model, k: int,
                       temperature: float, seed: int = 0, rollback: str = "snapshot",
                       cache=None) -> SpecResult:
    """``max_new_tokens`` tokens sampled from ``model`` at ``temperature``, drafted by ``draft``:
    distributed exactly as plain sampling (not token for token: the random stream differs).
    ``cache`` (a fresh HybridCache if None) ends holding every token but the last."""
    if not isinstance(draft, Model):
        raise ValueError(f"draft: expected a kimilab.model.Model, got {type(draft).__name__}")
    max_new_tokens = check_int("max_new_tokens", max_new_tokens, 0)
    k = check_int("k", k, 1)
    rng = np.random.default_rng(check_int("seed", seed, 0))
    prompt = [int(t) for t in prompt_tokens]
    cache = model.new_cache() if cache is None else cache
    pool, _ = _scratch_pool(model, cache, rollback, k)
    strategy = make_rollback(rollback, model, pool, k)
    dist = softmax(model.prefill(prompt, cache)[-1], temperature)
    out = [int(rng.choice(len(dist), p=dist))] if max_new_tokens else []
    steps = []
    try:
        while len(out) < max_new_tokens:
            moved = strategy.moved_bytes
            drafts, q = draft_sampled(draft, prompt + out, k, temperature, rng)
            position = cache.seq_len
            logits, captures, view = verify(model, [out[-1]] + drafts, strategy.current(cache))
            strategy.save(view, captures)
            j, nxt = accept_sampled(drafts, q, softmax(logits, temperature), rng)
            new = (drafts[:j] + [nxt])[:max_new_tokens - len(out)]
            held = strategy.held_bytes
            strategy.restore(cache, len(new))
            out += new
            steps.append(StepStats(position, len(drafts), min(j, len(new)), len(new), held,
                                   pool.stats().pages_by_kind["scratch"], strategy.moved_bytes - moved,
                                   strategy.last_history, strategy.last_flush, tuple(range(len(new)))))
        strategy.finish(cache)
    finally:
        strategy.close()
    return SpecResult(out, tuple(steps), rollback, k, dict(strategy.seconds), strategy.flushes)


def first_tokens(p1: np.ndarray, q1: np.ndarray, p2: np.ndarray, q2: np.ndarray, n: int, seed: int,
                 rule=accept_sampled) -> np.ndarray:
    """``n`` draws [n, 2] of the first two output tokens of speculative sampling with k = 1, from
    tables: p1, q1 [vocab] after the prompt; p2, q2 [vocab, vocab], row x after prompt + x.

    Each draw is a whole step (draft x ~ q1, ``rule``), then, if it produced one token y1 only,
    a second step from prompt + y1 -- exactly what :func:`speculative_sample` does at k = 1.
    ``rule`` can be swapped for a broken one, to see the check catch it.
    """
    rng = np.random.default_rng(check_int("seed", seed, 0))
    vocab = len(p1)
    out = np.empty((check_int("n", n, 1), 2), dtype=np.int64)
    for r in range(n):
        x = int(rng.choice(vocab, p=q1))
        j, nxt = rule([x], q1[None], np.stack([p1, p2[x]]), rng)
        if j == 1:
            out[r] = (x, nxt)
            continue
        y = int(rng.choice(vocab, p=q2[nxt]))
        j2, z = rule([y], q2[nxt][None], np.stack([p2[nxt], p2[nxt]]), rng)  # the bonus after y is unused
        out[r] = (nxt, y if j2 == 1 else z)
    return out


def chi_square(samples: np.ndarray, probs: np.ndarray, min_expected: float = 5.0) -> tuple[float, int, float]:
    """Pearson's goodness-of-fit test of integer ``samples`` against ``probs`` [vocab]:
    (statistic, degrees of freedom, p-value).

    Cells expected to hold fewer than ``min_expected`` draws are pooled into one. The p-value
    uses the Wilson-Hilferty normal approximation of the chi-square tail (within about 1e-3
    of the exact tail for the hundred-odd degrees of freedom used here).
    """
    samples = np.asarray(samples).ravel()
    probs = np.asarray(probs, dtype=np.float64)
    n = samples.size
    counts = np.bincount(samples, minlength=len(probs)).astype(np.float64)
    expected = n * probs
    big = expected >= min_expected
    obs = np.append(counts[big], counts[~big].sum())
    exp = np.append(expected[big], expected[~big].sum())
    keep = exp > 0
    stat = float(((obs[keep] - exp[keep]) ** 2 / exp[keep]).sum())
    df = int(keep.sum()) - 1
    if df < 1:
        raise ValueError(f"samples: {n} draws fill too few cells of {min_expected:g} expected for a test")
    z = ((stat / df) ** (1 / 3) - (1 - 2 / (9 * df))) / math.sqrt(2 / (9 * df))
    return stat, df, 0.5 * math.erfc(z / math.sqrt(2))
