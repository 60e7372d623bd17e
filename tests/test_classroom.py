"""The classroom edition: checked exercises in every chapter, the student notebooks built from them.

Fast checks (in ``make test``): every chapter has at least three checked exercises,
each a solution cell, a ``verify`` cell and a registered checker; the teacher's stored
outputs say "correct" for every one (nbval re-executes them, so pasting the solution
back passes its checker); the student edition keeps no solution and no output, and has
one stub per exercise. Slow check (``make classroom``, run by ``.ci/run``): every
student notebook, executed, runs up to its first exercise and stops exactly there with
``NotImplementedError("exercise N.M")``.
"""

import re
from pathlib import Path

import nbformat
import pytest

from kimilab import classroom
from kimilab.exercises import all_exercises, verify

CHAPTERS = sorted((Path(__file__).resolve().parent.parent / "chapters").glob("[0-9][0-9]_*.ipynb"))
VERIFY_OUT = re.compile(r"^\[(\d+\.\d+) [^\]]*\] correct\.$", re.M)


def _stored_output(cell) -> str:
    return "".join("".join(o.get("text", "")) for o in cell.get("outputs", []))


@pytest.mark.parametrize("path", CHAPTERS, ids=lambda p: p.stem)
def test_every_chapter_has_three_checked_exercises_that_pass(path):
    nb = nbformat.read(path, as_version=4)
    ids = [ex for _, ex in classroom.exercise_ids(nb)]
    chapter = str(int(path.name[:2]))
    assert len(ids) >= 3, f"{path.name}: {len(ids)} checked exercises, expected at least 3"
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


@pytest.mark.classroom
@pytest.mark.parametrize("path", CHAPTERS, ids=lambda p: p.stem)
def test_a_student_notebook_runs_to_its_first_exercise_and_stops_there(path, tmp_path):
    from nbclient import NotebookClient
    from nbclient.exceptions import CellExecutionError

    student = classroom.student_notebook(path)
    first = classroom.exercise_ids(nbformat.read(path, as_version=4))[0][1]
    client = NotebookClient(student, timeout=600, kernel_name="python3",
                            resources={"metadata": {"path": str(path.parent)}})
    with pytest.raises(CellExecutionError) as err:
        client.execute()
    assert err.value.ename == "NotImplementedError" and f"exercise {first}" in err.value.evalue
