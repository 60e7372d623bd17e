"""The classroom edition: student notebooks, the student bundle, and grading.

* :mod:`~kimilab.classroom.student`: one chapter without solutions or outputs;
* :mod:`~kimilab.classroom.bundle`: ``make student`` -> ``student/`` and ``student.zip``,
  which run the chapters and sanity-check answers without holding them;
* :mod:`~kimilab.classroom.grade`: ``make grade DIR=...`` -> a CSV of every exercise's
  result per answered notebook.
"""

from __future__ import annotations

import sys
from pathlib import Path

from kimilab.classroom.student import (SOLUTION_TAG, StubSolutions, chapter_notebooks, exercise_ids, student_notebook,
                                       stub_id)

__all__ = ["SOLUTION_TAG", "StubSolutions", "chapter_notebooks", "exercise_ids", "student_notebook", "stub_id",
           "main", "grade_main"]

ROOT = Path(__file__).resolve().parents[2]


def main() -> int:
    """``make student``: write the bundle and say what is in it."""
    from kimilab.classroom.bundle import STUDENT, ZIP, build_bundle

    n = build_bundle()
    print(f"student bundle: {STUDENT.relative_to(ROOT)}/ and {ZIP.relative_to(ROOT)} ({n['zip_bytes'] / 1e6:.1f} MB): "
          f"{n['chapters']} chapters, {n['exercises']} exercises stubbed with public checks ({n['checked']}), "
          f"{n['files']} files; no solutions, no outputs, no checker modules")
    return 0


def grade_main(paths: list[str], out: str, timeout: int, jobs: int = 1, limit: int = 1800) -> int:
    """``make grade``: execute the notebooks, write the CSV, print one line per notebook."""
    from kimilab.classroom.grade import grade

    from kimilab.validate import writable_file

    try:
        writable_file("--out", out)
    except ValueError as err:
        print(f"python -m kimilab grade: error: {err}", file=sys.stderr)
        return 2
    try:
        rows = grade(paths, Path(out), timeout=timeout, jobs=jobs, limit=limit)
    except ValueError as err:
        print(f"python -m kimilab grade: error: argument SUBMISSION: {err}", file=sys.stderr)
        return 2
    print(f"grades: {out} ({len(rows)} rows, {sum(r['points'] for r in rows)} correct)")
    return 0
