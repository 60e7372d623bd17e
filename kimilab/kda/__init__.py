"""Kimi Delta Attention (KDA): gates, the recurrent and chunkwise kernels, segment maps.

Per head the state ``S`` is a K x V matrix. Each token first decays every key-row of
``S`` by its own gate ``exp(g_t)`` (a vector, one value per key channel), then applies
a delta-rule correction with strength ``beta_t``; the output reads the updated state::

    S <- diag(exp(g_t)) S
    S <- S + beta_t k_t (v_t - S^T k_t)^T
    o_t = S^T (scale q_t)

Layouts follow flash-linear-attention: q, k, g ``[T, H, K]``; v ``[T, H, V]``;
beta ``[T, H]``; state ``[H, K, V]``; an optional leading batch axis ``B`` on all of
them. ``recurrent_kda`` is the slow, obvious loop over time; ``chunk_kda`` is the
chunkwise (UT-transform) form that does the same arithmetic with matrix products.
A whole segment acts on the state as an affine map ``S_out = M S_in + C``
(``segment_transition``): that is what splitting a sequence across workers needs.
"""

from __future__ import annotations

import math

import numpy as np

__all__ = [
    "l2_normalize",
    "softplus",
    "sigmoid",
    "kda_gate",
    "kda_gate_lowerbound",
    "beta_from_logits",
    "recurrent_kda",
    "kda_step",
    "chunk_kda",
    "unit_lower_inverse",
    "segment_transition",
    "apply_transition",
    "compose_transitions",
    "identity_transition",
    "linear_attention_state",
    "state_bytes",
    "recurrent_kda_flops",
    "chunk_kda_flops",
]

_FLOAT_DTYPES = (np.dtype(np.float32), np.dtype(np.float64))


# ----------------------------------------------------------------------------- checks


def _float_array(name: str, x, expected_dtype: np.dtype | None = None, ref: str = "q") -> np.ndarray:
    """``x`` as an ndarray of float32/float64 (and of ``expected_dtype`` when given)."""
    arr = np.asarray(x)
    if arr.dtype not in _FLOAT_DTYPES:
        raise ValueError(f"{name}: expected dtype float32 or float64, got {arr.dtype}")
    if expected_dtype is not None and arr.dtype != expected_dtype:
        raise ValueError(f"{name}: expected dtype {expected_dtype} (matching {ref}), got {arr.dtype}")
    return arr


def _describe(names: str, sizes: dict[str, int]) -> str:
    """'[T, H, K]' -> '[T, H, K]' and the sizes string 'T=8, H=2, K=16'."""
    return ", ".join(f"{n}={sizes[n]}" for n in names.split())


def _check_shape(name: str, arr: np.ndarray, names: str, sizes: dict[str, int], ref: str, ref_names: str) -> None:
    expected = tuple(sizes[n] for n in names.split())
    if arr.shape != expected:
        layout = "[" + ", ".join(names.split()) + "]"
        ref_layout = "[" + _describe(ref_names, sizes) + "]"
        raise ValueError(f"{name}: expected {layout} matching {ref} {ref_layout}, got shape {arr.shape}")


def _check_sequence(q, k, v, g, beta, initial_state, *, ref: str = "q"):
    """Validate a sequence call. Returns arrays (batched: leading B added) and sizes.

    ``ref`` names the array that fixes the layout ("q" for the kernels, "k" when
    no query is involved). ``q`` may be None when ``ref == "k"``.
    """
    first = q if ref == "q" else k
    first = _float_array(ref, first)
    if first.ndim not in (3, 4):
        raise ValueError(f"{ref}: expected [T, H, K] or [B, T, H, K], got shape {first.shape}")
    batched = first.ndim == 4
    if batched:
        B, T, H, K = first.shape
    else:
        (T, H, K), B = first.shape, 1
    sizes = {"B": B, "T": T, "H": H, "K": K}
    pre = "B " if batched else ""
    ref_names = pre + "T H K"
    if H < 1 or K < 1:
        raise ValueError(f"{ref}: expected H >= 1 and K >= 1, got shape {first.shape}")
    dtype = first.dtype
    arrays = {}
    for name, x in (("q", q), ("k", k), ("g", g)):
        if x is None and name == "q" and ref == "k":
            continue
        arr = _float_array(name, x, dtype, ref)
        _check_shape(name, arr, ref_names, sizes, ref, ref_names)
        arrays[name] = arr
    v = _float_array("v", v, dtype, ref)
    if v.ndim != len(ref_names.split()) or v.shape[:-1] != tuple(sizes[n] for n in (pre + "T H").split()):
        layout = "[" + ", ".join((pre + "T H V").split()) + "]"
        raise ValueError(
            f"v: expected {layout} matching {ref} [{_describe(ref_names, sizes)}], got shape {v.shape}"
        )
    V = v.shape[-1]
    if V < 1:
        raise ValueError(f"v: expected V >= 1, got shape {v.shape}")
    sizes["V"] = V
    beta = _float_array("beta", beta, dtype, ref)
    _check_shape("beta", beta, pre + "T H", sizes, ref, ref_names)
    if initial_state is not None:
        initial_state = _float_array("initial_state", initial_state, dtype, ref)
        _check_shape("initial_state", initial_state, pre + "H K V", sizes, ref, ref_names + " V")
    if not batched:
        arrays = {n: a[None] for n, a in arrays.items()}
        v, beta = v[None], beta[None]
        if initial_state is not None:
            initial_state = initial_state[None]
    return arrays.get("q"), arrays["k"], v, arrays["g"], beta, initial_state, batched, (B, T, H, K, V), dtype


