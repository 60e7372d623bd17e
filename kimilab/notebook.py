"""Notebook helpers: show the package's own source, so the book never pastes a copy."""

from __future__ import annotations

import inspect
import textwrap

__all__ = ["show_source", "source_of"]


def source_of(obj) -> str:
    """The source text of a kimilab function, class or module (dedented)."""
    try:
        return textwrap.dedent(inspect.getsource(obj))
    except (TypeError, OSError) as exc:
        raise ValueError(f"obj={obj!r}: expected a function, class or module defined in a file") from exc


def show_source(obj, *, lines: tuple[int, int] | None = None):
    """Display ``obj``'s source, syntax-highlighted, as the notebook cell's output.

    ``lines=(first, last)`` (1-based, inclusive) shows only part of a long body.
    Returns an ``IPython.display.Code`` object, whose plain-text form is the source
    itself, so the stored notebook output changes exactly when the code does.
    """
    from IPython.display import Code

    text = source_of(obj)
    if lines is not None:
        first, last = lines
        if not (1 <= first <= last):
            raise ValueError(f"lines={lines!r}: expected (first, last) with 1 <= first <= last")
        text = "\n".join(text.splitlines()[first - 1 : last]) + "\n"
    return Code(text, language="python")
