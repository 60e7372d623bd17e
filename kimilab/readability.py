"""How long a chapter takes to read, from its stored notebook: the core path and the deep dives.

The formula (the readability issue's): 200 prose words a minute, 10 code lines, 15 printed
output lines, 20 listing lines (a ``show_source`` cell's output), 1.5 minutes a figure. A section
whose heading says "Deep dive" counts as deep-dive time until the next heading of the same or a
higher level; everything else is the core path, which must read in ``CORE_LIMIT`` minutes. The
setup cell (tagged ``setup``: it installs the book on Colab, :mod:`kimilab.site.launch`) is run, not
read, and the web edition hides it, so it counts nowhere.

``python -m kimilab.readability [CHAPTERS_DIR]`` prints the table (and exits 1 past the limits).
"""

from __future__ import annotations

import json
import re
import sys
from dataclasses import dataclass, field
from pathlib import Path

__all__ = ["CORE_LIMIT", "WIDTH", "Reading", "read_notebook", "read_chapters", "main"]

CORE_LIMIT = 35.0  # minutes of core reading per chapter
WIDTH = 100  # the widest printed line allowed anywhere in a chapter
_RATES = {"words": 200, "code": 10, "output": 15, "listing": 20}
_FIGURE_MIN = 1.5
_HEADING = re.compile(r"^(#+)\s+(.*)")
_DEEP = re.compile(r"deep dive", re.I)
_UNLIMITED = re.compile(r"show_source\([^)]*limit\s*=\s*None")


@dataclass
class _Counts:
    words: int = 0
    code: int = 0
    output: int = 0
    listing: int = 0
    figures: int = 0

    def minutes(self) -> float:
        return (self.words / _RATES["words"] + self.code / _RATES["code"] + self.output / _RATES["output"]
                + self.listing / _RATES["listing"] + _FIGURE_MIN * self.figures)


@dataclass
class Reading:
    """One chapter's reading: minutes in the core and in deep dives, and what the page checks need."""

    name: str
    core: _Counts = field(default_factory=_Counts)
    deep: _Counts = field(default_factory=_Counts)
    widest: int = 0  # widest printed line, core and deep dives alike
    widest_line: str = ""
    key_results: bool = False  # a cell near the top prints a Key results box
    deep_dives: list[str] = field(default_factory=list)  # their headings
    long_core_listings: int = 0  # core cells that lift show_source's line limit (limit=None)

    @property
    def core_minutes(self) -> float:
        return self.core.minutes()

    @property
    def deep_minutes(self) -> float:
        return self.deep.minutes()


def _text_of(output: dict) -> str:
    text = output.get("text", "")
    if not text:
        text = output.get("data", {}).get("text/plain", "")
    return "".join(text)


def read_notebook(nb: dict, name: str = "") -> Reading:
    """The reading of one notebook (its JSON as a dict)."""
    r = Reading(name)
    deep_level = None
    for i, cell in enumerate(nb["cells"]):
        src = "".join(cell["source"])
        if cell["cell_type"] == "markdown":
            counts = r.deep if deep_level is not None else r.core
            for line in src.splitlines():
                m = _HEADING.match(line)
                if m:
                    level = len(m.group(1))
                    if deep_level is not None and level <= deep_level:
                        deep_level = None
                    if _DEEP.search(m.group(2)):
                        deep_level = level
                        r.deep_dives.append(m.group(2).strip())
                    counts = r.deep if deep_level is not None else r.core
                counts.words += len(line.split())
            continue
        if "setup" in cell.get("metadata", {}).get("tags", []):
            continue
        counts = r.deep if deep_level is not None else r.core
        if i < 6 and "key_results(" in src and any("Key results" in _text_of(o) for o in cell.get("outputs", [])):
            r.key_results = True
        counts.code += sum(1 for line in src.splitlines() if line.strip())
        if deep_level is None and _UNLIMITED.search(src):
            r.long_core_listings += 1
        for out in cell.get("outputs", []):
            data = out.get("data", {})
            if "image/png" in data or "image/svg+xml" in data:
                counts.figures += 1
                continue
            lines = _text_of(out).splitlines()
            if "show_source" in src:
                counts.listing += len(lines)
            else:
                counts.output += len(lines)
            for line in lines:
                if len(line) > r.widest:
                    r.widest, r.widest_line = len(line), line
    return r


def read_chapters(folder: Path) -> list[Reading]:
    """Every stored ``NN_slug.ipynb`` under ``folder``, in order."""
    return [read_notebook(json.loads(p.read_text(encoding="utf-8")), p.stem)
            for p in sorted(Path(folder).glob("[0-9][0-9]_*.ipynb"))]


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    folder = Path(argv[0]) if argv else Path(__file__).resolve().parent.parent / "chapters"
    if not folder.is_dir():
        print(f"CHAPTERS_DIR={folder}: expected a folder of NN_slug.ipynb chapters", file=sys.stderr)
        return 2
    bad = 0
    print(f"{'chapter':<28} {'core min':>8} {'deep min':>8} {'widest':>6}  key results")
    for r in read_chapters(folder):
        over = r.core_minutes > CORE_LIMIT or r.widest > WIDTH or not r.key_results
        bad += over
        print(f"{r.name:<28} {r.core_minutes:8.0f} {r.deep_minutes:8.0f} {r.widest:6d}  "
              f"{'yes' if r.key_results else 'no'}{'  <- over' if over else ''}")
    return 1 if bad else 0


if __name__ == "__main__":
    raise SystemExit(main())
