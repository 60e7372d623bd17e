"""The exercise check itself: compare a reader's answer with a value kimilab computes, and say what is off."""

from __future__ import annotations

import math

import numpy as np

__all__ = ["check", "ExerciseResult"]


class ExerciseResult:
    """What :func:`check` decided: ``ok`` and the ``message`` it printed."""

    def __init__(self, message: str, ok: bool):
        self.message = message
        self.ok = ok

    def __bool__(self) -> bool:
        return self.ok

    def __repr__(self) -> str:
        return self.message

    def _ipython_display_(self) -> None:
        """Already printed by :func:`check`; show nothing twice in a notebook."""


def _close(answer, expected, rtol: float, atol: float) -> bool:
    if isinstance(expected, (str, bool)) or expected is None:
        return answer == expected
    try:
        a = np.asarray(answer, dtype=float)
        e = np.asarray(expected, dtype=float)
    except (TypeError, ValueError):
        return False
    if a.shape != e.shape:
        return False
    return bool(np.allclose(a, e, rtol=rtol, atol=atol))


def _what_is_off(answer, expected) -> str:
    """One clause on how a wrong answer differs: its shape, its type, or by what factor."""
    if isinstance(expected, (str, bool)) or expected is None:
        return ""
    try:
        a = np.asarray(answer, dtype=float)
        e = np.asarray(expected, dtype=float)
    except (TypeError, ValueError):
        return f", which is not a number (expected a {type(expected).__name__})"
    if a.shape != e.shape:
        return f", of shape {a.shape} where {e.shape} is expected"
    if a.ndim or not np.isfinite(a) or a == 0 or e == 0:
        return ""
    ratio = float(e / a)
    if ratio <= 0:
        return ", which has the wrong sign"
    side = "too small" if ratio > 1 else "too large"
    factor = max(ratio, 1 / ratio)
    return f", {(factor - 1) * 100:.2g}% {side}" if factor < 1.5 else f", {side} by a factor of {factor:.3g}"


def check(answer, expected, *, name: str, hint: str = "", rtol: float = 1e-6, atol: float = 0.0,
          verbose: bool = True) -> ExerciseResult:
    """Check an exercise answer and print a helpful message; never raises for a wrong answer.

    ``answer=None`` means "not attempted yet": the message says what to compute.
    Numbers compare with ``rtol``/``atol``; strings and booleans compare exactly.
    """
    if answer is None or (isinstance(answer, float) and math.isnan(answer)):
        result = ExerciseResult(f"[{name}] not answered yet. {hint}".rstrip(), False)
    elif _close(answer, expected, rtol, atol):
        result = ExerciseResult(f"[{name}] correct.", True)
    else:
        shown = repr(answer) if np.ndim(answer) == 0 else "an array"
        hint = f" Hint: {hint}" if hint else ""
        result = ExerciseResult(f"[{name}] not quite: you gave {shown}{_what_is_off(answer, expected)}.{hint}", False)
    if verbose:
        print(result.message)
    return result
