"""Grading: execute answered student notebooks in isolation and grade their answers in this process.

``python -m kimilab grade SUBMISSIONS... --out grades.csv`` (``make grade DIR=...``)
executes each notebook it finds (a folder is searched recursively) against the student
edition, in a folder and a kernel of its own (:mod:`kimilab.classroom.isolation`:
sandboxed with Landlock where Linux has it). The kernel only records each answer as
data (:mod:`kimilab.exercises.answers`); the expected values never enter it. This
process reads the answers back and runs the teacher's check on them. One row per
notebook and checked exercise of its chapter:

``notebook, chapter, exercise, status, points, message``

``status`` is ``correct``, ``wrong``, ``unanswered`` (the stub is still there, or the
answer is ``None``), ``edited`` (the exercise's check cell is not the one handed out),
``error`` (the check cell raised, the answer was recorded more than once, the kernel died,
the notebook ran past a limit, or it changed files it must not; the message says which) or
``not run`` (no check cell for it, or the notebook never reached it). ``points`` is 1
for correct, else 0.

``--jobs N`` grades N notebooks at once (each in its own kernel). Beside the CSV go a
gradebook (``NAME-gradebook.csv``: one row per student, one column per exercise, the total)
and an LMS export in Canvas's gradebook-import layout (``NAME-canvas.csv``: one column of
points per chapter). A student is the folder under the named SUBMISSION folder that holds
the notebook (``submissions/alice/01_naive_kv_cache.ipynb`` is ``alice``), else the file's
stem.

One submission cannot stop the class: a notebook that cannot be read, kills its kernel or
hangs gets its rows with the reason, and grading goes on; each notebook's rows reach the
CSV as soon as it is graded. A cell that begins with ``= + - @`` is written with a leading
quote, so no spreadsheet runs a student's text as a formula.

What was taken and what was written: nbclient (the engine nbgrader and otter-grader
also execute with) runs the notebooks; the student edition is made with nbconvert's
preprocessors, as nbgrader makes its release. nbgrader's and otter's autograders run
their tests inside the student's kernel, where a submission can reach and replace them
(the forgeries tests/test_redteam.py plays), so the split -- answers as data out of the
kernel, checks in the grader -- and the sandbox are written here.
"""

from __future__ import annotations

import csv
import re
import shutil
import tempfile
import threading
from collections import Counter
from pathlib import Path

from kimilab.classroom.isolation import Edition, cell_intact, run_isolated

__all__ = ["FIELDS", "find_notebooks", "grade_notebook", "grade", "csv_safe", "student_of", "gradebook", "LIMIT"]

ROOT = Path(__file__).resolve().parents[2]
FIELDS = ("notebook", "chapter", "exercise", "status", "points", "message")
LIMIT = 1800  # seconds a whole notebook may run (each cell: --timeout)


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


def _status(ex: str, edition: Edition, chapter: int, nb, recorded: dict, stubs: dict, errors: dict,
            stopped: str | None) -> tuple[str, str]:
    """(status, message) of exercise ``ex`` in an executed notebook; the check runs here, not in the kernel."""
    from kimilab.classroom.student import VERIFY
    from kimilab.exercises import check

    handed_out = edition.check_cells.get(chapter, {}).get(ex)
    cells = [c.source for c in nb.cells if c.cell_type == "code" and any(m.group(1) == ex for m in VERIFY.finditer(
        c.source))]
    if handed_out is not None and cells and not any(cell_intact(c, handed_out) for c in cells):
        return "edited", f"its check cell is not the one handed out (it must read: {handed_out[:80]})"
    if ex in stubs:
        return "unanswered", stubs[ex]
    got = recorded.get(ex, [])
    if len(got) > 1:
        return "error", f"an answer was recorded {len(got)} times; the check cell records it once"
    if got:
        e = edition.exercises[ex]
        verdict = check(got[0], edition.expected[ex], name=f"{ex} {e.title}", hint=e.hints, rtol=e.rtol,
                        atol=e.atol, verbose=False)
        return verdict.status, verdict.message
    if ex in errors:
        return "error", errors[ex]
    if stopped:
        return "error", stopped
    if not cells:
        return "not run", "the notebook has no check cell for it"
    return "not run", "its check cell did not run"


