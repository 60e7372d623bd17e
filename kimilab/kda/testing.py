"""Seeded random KDA inputs: the ONE generator the tests, the benchmark and chapter 2 draw from.

The kernels are exact, so they are checked on random inputs whose *gates* look like
the cases that matter: a freshly initialised Kimi layer, flash-linear-attention's
test gate, decays strong enough to force the chunk kernel's smallest blocks, and no
decay at all. The same seed always gives the same numbers (chapter 2 prints results
computed from them), whatever the dtype: everything is drawn in float64, then cast.
"""

from __future__ import annotations

import numpy as np

from kimilab.kda.gate import beta_from_logits, kda_gate, l2_normalize, sigmoid
from kimilab.validate import check_choice, check_int

__all__ = ["GATES", "PROPERTY_EXAMPLES", "random_inputs"]

# Random shapes hypothesis draws for the main property of tests/test_kda.py
# (chunked == recurrent in float64); chapter 2 prints it.
PROPERTY_EXAMPLES = 120

GATES = {
    "kimi-init": "softplus gate at Kimi's init: exp(A_log) ~ U[1, 16] per head, softplus(dt_bias) "
                 "spread geometrically over [1e-3, 1e-1] across channels, raw gate ~ N(0, 0.25)",
    "logsigmoid": "g = log(sigmoid(N(0, 1))), the gate flash-linear-attention's KDA tests draw",
    "strong": "g ~ -U[0, 20]: per-step decays down to e^-20",
    "extreme": "g ~ -U[0, 60]: forces the chunk kernel's smallest in-chunk blocks",
    "zero": "g = 0: no forgetting (the plain delta rule)",
}


def random_inputs(T: int, H: int, K: int, V: int, *, seed: int, gate: str = "kimi-init",
                  dtype=np.float64, batch: int | None = None):
    """Seeded KDA inputs in the kernels' layout: ``((q, k, v, g, beta), initial_state)``.

    q, k ``[T, H, K]`` (L2-normalised, as the layer feeds them), v ``[T, H, V]`` ~ N(0, 1),
    g ``[T, H, K]`` per ``gate`` (one of :data:`GATES`), beta ``[T, H]`` = sigmoid(N(0, 1)),
    initial_state ``[H, K, V]`` ~ N(0, 1); with ``batch`` a leading ``B`` axis on all.
    Drawn in that order from ``np.random.default_rng(seed)`` in float64, then cast to
    ``dtype`` (float32 or float64).
    """
    T = check_int("T", T, 0)
    H, K, V = (check_int(name, x, 1) for name, x in (("H", H), ("K", K), ("V", V)))
    check_choice("gate", gate, GATES)
    lead = (T, H) if batch is None else (check_int("batch", batch, 1), T, H)
    if dtype not in (np.float32, np.float64, "float32", "float64"):
        raise ValueError(f"dtype={dtype!r}: expected float32 or float64")
    r = np.random.default_rng(check_int("seed", seed, 0))
    q = l2_normalize(r.standard_normal(lead + (K,)))
    k = l2_normalize(r.standard_normal(lead + (K,)))
    v = r.standard_normal(lead + (V,))
    if gate == "kimi-init":
        dt = np.geomspace(1e-3, 1e-1, H * K)
        g = kda_gate(0.5 * r.standard_normal(lead + (K,)), np.log(r.uniform(1, 16, H)), np.log(np.expm1(dt)))
    elif gate == "logsigmoid":
        g = np.log(sigmoid(r.standard_normal(lead + (K,))))
    elif gate in ("strong", "extreme"):
        g = -r.uniform(0.0, 20.0 if gate == "strong" else 60.0, lead + (K,))
    else:
        g = np.zeros(lead + (K,))
    beta = beta_from_logits(r.standard_normal(lead))
    S0 = r.standard_normal(lead[:-2] + (H, K, V))
    return tuple(x.astype(dtype) for x in (q, k, v, g, beta)), S0.astype(dtype)
