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

# Largest exponent allowed for the in-chunk gate factors (see _pick_block), and the
# flush level: gate factors below it are set to exactly 0. float32: 1e-15, eight
# orders below float32 precision; float64: sqrt(tiny) ~ 1e-154. Flushing changes any
# result by less than that and keeps subnormal numbers (~100x slower in BLAS) out of
# the matmuls: a factor in [e^-limit, 1] times one >= the flush level stays normal.
_EXP_LIMIT = {np.dtype(np.float32): 40.0, np.dtype(np.float64): 300.0}
_FLUSH = {np.dtype(np.float32): 1e-15, np.dtype(np.float64): float(np.sqrt(np.finfo(np.float64).tiny))}
_SLAB_ELEMENTS = 1 << 22  # bound on the temporary right-factor tensor per slab of chunks


def _exp_flushed(x: np.ndarray, headroom: float = 0.0) -> np.ndarray:
    """exp(x), with 0 where exp(x) < flush level * exp(-headroom) (decided on x, before exp)."""
    floor = math.log(_FLUSH[x.dtype]) - headroom
    return np.exp(np.where(x < floor, -np.inf, x).astype(x.dtype, copy=False))


def _flush(x: np.ndarray) -> np.ndarray:
    """Set |x| < flush level to 0, in place; returns x."""
    np.putmask(x, np.abs(x) < _FLUSH[x.dtype], 0)
    return x


