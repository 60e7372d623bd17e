"""The student bundle: everything a student needs to run the chapters, and no answers.

``python -m kimilab student`` (what ``make student`` runs) writes ``student/`` and
``student.zip`` (the same files under one folder, ``kimilab-student/``):

* ``chapters/NN_slug.ipynb``: the student notebooks (:mod:`kimilab.classroom.student`:
  solution cells replaced by stubs, outputs cleared) and ``references.md``;
* ``kimilab/``: the package the chapters import, without the modules that compute
  the answers (``kimilab/exercises/chNN.py``) and without the teacher's tools (the book
  builder, the web edition, this classroom package); ``kimilab/exercises/public.json``
  holds public sanity checks instead (:mod:`kimilab.exercises.public`): no answer and
  no digest of one;
* ``data/``: the traces the chapters read;
* ``README.md``, ``pyproject.toml`` and a ``Makefile``: ``make lab`` installs the
  package into ``.venv`` and opens the chapters.

Nothing here executes a chapter: a build takes seconds (computing the expected
values, to place each public range around its answer, is most of it).
"""

from __future__ import annotations

import importlib.metadata
import re
import shutil
import zipfile
from pathlib import Path

__all__ = ["STUDENT", "ZIP", "TEACHER_ONLY", "BUNDLED_RESULTS", "build_bundle", "bundle_files"]

ROOT = Path(__file__).resolve().parents[2]
STUDENT = ROOT / "student"
ZIP = ROOT / "student.zip"
# Stored results the bundle keeps: chapter 6's map of generated traffic and its held-out check hold
# no exercise's answer, and a student's machine would take about 16 minutes to compute them.
BUNDLED_RESULTS = ("ch6_policy_map", "ch6_held_out")
PACKAGE = ROOT / "kimilab"
# Paths under kimilab/ that stay with the teacher: the answers, and the tools that build the editions.
TEACHER_ONLY = (re.compile(r"^exercises/ch\d\d\.py$"), re.compile(r"^(classroom|site|templates)(/|\.py$)"),
                re.compile(r"^book\.py$"), re.compile(r"(^|/)__pycache__/"), re.compile(r"^exercises/(key|public)\.json$"))
_NOTEBOOK_DEPS = ("ipykernel", "jupyterlab")

_README = """\
# kimilab: the student edition

The chapters of *kimilab*, a book that builds the serving machinery of a hybrid
linear-attention model (Kimi Linear) on a plain CPU. Each chapter is a notebook in
`chapters/`; run it top to bottom. It stops at its first exercise with
`NotImplementedError("exercise N.M")`: replace that cell with your code, which sets
`answer`, and run the `verify("N.M", answer)` cell below it. It runs public sanity
checks (the kind of answer, its sign, a range of sizes) and says what is off, with a
hint (the concept first; a narrower hint if you try again). Whether an answer that
passes them is right, your teacher's grader decides: this edition does not hold the
answers. Keep each `verify` cell as it is; the grader reads your answer through it.
Exercises marked *(open)* have no checker: discuss them.

## Setting up (Python >= 3.10)

```sh
make lab          # creates .venv, installs kimilab and JupyterLab, opens chapters/
```

or by hand: `python3 -m venv .venv && .venv/bin/pip install -e . && .venv/bin/jupyter lab chapters/`.
Nothing downloads while the chapters run: the model is seeded and `data/` holds the
traces (see `data/README.md`; one is Moonshot's real Mooncake trace, Apache-2.0).

## What is here

- `chapters/`: the {chapters} chapters, without solutions and without outputs
  ({exercises} checked exercises), and `references.md`.
- `kimilab/`: the package the chapters import. Its checks are public
  (`kimilab/exercises/public.json`); it does not contain the answers.
- `data/`: the request traces.
"""

_MAKEFILE = """\
# make lab: install kimilab (this folder) and JupyterLab into .venv and open the chapters.
PYTHON ?= python3
export OPENBLAS_NUM_THREADS ?= 1
export OMP_NUM_THREADS ?= 1

.PHONY: setup lab
setup: .venv/.installed

.venv/.installed: pyproject.toml
\t@test -x .venv/bin/python || $(PYTHON) -m venv .venv
\t.venv/bin/python -m pip install --quiet -e .
\t@touch $@

lab: setup
\t.venv/bin/jupyter lab chapters/
"""


def _requirements() -> list[str]:
    """The package's own dependencies plus the notebook ones, as the teacher's install declares them."""
    reqs = importlib.metadata.requires("kimilab") or []
    plain = [r for r in reqs if "extra ==" not in r]
    notebook = [r.split(";")[0].strip() for r in reqs
                if "extra == \"dev\"" in r and re.split(r"[<>=!~ ;]", r, maxsplit=1)[0] in _NOTEBOOK_DEPS]
    return plain + notebook