def grade_notebook(path: Path, *, timeout: int = 600, limit: int = LIMIT, edition: Edition | None = None) -> list[dict]:
    """Execute one notebook in isolation and return its rows (one per checked exercise of its chapter);
    ``edition`` (one per grading run) is built here if not given."""
    import nbformat

    from kimilab.exercises.answers import read_answers

    try:
        nb = nbformat.read(path, as_version=4)
    except Exception as err:  # nbformat raises several kinds for a file that is not a notebook
        return [{"notebook": str(path), "chapter": "", "exercise": "", "status": "error", "points": 0,
                 "message": f"not a readable notebook ({type(err).__name__})"}]
    own = edition is None
    edition = edition or Edition.build()
    try:
        chapter = _chapter(nb, path)
        expected = [i for i in edition.expected if chapter is not None and int(i.split(".")[0]) == chapter]
        work = Path(tempfile.mkdtemp(prefix="work-", dir=edition.root))
        run = run_isolated(nb, edition, work, timeout=timeout, limit=limit)
        recorded, _ = read_answers(run.answers)
        stubs, errors = _errors(run.nb)
        rows = []
        for ex in expected:
            status, message = _status(ex, edition, chapter, run.nb, recorded, stubs, errors, run.stopped)
            rows.append({"notebook": str(path), "chapter": chapter or "", "exercise": ex, "status": status,
                         "points": int(status == "correct"), "message": message})
        shutil.rmtree(work, ignore_errors=True)
        return rows
    finally:
        if own:
            edition.close()


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


def grade(paths: list[str | Path], out: Path, *, timeout: int = 600, limit: int = LIMIT, jobs: int = 1,
          echo=print, edition: Edition | None = None) -> list[dict]:
    """Grade every notebook found under ``paths`` (``jobs`` at a time), writing each one's rows to the CSV
    ``out`` as it finishes (so a crash later loses nothing graded), then the gradebook and the Canvas
    export beside it; returns the rows. ``edition`` (``Edition.build()``) is built, and removed, here
    unless given."""
    from concurrent.futures import ThreadPoolExecutor, as_completed  # each notebook runs in its own kernel

    from kimilab.classroom.isolation import package_exposed

    notebooks = find_notebooks(paths)
    if not notebooks:
        raise ValueError(f"{' '.join(map(str, paths))}: no notebooks found")
    rows = []
    out.parent.mkdir(parents=True, exist_ok=True)
    own = edition is None
    edition = edition or Edition.build()
    try:
        if edition.landlock:
            echo(f"isolation: Landlock sandbox (ABI {edition.landlock}); each notebook reads only Python, the "
                 "system and the student edition, and writes only its own temporary folder")
            if package_exposed(edition.folder):
                echo("warning: this kimilab is installed inside a folder the kernels may read (not editable), so "
                     "its answer modules are readable there; install it with `make setup` (pip install -e .)")
        else:
            jobs = 1  # without a sandbox a changed file is only found afterwards: one notebook at a time
            echo("isolation: no Landlock on this system; each notebook runs in its own folder against the "
                 "student edition, one at a time, and any teacher file it changes is restored and scores it 0. "
                 "Students' code runs with your permissions: grade in a container or a throwaway account")
        snapshot = None if edition.landlock else edition.snapshot()  # a sandboxed kernel cannot write them
        lock = threading.Lock()
        with open(out, "w", newline="", encoding="utf-8") as f, ThreadPoolExecutor(max(1, jobs)) as pool:
            writer = csv.DictWriter(f, fieldnames=FIELDS)
            writer.writeheader()
            f.flush()

            def one(path):
                mine = grade_notebook(path, timeout=timeout, limit=limit, edition=edition)
                with lock:
                    changed = snapshot.restore_changed() if snapshot is not None else []
                if changed:
                    for r in mine:
                        r |= {"status": "error", "points": 0, "message": (
                            f"the notebook changed {len(changed)} file(s) it must not (restored): "
                            f"{', '.join(p.name for p in changed[:3])}")}
                return mine

            running = {pool.submit(one, path): path for path in notebooks}
            for k, done in enumerate(as_completed(running), start=1):
                mine = done.result()
                writer.writerows({key: csv_safe(v) for key, v in r.items()} for r in mine)
                f.flush()
                echo(f"[{k}/{len(notebooks)}] {running[done]}: {sum(r['points'] for r in mine)}/{len(mine)} correct")
                rows += mine
    finally:
        if own:
            edition.close()
    book, canvas = _write_gradebooks(rows, paths, out)
    echo(f"gradebook: {book}; Canvas import: {canvas}")
    return rows
