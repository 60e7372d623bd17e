"""Grading: execute answered student notebooks and write every exercise's result to a CSV.

``python -m kimilab grade SUBMISSIONS... --out grades.csv`` (``make grade DIR=...``)
executes each notebook it finds (a folder is searched recursively) in a fresh kernel
from ``chapters/``, with the teacher's checkers, and records each ``verify`` verdict
through ``KIMILAB_GRADE_LOG`` (:mod:`kimilab.exercises`). A cell that raises does not
stop the run, so one broken exercise costs only itself. One row per notebook and
checked exercise of its chapter:

``notebook, chapter, exercise, status, points, message``

``status`` is ``correct``, ``wrong``, ``unanswered`` (the stub is still there, or the
answer is ``None``), ``error`` (the ``verify`` cell raised; the message says what) or
``not run`` (no ``verify`` call for it executed). ``points`` is 1 for correct, else 0.
Students' code runs with the grader's permissions: grade in a throwaway container or
account.
"""

from __future__ import annotations

import csv
import json
import os
import tempfile
from collections import Counter
from pathlib import Path

__all__ = ["FIELDS", "find_notebooks", "grade_notebook", "grade"]

ROOT = Path(__file__).resolve().parents[2]
FIELDS = ("notebook", "chapter", "exercise", "status", "points", "message")


def find_notebooks(paths: list[str | Path]) -> list[Path]:
    """The notebooks named or inside the folders named (recursively, without checkpoints), in order."""
    found = []
    for p in map(Path, paths):
        if p.is_dir():
            found += sorted(q for q in p.rglob("*.ipynb") if ".ipynb_checkpoints" not in q.parts)
        elif p.is_file() and p.suffix == ".ipynb":
            found.append(p)
        else:
            raise ValueError(f"{p}: no such notebook or folder")
    return found


def _chapter(nb) -> int | None:
    from kimilab.classroom.student import VERIFY

    ids = [m.group(1) for c in nb.cells if c.cell_type == "code" for m in VERIFY.finditer(c.source)]
    counts = Counter(int(i.split(".")[0]) for i in ids)
    return counts.most_common(1)[0][0] if counts else None


def _errors(nb) -> tuple[dict[str, str], dict[str, str]]:
    """({id: stub still raising}, {id: the error its verify cell raised}) from an executed notebook."""
    from kimilab.classroom.student import VERIFY, stub_id

    stubs, errors = {}, {}
    for cell in nb.cells:
        if cell.cell_type != "code":
            continue
        err = next((o for o in cell.get("outputs", []) if o.get("output_type") == "error"), None)
        if err is None:
            continue
        stub = stub_id(cell.source)
        if stub and err.get("ename") == "NotImplementedError":
            stubs[stub] = "the exercise's stub is still in place"
        for m in VERIFY.finditer(cell.source):
            errors[m.group(1)] = f"{err.get('ename')}: {err.get('evalue', '')}"[:200]
    return stubs, errors


def grade_notebook(path: Path, *, timeout: int = 600) -> list[dict]:
    """Execute one notebook and return its rows (one per checked exercise of its chapter)."""
    import nbformat
    from nbclient import NotebookClient

    from kimilab.exercises import GRADE_LOG_ENV, all_exercises

    try:
        nb = nbformat.read(path, as_version=4)
    except Exception as err:  # nbformat raises several kinds for a file that is not a notebook
        raise ValueError(f"{path}: not a readable notebook ({type(err).__name__})") from err
    chapter = _chapter(nb)
    expected = [i for i in all_exercises() if chapter is not None and int(i.split(".")[0]) == chapter]
    with tempfile.TemporaryDirectory() as tmp:
        log = Path(tmp) / "verdicts.jsonl"
        saved = {k: os.environ.get(k) for k in (GRADE_LOG_ENV, "KIMILAB_FIGURES")}
        os.environ.update({GRADE_LOG_ENV: str(log), "KIMILAB_FIGURES": tmp})
        try:
            NotebookClient(nb, timeout=timeout, kernel_name="python3", allow_errors=True,
                           resources={"metadata": {"path": str(ROOT / "chapters")}}).execute()
        finally:
            for k, v in saved.items():
                os.environ.pop(k) if v is None else os.environ.__setitem__(k, v)
        verdicts = {}
        if log.exists():
            for line in log.read_text(encoding="utf-8").splitlines():
                v = json.loads(line)
                verdicts[v["id"]] = v
    stubs, errors = _errors(nb)
    rows = []
    for ex in expected + sorted(set(verdicts) - set(expected)):
        if ex in stubs:
            status, message = "unanswered", stubs[ex]
        elif ex in verdicts:
            status, message = verdicts[ex]["status"], verdicts[ex]["message"]
        elif ex in errors:
            status, message = "error", errors[ex]
        else:
            status, message = "not run", "no verify call for it ran"
        rows.append({"notebook": str(path), "chapter": chapter or "", "exercise": ex, "status": status,
                     "points": int(status == "correct"), "message": message})
    return rows


def grade(paths: list[str | Path], out: Path, *, timeout: int = 600, echo=print) -> list[dict]:
    """Grade every notebook found under ``paths`` and write the CSV ``out``; returns the rows."""
    notebooks = find_notebooks(paths)
    if not notebooks:
        raise ValueError(f"{' '.join(map(str, paths))}: no notebooks found")
    rows = []
    for path in notebooks:
        mine = grade_notebook(path, timeout=timeout)
        echo(f"{path}: {sum(r['points'] for r in mine)}/{len(mine)} correct")
        rows += mine
    out.parent.mkdir(parents=True, exist_ok=True)
    with open(out, "w", newline="", encoding="utf-8") as f:
        writer = csv.DictWriter(f, fieldnames=FIELDS)
        writer.writeheader()
        writer.writerows(rows)
    return rows
