"""Speculative decoding over time on one deployment: tokens per step, a verify step of a whole batch,
the rollback's share of it, and the acceptance at which speculation starts to pay.

A verify step of B requests is ONE forward pass (:func:`~kimilab.costs.steptime.step_seconds`
with B chunks of n positions): its weight read -- the experts the B n tokens route to, their
union at that token count, uniform routing assumed (:class:`~kimilab.config.WeightModel`) -- is
shared; each request's rollback work is its own (:mod:`~kimilab.costs.spec_bytes`). Drafting
is taken as free (an n-gram lookup; a draft model or MTP head costs a forward of its own).

Two names for acceptance, never mixed: the per-position **acceptance probability** alpha (the
chance a draft is accepted given every draft before it was; a tree node continues the path if
any of its w children is right: 1 - (1 - alpha)^w), and the **accepted fraction** of drafts a
run measures, (tokens per step - 1) / k on a chain (:func:`accepted_fraction`).
"""

from __future__ import annotations

from functools import lru_cache
from typing import Sequence

from kimilab.config import ModelConfig
from kimilab.costs.cache_bytes import checkpoint_bytes
from kimilab.costs.deployment import Deployment
from kimilab.costs.parallel import requests_on_busiest_device, state_heads_per_device
from kimilab.costs.spec_bytes import DEFAULT_RING, ROLLBACK_STRATEGIES, lazy_cycle, mean_moved_bytes, replay_flops
from kimilab.costs.steptime import decode_step_seconds, step_seconds
from kimilab.validate import check_choice, check_float, check_int

__all__ = ["expected_tokens_per_step", "expected_tokens_per_step_tree", "accepted_fraction",
           "alpha_from_accepted_fraction", "rollback_seconds", "verify_step_seconds",
           "rollback_share", "spec_tokens_per_second", "break_even_acceptance"]


def _alpha(alpha) -> float:
    a = check_float("alpha", alpha, minimum=0.0)
    if a > 1.0:
        raise ValueError(f"alpha={alpha!r}: expected an acceptance probability in [0, 1]")
    return a


def expected_tokens_per_step(alpha: float, k: int) -> float:
    """Tokens one chain verify yields when each draft is accepted with probability ``alpha`` given
    all before it were: (1 - alpha^(k+1)) / (1 - alpha) (the accepted drafts plus the target's
    own token). The accepted fraction of drafts is (that - 1) / k."""
    a = _alpha(alpha)
    k = check_int("k", k, 0, unit="draft tokens")
    return float(k + 1) if a == 1.0 else (1.0 - a ** (k + 1)) / (1.0 - a)


def expected_tokens_per_step_tree(alphas, widths: Sequence[int]) -> float:
    """Tokens one verify of a tree yields: 1 + sum over depths d of prod_{e <= d} (1 - (1 - alpha_e)^w_e),
    ``widths[e]`` children per node at depth e, ``alphas`` one probability or one per depth. A
    chain is ``widths = (1,) * k``; a drafter whose acceptance decays with depth has falling alphas."""
    widths = [check_int(f"widths[{d}]", w, 1) for d, w in enumerate(widths)]
    if isinstance(alphas, (int, float)):
        alphas = [alphas] * len(widths)
    alphas = [_alpha(a) for a in alphas]
    if len(alphas) != len(widths):
        raise ValueError(f"alphas: expected one per depth ({len(widths)}), got {len(alphas)}")
    total, reach = 1.0, 1.0
    for a, w in zip(alphas, widths):
        reach *= 1.0 - (1.0 - a) ** w
        total += reach
    return total


def accepted_fraction(alpha: float, k: int) -> float:
    """The accepted fraction of drafts of a chain at acceptance probability ``alpha``:
    (alpha + alpha^2 + ... + alpha^k) / k."""
    k = check_int("k", k, 1, unit="draft tokens")
    return (expected_tokens_per_step(alpha, k) - 1.0) / k


def alpha_from_accepted_fraction(fraction: float, k: int) -> float:
    """The acceptance probability alpha whose chain of ``k`` drafts has this accepted fraction
    (the inverse of :func:`accepted_fraction`, by bisection to 1e-12)."""
    f = _alpha(fraction)
    lo, hi = 0.0, 1.0
    while hi - lo > 1e-12:
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if accepted_fraction(mid, k) < f else (lo, mid)
    return (lo + hi) / 2


def _shape(k: int, widths) -> tuple[int, int, bool]:
    """(depth, verified positions, is it a tree) of a chain of k or a tree of ``widths``."""
    if widths is None:
        return k, k + 1, False
    widths = [check_int(f"widths[{d}]", w, 1) for d, w in enumerate(widths)]
    nodes, level = 1, 1
    for w in widths:
        level *= w
        nodes += level
    return len(widths), nodes, any(w > 1 for w in widths)