def unit_lower_inverse(L: np.ndarray) -> np.ndarray:
    """``(I + L)^-1`` for strictly lower-triangular ``L [..., n, n]``, batched.

    Bottom-up block doubling, in place: the inverse of [[A, 0], [B, D]] is
    [[A^-1, 0], [-D^-1 B A^-1, D^-1]]. Starting from 1x1 diagonal blocks (ones),
    each level fills the lower-left quarter of every 2b x 2b diagonal block with
    two batched matmuls, so the whole inverse is ~2 log2(n) numpy calls and
    ~n^3/3 multiply-adds. n is padded to a power of two with zeros (identity rows),
    which does not change the top-left n x n block of the inverse.
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


def _to_chunks(x: np.ndarray, n_chunks: int, C: int) -> np.ndarray:
    """[B, T, H, D] -> head-major [B*H, N, C, D], zero-padded at the end of time."""
    B, T, H, D = x.shape
    out = np.empty((B, H, n_chunks, C, D), x.dtype)
    full = T // C
    if full:
        out[:, :, :full] = x[:, : full * C].reshape(B, full, C, H, D).transpose(0, 3, 1, 2, 4)
    if full < n_chunks:
        rest = T - full * C
        out[:, :, full:] = 0
        out[:, :, full, :rest] = x[:, full * C :].transpose(0, 2, 1, 3)
    return out.reshape(B * H, n_chunks, C, D)


def _from_chunks(o: np.ndarray, B: int, T: int, H: int) -> np.ndarray:
    """Head-major [B*H, N, C, V] -> [B, T, H, V] (dropping the padding)."""
    BH, N, C, V = o.shape
    out = np.empty((B, N * C, H, V), o.dtype)
    out.reshape(B, N, C, H, V)[...] = o.reshape(B, H, N, C, V).transpose(0, 2, 3, 1, 4)
    return out[:, :T] if T < N * C else out


def _block_boundaries(G: np.ndarray, s: int) -> np.ndarray:
    """P[:, b] = cumulative gate just before block b (0 for the first block). G [F, C, K]."""
    F, C, K = G.shape
    P = np.zeros((F, C // s, K), G.dtype)
    P[:, 1:] = G[:, s - 1 : C - 1 : s]
    return P


def _block_sizes(G: np.ndarray, C: int, decaying: bool) -> np.ndarray:
    """Per chunk-head, the largest block size s (a divisor of C) whose factored form cannot overflow.

    Inside a chunk exp(G_i - G_j) is split as
    exp(G_i - P_b) * exp(P_b - P_b') * exp(P_b' - G_j), with b, b' the blocks of i, j
    and P_b the cumulative gate just before block b. The middle factor is <= 1 for
    decaying gates and is masked to 0 for b' > b (future blocks) before exp; the
    outer factors only span one block. We take the largest s whose per-block decay
    stays within _EXP_LIMIT, so no factor overflows (nor does the discarded
    upper-triangle product). Strong gates shrink s; s = 1 is always safe.
    ``decaying`` (all g <= 0) allows a cheaper test: a block's range is its total decay.
    G [F, C, K] -> int array [F].
    """
    F = G.shape[0]
    limit = _EXP_LIMIT[G.dtype]
    sizes = np.ones(F, dtype=np.int64)
    open_ = np.ones(F, dtype=bool)
    running_min = None if decaying else np.minimum.accumulate(G, axis=-2)
    for s in (d for d in range(C, 1, -1) if C % d == 0):
        P = _block_boundaries(G, s)
        if decaying:
            worst = (P - G[:, s - 1 :: s]).max(axis=(1, 2), initial=0.0)  # total decay of each block
        else:
            right = (P - running_min[:, s - 1 :: s]).max(axis=(1, 2), initial=0.0)  # P_b - G_j, j <= end of b
            left = (G.reshape(F, C // s, s, -1).max(axis=-2) - P).max(axis=(1, 2), initial=0.0)  # G_i - P_b
            worst = np.maximum(right, left)
        fits = open_ & (worst <= limit)
        sizes[fits] = s
        open_ &= ~fits
        if not open_.any():
            break
    return sizes


def _pick_block(G: np.ndarray, C: int, decaying: bool) -> int:
    """The smallest per-chunk block size (what the strongest gate forces)."""
    return int(_block_sizes(G, C, decaying).min(initial=C))


def _gate_factors(G: np.ndarray, s: int, exp_G=None, decay_to_end=None, a_last=None) -> dict:
    """The exponentials the chunk needs, from ONE full-size exp. G [F, C, K].

    ``exp_G``, ``decay_to_end`` [F, C, K] and ``a_last`` [F, K] may be given as output arrays.
    """
    F, C, K = G.shape
    nb = C // s
    limit = _EXP_LIMIT[G.dtype]
    P = _block_boundaries(G, s)  # [F, nb, K]
    own = np.subtract(P[:, :, None, :], G.reshape(F, nb, s, K))
    own = np.exp(own, out=own).reshape(F, C, K)  # exp(P_b(j) - G_j) in [1, e^limit]
    left = np.reciprocal(own)  # exp(G_i - P_b(i)) in [e^-limit, 1]
    block_decay = None
    if nb > 1:  # exp(P_b - P_b'), 0 for b' > b (masked BEFORE exp); it multiplies `own`, hence the headroom
        expo = np.where(np.tri(nb, nb, 0, dtype=bool)[None, :, :, None], P[:, :, None, :] - P[:, None, :, :], -np.inf)
        block_decay = _exp_flushed(expo.astype(G.dtype, copy=False), limit)
    # A factor in [e^-limit, 1] times one flushed at tau e^-limit stays >= tau e^-2limit: tiny but
    # normal, so these products need no second flush.
    if exp_G is None:
        exp_G = np.empty((F, C, K), G.dtype)
    np.multiply(left.reshape(F, nb, s, K), _exp_flushed(P)[:, :, None, :], out=exp_G.reshape(F, nb, s, K))
    G_last = G[:, -1, :]
    to_end = _exp_flushed(G_last[:, None, :] - P, limit)  # exp(G_C - P_b)
    if decay_to_end is None:
        decay_to_end = np.empty((F, C, K), G.dtype)
    np.multiply(own.reshape(F, nb, s, K), to_end[:, :, None, :], out=decay_to_end.reshape(F, nb, s, K))  # exp(G_C - G_j)
    if a_last is None:
        a_last = np.empty((F, K), G.dtype)
    a_last[...] = _exp_flushed(G_last)
    return {
        "own": own,
        "left": left,
        "block_decay": block_decay,
        "exp_G": exp_G,
        "decay_to_end": decay_to_end,
        "a_last": a_last,  # exp(G_C) [F, K]
    }


def _intra_chunk(kc, qc, own, left, block_decay, s, Akk, Aqk):
    """Fill Akk (strictly lower) and Aqk (lower incl. diagonal) [F, C, C] for a slab of chunks.

    kc, qc, own, left [F, C, K]; block_decay [F, nb, nb, K]; Akk, Aqk zero-initialised.
    Row block b is one matmul of (x_i exp(G_i - P_b)) against (k_j exp(P_b - G_j))
    over the causal columns j < (b+1) s only. Aqk may be None (not needed).
    """
    F, C, K = kc.shape
    nb = C // s
    k_left = kc * left
    q_left = qc * left if Aqk is not None else None
    k_own = kc * own
    upper_strict = ~np.tri(s, s, -1, dtype=bool)
    upper = ~np.tri(s, s, 0, dtype=bool)
    for b in range(nb):
        lo, hi = b * s, (b + 1) * s
        if b == 0:
            right_T = k_own[:, :hi].swapaxes(-1, -2)
        else:  # exp(P_b - G_j) = exp(P_b - P_b') exp(P_b' - G_j); flushed (see _FLUSH)
            factor = own[:, :hi].reshape(F, b + 1, s, K) * block_decay[:, b, : b + 1, None, :]
            np.putmask(factor, factor < _FLUSH[kc.dtype], 0)
            right_T = np.multiply(kc[:, :hi], factor.reshape(F, hi, K), out=factor.reshape(F, hi, K)).swapaxes(-1, -2)
        np.matmul(k_left[:, lo:hi], right_T, out=Akk[:, lo:hi, :hi])
        np.copyto(Akk[:, lo:hi, lo:hi], 0, where=upper_strict)  # drop the (bounded) upper triangle
        if Aqk is not None:
            np.matmul(q_left[:, lo:hi], right_T, out=Aqk[:, lo:hi, :hi])
            np.copyto(Aqk[:, lo:hi, lo:hi], 0, where=upper)
    _flush(Akk)


def _prepare_chunks(q, k, v, g, beta, C, *, need_output: bool):
    """Everything that is independent across chunks, batched over B, H and chunks at once.

    Arrays come back head-major, [B*H, N, ...]; every matmul runs on a 3-D stack
    (numpy's fast path; 4-D and higher stacks are several times slower).
    q is used unscaled; chunk_kda scales the output instead.
    """
    B, T, H, K = k.shape
    V = v.shape[-1]
    N = max(1, -(-T // C))
    F = N * B * H
    kc = _to_chunks(k, N, C).reshape(F, C, K)  # padded steps: k = v = beta = g = 0
    vc = _to_chunks(v, N, C).reshape(F, C, V)
    G = _to_chunks(g, N, C)
    for i in range(1, C):  # in-chunk inclusive cumsum; C vectorised adds beat a strided np.cumsum
        G[:, :, i] += G[:, :, i - 1]
    G = G.reshape(F, C, K)
    beta_c = _to_chunks(beta[..., None], N, C).reshape(F, 1, C)
    qc = _to_chunks(q, N, C).reshape(F, C, K) if need_output else None
    # One block size per head (its strongest chunk decides); runs of heads with the same
    # size are contiguous slices of the head-major arrays, so each run is one batch.
    per_chunk = _block_sizes(G, C, decaying=bool(g.size == 0 or g.max() <= 0))
    head_sizes = per_chunk.reshape(B * H, N).min(axis=1)
    Akk = np.zeros((F, C, C), k.dtype)
    Aqk = np.zeros((F, C, C), k.dtype) if need_output else None
    exp_G = np.empty((F, C, K), k.dtype)
    decay_to_end = np.empty((F, C, K), k.dtype)
    a_last = np.empty((F, K), k.dtype)
    h0 = 0
    while h0 < B * H:
        s = int(head_sizes[h0])
        h1 = h0 + 1
        while h1 < B * H and head_sizes[h1] == s:
            h1 += 1
        step = max(1, _SLAB_ELEMENTS // ((C // s) * C * K))
        for lo in range(h0 * N, h1 * N, step):
            part = slice(lo, min(h1 * N, lo + step))
            fac = _gate_factors(G[part], s, exp_G[part], decay_to_end[part], a_last[part])
            _intra_chunk(kc[part], qc[part] if need_output else None, fac["own"], fac["left"], fac["block_decay"],
                         s, Akk[part], Aqk[part] if need_output else None)
        h0 = h1
    # UT transform: T = (I + StrictTril(diag(beta) Akk))^-1 diag(beta); W = T (exp(G) K), U = T V.
    Akk *= beta_c.swapaxes(-1, -2)  # diag(beta) Akk: row i times beta_i
    T_mat = unit_lower_inverse(Akk)
    T_mat *= beta_c  # ... diag(beta): column j times beta_j
    prep = {
        "W": np.matmul(T_mat, exp_G * kc).reshape(B * H, N, C, K),
        "U": np.matmul(T_mat, vc).reshape(B * H, N, C, V),
        "kd": (kc * decay_to_end).reshape(B * H, N, C, K),  # exp(G_C - G_j) k_j
        "a_last": a_last.reshape(B * H, N, K),
        "n_chunks": N,
        "block_sizes": head_sizes,
    }
    if need_output:
        prep["qg"] = (qc * exp_G).reshape(B * H, N, C, K)
        prep["Aqk"] = Aqk.reshape(B * H, N, C, C)
    return prep


def chunk_kda(q, k, v, g, beta, scale=None, initial_state=None, chunk_size: int = 64):
    """Chunkwise KDA (UT transform). Same result as ``recurrent_kda``; returns ``(o, final_state)``.

    Per chunk (q scaled, G = inclusive cumsum of g in the chunk)::

        Akk[i,j] = sum_d k_id k_jd exp(G_id - G_jd)  (j < i);  Aqk likewise with q (j <= i)
        T = (I + StrictTril(diag(beta) Akk))^-1 diag(beta);  W = T (exp(G) K);  U = T V
        V' = U - W S;  O = (exp(G) Q) S + Aqk V';  S <- diag(exp(G_C)) S + (exp(G_C - G) K)^T V'

    Everything except the dependence on S is batched over all chunks and heads
    (``_prepare_chunks``); only the short state pass loops over chunks. A short
    last chunk is zero-padded (k = v = beta = g = 0 leaves the state untouched).
    Gate factors below sqrt(tiny) are flushed to 0 (see _FLUSH).
    """
    q, k, v, g, beta, S0, batched, (B, T, H, K, V), dtype = _check_sequence(q, k, v, g, beta, initial_state)
    scale = _resolve_scale(scale, K)
    C = _check_chunk_size(chunk_size)
    prep = _prepare_chunks(q, k, v, g, beta, C, need_output=True)
    N = prep["n_chunks"]
    W, U, kd, a_last = prep["W"], prep["U"], prep["kd"], prep["a_last"]
    S = np.zeros((B * H, K, V), dtype) if S0 is None else S0.reshape(B * H, K, V).astype(dtype, copy=True)
    states = np.empty((B * H, N, K, V), dtype)  # the state entering each chunk
    v_new = np.empty((B * H, N, C, V), dtype)
    for c in range(N):
        states[:, c] = S
        np.subtract(U[:, c], np.matmul(W[:, c], S), out=v_new[:, c])
        S *= a_last[:, c, :, None]
        S += np.matmul(kd[:, c].swapaxes(-1, -2), v_new[:, c])
    F = N * B * H
    o = np.matmul(prep["qg"].reshape(F, C, K), states.reshape(F, K, V))
    o += np.matmul(prep["Aqk"].reshape(F, C, C), v_new.reshape(F, C, V))
    o *= np.asarray(scale, dtype)
    o = _from_chunks(o.reshape(B * H, N, C, V), B, T, H)
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
    prep = _prepare_chunks(None, k, v, g, beta, C, need_output=False)
    W, U, kd, a_last = prep["W"], prep["U"], prep["kd"], prep["a_last"]
    aug = np.zeros((B * H, K, V + K), dtype)
    aug[:, :, V:] = np.eye(K, dtype=dtype)
    u_aug = np.zeros((B * H, C, V + K), dtype)
    for c in range(prep["n_chunks"]):
        u_aug[:, :, :V] = U[:, c]
        aug = a_last[:, c, :, None] * aug + np.matmul(kd[:, c].swapaxes(-1, -2), u_aug - np.matmul(W[:, c], aug))
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
