"""Shape and dtype checks shared by the KDA kernels (recurrent, chunk, transition, gates).

Every kernel takes the flash-linear-attention layout -- q, k, g ``[T, H, K]``,
v ``[T, H, V]``, beta ``[T, H]``, state ``[H, K, V]``, optionally with a leading batch
axis ``B`` -- and a bad argument fails the same way everywhere: a ``ValueError`` naming
the argument, the layout it should have, the sizes it must match and what it got.
The kernels then work on the batched form only (a leading axis of 1 added).
"""

from __future__ import annotations

import math

import numpy as np

__all__ = ["float_array", "check_sequence", "check_step", "resolve_scale"]

_FLOAT_DTYPES = (np.dtype(np.float32), np.dtype(np.float64))


def float_array(name: str, x, expected_dtype: np.dtype | None = None, ref: str = "q") -> np.ndarray:
    """``x`` as an ndarray of float32/float64 (and of ``expected_dtype`` when given)."""
    arr = np.asarray(x)
    if arr.dtype not in _FLOAT_DTYPES:
        raise ValueError(f"{name}: expected dtype float32 or float64, got {arr.dtype}")
    if expected_dtype is not None and arr.dtype != expected_dtype:
        raise ValueError(f"{name}: expected dtype {expected_dtype} (matching {ref}), got {arr.dtype}")
    return arr


def _describe(names: str, sizes: dict[str, int]) -> str:
    """Axis names 'T H K' and their sizes -> 'T=8, H=2, K=16'."""
    return ", ".join(f"{n}={sizes[n]}" for n in names.split())


def _check_shape(name: str, arr: np.ndarray, names: str, sizes: dict[str, int], ref: str, ref_names: str) -> None:
    expected = tuple(sizes[n] for n in names.split())
    if arr.shape != expected:
        layout = "[" + ", ".join(names.split()) + "]"
        ref_layout = "[" + _describe(ref_names, sizes) + "]"
        raise ValueError(f"{name}: expected {layout} matching {ref} {ref_layout}, got shape {arr.shape}")


def check_sequence(q, k, v, g, beta, initial_state, *, ref: str = "q"):
    """Validate a sequence call. Returns arrays (batched: leading B added) and sizes.

    ``ref`` names the array that fixes the layout ("q" for the kernels, "k" when
    no query is involved). ``q`` may be None when ``ref == "k"``. Returns
    ``q, k, v, g, beta, initial_state, batched, (B, T, H, K, V), dtype``.
    """
    first = q if ref == "q" else k
    first = float_array(ref, first)
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
        arr = float_array(name, x, dtype, ref)
        _check_shape(name, arr, ref_names, sizes, ref, ref_names)
        arrays[name] = arr
    v = float_array("v", v, dtype, ref)
    if v.ndim != len(ref_names.split()) or v.shape[:-1] != tuple(sizes[n] for n in (pre + "T H").split()):
        layout = "[" + ", ".join((pre + "T H V").split()) + "]"
        raise ValueError(
            f"v: expected {layout} matching {ref} [{_describe(ref_names, sizes)}], got shape {v.shape}"
        )
    V = v.shape[-1]
    if V < 1:
        raise ValueError(f"v: expected V >= 1, got shape {v.shape}")
    sizes["V"] = V
    beta = float_array("beta", beta, dtype, ref)
    _check_shape("beta", beta, pre + "T H", sizes, ref, ref_names)
    if initial_state is not None:
        initial_state = float_array("initial_state", initial_state, dtype, ref)
        _check_shape("initial_state", initial_state, pre + "H K V", sizes, ref, ref_names + " V")
    if not batched:
        arrays = {n: a[None] for n, a in arrays.items()}
        v, beta = v[None], beta[None]
        if initial_state is not None:
            initial_state = initial_state[None]
    return arrays.get("q"), arrays["k"], v, arrays["g"], beta, initial_state, batched, (B, T, H, K, V), dtype


def check_step(q, k, v, g, beta, state):
    """Validate one decode token (q, k, g ``[H, K]``, v ``[H, V]``, beta ``[H]``, state
    ``[H, K, V]``, or all with a leading B). Returns the six arrays batched, and ``batched``.
    """
    q = float_array("q", q)
    if q.ndim not in (2, 3):
        raise ValueError(f"q: expected [H, K] or [B, H, K] for one decode token, got shape {q.shape}")
    batched = q.ndim == 3
    pre = "B " if batched else ""
    sizes = dict(zip((pre + "H K").split(), q.shape))
    ref = pre + "H K"
    dtype = q.dtype
    k = float_array("k", k, dtype)
    g = float_array("g", g, dtype)
    _check_shape("k", k, ref, sizes, "q", ref)
    _check_shape("g", g, ref, sizes, "q", ref)
    v = float_array("v", v, dtype)
    if v.ndim != q.ndim or v.shape[:-1] != q.shape[:-1] or v.shape[-1] < 1:
        layout = "[" + ", ".join((pre + "H V").split()) + "]"
        raise ValueError(f"v: expected {layout} matching q [{_describe(ref, sizes)}], got shape {v.shape}")
    sizes["V"] = v.shape[-1]
    beta = float_array("beta", beta, dtype)
    _check_shape("beta", beta, pre + "H", sizes, "q", ref)
    if state is None:
        raise ValueError(f"state: expected [{', '.join((pre + 'H K V').split())}], got None")
    state = float_array("state", state, dtype)
    _check_shape("state", state, pre + "H K V", sizes, "q", ref + " V")
    arrays = (q, k, v, g, beta, state)
    if not batched:
        arrays = tuple(x[None] for x in arrays)
    return arrays, batched


def resolve_scale(scale, K: int) -> float:
    """The query scale: ``K**-0.5`` by default, else ``scale`` (which must be finite)."""
    if scale is None:
        return K**-0.5
    value = float(scale)
    if not math.isfinite(value):
        raise ValueError(f"scale: expected a finite number (default K**-0.5), got {scale!r}")
    return value
