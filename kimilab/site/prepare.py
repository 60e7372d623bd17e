"""What the web edition changes in a stored notebook before Sphinx renders it (nothing is executed).

* ``# NBVAL_...`` marker lines are dropped; a wall-clock cell is tagged ``wall-clock``
  instead (the page marks it as measured, varying from run to run).
* A ``show_source(...)`` cell's output (the listing) is collapsed (``hide-output``), and so is
  the code of the cell that prints the chapter's Key results box (``hide-input``);
  a plotting cell's code is collapsed (``hide-input``) and its figure kept.
* Every figure is numbered per chapter (``Figure 3.2``, anchor ``fig-3-2``) and
  captioned with its takeaway, the first paragraph of the markdown cell right below
  it, which moves into the caption. A figure with code cells between it and the next
  text is captioned with its plot titles instead. Its alt text describes the plot from
  the titles and axis labels in the cell's code. A table the same cell displays moves to a
  cell of its own right below the figure (its code hidden), so the figure holds only the plot.
* The student edition also drops every cell tagged ``solution`` and the outputs of the
  ``verify`` cells.
"""

from __future__ import annotations

import ast
import re

from nbformat.v4 import new_code_cell

__all__ = ["prepare_notebook", "plot_labels", "title_of", "references_md"]

_MARKER = re.compile(r"^\s*#\s*NBVAL_\w+\s*$")
_VERIFY = re.compile(r"\bverify\(")
_SHOW_SOURCE = re.compile(r"^\s*show_source\(", re.M)
_KEY_RESULTS = re.compile(r"^key_results\(", re.M)
_LABEL_CALLS = {"set_title": "title", "suptitle": "title", "title": "title", "set_xlabel": "x", "xlabel": "x",
                "set_ylabel": "y", "ylabel": "y"}
_TAKEAWAY = re.compile(r"^\s*(?:\*{1,2})?Takeaway(?:\s*\([^)]*\))?:(?:\*{1,2})?\s*", re.I)
_ANCHOR = re.compile(r'^<a id="([^"]+)"></a>\s*$', re.M)


def title_of(nb) -> str:
    """The notebook's first ``# `` heading: the page title everywhere."""
    for cell in nb.cells:
        if cell.cell_type == "markdown":
            for line in cell.source.splitlines():
                if line.startswith("# "):
                    return line[2:].strip()
    return "kimilab"


def _has_image(cell) -> bool:
    return any("image/png" in o.get("data", {}) or "image/svg+xml" in o.get("data", {}) for o in cell.outputs)


def plot_labels(source: str) -> dict[str, list[str]]:
    """Literal titles and axis labels set in a plotting cell: ``{"title": [...], "x": [...], "y": [...]}``."""
    found = {"title": [], "x": [], "y": []}
    try:
        tree = ast.parse(source)
    except SyntaxError:
        return found
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr in _LABEL_CALLS:
            arg = node.args[0] if node.args else None
            if isinstance(arg, ast.Constant) and isinstance(arg.value, str) and arg.value.strip():
                text = re.sub(r"\$([^$]*)\$", r"\1", arg.value).replace("\\", "").replace("\n", " ").strip()
                if text not in found[_LABEL_CALLS[node.func.attr]]:
                    found[_LABEL_CALLS[node.func.attr]].append(text)
    return found


def _alt(number: str, labels: dict[str, list[str]], caption: str) -> str:
    parts = []
    if labels["title"]:
        parts.append("; ".join(labels["title"]))
    axes = [f"{k} axis: {' / '.join(v)}" for k, v in (("x", labels["x"]), ("y", labels["y"])) if v]
    if axes:
        parts.append(", ".join(axes))
    text = ". ".join(parts) if parts else re.sub(r"[*`$_\\]", "", caption).split(". ")[0]
    return f"Figure {number}, a plot. {text}".strip()


def _split_first_paragraph(source: str) -> tuple[str, str]:
    head, _, rest = source.strip("\n").partition("\n\n")
    return head.strip(), rest.lstrip("\n")


def _add_tag(cell, tag: str) -> None:
    tags = cell.metadata.setdefault("tags", [])
    if tag not in tags:
        tags.append(tag)


def prepare_notebook(nb, chapter: int, *, student: bool = False):
    """Rewrite one chapter notebook for the site in place (see the module docstring); returns it."""
    if student:
        nb.cells = [c for c in nb.cells if "solution" not in c.metadata.get("tags", [])]
    figure = 0
    extras = {}
    for i, cell in enumerate(nb.cells):
        if cell.cell_type != "code":
            continue
        lines = cell.source.splitlines()
        if any(_MARKER.match(line) for line in lines):
            cell.source = "\n".join(line for line in lines if not _MARKER.match(line)).strip("\n")
            _add_tag(cell, "wall-clock")
        if _SHOW_SOURCE.search(cell.source):
            _add_tag(cell, "hide-output")
        if _KEY_RESULTS.search(cell.source):  # the box reads first; the code that computes it folds
            _add_tag(cell, "hide-input")
        if student and _VERIFY.search(cell.source):
            _add_tag(cell, "remove-output")
        if not _has_image(cell):
            continue
        figure += 1
        number = f"{chapter}.{figure}"
        _add_tag(cell, "hide-input")
        tables = [o for o in cell.outputs if o.output_type in ("display_data", "execute_result")
                  and not _has_image_output(o) and set(o.get("data", {})) - {"text/plain"}]
        if tables:  # a table printed beside the plot renders below the figure, not inside it
            extras[id(cell)] = tables
        cell.outputs = [o for o in cell.outputs if o.output_type == "stream" or _has_image_output(o)
                        or (o.output_type == "display_data" and o not in tables)]
        labels = plot_labels(cell.source)
        below = nb.cells[i + 1] if i + 1 < len(nb.cells) else None
        if below is not None and below.cell_type == "markdown" and not below.source.lstrip().startswith("#"):
            takeaway, below.source = _split_first_paragraph(below.source)
            takeaway = _TAKEAWAY.sub("", takeaway)
            takeaway = takeaway[:1].upper() + takeaway[1:]
        else:
            takeaway = "; ".join(labels["title"]) or f"Figure {number}"
        caption = f"**Figure {number}.** " + " ".join(takeaway.split())
        cell.metadata["mystnb"] = {"figure": {"name": f"fig-{chapter}-{figure}", "caption": caption,
                                              "classes": "kimilab-figure"},
                                   "image": {"alt": _alt(number, labels, takeaway)}}
    cells = []
    for c in nb.cells:
        if c.cell_type == "markdown" and not c.source.strip():
            continue
        cells.append(c)
        if id(c) in extras:
            cells.append(new_code_cell(source="# the tables the plotting cell above displays", outputs=extras[id(c)],
                                       metadata={"tags": ["remove-input"]}, execution_count=c.execution_count))
    nb.cells = cells
    return nb


def _has_image_output(output) -> bool:
    return any(k.startswith("image/") for k in output.get("data", {}))


def references_md(text: str) -> str:
    """``<a id="x"></a>`` anchors become MyST targets ``(x)=``, so ``references.md#x`` links resolve."""
    return _ANCHOR.sub(lambda m: f"({m.group(1)})=", text)
