"""The grader against students who try to forge a grade or break the class (issue 35's attacks).

One grading run over a class of chapter-1 notebooks: two honest students (first and last)
and one notebook per attack. Each attack must fail to forge -- its target exercise scores 0
-- and fail to break the class: every notebook gets its rows, the honest ones grade
correctly in the same run, and the teacher's files are unchanged afterwards.

* F1 forged records: a verdict line ``{"status": "correct"}`` in the old log and in the
  answers file, and a brute force that records a thousand guesses;
* F2 the key: ``EXERCISES["1.1"].expected()``, and running the teacher's own checker file;
* F3 monkey-patching the check; F4 an answer whose ``__array__`` walks the stack for the
  expected value; F5 a formula as the answer and as the student's folder name;
* G1 ``os._exit``; G2 an endless loop, and a notebook that runs past the notebook limit;
  G3 malformed lines in the answers file; G4 writing to the teacher's package, the edition's
  copy, and ``teacher_answers.md``;
* a notebook without check cells, and one whose check cell passes a value in place of
  ``answer``.

The teacher's checker file (F2's second half) is out of reach only in Landlock's sandbox;
without it that line of the test is skipped and the README says to grade in a container.
Marked ``classroom``: ``make classroom`` runs it (about a minute).
"""

from __future__ import annotations

import csv
import hashlib
from pathlib import Path

import nbformat
import pytest

from kimilab import classroom
from kimilab.classroom import sandbox

ROOT = Path(__file__).resolve().parent.parent
CHAPTER1 = next((ROOT / "chapters").glob("01_*.ipynb"))
TEACHER = str(ROOT)


def _solution(ex: str) -> str:
    teacher = nbformat.read(CHAPTER1, as_version=4)
    solutions = [c.source for c in teacher.cells if c.cell_type == "code"
                 and classroom.SOLUTION_TAG in c.metadata.get("tags", [])]
    return dict(zip((i for _, i in classroom.exercise_ids(teacher)), solutions))[ex]


def _write(path: Path, *cells: str) -> Path:
    nb = nbformat.v4.new_notebook()
    nb.cells = [nbformat.v4.new_markdown_cell("# 1. The naive KV cache")]
    nb.cells += [nbformat.v4.new_code_cell(c) for c in ("from kimilab.exercises import verify",) + cells]
    path.parent.mkdir(parents=True, exist_ok=True)
    nbformat.write(nb, path)
    return path


CHECK = 'verify("{}", answer)'
FORGE_LOG = """import json, os
for var in ("KIMILAB_GRADE_LOG", "KIMILAB_ANSWERS"):
    if os.environ.get(var):
        with open(os.environ[var], "a") as f:
            for ex in ("1.1", "1.2"):
                f.write(json.dumps({"id": ex, "status": "correct", "message": "correct"}) + "\\n")
answer = None"""
GUESSES = """import json, os
with open(os.environ["KIMILAB_ANSWERS"], "a") as f:
    for guess in range(1000):
        f.write(json.dumps({"id": "1.2", "answer": {"type": "int", "value": guess}}) + "\\n")
answer = None"""
KEY = f"""answer = None
try:
    from kimilab.exercises import EXERCISES
    answer = EXERCISES["1.1"].expected()
except Exception as err:
    print("no key:", type(err).__name__)
try:
    import runpy
    runpy.run_path({TEACHER!r} + "/kimilab/exercises/ch01.py")
    answer = EXERCISES["1.1"].expected()
except Exception as err:
    print("no teacher file:", type(err).__name__)"""
PATCH = """import kimilab.exercises as E
import kimilab.exercises.core as C
import kimilab.exercises.answers as A
C.check = E.check = lambda *a, **k: C.ExerciseResult("correct", True)
E.public.check_public = lambda *a, **k: C.ExerciseResult("correct", True)
answer = 1"""
WALKER = """import sys
import numpy as np
class Walker:
    def __array__(self, dtype=None, copy=None):
        frame = sys._getframe()
        while frame is not None:
            if "expected" in frame.f_locals:
                return np.asarray(frame.f_locals["expected"], dtype=float)
            frame = frame.f_back
        return np.asarray(0.0)
answer = Walker()"""
TAMPER = f"""import kimilab, os
hits = []
for path in ({TEACHER!r} + "/kimilab/exercises/core.py", {TEACHER!r} + "/chapters/teacher_answers.md",
             os.path.join(os.path.dirname(kimilab.__file__), "exercises", "answers.py")):
    try:
        with open(path, "a") as f:
            f.write("\\n# tampered\\n")
        hits.append(path)
    except OSError as err:
        print("refused:", path, type(err).__name__)
answer = None"""
MALFORMED = """import os
with open(os.environ["KIMILAB_ANSWERS"], "a") as f:
    f.write("not json\\n" + "[" * 100000 + "\\n" + '{"id": 5, "answer": 1}\\n')"""


