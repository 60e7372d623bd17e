"""Full causal softmax attention and the KV cache it decodes with (append, and truncate to roll back).

Layouts: queries ``q [T, H, D]``, keys ``k [L, Hkv, D]``, values ``v [L, Hkv, Dv]``.
The T queries are the *last* T of the L positions, so prefill is ``T == L`` and a
decode step is ``T == 1``. Grouped-query attention (GQA) shares each KV head with
``H // Hkv`` consecutive query heads. The softmax subtracts the row maximum before
exponentiating, so float64 results are exact to rounding.

FLOP counters are analytic and deterministic: they count the multiply-adds of the
matmuls (2 FLOPs each) over the causal (query, key) pairs that matter.
"""

from __future__ import annotations

import numpy as np

from kimilab.validate import check_int

__all__ = [
    "causal_attention",
    "reference_causal_attention",
    "KVCache",
    "decode_step",
    "causal_pairs",
    "attention_flops",
    "projection_flops",
    "decode_flops",
]

_FLOAT_DTYPES = (np.dtype(np.float32), np.dtype(np.float64))


def _check_array(name: str, x, ndim: int, layout: str) -> np.ndarray:
    if not isinstance(x, np.ndarray):
        raise ValueError(f"{name}: expected a numpy array of layout {layout}, got {type(x).__name__}")
    if x.ndim != ndim:
        raise ValueError(f"{name}: expected layout {layout} ({ndim} axes), got shape {x.shape}")
    if x.dtype not in _FLOAT_DTYPES:
        raise ValueError(f"{name}: expected dtype float32 or float64, got {x.dtype}")
    return x


def _check_qkv(q, k, v) -> tuple[int, int, int, int, int, int]:
    _check_array("q", q, 3, "[T, H, D]")
    _check_array("k", k, 3, "[L, Hkv, D]")
    _check_array("v", v, 3, "[L, Hkv, Dv]")
    T, H, D = q.shape
    L, Hkv, Dk = k.shape
    if Dk != D:
        raise ValueError(f"k: expected key dim D={D} (q's last axis) in [L, Hkv, D], got shape {k.shape}")
    if v.shape[:2] != (L, Hkv):
        raise ValueError(f"v: expected [L={L}, Hkv={Hkv}, Dv] to match k, got shape {v.shape}")
    if Hkv == 0 or H % Hkv:
        raise ValueError(f"k: expected Hkv dividing H={H} (GQA groups), got Hkv={Hkv}")
    if not 1 <= T <= L:
        raise ValueError(f"q: expected 1 <= T <= L={L} queries (the last T positions), got T={T}")
    if not (q.dtype == k.dtype == v.dtype):
        raise ValueError(f"q, k, v: expected one dtype, got q {q.dtype}, k {k.dtype}, v {v.dtype}")
    return T, H, D, L, Hkv, v.shape[2]


def causal_attention(q, k, v, scale=None, query_block: int = 256) -> np.ndarray:
    """Causal softmax attention of the last T positions over all L keys -> o [T, H, Dv].

    Vectorised over heads; queries are processed in blocks of ``query_block`` rows so
    the score matrix never exceeds ``H x query_block x L`` (a block only reads the keys
    its last query can see).
    """
    T, H, D, L, Hkv, Dv = _check_qkv(q, k, v)
    query_block = check_int("query_block", query_block, 1)
    scale = D ** -0.5 if scale is None else float(scale)
    group = H // Hkv
    offset = L - T  # absolute position of query 0
    # One matmul per KV head: its query heads' rows stacked, [Hkv, group * Tb, D] @ [Hkv, D, L].
    qg = q.reshape(T, Hkv, group, D).transpose(1, 2, 0, 3) * scale  # [Hkv, group, T, D]
    kt = k.transpose(1, 2, 0)  # [Hkv, D, L]
    vh = v.transpose(1, 0, 2)  # [Hkv, L, Dv]
    out = np.empty((Hkv, group, T, Dv), dtype=q.dtype)
    for start in range(0, T, query_block):
        stop = min(start + query_block, T)
        rows = stop - start
        n_keys = offset + stop  # keys visible to the block's last query
        q_rows = qg[:, :, start:stop].reshape(Hkv, group * rows, D)
        scores = (q_rows @ kt[:, :, :n_keys]).reshape(Hkv, group, rows, n_keys)
        q_pos = offset + np.arange(start, stop)
        future = np.arange(n_keys)[None, :] > q_pos[:, None]
        if future.any():
            scores = np.where(future, -np.inf, scores)
        scores -= scores.max(axis=-1, keepdims=True)
        weights = np.exp(scores, out=scores)
        weights /= weights.sum(axis=-1, keepdims=True)
        mixed = weights.reshape(Hkv, group * rows, n_keys) @ vh[:, :n_keys]
        out[:, :, start:stop] = mixed.reshape(Hkv, group, rows, Dv)
    return out.transpose(2, 0, 1, 3).reshape(T, H, Dv)


