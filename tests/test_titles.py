"""One title per chapter: README's chapter table and TEACHING's course plan use each chapter's own H1.

The H1 is the first ``# # N. Title`` line of ``chapters/NN_slug.py``; the web pages take
their titles from the same heading (``tests/test_site.py``). README's table links the
title without its number (the number has its own column); TEACHING's plan writes it whole.
"""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SOURCES = sorted((ROOT / "chapters").glob("[0-9][0-9]_*.py"))


def _h1s() -> dict[str, str]:
    out = {}
    for path in SOURCES:
        m = re.search(r"^# # (\d+\. .+)$", path.read_text(encoding="utf-8"), re.M)
        assert m, f"{path.name}: no '# # N. Title' heading"
        out[path.stem] = m.group(1).strip()
    return out


def test_readme_chapter_table_uses_the_h1s():
    rows = dict((stem, title) for title, stem in re.findall(
        r"^\| \d+ \| \[([^\]]+)\]\(chapters/(\d\d_[a-z0-9_]+)\.py\)", (ROOT / "README.md").read_text(), re.M))
    h1s = _h1s()
    assert set(rows) == set(h1s), f"README's table lists {sorted(rows)}"
    for stem, h1 in h1s.items():
        assert rows[stem] == h1.split(". ", 1)[1], f"README calls {stem} {rows[stem]!r}; its H1 is {h1!r}"


def test_teaching_plan_uses_the_h1s():
    text = (ROOT / "TEACHING.md").read_text()
    h1s = _h1s()
    for stem, h1 in h1s.items():
        n = h1.split(".", 1)[0]
        named = re.findall(rf"^#+ Week {n} — (.+)$", text, re.M)
        assert named == [h1], f"TEACHING's week {n} heading names {named}; the chapter's H1 is {h1!r}"


def test_teaching_states_the_measured_reading_times():
    """TEACHING's reading-time table is the one kimilab.readability measures on the stored notebooks."""
    from kimilab import readability

    text = (ROOT / "TEACHING.md").read_text()
    rows = {int(n): (int(core), int(deep)) for n, core, deep in
            re.findall(r"^\| (\d+)\. [^|]+\| (\d+) \| (\d+) \|", text, re.M)}
    measured = {int(r.name[:2]): (round(r.core_minutes), round(r.deep_minutes))
                for r in readability.read_chapters(ROOT / "chapters")}
    assert set(rows) == set(measured), f"TEACHING lists chapters {sorted(rows)}; the book has {sorted(measured)}"
    off = {n: (rows[n], measured[n]) for n in rows  # a minute of slack: rounding, a sentence added
           if max(abs(a - b) for a, b in zip(rows[n], measured[n])) > 1}
    assert not off, f"TEACHING's reading times (core, deep) differ from the measured ones: {off}"
