"""The web edition: two static sites rendered from the executed notebooks, readable offline.

``python -m kimilab html`` (what ``make html`` runs) renders every stored
``chapters/NN_slug.ipynb`` -- it executes nothing; ``make book`` does -- with Sphinx,
myst-nb and sphinx-book-theme into

* ``_build/html/``: the teacher's edition (solutions shown, ``TEACHING`` and the model
  answers of the open exercises included);
* ``_build/html-student/``: the student edition (solution cells and ``verify``
  outputs removed, no teaching pages).

The theme gives search, a chapter sidebar, per-page contents, dark mode; the
``sphinx-copybutton`` extension adds copy buttons. :mod:`kimilab.site.prepare` numbers
and captions the figures, collapses listings and plotting code, and drops nbval's
markers. Math is typeset by MathJax from the copy that the ``sphinx-mathjax-offline``
package ships (a subset of it is copied next to the pages), so neither building nor
reading the site touches the network.
"""

from __future__ import annotations

import importlib.util
import io
import re
import shutil
from contextlib import redirect_stderr, redirect_stdout
from pathlib import Path

__all__ = ["SITE", "STUDENT_SITE", "EDITIONS", "chapter_notebooks", "run_times", "build_site", "build_sites", "main",
           "REFERENCE_PAGES"]

ROOT = Path(__file__).resolve().parents[2]
CHAPTERS = ROOT / "chapters"
SITE = ROOT / "_build" / "html"
STUDENT_SITE = ROOT / "_build" / "html-student"
EDITIONS = {"teacher": SITE, "student": STUDENT_SITE}
TEMPLATE = Path(__file__).resolve().parent.parent / "templates" / "sphinx"
TEACHER_PAGES = (ROOT / "TEACHING.md", ROOT / "chapters" / "teacher_answers.md")
REFERENCE_PAGES = ("glossary", "notation", "api")  # chapters/NAME.md, linked from every chapter
_TERM_LINK = re.compile(r"\[([^\]]+)\]\((\d\d_[a-z0-9_]+)\.ipynb#(term-[a-z0-9-]+)\)")
_NOTEBOOK = re.compile(r"^(\d\d)_[a-z0-9_]+\.ipynb$")
_TABLE_ROW = re.compile(r"^\|\s*(\d+)\s*\|\s*\[([^\]]+)\]\(chapters/(\d\d_[a-z0-9_]+)\.py\)\s*\|(.*)\|\s*([^|]+?)\s*\|$")
_MATHJAX_PARTS = ("tex-chtml.js", "input/tex/extensions", "output/chtml/fonts/woff-v2", "ui", "a11y")


def chapter_notebooks() -> list[Path]:
    """The executed chapters, in order."""
    return sorted(p for p in CHAPTERS.glob("*.ipynb") if _NOTEBOOK.match(p.name))


def run_times(readme: Path = ROOT / "README.md") -> dict[str, str]:
    """``{NN_slug: "13 s"}`` from the README's chapter table (the reviewed run times)."""
    out = {}
    for line in readme.read_text(encoding="utf-8").splitlines():
        m = _TABLE_ROW.match(line.strip())
        if m:
            out[m.group(3)] = m.group(5).strip()
    return out


def _copy_mathjax(static: Path) -> None:
    spec = importlib.util.find_spec("sphinx-mathjax-offline")
    if spec is None or not spec.submodule_search_locations:
        raise RuntimeError("the sphinx-mathjax-offline package is missing: run `make setup`")
    source = Path(list(spec.submodule_search_locations)[0]) / "static" / "mathjax"
    for part in _MATHJAX_PARTS:
        src, dest = source / part, static / "mathjax" / part
        if src.is_dir():
            shutil.copytree(src, dest, dirs_exist_ok=True)
        else:
            dest.parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(src, dest)


def _link_rewrite(text: str) -> str:
    """Links from the markdown pages to chapters point at the rendered chapter documents."""
    text = re.sub(r"\]\((?:\.\./)?chapters/(\d\d_[a-z0-9_]+)\.(?:py|ipynb)", r"](\1.ipynb", text)
    return re.sub(r"\]\((?:\.\./)?chapters/(references|teacher_answers)\.md", r"](\1.md", text)


def _term_links(text: str) -> str:
    """A glossary link to a term's anchor in a chapter becomes a plain HTML link to the rendered page
    (the anchor is an ``<a id>`` in the chapter's prose, which Sphinx does not know as a target)."""
    return _TERM_LINK.sub(lambda m: f'<a href="{m.group(2)}.html#{m.group(3)}">{m.group(1)}</a>', text)