def rollback_seconds(cfg: ModelConfig, deployment: Deployment, strategy: str, k: int, kept: int, *,
                     batch: int = 1, keep: str = "post-conv", act_bytes: int | None = None,
                     ring_len: int = DEFAULT_RING, nodes: int | None = None, tokens_per_step: float | None = None,
                     gathered: bool = False) -> float:
    """Seconds a step of ``batch`` requests spends beyond a forward pass that reads and writes each
    request's state once, ``kept`` of the verified positions kept (negative: the strategy saves).

    Its bytes moved (:func:`~kimilab.costs.spec_bytes.moved_bytes`) minus those two states, over the
    busiest device's HBM bandwidth, plus its arithmetic (replay steps; a lazy ring's history reads
    and folds) at ``kernels.replay`` of peak. A lazy ring's history and write-backs are its steady
    state (:func:`lazy_cycle`) at ``tokens_per_step`` (default ``kept``).
    """
    check_choice("strategy", strategy, ROLLBACK_STRATEGIES)
    k = check_int("k", k, 0, unit="draft tokens")
    n = k + 1 if nodes is None else check_int("nodes", nodes, k + 1, unit="verified positions, at least k+1")
    kept = check_int("kept", kept, 1, unit="positions")
    if kept > n:
        raise ValueError(f"kept={kept}: expected at most k+1={n} verified positions" if nodes is None else
                         f"kept={kept}: expected at most {n} verified positions")
    on_device = requests_on_busiest_device(check_int("batch", batch, 1), deployment)
    dev, kern = deployment.device, deployment.kernels
    bw, rate = dev.hbm_bandwidth * kern.bandwidth, dev.peak_flops * kern.replay
    S = checkpoint_bytes(cfg, deployment)
    mine, heads = state_heads_per_device(cfg, deployment)
    K = V = cfg.head_dim
    moved = mean_moved_bytes(cfg, deployment, strategy, k, kept, nodes=n, ring_len=ring_len,
                             tokens_per_step=tokens_per_step, gathered=gathered, keep=keep, act_bytes=act_bytes)
    if strategy == "lazy-ring":
        h, flushes = lazy_cycle(n, ring_len, float(kept if tokens_per_step is None else tokens_per_step))
        flops = len(cfg.kda_layers) * mine * (4 * n * h * (K + V) + flushes * 2 * h * K * V)
    else:
        flops = replay_flops(cfg, kept) * mine / heads if strategy in ("replay", "ring") else 0.0
    return on_device * ((moved - 2 * S) / bw + flops / rate)


@lru_cache(maxsize=4096)
def _forward_seconds(cfg: ModelConfig, deployment: Deployment, n: int, context_len: int, batch: int) -> float:
    """The verify's forward pass (memoised: a bisection over acceptance asks for it many times)."""
    return step_seconds(cfg, deployment, chunks=[(n, context_len)] * batch)


def verify_step_seconds(cfg: ModelConfig, deployment: Deployment, context_len: int, k: int, *,
                        batch: int = 1, strategy: str = "replay", kept: int | None = None,
                        widths: Sequence[int] | None = None, **kw) -> float:
    """One speculative step of ``batch`` requests: ONE forward pass over their verified positions
    (k+1 each, or a tree of ``widths``), then each request's rollback (``kept`` positions, default
    all of a chain's). ``k = 0`` is a plain decode step. ``kw`` goes to :func:`rollback_seconds`."""
    L = check_int("context_len", context_len, 0, unit="tokens")
    k = check_int("k", k, 0, unit="draft tokens")
    batch = check_int("batch", batch, 1)
    if k == 0:
        return decode_step_seconds(cfg, deployment, L, batch)
    depth, n, tree = _shape(k, widths)
    if depth != k:
        raise ValueError(f"widths={list(widths)}: expected k={k} depths")
    return _forward_seconds(cfg, deployment, n, L, batch) + rollback_seconds(cfg, deployment, strategy, k, depth + 1 if kept is None else kept,
                                   batch=batch, nodes=n, gathered=tree, **kw)


def rollback_share(cfg: ModelConfig, deployment: Deployment, context_len: int, k: int, strategy: str, *,
                   batch: int = 1, kept: int | None = None, **kw) -> float:
    """The rollback's share of a verify step (negative when the strategy makes the step cheaper
    than a forward that writes every state once)."""
    kept = k + 1 if kept is None else kept
    total = verify_step_seconds(cfg, deployment, context_len, k, batch=batch, strategy=strategy, kept=kept, **kw)
    kw.pop("widths", None)
    return rollback_seconds(cfg, deployment, strategy, k, kept, batch=batch, **kw) / total


def spec_tokens_per_second(cfg: ModelConfig, deployment: Deployment, context_len: int, k: int, alpha: float,
                           strategy: str = "replay", *, batch: int = 1, decay: float = 1.0,
                           widths: Sequence[int] | None = None, **kw) -> float:
    """One request's expected tokens per second with speculative decoding in a batch of ``batch``:
    expected tokens per step over :func:`verify_step_seconds`. Acceptance probability ``alpha`` at
    depth 1, times ``decay`` per further depth; a chain of k, or a tree of ``widths``."""
    a = _alpha(alpha)
    if k == 0:
        return 1.0 / decode_step_seconds(cfg, deployment, check_int("context_len", context_len, 0), batch)
    depth = k if widths is None else len(widths)
    tokens = expected_tokens_per_step_tree([a * decay ** d for d in range(depth)],
                                           (1,) * k if widths is None else widths)
    kept = max(1, min(depth + 1, int(round(tokens))))
    return tokens / verify_step_seconds(cfg, deployment, context_len, k, batch=batch, strategy=strategy, kept=kept,
                                        widths=widths, tokens_per_step=tokens, **kw)


def break_even_acceptance(cfg: ModelConfig, deployment: Deployment, context_len: int, k: int,
                          strategy: str = "replay", *, batch: int = 1, **kw) -> float | None:
    """The acceptance probability ``alpha`` above which speculation beats plain decoding at this
    batch (bisection, to 1e-4); None if even alpha = 1 does not pay."""
    plain = spec_tokens_per_second(cfg, deployment, context_len, 0, 0.0, batch=batch)
    if spec_tokens_per_second(cfg, deployment, context_len, k, 1.0, strategy, batch=batch, **kw) <= plain:
        return None
    lo, hi = 0.0, 1.0
    while hi - lo > 1e-4:
        mid = (lo + hi) / 2
        if spec_tokens_per_second(cfg, deployment, context_len, k, mid, strategy, batch=batch, **kw) > plain:
            hi = mid
        else:
            lo = mid
    return hi