def _resolve_scale(scale, K: int) -> float:
    if scale is None:
        return K**-0.5
    value = float(scale)
    if not math.isfinite(value):
        raise ValueError(f"scale: expected a finite number (default K**-0.5), got {scale!r}")
    return value


def _check_chunk_size(chunk_size) -> int:
    if isinstance(chunk_size, bool) or not isinstance(chunk_size, (int, np.integer)) or chunk_size < 1:
        raise ValueError(f"chunk_size: expected a positive int (default 64), got {chunk_size!r}")
    return int(chunk_size)


# ----------------------------------------------------------------------------- gates


def l2_normalize(x, eps: float = 1e-6) -> np.ndarray:
    """``x / sqrt(sum(x**2) + eps)`` over the last axis (how KDA normalises q and k)."""
    x = _float_array("x", x)
    return x / np.sqrt(np.sum(x * x, axis=-1, keepdims=True) + eps)


def softplus(x) -> np.ndarray:
    """``log(1 + exp(x))`` without overflow."""
    return np.logaddexp(0.0, x).astype(np.asarray(x).dtype, copy=False)


def sigmoid(x) -> np.ndarray:
    """``1 / (1 + exp(-x))`` without overflow for large |x|."""
    x = np.asarray(x)
    e = np.exp(-np.abs(x))
    return np.where(x >= 0, 1.0 / (1.0 + e), e / (1.0 + e)).astype(x.dtype, copy=False)


def _gate_params(raw, A_log, dt_bias, *, allow_no_A: bool):
    raw = _float_array("raw", raw)
    if raw.ndim < 2:
        raise ValueError(f"raw: expected [..., H, K], got shape {raw.shape}")
    H, K = raw.shape[-2:]
    A = None
    if A_log is not None:
        A = _float_array("A_log", A_log)
        if A.size != H or A.ndim > 2:
            raise ValueError(f"A_log: expected [H] with H={H} (from raw [..., H={H}, K={K}]), got shape {A.shape}")
        A = A.reshape(H, 1).astype(raw.dtype)
    elif not allow_no_A:
        raise ValueError(f"A_log: expected [H] with H={H}, got None")
    x = raw
    if dt_bias is not None:
        bias = _float_array("dt_bias", dt_bias)
        if bias.shape not in ((H * K,), (H, K)):
            raise ValueError(
                f"dt_bias: expected [H*K]={H * K} or [H, K]=({H}, {K}) (from raw [..., H={H}, K={K}]), "
                f"got shape {bias.shape}"
            )
        x = raw + bias.reshape(H, K).astype(raw.dtype)
    return x, A


def kda_gate(raw, A_log, dt_bias=None) -> np.ndarray:
    """Softplus gate ``g = -exp(A_log[h]) * softplus(raw + dt_bias)`` (natural-log decay, <= 0).

    raw ``[..., H, K]`` (the low-rank gate projection of x), A_log ``[H]``,
    dt_bias ``[H*K]`` or ``[H, K]`` (optional). Output dtype follows ``raw``.
    """
    x, A = _gate_params(raw, A_log, dt_bias, allow_no_A=False)
    return (-np.exp(A) * softplus(x)).astype(x.dtype, copy=False)


def kda_gate_lowerbound(raw, A_log, dt_bias=None, lower_bound: float = -5.0) -> np.ndarray:
    """Bounded gate ``g = lower_bound * sigmoid(exp(A_log[h]) * (raw + dt_bias))``, in (lb, 0).

    ``A_log`` may be None (then no per-head scale). ``lower_bound`` in [-5, 0).
    """
    lb = float(lower_bound)
    if not -5.0 <= lb < 0.0:
        raise ValueError(f"lower_bound: expected a float in [-5, 0), got {lower_bound!r}")
    x, A = _gate_params(raw, A_log, dt_bias, allow_no_A=True)
    if A is not None:
        x = np.exp(A) * x
    return (lb * sigmoid(x)).astype(x.dtype, copy=False)


