"""Inputs where the transition M flushes, inputs where it lives, and how long it lives.

A slice's transition ``M = prod_t (I - b_t k_t k_t^T) Diag(a_t)`` shrinks along every key
direction the slice writes (the delta rule) and along every channel the gate decays.
With random unit keys the writes cover all K directions, so M dies within a few thousand
tokens whatever the gate ("flushed": rank r's entering state is then just rank r-1's C).
With keys in an r-dimensional subspace (trained models' keys are low-rank, Loki,
arXiv:2406.02542) the other K - r directions are only decayed by the gate; with a slow
gate M survives the whole prompt ("living"). :func:`regime_inputs` draws both kinds;
:func:`m_lifetime` measures the largest entry of M as a slice grows.
"""

from __future__ import annotations

import functools

import numpy as np

from kimilab.kda import compose_transitions, l2_normalize, segment_transition
from kimilab.kda.testing import GATES, random_inputs
from kimilab.validate import check_choice, check_int

__all__ = ["KEYS", "REGIMES", "SLOW_RATES", "regime_inputs", "m_lifetime", "lifetime_tokens", "regime_lifetimes"]

KEYS = {"random": "unit keys drawn uniformly on the sphere: every direction gets written",
        "low-rank": "unit keys in a fixed random subspace of `key_rank` dimensions per head (default K / 4)"}
SLOW_RATES = (1e-6, 1e-4)  # per-token decay rates of the "slow" gate: time constants 10^4 .. 10^6 tokens
REGIMES = {
    "flushed": ("random", "kimi-init"),  # the book's old benchmark: M is gone within ~2K tokens
    "living": ("low-rank", "slow"),  # keys in K/4 dims (16 of 64) and a slow gate: M outlives any prompt here
}


def regime_inputs(T: int, H: int, K: int, V: int, *, seed: int, regime: str | None = None, keys: str = "random",
                  gate: str = "kimi-init", key_rank: int | None = None, dtype=np.float64):
    """Seeded KDA inputs ``((q, k, v, g, beta), S0)`` of a named ``regime`` (or of ``keys`` and ``gate``).

    ``gate`` is one of ``kda.testing.GATES`` or ``"slow"``: g = -rate per channel, the rates
    spread geometrically over :data:`SLOW_RATES` and jittered x U(0.5, 1.5) per token. q, v,
    beta and S0 are ``random_inputs``' (same seed); only k and g change.
    """
    if regime is not None:
        keys, gate = REGIMES[check_choice("regime", regime, REGIMES)]
    check_choice("keys", keys, KEYS)
    check_choice("gate", gate, {**GATES, "slow": "slow decay"})
    key_rank = max(1, K // 4) if key_rank is None else check_int("key_rank", key_rank, 1)
    if keys == "low-rank" and key_rank > K:
        raise ValueError(f"key_rank={key_rank}: expected at most K={K}")
    (q, k, v, g, beta), S0 = random_inputs(T, H, K, V, seed=seed, gate="zero" if gate == "slow" else gate)
    r = np.random.default_rng([check_int("seed", seed, 0), 9])
    if keys == "low-rank":
        basis = np.linalg.qr(r.standard_normal((H, K, key_rank)))[0]  # [H, K, r] orthonormal columns
        k = l2_normalize(np.einsum("thr,hkr->thk", r.standard_normal((T, H, key_rank)), basis))
    if gate == "slow":
        rates = np.geomspace(*SLOW_RATES, H * K).reshape(H, K)
        g = -rates * r.uniform(0.5, 1.5, (T, H, K))
    return tuple(np.asarray(x, dtype=dtype) for x in (q, k, v, g, beta)), np.asarray(S0, dtype=dtype)


def m_lifetime(k, v, g, beta, block: int = 256, chunk_size: int = 64):
    """Largest ``|entry|`` of M after the first block, 2 blocks, ...: ``(tokens [n], max_entry [n])``.

    Each block's transition is computed once (``kda.segment_transition`` over all blocks at
    once) and composed in order, so this is O(T) and exact.
    """
    k, v, g, beta = (np.asarray(x) for x in (k, v, g, beta))
    T = k.shape[0]
    block = check_int("block", block, 1)
    n = T // block
    if n < 1:
        raise ValueError(f"block={block}: expected at most T={T} tokens")
    cut = [x[: n * block].reshape((n, block) + x.shape[1:]) for x in (k, v, g, beta)]
    Ms, Cs = segment_transition(*cut, chunk_size=chunk_size)  # [n, H, K, K], one per block
    total, out = (Ms[0], Cs[0]), [float(np.abs(Ms[0]).max())]
    for i in range(1, n):
        total = compose_transitions(total, (Ms[i], Cs[i]))
        out.append(float(np.abs(total[0]).max()))
    return np.arange(1, n + 1) * block, np.array(out)


def lifetime_tokens(tokens, max_entry, level: float = 1e-10) -> int | None:
    """The first token count at which M's largest entry is below ``level`` (None: it never is).

    1e-10 is the float32 chunk kernel's flush level: below it the kernel sets M to 0.
    """
    below = np.flatnonzero(np.asarray(max_entry) < level)
    return int(np.asarray(tokens)[below[0]]) if below.size else None


@functools.lru_cache(maxsize=8)
def regime_lifetimes(T: int, H: int, K: int, *, seed: int, V: int = 8, block: int = 256) -> dict:
    """M's lifetime for every kind of keys and gate: ``{(keys, gate): (tokens, max_entry)}``.

    For each of :data:`KEYS` with Kimi's gate at initialisation and with the slow gate, in that
    order: :func:`regime_inputs` of ``T`` tokens, then :func:`m_lifetime` over ``block``-token
    blocks. Memoised (chapter 9's key results and its lifetime plot share one computation), so
    the returned arrays are read-only.
    """
    out = {}
    for keys in KEYS:
        for gate in ("kimi-init", "slow"):
            (_, k, v, g, beta), _ = regime_inputs(T, H, K, V, seed=seed, keys=keys, gate=gate)
            tokens, top = m_lifetime(k, v, g, beta, block=block)
            for a in (tokens, top):
                a.setflags(write=False)
            out[keys, gate] = (tokens, top)
    return out
