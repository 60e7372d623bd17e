"""The exercise check itself: compare a reader's answer with the expected value, and say what is off.

The teacher's check: :func:`check` has the expected value (the teacher's repository
computes it with kimilab, and the grader runs it in its own process) and says by what
factor an answer is off and where an array differs most. It recognises a unit slip: an
answer off by exactly 2^10, 2^20, 2^30, 10^3, 10^6 or 10^9 (or by the ratio of a binary
to a decimal prefix) is named as such. The student bundle has no expected value; its
public checks (:mod:`kimilab.exercises.public`) share this module's wording.
"""

from __future__ import annotations

import math

import numpy as np

__all__ = ["check", "ExerciseResult", "UNIT_SLIPS", "as_numbers", "hint_for", "describe_type", "unit_slip_clause",
           "shape_clause", "shown", "unanswered"]

# (factor, the unit an answer too small by this factor was probably given in, the unit asked for)
UNIT_SLIPS: tuple[tuple[float, str, str], ...] = (
    (2.0**10, "KiB", "bytes"),
    (2.0**20, "MiB", "bytes"),
    (2.0**30, "GiB", "bytes"),
    (1e3, "thousands (kB, k tokens, seconds)", "units (bytes, tokens, milliseconds)"),
    (1e6, "millions (MB, M tokens)", "units (bytes, tokens)"),
    (1e9, "billions (GB, GFLOP)", "units (bytes, FLOPs)"),
    (2.0**10 / 1e3, "KiB", "kB"),
    (2.0**20 / 1e6, "MiB", "MB"),
    (2.0**30 / 1e9, "GiB", "GB"),
)
_FACTOR_NAMES = {2.0**10: "2^10", 2.0**20: "2^20", 2.0**30: "2^30", 1e3: "10^3", 1e6: "10^6", 1e9: "10^9",
                 2.0**10 / 1e3: "1.024 (2^10 / 10^3)", 2.0**20 / 1e6: "1.049 (2^20 / 10^6)",
                 2.0**30 / 1e9: "1.074 (2^30 / 10^9)"}


class ExerciseResult:
    """What a check decided: ``ok``, ``status`` ("correct", "wrong" or "unanswered") and the ``message`` printed."""

    def __init__(self, message: str, ok: bool, status: str | None = None):
        self.message = message
        self.ok = ok
        self.status = status or ("correct" if ok else "wrong")

    def __bool__(self) -> bool:
        return self.ok

    def __repr__(self) -> str:
        return self.message

    def _ipython_display_(self) -> None:
        """Already printed by the check; show nothing twice in a notebook."""


def hint_for(hints, attempt: int) -> str:
    """The hint for the ``attempt``-th wrong try (1-based): the concept first, then narrower ones."""
    if isinstance(hints, str):
        hints = (hints,) if hints else ()
    if not hints:
        return ""
    return hints[min(max(attempt, 1), len(hints)) - 1]


def describe_type(value) -> str:
    """'an integer', 'a number', 'an array of shape (3, 3)', ... (with its article)."""
    if isinstance(value, bool):
        return "True or False"
    if isinstance(value, (int, np.integer)):
        return "an integer"
    if isinstance(value, (float, np.floating)):
        return "a number"
    if isinstance(value, str):
        return "a string"
    if isinstance(value, np.ndarray) or isinstance(value, (list, tuple)):
        return f"an array of shape {np.shape(value)}"
    return f"a {type(value).__name__}"


def shape_clause(got: tuple, want: tuple) -> str:
    """The clause for an answer of the wrong shape (the answer itself is already quoted with its shape)."""
    return f", where {'a single number' if not want else f'an array of shape {want}'} is expected"


def as_numbers(value):
    """The answer as a float array, or None if it is not numbers (a string is not, even "12")."""
    if isinstance(value, (str, bytes)) or (isinstance(value, (list, tuple)) and any(isinstance(v, str) for v in value)):
        return None
    try:
        return np.asarray(value, dtype=float)
    except (TypeError, ValueError):
        return None


def _close(a, e, rtol: float, atol: float) -> bool:
    return bool(np.allclose(a, e, rtol=rtol, atol=atol))


def unit_slip_clause(factor: float, too_small: bool) -> str:
    """The clause naming a unit slip by ``factor``; ``too_small``: the answer times factor is right."""
    small, asked = next((s, a) for f, s, a in UNIT_SLIPS if f == factor)
    name = _FACTOR_NAMES[factor]
    if too_small:
        return f", too small by exactly {name}: you may have given {small} where {asked} were asked"
    return f", too large by exactly {name}: you may have given {asked} where {small} were asked"


