"""Exercise checking: compare a reader's answer with a value kimilab computes."""

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
        shown = answer if np.ndim(answer) == 0 else f"array of shape {np.shape(answer)}"
        result = ExerciseResult(
            f"[{name}] not quite: you gave {shown!r}. {hint}".rstrip(), False
        )
    if verbose:
        print(result.message)
    return result