def reference_causal_attention(q, k, v, scale=None) -> np.ndarray:
    """The slow, obvious twin of ``causal_attention``: one query and one head at a time."""
    T, H, D, L, Hkv, Dv = _check_qkv(q, k, v)
    scale = D ** -0.5 if scale is None else float(scale)
    group = H // Hkv
    out = np.empty((T, H, Dv), dtype=q.dtype)
    for t in range(T):
        pos = L - T + t
        for h in range(H):
            kv_head = h // group
            s = k[: pos + 1, kv_head] @ q[t, h] * scale
            w = np.exp(s - s.max())
            out[t, h] = (w / w.sum()) @ v[: pos + 1, kv_head]
    return out


class KVCache:
    """Contiguous per-layer KV cache: keys [L, Hkv, D], values [L, Hkv, Dv].

    Tokens are appended at the end; stored tokens never change. ``truncate(n)`` drops
    the tokens after the first n (rolling back rejected speculative tokens), and the
    next append writes over their storage. Storage grows by doubling (amortised O(1)
    append); ``keys``/``values`` are read-only views of the filled part, valid until
    the next ``truncate``. ``nbytes`` counts the filled part only; ``capacity_nbytes``
    the allocated buffers.
    """

    def __init__(self, n_kv_heads: int, head_dim: int, value_dim: int | None = None,
                 dtype="float64", capacity: int = 16) -> None:
        n_kv_heads = check_int("n_kv_heads", n_kv_heads, 1)
        head_dim = check_int("head_dim", head_dim, 1)
        capacity = check_int("capacity", capacity, 1)
        value_dim = head_dim if value_dim is None else check_int("value_dim", value_dim, 1)
        try:
            dt = np.dtype(dtype)
        except TypeError:
            raise ValueError(f"dtype: expected float32 or float64, got {dtype!r}") from None
        if dt not in _FLOAT_DTYPES:
            raise ValueError(f"dtype: expected float32 or float64, got {dt}")
        self.n_kv_heads = n_kv_heads
        self.head_dim = head_dim
        self.value_dim = value_dim
        self.dtype = dt
        self._k = np.empty((capacity, n_kv_heads, head_dim), dtype=dt)
        self._v = np.empty((capacity, n_kv_heads, value_dim), dtype=dt)
        self._length = 0

    def __repr__(self) -> str:
        return (f"KVCache(length={self._length}, n_kv_heads={self.n_kv_heads}, "
                f"head_dim={self.head_dim}, value_dim={self.value_dim}, dtype={self.dtype})")

    @property
    def length(self) -> int:
        """Tokens stored."""
        return self._length

    def __len__(self) -> int:
        return self._length

    @property
    def keys(self) -> np.ndarray:
        view = self._k[: self._length]
        view.flags.writeable = False
        return view

    @property
    def values(self) -> np.ndarray:
        view = self._v[: self._length]
        view.flags.writeable = False
        return view

    @property
    def nbytes(self) -> int:
        """Bytes of the stored keys and values (what the analytic model counts)."""
        return int(self.keys.nbytes + self.values.nbytes)

    @property
    def capacity_nbytes(self) -> int:
        """Bytes allocated, including room not yet filled."""
        return int(self._k.nbytes + self._v.nbytes)

    @property
    def bytes_per_token(self) -> int:
        return self.n_kv_heads * (self.head_dim + self.value_dim) * self.dtype.itemsize

    def append(self, k, v) -> int:
        """Append T new tokens (k [T, Hkv, D], v [T, Hkv, Dv], cache dtype); returns the new length."""
        _check_array("k", k, 3, f"[T, Hkv={self.n_kv_heads}, D={self.head_dim}]")
        _check_array("v", v, 3, f"[T, Hkv={self.n_kv_heads}, Dv={self.value_dim}]")
        if k.shape[1:] != (self.n_kv_heads, self.head_dim):
            raise ValueError(f"k: expected [T, Hkv={self.n_kv_heads}, D={self.head_dim}], "
                             f"got shape {k.shape}")
        if v.shape[1:] != (self.n_kv_heads, self.value_dim):
            raise ValueError(f"v: expected [T, Hkv={self.n_kv_heads}, Dv={self.value_dim}], "
                             f"got shape {v.shape}")
        if v.shape[0] != k.shape[0]:
            raise ValueError(f"v: expected T={k.shape[0]} tokens like k, got shape {v.shape}")
        if k.dtype != self.dtype or v.dtype != self.dtype:
            raise ValueError(f"k, v: expected the cache dtype {self.dtype}, "
                             f"got k {k.dtype}, v {v.dtype}")
        n = k.shape[0]
        needed = self._length + n
        if needed > self._k.shape[0]:
            capacity = max(needed, 2 * self._k.shape[0])
            for name in ("_k", "_v"):
                old = getattr(self, name)
                grown = np.empty((capacity,) + old.shape[1:], dtype=self.dtype)
                grown[: self._length] = old[: self._length]
                setattr(self, name, grown)
        self._k[self._length:needed] = k
        self._v[self._length:needed] = v
        self._length = needed
        return needed

    def truncate(self, n: int) -> int:
        """Keep the first ``n`` tokens and drop the rest (0 <= n <= length); returns ``n``.

        The storage stays allocated, so re-appending costs no regrowth. Afterwards the
        cache equals one that never held the dropped tokens.
        """
        if isinstance(n, (bool, np.bool_)) or not isinstance(n, (int, np.integer)) or not 0 <= n <= self._length:
            raise ValueError(f"n={n!r}: expected an int with 0 <= n <= length={self._length}")
        self._length = int(n)
        return self._length


