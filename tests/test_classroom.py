"""The classroom edition: checked exercises in every chapter, the student notebooks built from them, grading.

Fast checks (in ``make test``): every chapter has at least four checked exercises,
each a solution cell, a ``verify`` cell and a registered checker; the teacher's stored
outputs say "correct" for every one (nbval re-executes them, so pasting the solution
back passes its checker); the student edition keeps no solution and no output, and has
one stub per exercise; ``verify`` names unit slips and where an array differs most, and
its hints come concept first; the grader, run on chapter 1 answered by pasting the
teacher's solutions (one made wrong, one left as the stub), writes a CSV that says so.
Slow check (``make classroom``, run by ``.ci/run``): every notebook of a freshly built
student bundle, executed against the bundle's own ``kimilab`` (public checks, no answers), runs up
to its first exercise and stops exactly there with ``NotImplementedError("exercise N.M")``.
"""

import csv
import os
import re
import subprocess
import sys
from pathlib import Path

import nbformat
import numpy as np
import pytest

from kimilab import classroom
from kimilab.exercises import all_exercises, check, verify

CHAPTERS = sorted((Path(__file__).resolve().parent.parent / "chapters").glob("[0-9][0-9]_*.ipynb"))
VERIFY_OUT = re.compile(r"^\[(\d+\.\d+) [^\]]*\] correct\.$", re.M)


def _stored_output(cell) -> str:
    return "".join("".join(o.get("text", "")) for o in cell.get("outputs", []))


@pytest.mark.parametrize("path", CHAPTERS, ids=lambda p: p.stem)
def test_every_chapter_has_four_checked_exercises_that_pass(path):
    nb = nbformat.read(path, as_version=4)
    ids = [ex for _, ex in classroom.exercise_ids(nb)]
    chapter = str(int(path.name[:2]))
    assert len(ids) >= 4, f"{path.name}: {len(ids)} checked exercises, expected at least 4"
    assert len(set(ids)) == len(ids) and all(ex.split(".")[0] == chapter for ex in ids), ids
    registered = all_exercises()
    assert set(ids) <= set(registered), f"{path.name}: no checker for {sorted(set(ids) - set(registered))}"
    passed = {m.group(1) for cell in nb.cells if cell.cell_type == "code"
              for m in VERIFY_OUT.finditer(_stored_output(cell))}
    assert passed == set(ids), f"{path.name}: the reference solutions of {sorted(set(ids) - passed)} do not pass"


def test_every_registered_checker_is_used_by_its_chapter():
    used = {ex for path in CHAPTERS for _, ex in classroom.exercise_ids(nbformat.read(path, as_version=4))}
    assert set(all_exercises()) <= used


def test_a_wrong_answer_gets_one_sentence_on_what_is_wrong():
    first = next(iter(all_exercises()))
    result = verify(first, -1, verbose=False)
    assert not result and "not quite" in result.message and "Hint:" in result.message
    assert "\n" not in result.message
    with pytest.raises(ValueError, match="no such checked exercise"):
        verify("99.9", 1)


@pytest.mark.parametrize("path", CHAPTERS, ids=lambda p: p.stem)
def test_the_student_edition_has_stubs_and_no_solutions(path):
    teacher = nbformat.read(path, as_version=4)
    student = classroom.student_notebook(path)
    ids = [ex for _, ex in classroom.exercise_ids(teacher)]
    assert not any(classroom.SOLUTION_TAG in c.metadata.get("tags", []) for c in student.cells)
    assert all(not c.get("outputs") for c in student.cells if c.cell_type == "code")
    stubs = re.findall(r'raise NotImplementedError\("exercise (\d+\.\d+)"\)',
                       "\n".join(c.source for c in student.cells if c.cell_type == "code"))
    assert stubs == ids
    # pasting each reference solution over its stub gives back the teacher's code cells
    solutions = iter(c.source for c in teacher.cells if classroom.SOLUTION_TAG in c.metadata.get("tags", [])
                     and c.cell_type == "code")
    pasted = [next(solutions) if "NotImplementedError(\"exercise" in c.source else c.source
              for c in student.cells if c.cell_type == "code"]
    assert pasted == [c.source for c in teacher.cells if c.cell_type == "code"]


