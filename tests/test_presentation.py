"""The book's presentation helpers: exercise checks, house plot style, source display."""

from __future__ import annotations

import numpy as np
import pytest

from kimilab import exercises as checks, plots
from kimilab.notebook import show_source, source_of


def test_check_not_answered_gives_hint(capsys):
    result = checks.check(None, 42, name="ex1", hint="multiply 6 by 7")
    assert not result.ok
    out = capsys.readouterr().out
    assert "not answered yet" in out and "multiply 6 by 7" in out and "42" not in out


def test_check_wrong_and_right(capsys):
    assert not checks.check(41.0, 42, name="ex", hint="off by one?")
    assert "not quite" in capsys.readouterr().out
    assert checks.check(42.0 * (1 + 1e-9), 42, name="ex")
    assert checks.check(np.array([1.0, 2.0]), [1.0, 2.0], name="vec")
    assert not checks.check(np.array([1.0, 2.0, 3.0]), [1.0, 2.0], name="vec", verbose=False)
    assert checks.check("align", "align", name="s", verbose=False)
    assert not checks.check("kv-only", "align", name="s", verbose=False)


def test_plots_keys_are_fixed():
    assert plots.color("dual") == plots.METHODS["dual"][1]
    assert plots.style_of("kv-only") == {"label": plots.label("kv-only"), "color": plots.color("kv-only")}
    with pytest.raises(ValueError, match="method key='nope'"):
        plots.color("nope")


@pytest.mark.parametrize("keys", [
    ("no-cache", "kv-cache"),  # chapter 1, decode work and time
    ("gqa", "all-mla", "hybrid", "weights"),  # chapter 1, KV bytes vs context
    ("all-mla", "kv-cache", "kda-state"),  # chapter 2, state vs KV
    ("kda-state", "conv-state", "kv-cache", "all-mla", "hybrid"),  # chapter 3, layers and memory
    ("linear-attention", "delta-rule", "analytic"),  # chapter 2, read-back
    ("recurrent", "chunked"),  # chapter 2, cost
])
def test_keys_sharing_a_figure_have_distinct_colours(keys):
    colours = [plots.color(key) for key in keys]
    assert len(set(colours)) == len(colours), dict(zip(keys, colours))


def test_chapter1_exercise2_accepts_its_solution_and_rejects_wrong_ones():
    """The stated solution (3.09 million tokens) passes; GiB-for-GB and the hybrid's answer fail."""
    from kimilab import costs
    from kimilab.config import all_mla_27, kimi_linear_48b

    one = costs.ONE_H200
    expected = costs.device_weight_bytes(all_mla_27, one) / costs.kv_bytes_per_token(all_mla_27, one)
    rtol = 0.01  # the tolerance chapter 1's check uses
    assert checks.check(3.09e6, expected, name="ex2", rtol=rtol, verbose=False)
    assert checks.check(3_086_420, expected, name="ex2", rtol=rtol, verbose=False)
    assert not checks.check(96 * 2**30 / 31_104, expected, name="ex2", rtol=rtol, verbose=False)
    hybrid = costs.device_weight_bytes(kimi_linear_48b, one) / costs.kv_bytes_per_token(kimi_linear_48b, one)
    assert not checks.check(hybrid, expected, name="ex2", rtol=rtol, verbose=False)


def test_save_names_and_writes(tmp_path, monkeypatch):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    monkeypatch.setenv("KIMILAB_FIGURES", str(tmp_path))
    fig, ax = plt.subplots()
    ax.plot([0, 1], [0, 1])
    with pytest.raises(ValueError, match="figure name"):
        plots.save(fig, "Bad Name")
    path = plots.save(fig, "ch00-test")
    plt.close(fig)
    assert path == tmp_path / "ch00-test.png" and path.stat().st_size > 0


def test_show_source_is_the_package_code():
    from kimilab.notebook import wrap_listing

    code = show_source(checks.check, limit=None)
    assert code.data == wrap_listing(source_of(checks.check, docstring=False))
    assert "def check(" in code.data
    full = source_of(checks.check)
    shown = wrap_listing(full)
    assert [ln for ln in code.data.splitlines()] == [ln for ln in shown.splitlines() if ln in code.data.splitlines()]
    assert show_source(checks.check, docstring=True, limit=None).data == shown
    with pytest.raises(ValueError, match="obj="):
        source_of(42)


def test_a_listing_is_wrapped_to_the_page_and_stays_the_same_code():
    """Lines wider than the page break after a comma inside brackets: still valid Python, the same tokens."""
    import ast
    import inspect
    import io
    import textwrap
    import tokenize

    import kimilab.kda.chunk as chunk
    from kimilab.notebook import WIDTH, wrap_listing

    def tokens(text):
        return [(t.type, t.string) for t in tokenize.generate_tokens(io.StringIO(text).readline)
                if t.type not in (tokenize.NL, tokenize.NEWLINE, tokenize.INDENT, tokenize.DEDENT)]

    source = inspect.getsource(chunk.chunk_kda)  # chapter 2's listing
    wrapped = wrap_listing(source)
    assert max(len(ln) for ln in source.splitlines()) > WIDTH  # the test means something
    assert max(len(ln) for ln in wrapped.splitlines()) <= WIDTH
    ast.parse(textwrap.dedent(wrapped))
    assert tokens(wrapped) == tokens(source)
    assert wrap_listing("x = f(a, 'b, c # d')  # e, f", width=12) == "x = f(a,\n        'b, c # d')  # e, f"
    with pytest.raises(ValueError, match="obj="):
        source_of(42)