def _digests() -> dict[Path, bytes]:
    from kimilab.classroom.isolation import teacher_paths

    return {p: hashlib.sha256(p.read_bytes()).digest() for p in teacher_paths()}


@pytest.mark.classroom
def test_no_attack_forges_a_grade_or_breaks_the_class(tmp_path):
    from kimilab.classroom.grade import grade

    sub = tmp_path / "class"
    honest = (_solution("1.1"), CHECK.format("1.1"))
    _write(sub / "a_honest" / "nb.ipynb", *honest)
    _write(sub / "f1_forged_verdicts" / "nb.ipynb", FORGE_LOG, CHECK.format("1.1"), CHECK.format("1.2"))
    _write(sub / "f1_guesses" / "nb.ipynb", GUESSES, CHECK.format("1.2"))
    _write(sub / "f2_key" / "nb.ipynb", KEY, CHECK.format("1.1"))
    _write(sub / "f3_patch" / "nb.ipynb", PATCH, CHECK.format("1.1"))
    _write(sub / "f4_walker" / "nb.ipynb", WALKER, CHECK.format("1.1"))
    _write(sub / "=f5_formula" / "nb.ipynb", 'answer = \'=HYPERLINK("http://x", "y")\'', CHECK.format("1.1"))
    _write(sub / "g1_exit" / "nb.ipynb", *honest, "import os\nos._exit(1)", "answer = 1", CHECK.format("1.2"))
    _write(sub / "g2_hang" / "nb.ipynb", "while True:\n    pass", *honest)
    _write(sub / "g2_slow" / "nb.ipynb", *(["import time\ntime.sleep(3)"] * 6), *honest)
    _write(sub / "g3_malformed" / "nb.ipynb", MALFORMED, *honest)
    _write(sub / "g4_tamper" / "nb.ipynb", TAMPER, CHECK.format("1.1"))
    _write(sub / "n_no_check" / "nb.ipynb", "answer = 1")
    _write(sub / "n_edited" / "nb.ipynb", "answer = None", 'verify("1.1", 524288)')
    _write(sub / "z_honest" / "nb.ipynb", *honest)
    before = _digests()
    out, lines = tmp_path / "grades.csv", []
    rows = grade([sub], out, timeout=10, limit=12, jobs=2, echo=lines.append)
    assert _digests() == before, "a submission changed the teacher's files"
    by = {(Path(r["notebook"]).parent.name, r["exercise"]): r for r in rows}
    students = {Path(r["notebook"]).parent.name for r in rows}
    assert len(students) == 15 and all((s, ex) in by for s in students for ex in ("1.1", "1.2", "1.3", "1.6"))
    for s in ("a_honest", "z_honest", "g1_exit", "g2_hang", "g3_malformed"):  # honest answers survive the attacks
        if s != "g2_hang":
            assert by[s, "1.1"]["status"] == "correct", (s, by[s, "1.1"])
    points = {s: sum(r["points"] for r in rows if Path(r["notebook"]).parent.name == s) for s in students}
    assert points["a_honest"] == points["z_honest"] == 1
    forgers = ["f1_forged_verdicts", "f1_guesses", "f3_patch", "f4_walker", "=f5_formula", "g4_tamper", "n_no_check",
               "n_edited", "g2_hang", "g2_slow"] + ["f2_key"] * bool(sandbox.abi())  # F2's file: sandbox only
    for s in forgers:
        assert points[s] == 0, (s, [r for r in rows if Path(r["notebook"]).parent.name == s])
    assert "recorded 1000" in by["f1_guesses", "1.2"]["message"] or "recorded 1001" in by["f1_guesses", "1.2"][
        "message"]
    assert by["n_edited", "1.1"]["status"] == "edited"
    assert by["n_no_check", "1.1"]["status"] == "not run" and "no check cell" in by["n_no_check", "1.1"]["message"]
    assert "kernel died" in by["g1_exit", "1.2"]["message"]
    assert "10 s limit" in by["g2_hang", "1.1"]["message"]
    assert "12 s limit" in by["g2_slow", "1.1"]["message"]
    with open(out, newline="") as f:
        written = list(csv.reader(f))
    assert len(written) == len(rows) + 1
    for name in (out, out.with_name("grades-gradebook.csv"), out.with_name("grades-canvas.csv")):
        with open(name, newline="") as f:
            cells = [c for row in csv.reader(f) for c in row]
        assert not [c for c in cells if c[:1] in ("=", "+", "@") or (c[:1] == "-" and not c[1:].isdigit())], name
    if sandbox.abi():
        assert lines[0].startswith("isolation: Landlock")
    else:
        pytest.skip("no Landlock here: the teacher's checker file is readable from a kernel (F2's second half)")
