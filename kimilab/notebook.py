"""Notebook helpers: the package's own source, tables and key results that fit the page.

The book never pastes a copy of package code (``show_source`` shows the real thing), never
prints a table as f-string columns (``Table`` renders as a markdown table, with a plain-text
fallback that nbval compares), and states its key results up front from computed numbers
(``key_results``). Every plain-text form is at most ``WIDTH`` characters a line, so nothing
scrolls sideways in a notebook or on the web page.
"""

from __future__ import annotations

import ast
import inspect
import textwrap

__all__ = ["WIDTH", "LISTING_LINES", "show_source", "source_of", "wrap_listing", "Table", "show_table", "key_results"]

WIDTH = 100  # the widest printed line the book allows
LISTING_LINES = 40  # the longest listing allowed in a chapter's core path


def source_of(obj, *, docstring: bool = True) -> str:
    """The source text of a kimilab function, class or module (dedented); ``docstring=False`` drops
    the docstrings of the object and of everything defined inside it."""
    try:
        text = textwrap.dedent(inspect.getsource(obj))
    except (TypeError, OSError) as exc:
        raise ValueError(f"obj={obj!r}: expected a function, class or module defined in a file") from exc
    return text if docstring else _without_docstrings(text)


def _without_docstrings(text: str) -> str:
    """``text`` less every docstring line (found with ``ast``, so strings in code stay)."""
    drop: set[int] = set()
    for node in ast.walk(ast.parse(text)):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef, ast.Module)) and node.body:
            first = node.body[0]
            if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant) \
                    and isinstance(first.value.value, str):
                drop.update(range(first.lineno, first.end_lineno + 1))
    return "".join(line for i, line in enumerate(text.splitlines(keepends=True), 1) if i not in drop)


def show_source(obj, *, docstring: bool = False, limit: int | None = LISTING_LINES):
    """Display ``obj``'s source, syntax-highlighted, as the notebook cell's output.

    Pin a listing by function, not by line range: show the one function or method that carries
    the idea. Docstrings are left out unless ``docstring=True`` (the prose around the listing
    explains it, and a reworded docstring then does not change a stored output). A listing
    longer than ``limit`` lines raises: the core path shows at most ``LISTING_LINES``; a deep
    dive may pass ``limit=None``. Returns an ``IPython.display.Code`` object, whose plain-text
    form is the source itself (lines wider than the page broken inside brackets, :func:`wrap_listing`),
    so the stored notebook output changes exactly when the code does.
    """
    from IPython.display import Code

    text = wrap_listing(source_of(obj, docstring=docstring))
    n = len(text.splitlines())
    if limit is not None and n > limit:
        raise ValueError(f"show_source({getattr(obj, '__qualname__', obj)}): the listing has {n} lines, over "
                         f"limit={limit}; show a smaller function, or pass limit=None inside a deep dive")
    return Code(text, language="python")


def _break_after(line: str, width: int) -> int | None:
    """The position just after the last comma inside the outermost brackets that have one (outside
    strings and comments) that leaves the line's head within ``width``; None if there is none."""
    depth, quote, best = 0, None, {}
    for i, ch in enumerate(line):
        if quote:
            if ch == quote and line[i - 1] != "\\":
                quote = None
        elif ch in "\"'":
            quote = ch
        elif ch == "#":
            break
        elif ch in "([{":
            depth += 1
        elif ch in ")]}":
            depth -= 1
        elif ch == "," and depth > 0 and i + 1 <= width:
            best[depth] = i + 1
    return best[min(best)] if best else None


def wrap_listing(text: str, width: int = WIDTH) -> str:
    """``text`` with every line wider than ``width`` broken after a comma inside brackets (still valid
    Python), the rest indented 8 more: a listing fits the page as the chapters' printed lines must."""
    out = []
    for line in text.splitlines():
        indent = " " * (len(line) - len(line.lstrip()) + 8)
        while len(line) > width:
            cut = _break_after(line, width)
            if cut is None or not line[cut:].strip():
                break
            out.append(line[:cut].rstrip())
            line = indent + line[cut:].lstrip()
        out.append(line)
    return "\n".join(out) + ("\n" if text.endswith("\n") else "")


def _cell(value, fmt: str | None) -> str:
    if fmt is not None:
        return format(value, fmt)
    if isinstance(value, float):
        return f"{value:,.3g}" if abs(value) < 1e3 else f"{value:,.0f}"
    if isinstance(value, int) and not isinstance(value, bool):
        return f"{value:,}"
    return str(value)


