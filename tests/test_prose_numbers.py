"""Every number in a chapter's prose is printed by one of its cells (or is a marked citation).

A re-render that changes a result must not leave stale prose behind. For each executed
chapter, this test collects the numbers its code cells print (stored outputs) and use
(their source), then checks every number written in its markdown before the exercises:
a prose number passes when some printed or used number rounds to it at the prose's
precision — directly, as a percentage, or in thousands / millions / billions / KiB / MiB
/ GiB. Exempt: numbers inside `inline code`, and lines that cite a source (a link to
references.md, an arXiv id, a figure, section, page or issue number). Small integers
(under 100, no decimals) are not checked: they are counts of layers, heads and the like.
"""

import json
import re
from pathlib import Path

import pytest

CHAPTERS = sorted((Path(__file__).resolve().parent.parent / "chapters").glob("[0-9][0-9]_*.ipynb"))
PROSE_NUMBER = re.compile(r"(?<![\w.`/#-])(\d{1,3}(?:,\d{3})+|\d+\.\d+|\d{3,})(?![\w`])")
ANY_NUMBER = re.compile(r"\d[\d,]*\.?\d*(?:e[-+]?\d+)?")
CITATION = re.compile(r"references\.md|arXiv|\bFig|§|\bp\. \d|#\d")
SCALES = (1.0, 100.0, 1e-3, 1e-6, 1e-9, 2.0 ** -10, 2.0 ** -20, 2.0 ** -30)


def _cell_text(cell) -> str:
    parts = ["".join(cell.get("source", ""))]
    for out in cell.get("outputs", []):
        parts.append("".join(out.get("text", "")))
        parts.append("".join(out.get("data", {}).get("text/plain", "")))
    return "\n".join(parts)


def _numbers_shown(nb) -> set[float]:
    found = set()
    for cell in nb["cells"]:
        if cell["cell_type"] != "code":
            continue
        for m in ANY_NUMBER.finditer(_cell_text(cell)):
            try:
                found.add(float(m.group(0).replace(",", "").rstrip(".")))
            except ValueError:
                pass
    return found


def _prose_numbers(nb):
    """(number as written, the line) for every checked number in the prose before the exercises."""
    for cell in nb["cells"]:
        if cell["cell_type"] != "markdown":
            continue
        text = "".join(cell["source"])
        if "## Exercises" in text:
            return
        for line in text.splitlines():
            if CITATION.search(line):
                continue
            for m in PROSE_NUMBER.finditer(re.sub(r"`[^`]*`", "", line)):
                token = m.group(1)
                if "." not in token and "," not in token and int(token) < 100:
                    continue
                yield token, line.strip()


def _matches(token: str, shown: set[float]) -> bool:
    value = float(token.replace(",", ""))
    decimals = len(token.split(".")[1]) if "." in token else 0
    return any(round(v * s, decimals) == value for v in shown for s in SCALES)


@pytest.mark.parametrize("path", CHAPTERS, ids=lambda p: p.stem)
def test_every_prose_number_is_printed_by_a_cell(path):
    nb = json.loads(path.read_text())
    shown = _numbers_shown(nb)
    stale = [f"{token!r} in: {line[:110]}" for token, line in _prose_numbers(nb) if not _matches(token, shown)]
    assert not stale, (f"{path.name}: {len(stale)} prose number(s) no cell prints (print them, or cite "
                       "the source on the same line):\n  " + "\n  ".join(stale))


def test_the_check_can_fail():
    nb = {"cells": [{"cell_type": "code", "source": "print(0.374)", "outputs": [{"text": "0.374\n"}]},
                    {"cell_type": "markdown", "source": "The hit rate is 0.374, not 0.669."}]}
    shown = _numbers_shown(nb)
    verdicts = {token: _matches(token, shown) for token, _ in _prose_numbers(nb)}
    assert verdicts == {"0.374": True, "0.669": False}