def beta_from_logits(b) -> np.ndarray:
    """Delta-rule strength ``beta = sigmoid(b)`` in (0, 1)."""
    return sigmoid(_float_array("b", b))


# ----------------------------------------------------------------------------- recurrent


def _recurrent_update(S, q_t, k_t, v_t, decay_t, beta_t, scale):
    """One token, in place on S [B, H, K, V]; returns o [B, H, V]. Shared by loop and step."""
    S *= decay_t[..., :, None]
    kS = np.matmul(k_t[..., None, :], S)[..., 0, :]  # S^T k   [B, H, V]
    S += (beta_t[..., None] * k_t)[..., :, None] * (v_t - kS)[..., None, :]
    return np.matmul((scale * q_t)[..., None, :], S)[..., 0, :]


def recurrent_kda(q, k, v, g, beta, scale=None, initial_state=None):
    """Token-by-token KDA (the reference). Returns ``(o [.., T, H, V], final_state [.., H, K, V])``.

    Vectorised over batch and heads; the only Python loop is over time.
    """
    q, k, v, g, beta, S0, batched, (B, T, H, K, V), dtype = _check_sequence(q, k, v, g, beta, initial_state)
    scale = _resolve_scale(scale, K)
    S = np.zeros((B, H, K, V), dtype) if S0 is None else S0.astype(dtype, copy=True)
    decay = np.exp(g)
    o = np.empty((B, T, H, V), dtype)
    for t in range(T):
        o[:, t] = _recurrent_update(S, q[:, t], k[:, t], v[:, t], decay[:, t], beta[:, t], scale)
    if not batched:
        return o[0], S[0]
    return o, S


def kda_step(q, k, v, g, beta, state, scale=None):
    """One decode token. q, k, g ``[H, K]``; v ``[H, V]``; beta ``[H]``; state ``[H, K, V]``
    (or all with a leading B). Returns ``(o [.., H, V], new_state)``; ``state`` is not modified.
    """
    q = _float_array("q", q)
    if q.ndim not in (2, 3):
        raise ValueError(f"q: expected [H, K] or [B, H, K] for one decode token, got shape {q.shape}")
    batched = q.ndim == 3
    pre = "B " if batched else ""
    sizes = dict(zip((pre + "H K").split(), q.shape))
    ref = pre + "H K"
    dtype = q.dtype
    k = _float_array("k", k, dtype)
    g = _float_array("g", g, dtype)
    _check_shape("k", k, ref, sizes, "q", ref)
    _check_shape("g", g, ref, sizes, "q", ref)
    v = _float_array("v", v, dtype)
    if v.ndim != q.ndim or v.shape[:-1] != q.shape[:-1] or v.shape[-1] < 1:
        layout = "[" + ", ".join((pre + "H V").split()) + "]"
        raise ValueError(f"v: expected {layout} matching q [{_describe(ref, sizes)}], got shape {v.shape}")
    sizes["V"] = v.shape[-1]
    beta = _float_array("beta", beta, dtype)
    _check_shape("beta", beta, pre + "H", sizes, "q", ref)
    if state is None:
        raise ValueError(f"state: expected [{', '.join((pre + 'H K V').split())}], got None")
    state = _float_array("state", state, dtype)
    _check_shape("state", state, pre + "H K V", sizes, "q", ref + " V")
    if not batched:
        q, k, v, g, beta, state = (x[None] for x in (q, k, v, g, beta, state))
    K = q.shape[-1]
    scale = _resolve_scale(scale, K)
    S = state.astype(dtype, copy=True)
    o = _recurrent_update(S, q, k, v, np.exp(g), beta, scale)
    if not batched:
        return o[0], S[0]
    return o, S


# ----------------------------------------------------------------------------- chunkwise

# Largest spread (max - min) of the cumulative gate G inside one block of a chunk; see
# _block_sizes. Every in-block gate factor then lies in [e^-limit, e^limit], and so
# does the discarded upper triangle of a diagonal block.
_EXP_LIMIT = {np.dtype(np.float32): 60.0, np.dtype(np.float64): 300.0}
# Whole decays exp(G_x - G_y) below this level are set to exactly 0 (float32: 1e-10, far
# below float32 rounding; float64: sqrt(tiny) ~ 1e-154). That changes any result by less
# than the level times |k| |v|, and keeps subnormal numbers out of the matmuls: BLAS runs
# several times slower when whole rows of tiny values meet.
_FLUSH = {np.dtype(np.float32): 1e-10, np.dtype(np.float64): float(np.sqrt(np.finfo(np.float64).tiny))}
_SOLVE_BLOCK = 16  # diagonal block size of the triangular solve (see _unit_lower_solve)
_SLAB = 64  # chunk-heads prepared together (see _slabs)


