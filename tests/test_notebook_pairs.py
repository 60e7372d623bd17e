"""Every chapter is a jupytext pair whose .py and .ipynb hold the same cells."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

jupytext = pytest.importorskip("jupytext")
nbformat = pytest.importorskip("nbformat")

CHAPTERS = Path(__file__).resolve().parent.parent / "chapters"
SOURCES = sorted(p for p in CHAPTERS.glob("*.py") if re.match(r"^\d\d_[a-z0-9_]+\.py$", p.name))


def _cells(nb):
    return [(c.cell_type, c.source.strip()) for c in nb.cells]


def test_there_are_chapters():
    assert SOURCES, "no chapters/NN_slug.py found"


@pytest.mark.parametrize("src", SOURCES, ids=[p.stem for p in SOURCES])
def test_pair_in_sync(src: Path):
    ipynb = src.with_suffix(".ipynb")
    assert ipynb.exists(), f"{ipynb.name} missing: run `make book` (or python -m kimilab.book --only {src.name[:2]})"
    py_cells = _cells(jupytext.read(src))
    nb_cells = _cells(nbformat.read(ipynb, as_version=4))
    assert py_cells == nb_cells, (
        f"{src.name} and {ipynb.name} differ: edit the .py, then re-execute with "
        f"`python -m kimilab.book --only {src.name[:2]}`"
    )


@pytest.mark.parametrize("src", SOURCES, ids=[p.stem for p in SOURCES])
def test_chapter_is_executed_and_clean(src: Path):
    nb = nbformat.read(src.with_suffix(".ipynb"), as_version=4)
    code = [c for c in nb.cells if c.cell_type == "code" and c.source.strip()]
    assert code, f"{src.name}: no code cells"
    counts = [c.execution_count for c in code]
    assert counts == list(range(1, len(code) + 1)), f"{src.name}: stored notebook not executed top to bottom in one run"
    for c in code:
        for out in c.outputs:
            assert out.output_type != "error", f"{src.name}: stored output holds an error"
            if out.output_type == "stream":
                assert out.name == "stdout", f"{src.name}: stderr in stored output (warnings?): {out.text[:200]!r}"
    assert set(nb.metadata) <= {"kernelspec", "jupytext"}, f"{src.name}: volatile notebook metadata {sorted(nb.metadata)}"


@pytest.mark.parametrize("src", SOURCES, ids=[p.stem for p in SOURCES])
def test_chapter_has_book_structure(src: Path):
    text = src.read_text(encoding="utf-8")
    for heading in ("What you'll build", "Summary", "Exercises"):
        assert heading in text, f"{src.name}: missing a '{heading}' section"
    assert "verify(\"" in text, f"{src.name}: no exercise checked by kimilab.exercises.verify"
