"""The classroom edition: every chapter without its solutions, for students.

``python -m kimilab student`` (what ``make student`` runs) writes
``student/NN_slug.ipynb`` for every executed chapter with nbconvert's own
preprocessors:

1. :class:`StubSolutions` puts a stub before every code cell tagged ``solution``
   -- ``raise NotImplementedError("exercise N.M")``, N.M read from the
   ``verify("N.M", ...)`` call that checks it -- so a student who runs the
   notebook top to bottom stops at the first exercise, with its number;
2. ``TagRemovePreprocessor`` removes every cell tagged ``solution`` (the code and
   any markdown discussion of the answer);
3. ``ClearOutputPreprocessor`` clears all outputs: the student runs the chapter.

The teacher's edition is the book itself (``chapters/``), where the solutions run
and each ``verify`` prints "correct".
"""

from __future__ import annotations

import re
from pathlib import Path

from nbconvert.preprocessors import ClearOutputPreprocessor, Preprocessor, TagRemovePreprocessor

__all__ = ["SOLUTION_TAG", "StubSolutions", "exercise_ids", "student_notebook", "write_student_edition"]

ROOT = Path(__file__).resolve().parent.parent
CHAPTERS = ROOT / "chapters"
STUDENT = ROOT / "student"
SOLUTION_TAG = "solution"
_VERIFY = re.compile(r"""\bverify\(\s*["'](\d+\.\d+)["']""")
_NOTEBOOK = re.compile(r"^\d\d_[a-z0-9_]+\.ipynb$")


def _is_solution(cell) -> bool:
    return SOLUTION_TAG in cell.get("metadata", {}).get("tags", [])


def exercise_ids(nb) -> list[tuple[int, str]]:
    """``[(cell index, "N.M")]`` of every solution code cell, paired with the ``verify`` after it."""
    out = []
    for i, cell in enumerate(nb.cells):
        if cell.cell_type != "code" or not _is_solution(cell):
            continue
        later = (c for c in nb.cells[i + 1:] if c.cell_type == "code" and not _is_solution(c))
        m = next((_VERIFY.search(c.source) for c in later), None)
        if m is None:
            raise ValueError(f"cell {i}: a solution cell with no verify('N.M', ...) after it")
        out.append((i, m.group(1)))
    return out


class StubSolutions(Preprocessor):
    """Insert ``raise NotImplementedError("exercise N.M")`` before each solution code cell."""

    def preprocess(self, nb, resources):
        import nbformat

        stubs = dict(exercise_ids(nb))
        cells = []
        for i, cell in enumerate(nb.cells):
            if i in stubs:
                names = re.findall(r"^([A-Za-z_]\w*)\s*=", cell.source, re.M)
                wanted = "answer" if "answer" in names or not names else names[-1]
                cells.append(nbformat.v4.new_code_cell(
                    f"# Exercise {stubs[i]}: your code here; it should set `{wanted}`.\n"
                    f'raise NotImplementedError("exercise {stubs[i]}")'))
            cells.append(cell)
        nb.cells = cells
        return nb, resources


def student_notebook(path: Path):
    """The student edition of one executed chapter (a notebook node; nothing written)."""
    import nbformat

    nb = nbformat.read(path, as_version=4)
    resources: dict = {}
    for step in (StubSolutions(), TagRemovePreprocessor(remove_cell_tags={SOLUTION_TAG}),
                 ClearOutputPreprocessor()):
        nb, resources = step.preprocess(nb, resources)
    return nb


def write_student_edition(out: Path = STUDENT) -> list[Path]:
    """Write ``out/NN_slug.ipynb`` for every chapter; returns the paths."""
    import nbformat

    out.mkdir(parents=True, exist_ok=True)
    written = []
    for path in sorted(p for p in CHAPTERS.glob("*.ipynb") if _NOTEBOOK.match(p.name)):
        target = out / path.name
        nbformat.write(student_notebook(path), target)
        written.append(target)
    return written


def main() -> int:
    written = write_student_edition()
    n = sum(len(exercise_ids(__import__("nbformat").read(CHAPTERS / p.name, as_version=4))) for p in written)
    print(f"student edition: {len(written)} chapters, {n} exercises stubbed, in {STUDENT.relative_to(ROOT)}/")
    return 0
