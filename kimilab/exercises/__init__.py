"""Exercises: the check, and a checker for every chapter's checked exercises.

A chapter's checked exercise is three cells: the question (markdown), the reader's
solution (a code cell tagged ``solution``, which the classroom edition replaces by a
stub) and ``verify("N.M", answer)``. The checker lives here, not in the notebook, so
the student edition does not print the answer: :func:`verify` recomputes the expected
value with kimilab and says in one sentence what is wrong with a wrong answer.
Checkers are registered per chapter in ``kimilab/exercises/chNN.py``.
"""

from __future__ import annotations

import importlib
import pkgutil
import re
from dataclasses import dataclass
from typing import Callable

from kimilab.exercises.core import ExerciseResult, check

__all__ = ["check", "ExerciseResult", "Exercise", "exercise", "verify", "all_exercises", "CHAPTERS"]

# chapters whose checkers live here: one module kimilab/exercises/chNN.py each
CHAPTERS = tuple(sorted(int(m.name[2:]) for m in pkgutil.iter_modules(__path__) if re.fullmatch(r"ch\d\d", m.name)))
EXERCISES: dict[str, "Exercise"] = {}
_ID = re.compile(r"^(\d{1,2})\.(\d{1,2})$")


@dataclass(frozen=True)
class Exercise:
    """One checked exercise: its id ("6.2"), title, how to compute the answer, a hint."""

    id: str
    title: str
    expected: Callable[[], object]
    hint: str
    rtol: float = 1e-6
    atol: float = 0.0


def exercise(id: str, title: str, *, hint: str, rtol: float = 1e-6, atol: float = 0.0):
    """Register ``fn`` (no arguments, returns the expected answer) as exercise ``id``."""
    if not _ID.match(id):
        raise ValueError(f"id={id!r}: expected 'chapter.number', e.g. '6.2'")

    def register(fn):
        if id in EXERCISES:
            raise ValueError(f"id={id!r}: registered twice")
        EXERCISES[id] = Exercise(id, title, fn, hint, rtol, atol)
        return fn

    return register


def _load(chapter: int) -> None:
    importlib.import_module(f"kimilab.exercises.ch{chapter:02d}")


def verify(id: str, answer, *, verbose: bool = True) -> ExerciseResult:
    """Check ``answer`` for exercise ``id`` ("N.M"); prints and returns the verdict, never raises for a wrong one."""
    m = _ID.match(str(id))
    if not m:
        raise ValueError(f"id={id!r}: expected 'chapter.number', e.g. '6.2'")
    if int(m.group(1)) in CHAPTERS:
        _load(int(m.group(1)))
    if id not in EXERCISES:
        raise ValueError(f"id={id!r}: no such checked exercise; known: {sorted(EXERCISES)}")
    ex = EXERCISES[id]
    return check(answer, ex.expected(), name=f"{id} {ex.title}", hint=ex.hint, rtol=ex.rtol, atol=ex.atol,
                 verbose=verbose)


def all_exercises() -> dict[str, Exercise]:
    """Every registered checker, by id (loads every chapter's module)."""
    for chapter in CHAPTERS:
        _load(chapter)
    return dict(sorted(EXERCISES.items(), key=lambda kv: tuple(map(int, kv[0].split(".")))))