def _pyproject() -> str:
    deps = "".join(f'    "{r}",\n' for r in _requirements())
    return ('[build-system]\nrequires = ["setuptools>=77"]\nbuild-backend = "setuptools.build_meta"\n\n'
            '[project]\nname = "kimilab-student"\n'
            f'version = "{importlib.metadata.version("kimilab")}"\n'
            'description = "kimilab, the student edition: the chapters without solutions"\n'
            f'requires-python = ">=3.10"\ndependencies = [\n{deps}]\n\n'
            '[tool.setuptools.packages.find]\ninclude = ["kimilab*"]\n\n'
            '[tool.setuptools.package-data]\nkimilab = ["exercises/public.json"]\n')


def _copy_package(target: Path) -> None:
    for path in sorted(PACKAGE.rglob("*")):
        rel = path.relative_to(PACKAGE).as_posix()
        if path.is_dir() or any(p.search(rel) for p in TEACHER_ONLY) or path.suffix == ".pyc":
            continue
        dest = target / rel
        dest.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(path, dest)


def _describe_all(target: Path, expected: dict | None = None) -> int:
    """Write the public checks; ``expected`` ({id: value}) saves computing the values again."""
    from kimilab.exercises import all_exercises, public

    records = [public.describe(ex.id, ex.title, ex.hints, ex.expected() if expected is None else expected[ex.id])
               for ex in all_exercises().values()]
    public.write_public(target, records)
    return len(records)


def bundle_files(folder: Path) -> list[Path]:
    """Every file of a built bundle, in a fixed order."""
    return sorted(p for p in folder.rglob("*") if p.is_file())


def _zip(folder: Path, zip_path: Path) -> None:
    with zipfile.ZipFile(zip_path, "w", zipfile.ZIP_DEFLATED) as z:
        for path in bundle_files(folder):
            info = zipfile.ZipInfo(f"kimilab-student/{path.relative_to(folder).as_posix()}", (1980, 1, 1, 0, 0, 0))
            info.compress_type = zipfile.ZIP_DEFLATED
            info.external_attr = 0o644 << 16
            z.writestr(info, path.read_bytes())


def build_bundle(folder: Path = STUDENT, zip_path: Path | None = ZIP, *, expected: dict | None = None) -> dict:
    """Write the bundle into ``folder`` (replacing it) and ``zip_path``; returns counts for the report line.
    ``expected`` ({id: value}, the grader's) saves computing the answers a second time."""
    import nbformat

    from kimilab.classroom.student import CHAPTERS, chapter_notebooks, exercise_ids, student_notebook

    if folder.exists():
        shutil.rmtree(folder)
    (folder / "chapters").mkdir(parents=True)
    chapters = chapter_notebooks()
    stubs = 0
    for path in chapters:
        nbformat.write(student_notebook(path), folder / "chapters" / path.name)
        stubs += len(exercise_ids(nbformat.read(path, as_version=4)))
    for extra in ("references.md",):
        if (CHAPTERS / extra).exists():
            shutil.copyfile(CHAPTERS / extra, folder / "chapters" / extra)
    # not data/results: the stored results hold the numbers exercises ask for (a student's chapter computes
    # them), except those that hold no answer and take a student's machine long to compute (BUNDLED_RESULTS)
    shutil.copytree(ROOT / "data", folder / "data", ignore=shutil.ignore_patterns("__pycache__", ".*", "results"))
    (folder / "data" / "results").mkdir()
    for name in BUNDLED_RESULTS:
        shutil.copyfile(ROOT / "data" / "results" / f"{name}.json", folder / "data" / "results" / f"{name}.json")
    _copy_package(folder / "kimilab")
    checked = _describe_all(folder / "kimilab" / "exercises" / "public.json", expected)
    (folder / "README.md").write_text(_README.format(chapters=len(chapters), exercises=stubs), encoding="utf-8")
    (folder / "pyproject.toml").write_text(_pyproject(), encoding="utf-8")
    (folder / "Makefile").write_text(_MAKEFILE, encoding="utf-8")
    if zip_path is not None:
        _zip(folder, zip_path)
    return {"chapters": len(chapters), "exercises": stubs, "checked": checked,
            "files": len(bundle_files(folder)), "bytes": sum(p.stat().st_size for p in bundle_files(folder)),
            "zip_bytes": zip_path.stat().st_size if zip_path is not None else 0}