def test_verify_names_unit_slips_array_differences_and_types():
    slip = check(3 * 2**20 / 2**20, 3 * 2**20, name="x", verbose=False)
    assert "too small by exactly 2^20" in slip.message and "MiB where bytes" in slip.message
    assert "too large by exactly 10^9" in check(5e9, 5.0, name="x", verbose=False).message
    assert "GiB where GB" in check(10 / 1.073741824, 10.0, name="x", verbose=False).message
    expected = np.arange(6.0).reshape(2, 3)
    answer = expected.copy()
    answer[1, 2] += 0.5
    answer[0, 1] += 0.1
    msg = check(answer, expected, name="x", verbose=False).message
    assert "2 of 6 elements are off, the most at index (1, 2)" in msg and "difference 0.5" in msg
    msg = check("12", 12, name="x", verbose=False).message
    assert "not a number (an integer was expected)" in msg and "a int" not in msg
    assert "not a whole number" in check(12.5, 12, name="x", verbose=False).message


def test_hints_come_concept_first_then_narrower():
    ex = all_exercises()["6.2"]
    assert "10 x 10^9 bytes" in ex.hints[0] and "1e9 bytes" not in " ".join(ex.hints)
    first = verify("6.1", -3, verbose=False).message
    second = verify("6.1", -3, verbose=False).message
    hints = all_exercises()["6.1"].hints
    assert first.endswith(hints[0]) and second.endswith(hints[1])


def _answered(tmp_path: Path) -> Path:
    """Chapter 1's student notebook with 1.1 solved, 1.2 answered wrongly and 1.3 left as the stub."""
    teacher_path = next(p for p in CHAPTERS if p.name.startswith("01_"))
    teacher = nbformat.read(teacher_path, as_version=4)
    solutions = dict(zip((ex for _, ex in classroom.exercise_ids(teacher)),
                         (c.source for c in teacher.cells if classroom.SOLUTION_TAG in c.metadata.get("tags", [])
                          and c.cell_type == "code")))
    student = classroom.student_notebook(teacher_path)
    for cell in student.cells:
        stub = classroom.stub_id(cell.source) if cell.cell_type == "code" else None
        if stub == "1.1":
            cell.source = solutions["1.1"]
        elif stub == "1.2":
            cell.source = "answer = 1  # a wrong answer"
    target = tmp_path / "alice" / teacher_path.name
    target.parent.mkdir()
    nbformat.write(student, target)
    return target


@pytest.fixture(scope="module")
def edition():
    from kimilab.classroom.isolation import Edition

    ed = Edition.build()
    yield ed
    ed.close()


def test_the_grader_writes_one_row_per_exercise(tmp_path, edition):
    from kimilab.classroom.grade import FIELDS, grade

    notebook = _answered(tmp_path)
    out = tmp_path / "grades.csv"
    grade([tmp_path / "alice"], out, echo=lambda line: None, edition=edition)
    with open(out, newline="") as f:
        rows = list(csv.DictReader(f))
    assert tuple(rows[0]) == FIELDS
    status = {r["exercise"]: (r["status"], r["points"]) for r in rows}
    assert status == {"1.1": ("correct", "1"), "1.2": ("wrong", "0"), "1.3": ("unanswered", "0"),
                      "1.6": ("unanswered", "0")}, rows
    assert all(r["notebook"] == str(notebook) and r["chapter"] == "1" for r in rows)


