"""The web edition: a static site rendered from the executed notebooks, readable offline.

``python -m kimilab html`` (what ``make html`` runs) renders every stored
``chapters/NN_slug.ipynb`` -- it executes nothing; ``make book`` does -- with
nbconvert's own HTML exporter and the ``lab`` template, plus:

* a navigation bar on every chapter page (index, previous, next);
* ``index.html``: the table of contents with each chapter's run time (from the
  README's chapter table, the reviewed numbers) and an index of every section;
* ``references.html`` and the other markdown pages of ``chapters/``.

Why nbconvert and not Jupyter Book: the notebooks are already executed and
checked by nbval, so the site only has to render them; nbconvert is already a
dependency (``make book`` uses it), needs no Node toolchain and no second build
configuration. The pages load nothing from the network: the template drops the
CDN scripts (require.js, MathJax, mermaid), figures are embedded in the page, and
display math is converted to MathML at build time (``latex2mathml``), which
browsers render natively.
"""

from __future__ import annotations

import html
import re
from pathlib import Path

__all__ = ["SITE", "chapter_notebooks", "run_times", "build_site"]

ROOT = Path(__file__).resolve().parent.parent
CHAPTERS = ROOT / "chapters"
SITE = ROOT / "_build" / "html"
TEMPLATES = Path(__file__).resolve().parent / "templates"
_NOTEBOOK = re.compile(r"^(\d\d)_[a-z0-9_]+\.ipynb$")
_DISPLAY_MATH = re.compile(r"\$\$(.+?)\$\$", re.S)
_INLINE_MATH = re.compile(r"(?<![\\$])\$(?!\s)([^$\n]+?)(?<!\s)\$(?!\d)")
_TABLE_ROW = re.compile(r"^\|\s*(\d+)\s*\|\s*\[([^\]]+)\]\(chapters/(\d\d_[a-z0-9_]+)\.py\)\s*\|(.*)\|\s*([^|]+?)\s*\|$")
_SECTION = re.compile(r'<h2 id="([^"]+)"[^>]*>(.*?)(?:<a class="anchor-link"[^>]*>.*?</a>)?</h2>', re.S)


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


def _math_to_mathml(source: str) -> str:
    """Replace $$...$$ and $...$ in markdown with MathML, so no script is needed to show them."""
    from latex2mathml.converter import convert

    def display(m):
        return "\n\n" + convert(m.group(1).strip(), display="block") + "\n\n"

    source = _DISPLAY_MATH.sub(display, source)
    return _INLINE_MATH.sub(lambda m: convert(m.group(1)), source)


def _title(nb) -> str:
    for cell in nb.cells:
        if cell.cell_type == "markdown":
            for line in cell.source.splitlines():
                if line.startswith("# "):
                    return line[2:].strip()
    return "kimilab"


def _nav(prev: tuple | None, nxt: tuple | None) -> str:
    parts = ['<a href="index.html">contents</a>']
    if prev:
        parts.insert(0, f'<a rel="prev" href="{prev[0]}.html">&larr; {html.escape(prev[1])}</a>')
    if nxt:
        parts.append(f'<a rel="next" href="{nxt[0]}.html">{html.escape(nxt[1])} &rarr;</a>')
    return '<nav class="kimilab-nav">' + " &middot; ".join(parts) + "</nav>"


def _page(title: str, body: str) -> str:
    return ("<!doctype html><html lang='en'><head><meta charset='utf-8'>"
            "<meta name='viewport' content='width=device-width, initial-scale=1'>"
            f"<title>{html.escape(title)}</title><style>body{{font-family:sans-serif;max-width:60rem;"
            "margin:2rem auto;padding:0 1rem;line-height:1.5}table{border-collapse:collapse}"
            "td,th{border-bottom:1px solid #ddd;padding:.25rem .6rem;text-align:left}</style></head>"
            f"<body>\n{body}\n</body></html>\n")


