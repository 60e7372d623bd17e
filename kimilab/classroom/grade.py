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

``--jobs N`` grades N notebooks at once (each in its own kernel). Beside the CSV go a
gradebook (``NAME-gradebook.csv``: one row per student, one column per exercise, the total)
and an LMS export in Canvas's gradebook-import layout (``NAME-canvas.csv``: one column of
points per chapter). A student is the folder under the named SUBMISSION folder that holds
the notebook (``submissions/alice/01_naive_kv_cache.ipynb`` is ``alice``), else the file's
stem.

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

__all__ = ["FIELDS", "find_notebooks", "grade_notebook", "grade", "csv_safe", "student_of", "gradebook"]

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
        env = dict(os.environ, **{GRADE_LOG_ENV: str(log), "KIMILAB_FIGURES": tmp})  # this kernel's only
        try:
            NotebookClient(nb, timeout=timeout, kernel_name="python3", allow_errors=True,
                           resources={"metadata": {"path": str(ROOT / "chapters")}}).execute(env=env)
        except Exception as err:  # a dead or hung kernel ends this notebook, not the class
            stopped = _stopped(err, timeout)
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


def student_of(path: Path, paths: list[str | Path]) -> str:
    """The student a notebook belongs to: its first folder below the SUBMISSION folder holding it, else its stem."""
    for root in map(Path, paths):
        try:
            rel = Path(path).resolve().relative_to(root.resolve())
        except ValueError:
            continue
        if root.is_dir() and len(rel.parts) > 1:
            return rel.parts[0]
    return Path(path).stem


def gradebook(rows: list[dict], paths: list[str | Path]) -> tuple[list[str], list[list]]:
    """(header, one row per student): the student, the points of each exercise seen, the total."""
    exercises = sorted({r["exercise"] for r in rows if r["exercise"]},
                       key=lambda e: tuple(int(x) for x in e.split(".")))
    book: dict[str, dict] = {}
    for r in rows:
        got = book.setdefault(student_of(Path(r["notebook"]), paths), {})
        if r["exercise"]:
            got[r["exercise"]] = got.get(r["exercise"], 0) + r["points"]
    body = [[s] + [got.get(e, 0) for e in exercises] + [sum(got.values())] for s, got in sorted(book.items())]
    return ["student"] + exercises + ["total"], body


def _write_gradebooks(rows: list[dict], paths, out: Path) -> tuple[Path, Path]:
    """The gradebook and the Canvas import next to ``out`` (``NAME-gradebook.csv``, ``NAME-canvas.csv``)."""
    header, body = gradebook(rows, paths)
    book, canvas = (out.with_name(f"{out.stem}-{kind}.csv") for kind in ("gradebook", "canvas"))
    with open(book, "w", newline="", encoding="utf-8") as f:
        csv.writer(f).writerows([header] + [[csv_safe(v) for v in row] for row in body])
    chapters = sorted({int(e.split(".")[0]) for e in header[1:-1]})
    with open(canvas, "w", newline="", encoding="utf-8") as f:  # Canvas: Student, ID, SIS User ID, SIS Login ID, Section
        w = csv.writer(f)
        w.writerow(["Student", "ID", "SIS User ID", "SIS Login ID", "Section"] + [f"kimilab chapter {c}" for c in chapters])
        w.writerow(["Points Possible", "", "", "", ""] + [sum(e.split(".")[0] == str(c) for e in header[1:-1])
                                                         for c in chapters])
        for row in body:
            pts = dict(zip(header[1:-1], row[1:-1]))
            w.writerow([csv_safe(row[0]), "", "", csv_safe(row[0]), ""]
                       + [sum(v for e, v in pts.items() if e.split(".")[0] == str(c)) for c in chapters])
    return book, canvas


def grade(paths: list[str | Path], out: Path, *, timeout: int = 600, jobs: int = 1, echo=print) -> list[dict]:
    """Grade every notebook found under ``paths`` (``jobs`` at a time), writing each one's rows to the CSV
    ``out`` as it finishes (so a crash later loses nothing graded), then the gradebook and the Canvas
    export beside it; returns the rows."""
    from concurrent.futures import ThreadPoolExecutor, as_completed  # each notebook runs in its own kernel

    notebooks = find_notebooks(paths)
    if not notebooks:
        raise ValueError(f"{' '.join(map(str, paths))}: no notebooks found")
    rows = []
    out.parent.mkdir(parents=True, exist_ok=True)
    with open(out, "w", newline="", encoding="utf-8") as f, ThreadPoolExecutor(max(1, jobs)) as pool:
        writer = csv.DictWriter(f, fieldnames=FIELDS)
        writer.writeheader()
        f.flush()
        running = {pool.submit(grade_notebook, path, timeout=timeout): path for path in notebooks}
        for k, done in enumerate(as_completed(running), start=1):
            mine = done.result()
            writer.writerows({key: csv_safe(v) for key, v in r.items()} for r in mine)
            f.flush()
            echo(f"[{k}/{len(notebooks)}] {running[done]}: {sum(r['points'] for r in mine)}/{len(mine)} correct")
            rows += mine
    book, canvas = _write_gradebooks(rows, paths, out)
    echo(f"gradebook: {book}; Canvas import: {canvas}")
    return rows
