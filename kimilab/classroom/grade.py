"""Grading: execute answered student notebooks and write every exercise's result to a CSV.

``python -m kimilab grade SUBMISSIONS... --out grades.csv`` (``make grade DIR=...``)
executes each notebook it finds (a folder is searched recursively) in a fresh kernel
from ``chapters/``, with the teacher's checkers, and records each ``verify`` verdict
through ``KIMILAB_GRADE_LOG`` (:mod:`kimilab.exercises`). A cell that raises does not
stop the run, so one broken exercise costs only itself. One row per notebook and
checked exercise of its chapter:

``notebook, chapter, exercise, status, points, message``

``status`` is ``correct``, ``wrong``, ``unanswered`` (the stub is still there, or the
answer is ``None``), ``error`` (the ``verify`` cell raised, the kernel died or a cell ran
past the time limit; the message says what) or ``not run`` (no ``verify`` call for it
executed, or the notebook has none). ``points`` is 1 for correct, else 0.

One submission cannot stop the class: a notebook that cannot be read, kills its kernel or
hangs gets its rows with the reason, and grading goes on; each notebook's rows reach the
CSV as soon as it is graded. A cell that begins with ``= + - @`` is written with a leading
quote, so no spreadsheet runs a student's text as a formula. Students' code still runs
with the grader's permissions: grade in a throwaway container or account.
"""

from __future__ import annotations

import csv
import json
import os
import re
import tempfile
from collections import Counter
from pathlib import Path

__all__ = ["FIELDS", "find_notebooks", "grade_notebook", "grade", "csv_safe"]

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


_TITLE = re.compile(r"^#\s+(\d+)\.\s", re.M)
_FILE = re.compile(r"^(\d\d)_")


def _chapter(nb, path: Path | None = None) -> int | None:
    """The chapter a notebook answers: the one most of its ``verify`` calls name, else its title's
    number ("# 11. ..."), else its file name's ("11_..."); None if nothing says."""
    from kimilab.classroom.student import VERIFY

    ids = [m.group(1) for c in nb.cells if c.cell_type == "code" for m in VERIFY.finditer(c.source)]
    counts = Counter(int(i.split(".")[0]) for i in ids)
    if counts:
        return counts.most_common(1)[0][0]
    title = next((m for c in nb.cells if c.cell_type == "markdown" for m in [_TITLE.search(c.source)] if m), None)
    if title:
        return int(title.group(1))
    m = _FILE.match(path.name) if path is not None else None
    return int(m.group(1)) if m else None


def _verdicts(log: Path) -> dict[str, dict]:
    """The verdicts the kernel appended, by exercise id; a line that is not one (malformed, or
    without the fields) is skipped rather than trusted or fatal."""
    out = {}
    if not log.exists():
        return out
    for line in log.read_text(encoding="utf-8", errors="replace").splitlines():
        try:
            v = json.loads(line)
            out[str(v["id"])] = {"status": str(v["status"]), "message": str(v.get("message", ""))}
        except (ValueError, TypeError, KeyError, RecursionError):
            continue
    return out


def _stopped(err: Exception, timeout: int) -> str:
    """Why a notebook's run ended early, in one line."""
    name = type(err).__name__
    if name == "CellTimeoutError":
        return f"a cell ran past the {timeout} s limit; the notebook was stopped there"
    if name == "DeadKernelError":
        return "the kernel died (the notebook exited or ran out of memory); the rest did not run"
    return f"the notebook stopped: {name}: {' '.join(str(err).split())[:160]}"


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
        return [{"notebook": str(path), "chapter": "", "exercise": "", "status": "error", "points": 0,
                 "message": f"not a readable notebook ({type(err).__name__})"}]
    chapter = _chapter(nb, path)
    expected = [i for i in all_exercises() if chapter is not None and int(i.split(".")[0]) == chapter]
    stopped = None
    with tempfile.TemporaryDirectory() as tmp:
        log = Path(tmp) / "verdicts.jsonl"
        saved = {k: os.environ.get(k) for k in (GRADE_LOG_ENV, "KIMILAB_FIGURES")}
        os.environ.update({GRADE_LOG_ENV: str(log), "KIMILAB_FIGURES": tmp})
        try:
            NotebookClient(nb, timeout=timeout, kernel_name="python3", allow_errors=True,
                           resources={"metadata": {"path": str(ROOT / "chapters")}}).execute()
        except Exception as err:  # a dead or hung kernel ends this notebook, not the class
            stopped = _stopped(err, timeout)
        finally:
            for k, v in saved.items():
                os.environ.pop(k) if v is None else os.environ.__setitem__(k, v)
        verdicts = _verdicts(log)
    stubs, errors = _errors(nb)
    rows = []
    for ex in expected + sorted(set(verdicts) - set(expected)):
        if ex in stubs:
            status, message = "unanswered", stubs[ex]
        elif ex in verdicts:
            status, message = verdicts[ex]["status"], verdicts[ex]["message"]
        elif ex in errors:
            status, message = "error", errors[ex]
        elif stopped:
            status, message = "error", stopped
        else:
            status, message = "not run", "no verify call for it ran"
        rows.append({"notebook": str(path), "chapter": chapter or "", "exercise": ex, "status": status,
                     "points": int(status == "correct"), "message": message})
    return rows


def csv_safe(value):
    """A cell as written to the CSV: text that a spreadsheet would run as a formula (it begins
    with = + - @, a tab or a carriage return) gets a leading quote; numbers pass as they are."""
    if isinstance(value, str) and value[:1] in ("=", "+", "-", "@", "\t", "\r"):
        return "'" + value
    return value


def grade(paths: list[str | Path], out: Path, *, timeout: int = 600, echo=print) -> list[dict]:
    """Grade every notebook found under ``paths``, writing each one's rows to the CSV ``out`` as it
    finishes (so a crash later loses nothing graded); returns the rows."""
    notebooks = find_notebooks(paths)
    if not notebooks:
        raise ValueError(f"{' '.join(map(str, paths))}: no notebooks found")
    rows = []
    out.parent.mkdir(parents=True, exist_ok=True)
    with open(out, "w", newline="", encoding="utf-8") as f:
        writer = csv.DictWriter(f, fieldnames=FIELDS)
        writer.writeheader()
        f.flush()
        for k, path in enumerate(notebooks, start=1):
            mine = grade_notebook(path, timeout=timeout)
            writer.writerows({key: csv_safe(v) for key, v in r.items()} for r in mine)
            f.flush()
            echo(f"[{k}/{len(notebooks)}] {path}: {sum(r['points'] for r in mine)}/{len(mine)} correct")
            rows += mine
    return rows