def test_parallel_grading_writes_a_gradebook_and_a_canvas_import(tmp_path, edition):
    import shutil

    from kimilab.classroom.grade import grade, student_of

    alice = _answered(tmp_path)
    (tmp_path / "bob").mkdir()
    shutil.copy(alice, tmp_path / "bob" / alice.name)
    out = tmp_path / "grades.csv"
    grade([tmp_path], out, jobs=2, echo=lambda line: None, edition=edition)
    with open(tmp_path / "grades-gradebook.csv", newline="") as f:
        book = list(csv.reader(f))
    assert book[0] == ["student", "1.1", "1.2", "1.3", "1.6", "total"]
    assert book[1:] == [["alice", "1", "0", "0", "0", "1"], ["bob", "1", "0", "0", "0", "1"]]
    with open(tmp_path / "grades-canvas.csv", newline="") as f:
        canvas = list(csv.reader(f))
    assert canvas[0][:5] == ["Student", "ID", "SIS User ID", "SIS Login ID", "Section"] and canvas[0][5:] == [
        "kimilab chapter 1"]
    assert canvas[1][0] == "Points Possible" and canvas[1][5] == "4"
    assert [(r[0], r[3], r[5]) for r in canvas[2:]] == [("alice", "alice", "1"), ("bob", "bob", "1")]
    assert student_of(alice, [alice]) == alice.stem  # a notebook named alone: its stem


def test_the_grader_names_a_bad_argument_in_one_line(tmp_path):
    out = subprocess.run([sys.executable, "-m", "kimilab", "grade", str(tmp_path / "missing")],
                         capture_output=True, text=True)
    assert out.returncode == 2 and out.stderr.count("\n") == 1
    assert "missing" in out.stderr and "SUBMISSION" in out.stderr


@pytest.fixture(scope="module")
def student_bundle(tmp_path_factory):
    from kimilab.classroom.bundle import build_bundle

    folder = tmp_path_factory.mktemp("bundle") / "student"
    build_bundle(folder, None)
    return folder


