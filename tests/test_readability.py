"""A chapter a student can finish: the core path reads in 35 minutes, nothing printed is wider
than the page, a computed Key results box opens each chapter and a Summary closes it.

Reading time is measured from the stored notebooks by :mod:`kimilab.readability` (the
readability issue's formula). Depth lives in sections headed "Deep dive", which do not count.
"""

import json
from pathlib import Path

import pytest

from kimilab import readability
from kimilab.notebook import Table, key_results, show_source

CHAPTERS = Path(__file__).resolve().parent.parent / "chapters"
NOTEBOOKS = sorted(CHAPTERS.glob("[0-9][0-9]_*.ipynb"))


def _nb(path: Path) -> dict:
    return json.loads(path.read_text(encoding="utf-8"))


@pytest.mark.parametrize("path", NOTEBOOKS, ids=[p.stem[:2] for p in NOTEBOOKS])
def test_core_path_reads_in_one_sitting(path):
    r = readability.read_notebook(_nb(path), path.stem)
    assert r.core_minutes <= readability.CORE_LIMIT, (
        f"{path.name}: core path reads in {r.core_minutes:.1f} min, over {readability.CORE_LIMIT:.0f}; "
        f"move comparisons, sweeps and sensitivity into a '### Deep dive: ...' section")


@pytest.mark.parametrize("path", NOTEBOOKS, ids=[p.stem[:2] for p in NOTEBOOKS])
def test_no_printed_line_is_wider_than_the_page(path):
    r = readability.read_notebook(_nb(path), path.stem)
    assert r.widest <= readability.WIDTH, f"{path.name}: a printed line of {r.widest} characters: {r.widest_line!r}"
    assert not r.long_core_listings, f"{path.name}: a core listing over 40 lines (show_source(..., limit=None))"


@pytest.mark.parametrize("path", NOTEBOOKS, ids=[p.stem[:2] for p in NOTEBOOKS])
def test_key_results_first_summary_last(path):
    nb = _nb(path)
    r = readability.read_notebook(nb, path.stem)
    assert r.key_results, f"{path.name}: no computed Key results box (key_results(...)) in its first cells"
    headings = ["".join(c["source"]) for c in nb["cells"] if c["cell_type"] == "markdown"]
    summary = [i for i, h in enumerate(headings) if h.lstrip().startswith("## Summary")]
    exercises = [i for i, h in enumerate(headings) if h.lstrip().startswith("## Exercises")]
    assert summary and exercises and summary[0] < exercises[0], f"{path.name}: '## Summary' before '## Exercises'"
    text = "\n".join(headings[summary[0]:exercises[0]])
    assert "next chapter" in text.lower() or path.stem.startswith("12"), \
        f"{path.name}: the summary names the question the next chapter answers"
    assert r.deep_dives or r.core_minutes < 20, f"{path.name}: a long chapter with no deep dive"


def _markdown(text: str) -> dict:
    return {"cell_type": "markdown", "source": text}


def _code(src: str, out: str) -> dict:
    return {"cell_type": "code", "source": src, "outputs": [{"output_type": "stream", "name": "stdout", "text": out}]}


def test_the_reading_check_can_fail_and_deep_dives_do_not_count():
    long_prose = " ".join(["word"] * 8000)  # 40 minutes at 200 words a minute
    nb = {"cells": [_markdown("# T"), _code("key_results(1)", "Key results\n- 1"), _markdown(long_prose)]}
    r = readability.read_notebook(nb)
    assert r.core_minutes == pytest.approx(40 + 0.1 + 2 / 15, abs=0.01) and r.key_results
    nb["cells"].insert(2, _markdown("## Part\n\n### Deep dive: the sweep"))
    nb["cells"].append(_code("x = 1\nprint('x' * 120)", "x" * 120 + "\n"))
    nb["cells"].append(_markdown("## Summary\n\nshort"))
    r = readability.read_notebook(nb)
    assert r.core_minutes < 1 and r.deep_minutes > 40 and r.deep_dives == ["Deep dive: the sweep"]
    assert r.widest == 120  # widths count in deep dives too
    nb["cells"].insert(1, _code("show_source(f, limit=None)", "def f():\n    pass\n"))
    assert readability.read_notebook(nb).long_core_listings == 1


def test_tables_fit_the_page_and_render_as_markdown():
    t = Table([("ends", 0.3333333, 12), ("dual", 0.25, 1200)], ["policy", "hit", "pages"], formats={"hit": ".3f"})
    assert t._repr_markdown_().splitlines()[:2] == ["| policy | hit | pages |", "|:---|---:|---:|"]
    assert repr(t).splitlines()[2] == "ends    0.333     12"
    with pytest.raises(ValueError, match="widest column is 'name'"):
        Table([("x" * 120, 1)], ["name", "n"])
    with pytest.raises(ValueError, match="rows\\[0\\] has 1 values"):
        Table([(1,)], ["a", "b"])


def test_key_results_carry_numbers_and_wrap():
    box = key_results("a " * 80 + "1.", "b 2.", "c 3.")
    assert all(len(line) <= 100 for line in repr(box).splitlines()) and repr(box).startswith("Key results")
    with pytest.raises(ValueError, match="3 to 5"):
        key_results("1", "2")
    with pytest.raises(ValueError, match="has none"):
        key_results("1", "2", "no number here")


def test_listings_are_pinned_by_function_and_short():
    from kimilab.ops import attention

    assert '"""' not in show_source(attention.causal_attention).data
    with pytest.raises(ValueError, match="over limit=3"):
        show_source(attention.causal_attention, limit=3)
    assert show_source(attention, limit=None).data.count("\n") > 40


def test_the_setup_cell_is_run_not_read():
    """Colab's setup cell (tagged setup, hidden on the web) adds no reading time; any other cell does."""
    body = "\n".join(f"line_{i} = {i}" for i in range(30))
    nb = {"cells": [_markdown("# T"), _code(body, ""), _code("key_results(1)", "Key results\n- 1")]}
    plain = readability.read_notebook(nb).core_minutes
    nb["cells"][1]["metadata"] = {"tags": ["setup", "remove-cell"]}
    r = readability.read_notebook(nb)
    assert r.key_results and plain - r.core_minutes == pytest.approx(30 / 10)
