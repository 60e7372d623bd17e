"""The student notebook: one chapter without its solutions and without outputs.

:func:`student_notebook` runs nbconvert's own preprocessors over an executed chapter:

1. :class:`StubSolutions` puts a stub before every code cell tagged ``solution``
   -- ``raise NotImplementedError("exercise N.M")``, N.M read from the
   ``verify("N.M", ...)`` call that checks it -- so a student who runs the
   notebook top to bottom stops at the first exercise, with its number;
2. ``TagRemovePreprocessor`` removes every cell tagged ``solution`` (the code and
   any markdown discussion of the answer);
3. ``ClearOutputPreprocessor`` clears all outputs: the student runs the chapter.

The teacher's edition is the book itself (``chapters/``), where the solutions run
and each ``verify`` prints "correct". :mod:`kimilab.classroom.bundle` puts these
notebooks in the student bundle.
"""

from __future__ import annotations

import re
from pathlib import Path

from nbconvert.preprocessors import ClearOutputPreprocessor, Preprocessor, TagRemovePreprocessor

__all__ = ["SOLUTION_TAG", "StubSolutions", "exercise_ids", "student_notebook", "chapter_notebooks", "stub_id"]

ROOT = Path(__file__).resolve().parents[2]
CHAPTERS = ROOT / "chapters"
SOLUTION_TAG = "solution"
VERIFY = re.compile(r"""\bverify\(\s*["'](\d+\.\d+)["']""")
_STUB = re.compile(r'raise NotImplementedError\("exercise (\d+\.\d+)"\)')
_NOTEBOOK = re.compile(r"^\d\d_[a-z0-9_]+\.ipynb$")


def chapter_notebooks(folder: Path = CHAPTERS) -> list[Path]:
    """The executed chapters ``NN_slug.ipynb``, in order."""
    return sorted(p for p in folder.glob("*.ipynb") if _NOTEBOOK.match(p.name))


def stub_id(source: str) -> str | None:
    """"N.M" if a code cell is the stub of exercise N.M (a student has not replaced it), else None."""
    m = _STUB.search(source)
    return m.group(1) if m else None


def _is_solution(cell) -> bool:
    return SOLUTION_TAG in cell.get("metadata", {}).get("tags", [])


def exercise_ids(nb) -> list[tuple[int, str]]:
    """``[(cell index, "N.M")]`` of every solution code cell, paired with the ``verify`` after it."""
    out = []
    for i, cell in enumerate(nb.cells):
        if cell.cell_type != "code" or not _is_solution(cell):
            continue
        later = (c for c in nb.cells[i + 1:] if c.cell_type == "code" and not _is_solution(c))
        m = next((VERIFY.search(c.source) for c in later), None)
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
                stub = nbformat.v4.new_code_cell(
                    f"# Exercise {stubs[i]}: your code here; it should set `{wanted}`.\n"
                    f'raise NotImplementedError("exercise {stubs[i]}")')
                if (nb.nbformat, nb.nbformat_minor) < (4, 5):  # cell ids came with nbformat 4.5
                    del stub["id"]
                cells.append(stub)
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