def _flush(x: np.ndarray) -> np.ndarray:
    """Set entries of the non-negative decay factor ``x`` below _FLUSH to 0, in place."""
    x *= x >= _FLUSH[x.dtype]
    return x


def unit_lower_inverse(L: np.ndarray) -> np.ndarray:
    """``(I + L)^-1`` for strictly lower-triangular ``L [..., n, n]``, batched.

    Bottom-up block doubling, in place: the inverse of [[A, 0], [B, D]] is
    [[A^-1, 0], [-D^-1 B A^-1, D^-1]]. Starting from 1x1 diagonal blocks (ones),
    each level fills the lower-left quarter of every 2b x 2b diagonal block with
    two batched matmuls, so the whole inverse is ~2 log2(n) numpy calls and
    ~n^3/3 multiply-adds. n is padded to a power of two with zeros (identity rows),
    which does not change the top-left n x n block of the inverse.
    (``chunk_kda`` never forms the inverse; it solves with ``_unit_lower_solve``.)
    """
    L = np.asarray(L)
    if L.ndim < 2 or L.shape[-1] != L.shape[-2]:
        raise ValueError(f"L: expected [..., n, n], got shape {L.shape}")
    n = L.shape[-1]
    lead = L.shape[:-2]
    m = 1 << max(0, (n - 1).bit_length())
    F = int(np.prod(lead, dtype=np.int64))
    if m == n:
        Lp = np.ascontiguousarray(L).reshape(F, n, n)
    else:
        Lp = np.zeros((F, m, m), L.dtype)
        Lp[:, :n, :n] = L.reshape(F, n, n)
    X = np.zeros((F, m, m), L.dtype)
    X.reshape(F, m * m)[:, :: m + 1] = 1
    b = 1
    while b < m:
        w = 2 * b

        def diag_blocks(a, writeable=False):
            fs, rs, cs = a.strides
            return np.lib.stride_tricks.as_strided(
                a, shape=(F, m // w, w, w), strides=(fs, w * (rs + cs), rs, cs), writeable=writeable
            )

        Xd = diag_blocks(X, writeable=True)
        lower = np.matmul(diag_blocks(Lp)[:, :, b:, :b], Xd[:, :, :b, :b])
        np.negative(np.matmul(Xd[:, :, b:, b:], lower), out=lower)
        Xd[:, :, b:, :b] = lower
        b = w
    return X.reshape(lead + (m, m))[..., :n, :n]


def _small_unit_lower_inverse(L: np.ndarray) -> np.ndarray:
    """``(I + L)^-1`` for a stack of small strictly lower ``L [M, b, b]``, by rows.

    Row i of the inverse is ``e_i - L[i, :i] X[:i]``: b - 1 batched products, each over
    all M blocks at once. Cheap for b <= 16 (what ``_unit_lower_solve`` feeds it).
    """
    M, b, _ = L.shape
    X = np.zeros_like(L)
    X.reshape(M, b * b)[:, :: b + 1] = 1
    minus_L = np.negative(L)
    for i in range(1, b):
        np.matmul(minus_L[:, i : i + 1, :i], X[:, :i, :i], out=X[:, i : i + 1, :i])
    return X


def _unit_lower_solve(L: np.ndarray, R: np.ndarray, block: int = _SOLVE_BLOCK) -> np.ndarray:
    """``X = (I + L)^-1 R`` for strictly lower-triangular ``L [F, n, n]`` and ``R [F, n, m]``.

    Block forward substitution: invert all the small diagonal blocks at once, then
    ``X_b = D_b^-1 (R_b - L[b, :b] X[:b])`` block row by block row -- about 2 n / block
    batched products and half the multiply-adds of forming the inverse and then
    multiplying by it. (A generic batched np.linalg.solve is far slower at this size;
    ``make bench`` times the candidates.) n is zero-padded to a multiple of the block.
    """
    F, n, _ = L.shape
    block = max(1, min(block, n))
    nb = -(-n // block)
    if nb * block != n:  # zero padding adds identity rows and leaves the first n rows of X alone
        Lp = np.zeros((F, nb * block, nb * block), L.dtype)
        Lp[:, :n, :n] = L
        Rp = np.zeros((F, nb * block, R.shape[-1]), R.dtype)
        Rp[:, :n] = R
        return _unit_lower_solve(Lp, Rp, block)[:, :n]
    blocks = range(nb)
    diag = L.reshape(F, nb, block, nb, block)[:, blocks, :, blocks]  # [nb, F, block, block]
    inv_diag = _small_unit_lower_inverse(diag.reshape(nb * F, block, block)).reshape(nb, F, block, block)
    X = np.empty(R.shape, np.result_type(L, R))
    for b in blocks:
        rows = slice(b * block, (b + 1) * block)
        rhs = R[:, rows]
        if b:
            rhs = rhs - np.matmul(L[:, rows, : b * block], X[:, : b * block])
        np.matmul(inv_diag[b], rhs, out=X[:, rows])
    return X


def _block_sizes(G: np.ndarray, C: int, decaying: bool) -> np.ndarray:
    """Per chunk, the largest block size s (a divisor of C) whose factored scores are safe.

    Inside a block of s rows the score exponent is split around the block's first row r:
    exp(G_i - G_j) = exp(G_i - G_r) * exp(G_r - G_j). Both factors, and the discarded
    products above the diagonal, stay within e^(+-spread), the spread being max - min of
    G over the block. We take the largest s whose every block spread is <= _EXP_LIMIT,
    so nothing overflows. Strong gates shrink s; s = 1 (spread 0) is always safe.
    ``decaying`` (all g <= 0: G falls) makes the spread just first minus last.
    G [F, C, K] -> int array [F].
    """
    F, _, K = G.shape
    limit = _EXP_LIMIT[G.dtype]
    sizes = np.ones(F, dtype=np.int64)
    open_ = np.ones(F, dtype=bool)
    for s in (d for d in range(C, 1, -1) if C % d == 0):
        if decaying:
            spread = G[:, ::s] - G[:, s - 1 :: s]
        else:
            blocks = G.reshape(F, C // s, s, K)
            spread = blocks.max(axis=2) - blocks.min(axis=2)
        fits = open_ & (spread.max(axis=(1, 2), initial=0.0) <= limit)
        sizes[fits] = s
        open_ &= ~fits
        if not open_.any():
            break
    return sizes


def _pick_block(G: np.ndarray, C: int, decaying: bool) -> int:
    """The smallest per-chunk block size (what the strongest gate forces)."""
    return int(_block_sizes(G, C, decaying).min(initial=C))


def _chunk_terms(kc, kb, qc, G, s: int, out: dict) -> None:
    """The state-independent terms of chunks sharing block size s, written into ``out``.

    kc = k, kb = beta k, qc = scaled q (None: no queries), G [F, C, K]. Fills
    "L" ~ diag(beta) Akk and "Aqk" [F, C, C] on and below the diagonal blocks (zero-
    initialised; the caller masks them to strictly lower / lower); "kg" = beta k exp(G),
    "qg" = q exp(G), "kd" = k exp(G_C - G) [F, C, K]; "a_last" = exp(G_C) [F, K].

    Scores are products of factors from ONE full-size exp: row i of block b carries
    exp(G_i - G_r) (r = first row of b), column j carries exp(G_r - G_j), which is
    1 / exp(G_j - G_r) inside the block and exp(G_r - G_r') exp(G_r' - G_j) for an
    earlier block b' (first row r'). Each row block is then one batched matmul over
    all its causal columns. Whole decays exp(G_x - G_y) are flushed (see _FLUSH).
    """
    F, C, K = G.shape
    nb = C // s
    blocks = G.reshape(F, nb, s, K)
    first = blocks[:, :, :1]  # [F, nb, 1, K]
    left = np.subtract(blocks, first).reshape(F, C, K)
    np.exp(left, out=left)  # exp(G_i - G_r), in [e^-limit, e^limit]
    own = np.reciprocal(left)  # exp(G_r - G_j)

    def decay(factor_full, factor_block, rows=slice(None)):
        """factor_full * factor_block (broadcast over each block's rows), flushed: a whole decay."""
        n = factor_full[:, rows].shape[1] // s
        return _flush(np.multiply(factor_full[:, rows].reshape(F, n, s, K), factor_block).reshape(F, n * s, K))

    exp_G = decay(left, np.exp(first))  # exp(G_i)
    np.multiply(kb, exp_G, out=out["kg"])
    np.multiply(kc, decay(own, np.exp(G[:, None, -1:] - first)), out=out["kd"])  # k_j exp(G_C - G_j)
    _flush(np.exp(G[:, -1], out=out["a_last"]))
    k_left, k_own = kb * left, kc * own
    q_left = None
    if qc is not None:
        np.multiply(qc, exp_G, out=out["qg"])
        q_left = qc * left
    for b in range(nb):
        lo, hi = b * s, (b + 1) * s
        if b == 0:
            right = k_own[:, :hi]
        else:  # earlier blocks b': k_j exp(G_r' - G_j) exp(G_r - G_r')
            right = np.empty((F, hi, K), G.dtype)
            np.multiply(kc[:, :lo], decay(own, np.exp(first[:, b : b + 1] - first[:, :b]), slice(0, lo)),
                        out=right[:, :lo])
            right[:, lo:] = k_own[:, lo:hi]
        right_T = right.swapaxes(-1, -2)
        np.matmul(k_left[:, lo:hi], right_T, out=out["L"][:, lo:hi, :hi])
        if qc is not None:
            np.matmul(q_left[:, lo:hi], right_T, out=out["Aqk"][:, lo:hi, :hi])


def _slab(x: np.ndarray, c0: int, c1: int, C: int) -> np.ndarray:
    """Chunks c0..c1-1 of x [B, T, H, D] as a chunk-major stack [(c1-c0)*B*H, C, D].

    Zero-padded past T (padded steps: k = v = beta = g = 0 leave the state untouched).
    """
    B, T, H, D = x.shape
    n = c1 - c0
    seg = x[:, c0 * C : c1 * C]
    if seg.shape[1] < n * C:
        seg = np.concatenate([seg, np.zeros((B, n * C - seg.shape[1], H, D), x.dtype)], axis=1)
    # Always a fresh copy (callers work on it in place, and must never touch the inputs).
    return seg.reshape(B, n, C, H, D).transpose(1, 0, 3, 2, 4).copy().reshape(n * B * H, C, D)


def _prepare_slab(q, k, v, G_all, beta, c0, c1, C, scale, decaying: bool, need_output: bool) -> dict:
    """Everything in chunks c0..c1-1 that does not depend on the state, batched over them all.

    ``G_all`` is the in-chunk cumulative gate for the whole sequence (``_chunk_cumsum``).
    Returns chunk-major stacks [n*B*H, ...]: W, U (the UT transform), kd = k exp(G_C - G),
    a_last = exp(G_C) and, with queries, QA = [exp(G) q | Aqk] [n*B*H, C, K + C], so that
    the slab's output is one matmul of QA with [state entering each chunk; V'].
    """
    K, V = k.shape[-1], v.shape[-1]
    dtype = k.dtype
    kc = _slab(k, c0, c1, C)
    F = kc.shape[0]
    G = _slab(G_all, c0, c1, C)
    beta_c = _slab(beta[..., None], c0, c1, C)
    kb = kc * beta_c
    qc = None
    if need_output:
        qc = _slab(q, c0, c1, C)
        qc *= np.asarray(scale, dtype)
    rhs = np.empty((F, C, K + V), dtype)  # [beta k exp(G) | beta v]; the UT transform solves against it
    np.multiply(_slab(v, c0, c1, C), beta_c, out=rhs[:, :, K:])
    out = {"L": np.zeros((F, C, C), dtype), "kg": rhs[:, :, :K], "kd": np.empty((F, C, K), dtype),
           "a_last": np.empty((F, K), dtype)}
    if need_output:
        QA = np.zeros((F, C, K + C), dtype)
        out["qg"], out["Aqk"] = QA[:, :, :K], QA[:, :, K:]
    # One block size for the slab: its strongest chunk decides (gathering chunks into
    # groups of equal size costs more than it saves).
    s = int(_block_sizes(G, C, decaying).min())
    _chunk_terms(kc, kb, qc, G, s, out)
    # Keep the causal parts (the dropped upper triangle is bounded, see _EXP_LIMIT); flat
    # contiguous multiplies are several times faster than broadcasting a [C, C] mask.
    L = out["L"]
    L.reshape(F, C * C)[...] *= np.tri(C, C, -1, dtype=dtype).reshape(C * C)
    # UT transform: T = (I + L)^-1 diag(beta), so [W | U] = (I + L)^-1 [beta exp(G) K | beta V].
    WU = _unit_lower_solve(L, rhs)
    prep = {"W": WU[:, :, :K], "U": WU[:, :, K:], "kd": out["kd"], "a_last": out["a_last"]}
    if need_output:
        keep = np.concatenate([np.ones((C, K), dtype), np.tri(C, C, 0, dtype=dtype)], axis=1)
        QA.reshape(F, C * (K + C))[...] *= keep.reshape(C * (K + C))
        prep["QA"] = QA
    return prep


def _chunk_cumsum(g: np.ndarray, C: int) -> np.ndarray:
    """Inclusive cumsum of g [B, T, H, K] restarting at every chunk, in time-major order.

    C vectorised adds over the whole sequence (each on contiguous [H, K] rows) beat both
    np.cumsum along a strided axis and C adds per slab.
    """
    B, T, H, K = g.shape
    N = max(1, -(-T // C))
    G = np.zeros((B, N * C, H, K), g.dtype)
    G[:, :T] = g
    chunks = G.reshape(B, N, C, H, K)
    for i in range(1, C):
        chunks[:, :, i] += chunks[:, :, i - 1]
    return G


def _slabs(n_chunks: int, heads: int):
    """(c0, c1) ranges of chunks processed together: ~_SLAB chunk-heads, so that a slab's
    temporaries stay in cache (measured: ~25% faster than one pass over all chunks)."""
    step = max(1, _SLAB // max(1, heads))
    return [(c0, min(n_chunks, c0 + step)) for c0 in range(0, n_chunks, step)]


def chunk_kda(q, k, v, g, beta, scale=None, initial_state=None, chunk_size: int = 64):
    """Chunkwise KDA (UT transform). Same result as ``recurrent_kda``; returns ``(o, final_state)``.

    Per chunk (q scaled, G = inclusive cumsum of g in the chunk)::

        Akk[i,j] = sum_d k_id k_jd exp(G_id - G_jd)  (j < i);  Aqk likewise with q (j <= i)
        T = (I + StrictTril(diag(beta) Akk))^-1 diag(beta);  W = T (exp(G) K);  U = T V
        V' = U - W S;  O = (exp(G) Q) S + Aqk V';  S <- diag(exp(G_C)) S + (exp(G_C - G) K)^T V'

    Everything except the dependence on S is batched over many chunks and all heads at
    once (``_prepare_slab``, one slab of chunks at a time); the state pass is 2 small
    matmuls per chunk, and it stores [S; V'] per chunk so that O is one matmul per slab.
    A short last chunk is zero-padded (k = v = beta = g = 0 leaves the state untouched).
    Decays exp(G_x - G_y) below _FLUSH (float32 1e-10, float64 ~1e-154) are flushed to 0.
    """
    q, k, v, g, beta, S0, batched, (B, T, H, K, V), dtype = _check_sequence(q, k, v, g, beta, initial_state)
    scale = _resolve_scale(scale, K)
    C = _check_chunk_size(chunk_size)
    N = max(1, -(-T // C))
    decaying = bool(g.size == 0 or g.max() <= 0)
    S = np.zeros((B * H, K, V), dtype) if S0 is None else S0.reshape(B * H, K, V).astype(dtype, copy=True)
    o = np.empty((B, N, C, H, V), dtype)
    G = _chunk_cumsum(g, C)
    for c0, c1 in _slabs(N, B * H):
        prep = _prepare_slab(q, k, v, G, beta, c0, c1, C, scale, decaying, need_output=True)
        n = c1 - c0
        W, U, kd = (prep[name].reshape(n, B * H, C, -1) for name in ("W", "U", "kd"))
        a_last = prep["a_last"].reshape(n, B * H, K, 1)
        Z = np.empty((n, B * H, K + C, V), dtype)  # per chunk: [state entering it; V']
        Z[0, :, :K] = S
        for j in range(n):
            state, v_new = Z[j, :, :K], Z[j, :, K:]
            np.matmul(W[j], state, out=v_new)
            np.subtract(U[j], v_new, out=v_new)  # V' = U - W S
            nxt = Z[j + 1, :, :K] if j + 1 < n else S
            np.matmul(kd[j].swapaxes(-1, -2), v_new, out=nxt)
            nxt += a_last[j] * state  # S <- diag(exp(G_C)) S + (exp(G_C - G) K)^T V'
        o_slab = np.matmul(prep["QA"], Z.reshape(n * B * H, K + C, V))  # (exp(G) Q) S + Aqk V'
        o[:, c0:c1] = o_slab.reshape(n, B, H, C, V).transpose(1, 0, 3, 2, 4)
    o = o.reshape(B, N * C, H, V)[:, :T]
    S = S.reshape(B, H, K, V)
    if not batched:
        return o[0], S[0]
    return o, S


# ----------------------------------------------------------------------------- segments


def segment_transition(k, v, g, beta, chunk_size: int = 64):
    """The affine map a segment applies to the state: ``S_out = M @ S_in + C``.

    k, g ``[.., T, H, K]``, v ``[.., T, H, V]``, beta ``[.., T, H]``. Returns
    ``M [.., H, K, K]`` (acting on the key dimension) and ``C [.., H, K, V]`` (the state
    reached from zero). Per chunk the map is S -> (diag(exp(G_C)) - (exp(G_C - G) K)^T W) S
    + (exp(G_C - G) K)^T U; we run the chunk state pass once on the augmented state
    ``[S | M]`` starting from ``[0 | I]`` (the M columns see U = 0). Queries never
    touch the state, so none are needed.
    """
    _, k, v, g, beta, _, batched, (B, T, H, K, V), dtype = _check_sequence(None, k, v, g, beta, None, ref="k")
    C = _check_chunk_size(chunk_size)
    N = max(1, -(-T // C))
    decaying = bool(g.size == 0 or g.max() <= 0)
    aug = np.zeros((B * H, K, V + K), dtype)
    aug[:, :, V:] = np.eye(K, dtype=dtype)
    u_aug = np.zeros((B * H, C, V + K), dtype)
    G = _chunk_cumsum(g, C)
    for c0, c1 in _slabs(N, B * H):
        prep = _prepare_slab(None, k, v, G, beta, c0, c1, C, 1.0, decaying, need_output=False)
        n = c1 - c0
        W, U, kd = (prep[name].reshape(n, B * H, C, -1) for name in ("W", "U", "kd"))
        a_last = prep["a_last"].reshape(n, B * H, K, 1)
        for j in range(n):
            u_aug[:, :, :V] = U[j]
            aug = a_last[j] * aug + np.matmul(kd[j].swapaxes(-1, -2), u_aug - np.matmul(W[j], aug))
    M = np.ascontiguousarray(aug[:, :, V:]).reshape(B, H, K, K)
    Cst = np.ascontiguousarray(aug[:, :, :V]).reshape(B, H, K, V)
    if not batched:
        return M[0], Cst[0]
    return M, Cst


def apply_transition(M, C, S):
    """``M @ S + C``: the state after a segment whose transition is (M, C), entered with S."""
    M, C, S = (np.asarray(x) for x in (M, C, S))
    if M.ndim < 3 or M.shape[-1] != M.shape[-2]:
        raise ValueError(f"M: expected [.., H, K, K], got shape {M.shape}")
    if C.shape[:-1] != M.shape[:-1]:
        raise ValueError(f"C: expected [.., H, K, V] matching M {M.shape}, got shape {C.shape}")
    if S.shape != C.shape:
        raise ValueError(f"S: expected [.., H, K, V] = {C.shape} matching C, got shape {S.shape}")
    return np.matmul(M, S) + C


def compose_transitions(first, second):
    """Transition of ``first`` followed by ``second``: (M2 M1, M2 C1 + C2). Order matters."""
    M1, C1 = first
    M2, C2 = second
    return np.matmul(M2, M1), np.matmul(M2, C1) + C2


def identity_transition(H: int, K: int, V: int, dtype=np.float64):
    """The transition of an empty segment: (I, 0)."""
    return np.broadcast_to(np.eye(K, dtype=dtype), (H, K, K)).copy(), np.zeros((H, K, V), dtype)


def linear_attention_state(k, v) -> np.ndarray:
    """Plain (ungated, no delta) linear attention state ``S = sum_t k_t v_t^T`` -> [.., H, K, V]."""
    k = _float_array("k", k)
    v = _float_array("v", v, k.dtype, "k")
    return np.einsum("...thk,...thv->...hkv", k, v)


# ----------------------------------------------------------------------------- costs


def state_bytes(H: int, K: int, V: int, itemsize: int = 4) -> int:
    """Bytes of one layer's KDA state: H x K x V elements, independent of context length."""
    return int(H) * int(K) * int(V) * int(itemsize)


def recurrent_kda_flops(T: int, H: int, K: int, V: int) -> int:
    """FLOPs of ``recurrent_kda`` per the update above (multiply-add = 2).

    Per token and head: decay K*V, S^T k 2KV, v - S^T k V, beta k K,
    rank-1 update 2KV, output 2KV (+ K for scaling q).
    """
    per = 7 * K * V + V + 2 * K
    return int(T) * int(H) * per


def chunk_kda_flops(T: int, H: int, K: int, V: int, chunk: int = 64) -> int:
    """FLOPs of the chunkwise algorithm as written in ``chunk_kda``'s docstring.

    Counts the dense products per chunk of length c (the last may be short):
    Akk and Aqk 2 * 2c^2K, the unit-triangular inverse c^3/3 * 2, W and U 2c^2(K+V),
    V' = U - WS 2cKV + cV, O 2cKV + 2c^2V + cV, the state update 2cKV + 2KV,
    plus the gate factors (~6cK). Masked-out work is not counted.
    """
    T, H, K, V, chunk = (int(x) for x in (T, H, K, V, chunk))
    total = 0
    full, rest = divmod(T, chunk)
    for c, count in ((chunk, full), (rest, 1 if rest else 0)):
        if count == 0:
            continue
        per = (
            4 * c * c * K
            + (2 * c**3) // 3
            + 2 * c * c * (K + V)
            + 2 * c * K * V
            + c * V
            + 2 * c * K * V
            + 2 * c * c * V
            + c * V
            + 2 * c * K * V
            + 2 * K * V
            + 6 * c * K
        )
        total += count * per
    return total * H
