"""Exercises: the check, and a checker for every chapter's checked exercises.

A chapter's checked exercise is three cells: the question (markdown), the reader's
solution (a code cell tagged ``solution``, which the classroom edition replaces by a
stub) and ``verify("N.M", answer)``, which says "correct" or, in one sentence, what is
off, and gives a hint: the concept on the first wrong try, a narrower one after.

Where the answers come from:

* in the teacher's repository, ``kimilab/exercises/chNN.py`` registers one function per
  exercise that computes the expected value with kimilab (:func:`exercise`), and
  ``verify`` says "correct" or what is off;
* in the student bundle (``make student``) those modules are absent, and ``verify``
  runs only public sanity checks (:mod:`kimilab.exercises.public`): the kind of answer,
  its sign and a range of sizes. The bundle holds no answer and no digest of one.

When ``KIMILAB_ANSWERS`` names a file, ``verify`` first appends the answer to it as data
(:mod:`kimilab.exercises.answers`): that is all ``python -m kimilab grade`` takes from
a student's kernel. It grades in its own process.
"""

from __future__ import annotations

import importlib
import pkgutil
import re
from dataclasses import dataclass
from typing import Callable

from kimilab.exercises import answers, public
from kimilab.exercises.core import ExerciseResult, check

__all__ = ["check", "ExerciseResult", "Exercise", "exercise", "verify", "all_exercises", "CHAPTERS"]

# chapters whose checkers live here: one module kimilab/exercises/chNN.py each (none in the student bundle)
CHAPTERS = tuple(sorted(int(m.name[2:]) for m in pkgutil.iter_modules(__path__) if re.fullmatch(r"ch\d\d", m.name)))
EXERCISES: dict[str, "Exercise"] = {}
_ID = re.compile(r"^(\d{1,2})\.(\d{1,2})$")
_ATTEMPTS: dict[str, int] = {}


@dataclass(frozen=True)
class Exercise:
    """One checked exercise: its id ("6.2"), title, how to compute the answer, its hints (concept first)."""

    id: str
    title: str
    expected: Callable[[], object]
    hints: tuple[str, ...]
    rtol: float = 1e-6
    atol: float = 0.0


def exercise(id: str, title: str, *, hint: str | tuple[str, ...], rtol: float = 1e-6, atol: float = 0.0):
    """Register ``fn`` (no arguments, returns the expected answer) as exercise ``id``.

    ``hint`` is one hint or a tuple of them in the order a reader should see them: the
    concept first, then narrower ones; none may name the call that computes the answer.
    """
    if not _ID.match(id):
        raise ValueError(f"id={id!r}: expected 'chapter.number', e.g. '6.2'")
    hints = (hint,) if isinstance(hint, str) else tuple(hint)

    def register(fn):
        if id in EXERCISES:
            raise ValueError(f"id={id!r}: registered twice")
        EXERCISES[id] = Exercise(id, title, fn, hints, rtol, atol)
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
    answers.record(id, answer)  # grading: the answer as data, before any check can fail
    attempt = _ATTEMPTS.get(id, 0) + 1
    if id in EXERCISES:
        ex = EXERCISES[id]
        result = check(answer, ex.expected(), name=f"{id} {ex.title}", hint=ex.hints, rtol=ex.rtol, atol=ex.atol,
                       verbose=verbose, attempt=attempt)
    else:
        records = public.load_public()
        if id not in records:
            known = sorted(set(EXERCISES) | set(records), key=lambda k: tuple(map(int, k.split("."))))
            raise ValueError(f"id={id!r}: no such checked exercise; known: {known}")
        result = public.check_public(answer, records[id], verbose=verbose, attempt=attempt)
    if result.status == "wrong":
        _ATTEMPTS[id] = attempt
    return result


def all_exercises() -> dict[str, Exercise]:
    """Every registered checker, by id (loads every chapter's module)."""
    for chapter in CHAPTERS:
        _load(chapter)
    return dict(sorted(EXERCISES.items(), key=lambda kv: tuple(map(int, kv[0].split(".")))))