def _index(books: list[tuple[str, str]], pages: list[tuple[str, str]], edition: str) -> str:
    times = run_times()
    rows = "\n".join(f"| [{title}]({stem}.ipynb) | {times.get(stem, '—')} |" for stem, title in books)
    which = ("the teacher's edition: solutions shown, with the course plan and the model answers"
             if edition == "teacher" else
             "the student edition: the exercises' solutions are not shown; run the chapters to answer them")
    toc = "\n".join(f"{stem}" for stem, _ in books)
    extra = "\n".join(stem for stem, _ in pages)
    return (
        "# kimilab: serving a hybrid linear-attention model, built up on a CPU\n\n"
        "Executable chapters that build, step by step and checked against slow twins, the serving machinery a "
        "Kimi Linear-style model needs. Each page is a chapter notebook as executed by `make book`; this is "
        f"{which}.\n\n"
        "| chapter | run time (`make book`, 2 CPU cores) |\n|---|---|\n"
        f"{rows}\n\n"
        f"```{{toctree}}\n:caption: Chapters\n:hidden:\n\n{toc}\n```\n\n"
        f"```{{toctree}}\n:caption: More\n:hidden:\n\n{extra}\n```\n")


def _write_source(src: Path, notebooks: list[Path], edition: str) -> None:
    import nbformat

    from kimilab.site.api import api_for_sphinx
    from kimilab.site.prepare import prepare_notebook, references_md, title_of

    if src.exists():
        shutil.rmtree(src)
    (src / "_static").mkdir(parents=True)
    conf = (TEMPLATE / "conf.py.in").read_text(encoding="utf-8")
    if edition == "student":  # the repository's chapters show the solutions: students download their notebook
        conf += '\n# The student edition: no launch menu (it would open the solutions); the download button stays.\n' \
                'html_theme_options["launch_buttons"] = {}\n'
    (src / "conf.py").write_text(conf, encoding="utf-8")
    for static in (TEMPLATE / "_static").iterdir():
        shutil.copyfile(static, src / "_static" / static.name)
    _copy_mathjax(src / "_static")
    books = []
    for path in notebooks:
        nb = nbformat.read(path, as_version=4)
        prepare_notebook(nb, int(path.name[:2]), student=edition == "student")
        nbformat.write(nb, src / path.name)
        books.append((path.stem, title_of(nb)))
    pages = []
    if (CHAPTERS / "references.md").exists():
        (src / "references.md").write_text(references_md((CHAPTERS / "references.md").read_text(encoding="utf-8")),
                                           encoding="utf-8")
        pages.append(("references", "References"))
    for stem in REFERENCE_PAGES:
        page = CHAPTERS / f"{stem}.md"
        text = _term_links(page.read_text(encoding="utf-8"))
        (src / page.name).write_text(api_for_sphinx(text) if stem == "api" else text, encoding="utf-8")
        pages.append((stem, stem))
    for page in TEACHER_PAGES if edition == "teacher" else ():
        if page.exists():
            (src / page.name).write_text(_link_rewrite(page.read_text(encoding="utf-8")), encoding="utf-8")
            pages.append((page.stem, page.stem))
    (src / "index.md").write_text(_index(books, pages, edition), encoding="utf-8")


def build_site(out: Path = SITE, notebooks: list[Path] | None = None, *, edition: str = "teacher",
               strict: bool = False) -> Path:
    """Render one edition into ``out``; returns the path of ``index.html``.

    ``strict`` turns Sphinx warnings (a broken cross-reference, a bad caption) into an error.
    """
    from sphinx.cmd.build import build_main

    if edition not in EDITIONS:
        raise ValueError(f"edition={edition!r}: expected one of {sorted(EDITIONS)}")
    notebooks = chapter_notebooks() if notebooks is None else notebooks
    src = out.parent / f".src-{out.name}"
    _write_source(src, notebooks, edition)
    if out.exists():
        shutil.rmtree(out)
    args = ["-b", "html", "-q", "-d", str(src / ".doctrees"), str(src), str(out)]
    log = io.StringIO()
    with redirect_stdout(log), redirect_stderr(log):
        status = build_main((["-W", "--keep-going"] if strict else []) + args)
    if status:
        raise RuntimeError(f"sphinx-build failed for the {edition} edition:\n{log.getvalue()[-4000:]}")
    return out / "index.html"


def build_sites(strict: bool = False) -> dict[str, Path]:
    """Both editions, each in its folder; returns their index pages by edition.

    ``chapters/api.md`` is rewritten first from the package (see :mod:`kimilab.site.api`).
    """
    from kimilab.site.api import api_markdown

    page = CHAPTERS / "api.md"
    if not page.exists() or page.read_text(encoding="utf-8") != api_markdown():
        page.write_text(api_markdown(), encoding="utf-8")
    return {edition: build_site(out, edition=edition, strict=strict) for edition, out in EDITIONS.items()}


def main(argv: list[str] | None = None) -> int:
    for edition, index in build_sites().items():
        pages = len(list(index.parent.glob("*.html")))
        print(f"HTML ({edition} edition): {index.relative_to(ROOT)} ({pages} pages)")
    return 0