def _unit_slip(a, e, rtol: float, atol: float) -> str:
    for factor, _, _ in UNIT_SLIPS:
        if _close(a * factor, e, rtol, atol * factor):
            return unit_slip_clause(factor, True)
        if _close(a / factor, e, rtol, atol / factor):
            return unit_slip_clause(factor, False)
    return ""


def _what_is_off(answer, expected, rtol: float, atol: float) -> str:
    """One clause on how a wrong answer differs: its type, its shape, a unit slip, by what factor, or where."""
    if isinstance(expected, (str, bool)) or expected is None:
        same = isinstance(answer, (bool, np.bool_)) if isinstance(expected, bool) else isinstance(answer, str)
        return "" if same else f" ({describe_type(expected)} was expected)"
    a, e = as_numbers(answer), as_numbers(expected)
    if a is None:
        return f", which is not a number ({describe_type(expected)} was expected)"
    if a.shape != e.shape:
        return shape_clause(a.shape, e.shape)
    if not np.all(np.isfinite(a)):
        return ", which is not finite"
    slip = _unit_slip(a, e, rtol, atol)
    if slip:
        return slip
    if a.ndim == 0 and isinstance(expected, (int, np.integer)) and float(a) != int(a):
        return ", which is not a whole number (an integer was expected)"
    if a.ndim:
        diff = np.abs(a - e)
        worst = np.unravel_index(int(np.argmax(diff)), diff.shape)
        off = int(np.count_nonzero(~np.isclose(a, e, rtol=rtol, atol=atol)))
        index = tuple(int(i) for i in worst) if len(worst) > 1 else int(worst[0])
        return (f"; {off} of {a.size} elements are off, the most at index {index}: "
                f"{a[worst]:.6g} where {e[worst]:.6g} is expected (difference {diff[worst]:.3g})")
    if a == 0 or e == 0:
        return ""
    ratio = float(e / a)
    if ratio <= 0:
        return ", which has the wrong sign"
    side = "too small" if ratio > 1 else "too large"
    factor = max(ratio, 1 / ratio)
    return f", {(factor - 1) * 100:.2g}% {side}" if factor < 1.5 else f", {side} by a factor of {factor:.3g}"


def _equal(answer, expected, rtol: float, atol: float) -> bool:
    if isinstance(expected, bool):
        return isinstance(answer, (bool, np.bool_)) and bool(answer) == expected
    if isinstance(expected, str) or expected is None:
        return isinstance(answer, str) and answer == expected
    a, e = as_numbers(answer), as_numbers(expected)
    return a is not None and a.shape == e.shape and _close(a, e, rtol, atol)


def unanswered(answer) -> bool:
    """``None`` or NaN: the reader has not computed an answer yet."""
    return answer is None or (isinstance(answer, float) and math.isnan(answer))


def shown(answer) -> str:
    """How a wrong answer is quoted back: its value, or its kind for an array."""
    try:
        if np.ndim(answer):
            return f"an array of shape {np.shape(answer)}"
    except ValueError:  # a ragged list
        return "a ragged list"
    text = repr(answer)
    return text if len(text) <= 60 else text[:57] + "..."


def check(answer, expected, *, name: str, hint="", rtol: float = 1e-6, atol: float = 0.0,
          verbose: bool = True, attempt: int = 1) -> ExerciseResult:
    """Check an exercise answer and print a one-line verdict; never raises for a wrong answer.

    ``answer=None`` means "not attempted yet": the message gives the first hint.
    Numbers compare with ``rtol``/``atol`` (numpy's ``allclose``); strings and booleans
    compare exactly. ``hint`` is one hint or a sequence of them, concept first; a
    wrong answer shows the ``attempt``-th (the last one once they run out).
    """
    if unanswered(answer):
        result = ExerciseResult(f"[{name}] not answered yet. {hint_for(hint, 1)}".rstrip(), False, "unanswered")
    elif _equal(answer, expected, rtol, atol):
        result = ExerciseResult(f"[{name}] correct.", True)
    else:
        text = hint_for(hint, attempt)
        text = f" Hint: {text}" if text else ""
        off = _what_is_off(answer, expected, rtol, atol)
        result = ExerciseResult(f"[{name}] not quite: you gave {shown(answer)}{off}.{text}", False)
    if verbose:
        print(result.message)
    return result