def _link_rewrite(text: str) -> str:
    """Links between chapters and pages point at the rendered pages."""
    return re.sub(r'href="(?:\.\./)?(?:chapters/)?([a-z0-9_]+)\.(?:md|ipynb|py)(#[^"]*)?"', r'href="\1.html\2"', text)


def build_site(out: Path = SITE, notebooks: list[Path] | None = None) -> Path:
    """Render the site into ``out``; returns the path of ``index.html``."""
    import nbformat
    from nbconvert import HTMLExporter
    from nbconvert.filters.markdown import markdown2html

    notebooks = chapter_notebooks() if notebooks is None else notebooks
    out.mkdir(parents=True, exist_ok=True)
    exporter = HTMLExporter(extra_template_basedirs=[str(TEMPLATES)], template_name="kimilab_site")
    books = []
    for path in notebooks:
        nb = nbformat.read(path, as_version=4)
        for cell in nb.cells:
            if cell.cell_type == "markdown":
                cell.source = _math_to_mathml(cell.source)
        books.append((path.stem, _title(nb), nb))
    times = run_times()
    sections = {}
    for i, (stem, title, nb) in enumerate(books):
        prev = books[i - 1][:2] if i else None
        nxt = books[i + 1][:2] if i + 1 < len(books) else None
        body, _ = exporter.from_notebook_node(nb, resources={"kimilab_nav": _nav(prev, nxt)})
        body = _link_rewrite(body)
        sections[stem] = [(anchor, re.sub(r"<[^>]+>", "", label).strip()) for anchor, label in _SECTION.findall(body)]
        (out / f"{stem}.html").write_text(body, encoding="utf-8")
    pages = []
    for page in sorted(CHAPTERS.glob("*.md")) + [p for p in (ROOT / "TEACHING.md",) if p.exists()]:
        text = page.read_text(encoding="utf-8")
        title = next((ln[2:].strip() for ln in text.splitlines() if ln.startswith("# ")), page.stem)
        body = '<nav class="kimilab-nav"><a href="index.html">contents</a></nav>\n' + markdown2html(text)
        (out / f"{page.stem}.html").write_text(_link_rewrite(_page(title, body)), encoding="utf-8")
        pages.append((page.stem, title))
    rows = "\n".join(f'<tr><td><a href="{stem}.html">{html.escape(title)}</a></td>'
                     f"<td>{html.escape(times.get(stem, '—'))}</td></tr>" for stem, title, _ in books)
    index_of_sections = "\n".join(
        f'<li><a href="{stem}.html">{html.escape(title)}</a><ul>'
        + "".join(f'<li><a href="{stem}.html#{anchor}">{html.escape(label)}</a></li>'
                  for anchor, label in sections[stem])
        + "</ul></li>" for stem, title, _ in books)
    extra = "".join(f'<li><a href="{stem}.html">{html.escape(title)}</a></li>' for stem, title in pages)
    index = out / "index.html"
    index.write_text(_page("kimilab", (
        "<h1>kimilab: serving a hybrid linear-attention model, built up on a CPU</h1>\n"
        "<p>Executable chapters that build, step by step and checked against slow twins, the serving "
        "machinery a Kimi Linear-style model needs. Each page is a chapter notebook as executed by "
        "<code>make book</code>.</p>\n<h2 id='contents'>Contents</h2>\n"
        f"<table><tr><th>chapter</th><th>run time (make book, 2 CPU cores)</th></tr>\n{rows}\n</table>\n"
        f"<ul>{extra}</ul>\n<h2 id='index'>Index of sections</h2>\n<ul>\n{index_of_sections}\n</ul>")),
        encoding="utf-8")
    return index


def main(argv: list[str] | None = None) -> int:
    index = build_site()
    print(f"HTML: {index.relative_to(ROOT)} ({len(list(index.parent.glob('*.html')))} pages)")
    return 0