class Table:
    """A small results table: markdown for the notebook and the web page, aligned plain text for nbval.

    ``rows`` are sequences of values in the order of ``columns``; ``formats`` maps a column name to a
    format spec (``".3f"``, ``",d"``, ``".1%"``); unformatted floats get 3 significant digits.
    A number column is right-aligned. The plain-text form must fit ``WIDTH`` characters: a wider
    table raises ``ValueError`` naming its widest column (split it, or make it a plot).
    """

    def __init__(self, rows, columns, *, formats: dict[str, str] | None = None, title: str | None = None):
        columns = [str(c) for c in columns]
        rows = [list(r) for r in rows]
        if not columns:
            raise ValueError("columns=[]: expected at least one column name")
        for i, row in enumerate(rows):
            if len(row) != len(columns):
                raise ValueError(f"rows[{i}] has {len(row)} values; expected {len(columns)} (columns={columns})")
        formats = dict(formats or {})
        unknown = set(formats) - set(columns)
        if unknown:
            raise ValueError(f"formats: no column named {sorted(unknown)}; columns are {columns}")
        self.columns, self.title = columns, title
        self.cells = [[_cell(v, formats.get(c)) for v, c in zip(row, columns)] for row in rows]
        self.numeric = [bool(rows) and all(isinstance(r[j], (int, float)) and not isinstance(r[j], bool)
                                           for r in rows) for j in range(len(columns))]
        text = self._text()
        widest = max(len(line) for line in text.splitlines())
        if widest > WIDTH:
            widths = self._widths()
            big = columns[widths.index(max(widths))]
            raise ValueError(f"Table is {widest} characters wide, over {WIDTH}; its widest column is {big!r}: "
                             "shorten names, drop columns, or plot it")

    def _widths(self) -> list[int]:
        return [max(len(x) for x in [c] + [r[j] for r in self.cells]) for j, c in enumerate(self.columns)]

    def _text(self) -> str:
        widths = self._widths()

        def line(values):
            return "  ".join(v.rjust(w) if num else v.ljust(w)
                             for v, w, num in zip(values, widths, self.numeric)).rstrip()

        out = [self.title] if self.title else []
        out += [line(self.columns), "  ".join("-" * w for w in widths)]
        out += [line(r) for r in self.cells]
        return "\n".join(out)

    def __repr__(self) -> str:
        return self._text()

    def _repr_markdown_(self) -> str:
        def esc(s: str) -> str:
            return s.replace("|", "\\|")

        head = f"**{esc(self.title)}**\n\n" if self.title else ""
        rule = "|".join("---:" if num else ":---" for num in self.numeric)
        body = "\n".join("| " + " | ".join(esc(x) for x in r) + " |" for r in self.cells)
        return f"{head}| {' | '.join(esc(c) for c in self.columns)} |\n|{rule}|\n{body}\n"

    def rows(self) -> list[list[str]]:
        """The formatted cells, row by row (what both forms show)."""
        return [list(r) for r in self.cells]


def show_table(rows, columns, **kwargs) -> Table:
    """``Table(rows, columns, **kwargs)``: the last expression of a cell renders it."""
    return Table(rows, columns, **kwargs)


class _KeyResults:
    def __init__(self, sentences: list[str]):
        self.sentences = sentences

    def __repr__(self) -> str:
        lines = ["Key results"]
        for s in self.sentences:
            lines += textwrap.wrap(s, WIDTH, initial_indent="- ", subsequent_indent="  ")
        return "\n".join(lines)

    def _repr_markdown_(self) -> str:
        items = "\n".join(f"> - {s}" for s in self.sentences)
        return f"> **Key results**\n>\n{items}\n"


def key_results(*sentences: str) -> _KeyResults:
    """The box that opens a chapter: three to five sentences, each carrying a number a cell computed.

    Call it as the last expression of the chapter's first code cells, with f-strings over the
    numbers the chapter derives; the plain-text form wraps at ``WIDTH`` characters.
    """
    sentences = [" ".join(str(s).split()) for s in sentences]
    if not 3 <= len(sentences) <= 5:
        raise ValueError(f"key_results: got {len(sentences)} sentences; expected 3 to 5")
    if not all(any(ch.isdigit() for ch in s) for s in sentences):
        bare = next(s for s in sentences if not any(ch.isdigit() for ch in s))
        raise ValueError(f"key_results: each sentence carries its number; this one has none: {bare[:60]!r}")
    return _KeyResults(sentences)