def decode_step(q, k, v, cache: KVCache, scale=None) -> np.ndarray:
    """Append the new tokens' k/v to ``cache``, then attend their queries over everything cached.

    q [T, H, D], k [T, Hkv, D], v [T, Hkv, Dv] for T new tokens (T == 1 when decoding).
    Returns o [T, H, Dv], equal to recomputing causal attention over the whole prefix.
    """
    if not isinstance(cache, KVCache):
        raise ValueError(f"cache: expected a KVCache, got {type(cache).__name__}")
    _check_array("q", q, 3, "[T, H, D]")
    _check_array("k", k, 3, "[T, Hkv, D]")
    if q.shape[0] != k.shape[0]:
        raise ValueError(f"q: expected T={k.shape[0]} new queries (one per new key), "
                         f"got shape {q.shape}")
    if q.shape[2] != cache.head_dim or q.shape[1] % cache.n_kv_heads or q.dtype != cache.dtype:
        raise ValueError(f"q: expected [T, H, D={cache.head_dim}] of dtype {cache.dtype} "
                         f"with H a multiple of Hkv={cache.n_kv_heads}, "
                         f"got shape {q.shape} dtype {q.dtype}")
    cache.append(k, v)  # validated above and in append, so a bad call leaves the cache unchanged
    return causal_attention(q, cache.keys, cache.values, scale=scale)


# ----- FLOP counters ----------------------------------------------------------

def causal_pairs(T: int, L: int) -> int:
    """(query, key) pairs a causal mask keeps when the T queries are the last of L positions."""
    T = check_int("T", T, 0)
    L = check_int("L", L, 0)
    if T > L:
        raise ValueError(f"T={T}: expected T <= L={L}")
    return T * (L - T) + T * (T + 1) // 2


def attention_flops(T: int, L: int, H: int, D: int, Dv: int | None = None) -> int:
    """FLOPs of scores (q.k) and mixing (w.v) for T causal queries over L keys, H query heads."""
    H = check_int("H", H, 1)
    D = check_int("D", D, 1)
    Dv = D if Dv is None else check_int("Dv", Dv, 1)
    return 2 * causal_pairs(T, L) * H * (D + Dv)


def projection_flops(T: int, d_model: int, H: int, Hkv: int, D: int, Dv: int | None = None) -> int:
    """FLOPs of the q, k, v and output projections of T tokens in one attention layer."""
    T = check_int("T", T, 0)
    d_model = check_int("d_model", d_model, 1)
    H = check_int("H", H, 1)
    Hkv = check_int("Hkv", Hkv, 1)
    D = check_int("D", D, 1)
    Dv = D if Dv is None else check_int("Dv", Dv, 1)
    return 2 * T * d_model * (H * D + Hkv * D + Hkv * Dv + H * Dv)


def decode_flops(context_len: int, *, n_heads: int, head_dim: int, n_kv_heads: int | None = None,
                 value_dim: int | None = None, d_model: int | None = None, n_layers: int = 1,
                 cached: bool = True) -> int:
    """FLOPs of attention layers to produce the token at position ``context_len`` (1-based).

    With a cache: project the one new token and attend its query over ``context_len`` keys.
    Without one: every layer's keys depend on the layer below at every position, so the
    whole prefix is run again: project all ``context_len`` tokens and attend all of them
    causally. Projections are counted only when ``d_model`` is given.
    """
    L = check_int("context_len", context_len, 1)
    n_layers = check_int("n_layers", n_layers, 1)
    Hkv = n_heads if n_kv_heads is None else n_kv_heads
    T = 1 if cached else L
    per_layer = attention_flops(T, L, n_heads, head_dim, value_dim)
    if d_model is not None:
        per_layer += projection_flops(T, d_model, n_heads, Hkv, head_dim, value_dim)
    return n_layers * per_layer