@pytest.mark.classroom
@pytest.mark.parametrize("path", CHAPTERS, ids=lambda p: p.stem)
def test_a_bundle_notebook_runs_to_its_first_exercise_and_stops_there(path, student_bundle, monkeypatch):
    from nbclient import NotebookClient
    from nbclient.exceptions import CellExecutionError

    notebook = student_bundle / "chapters" / path.name
    student = nbformat.read(notebook, as_version=4)
    first = classroom.exercise_ids(nbformat.read(path, as_version=4))[0][1]
    student.cells.insert(0, nbformat.v4.new_code_cell(
        "import kimilab, kimilab.exercises as _e\n"
        f"assert kimilab.__file__.startswith({str(student_bundle)!r}) and not _e.all_exercises()"))
    monkeypatch.setenv("PYTHONPATH", str(student_bundle) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    client = NotebookClient(student, timeout=600, kernel_name="python3",
                            resources={"metadata": {"path": str(notebook.parent)}})
    with pytest.raises(CellExecutionError) as err:
        client.execute()
    assert err.value.ename == "NotImplementedError" and f"exercise {first}" in err.value.evalue


def _notebook(path: Path, *cells: str, title: str = "# 1. The naive KV cache") -> Path:
    nb = nbformat.v4.new_notebook()
    nb.cells = [nbformat.v4.new_markdown_cell(title)] + [nbformat.v4.new_code_cell(c) for c in cells]
    nb.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3", "language": "python"}
    path.parent.mkdir(parents=True, exist_ok=True)
    nbformat.write(nb, path)
    return path


@pytest.mark.classroom
def test_one_submission_cannot_stop_the_class(tmp_path, edition):
    """A kernel that dies, a cell that hangs, a file that is no notebook, a notebook with no verify
    call: every notebook still gets its rows (with the reason), grading goes on, and the CSV has each
    row as it was graded (tests/test_redteam.py plays the forgeries and the formula)."""
    from kimilab.classroom.grade import grade

    sub = tmp_path / "class"
    imp = "from kimilab.exercises import verify"
    _notebook(sub / "a_dies.ipynb", imp, "answer = 0", 'verify("1.1", answer)', "import os\nos._exit(1)",
              'verify("1.2", answer)')
    _notebook(sub / "b_hangs.ipynb", imp, "while True:\n    pass", 'verify("1.1", answer)')
    (sub / "c_garbage.ipynb").write_text("not a notebook")
    _notebook(sub / "d_no_verify.ipynb", "x = 1")
    out, lines = tmp_path / "grades.csv", []
    rows = grade([sub], out, timeout=5, echo=lines.append, edition=edition)
    progress = [line for line in lines if line.startswith("[")]
    assert len(progress) == 4 and progress[-1].startswith("[4/4] ") and lines[-1].startswith("gradebook: ")
    by = {(Path(r["notebook"]).stem, r["exercise"]): r for r in rows}
    assert by["a_dies", "1.1"]["status"] == "wrong"
    assert by["a_dies", "1.2"]["status"] == "error" and "kernel died" in by["a_dies", "1.2"]["message"]
    assert by["b_hangs", "1.1"]["status"] == "error" and "5 s limit" in by["b_hangs", "1.1"]["message"]
    assert by["c_garbage", ""]["status"] == "error" and "not a readable notebook" in by["c_garbage", ""]["message"]
    no_verify = [r for r in rows if Path(r["notebook"]).stem == "d_no_verify"]
    assert no_verify and {r["status"] for r in no_verify} == {"not run"} and {r["points"] for r in no_verify} == {0}
    assert {r["exercise"] for r in no_verify} == {r["exercise"] for r in rows if Path(r["notebook"]).stem == "a_dies"}
    with open(out, newline="") as f:
        written = list(csv.DictReader(f))
    assert len(written) == len(rows)


def test_answers_travel_as_data_and_malformed_records_are_not_trusted(tmp_path):
    from kimilab.exercises import answers

    values = [None, True, "text", 7, 2.5, np.int64(3), np.float32(0.5), np.arange(6.0).reshape(2, 3), [1, 2]]
    for v in values:
        got = answers.decode(json_roundtrip(answers.encode(v)))
        assert (got is None and v is None) or np.array_equal(np.asarray(got), np.asarray(v)), (v, got)
        assert type(got) in (type(None), bool, str, int, float, np.ndarray)
    assert repr(answers.decode(answers.encode(object()))).startswith("a object")
    path = tmp_path / "answers.jsonl"
    path.write_text('not json\n{"id": 5, "answer": {"type": "int", "value": 1}}\n'
                    '{"id": "1.1", "answer": {"type": "int", "value": "7"}}\n'
                    '{"id": "1.1", "answer": {"type": "array", "shape": [2], "value": [1]}}\n'
                    '{"id": "1.2", "answer": {"type": "float", "value": 2}}\n' + "[" * 10**5 + "\n")
    got, bad = answers.read_answers(path)
    assert got == {"1.2": [2.0]} and bad == 5


def json_roundtrip(x):
    import json

    return json.loads(json.dumps(x))


def test_the_sandbox_denies_what_it_does_not_grant(tmp_path):
    from kimilab.classroom import sandbox
    from kimilab.classroom.isolation import _read_roots

    if not sandbox.abi():
        pytest.skip("no Landlock on this system: the grader falls back to restoring changed files")
    secret, own = tmp_path / "secret.txt", tmp_path / "own"
    secret.write_text("the key")
    own.mkdir()
    code = (f"import os\nopen({str(own / 'x')!r}, 'w').write('ok')\n"
            "for mode in ('r', 'a'):\n"
            "    try:\n"
            f"        open({str(secret)!r}, mode); print('open', mode)\n"
            "    except PermissionError:\n"
            "        print('denied', mode)\n")
    argv = sandbox.launcher(_read_roots(own), [str(own)], [sys.executable, "-c", code])
    out = subprocess.run(argv, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split("\n")[:2] == ["denied r", "denied a"] and (own / "x").read_text() == "ok"
