"""Stored results: a file is used only for its own call and source, and a check recomputes it."""

import json

import pytest

from kimilab import recall, stored


@pytest.fixture
def results(tmp_path, monkeypatch):
    monkeypatch.setattr(stored, "RESULTS", tmp_path)
    monkeypatch.delenv("KIMILAB_RECOMPUTE", raising=False)
    return tmp_path


def counting(monkeypatch):
    calls = []
    real = recall.rebinding

    def rebinding(*a, **kw):
        calls.append(kw)
        return real(*a, **kw)

    rebinding.__module__, rebinding.__qualname__ = real.__module__, real.__qualname__
    monkeypatch.setattr(recall, "rebinding", rebinding)
    return rebinding, calls


def test_a_stored_result_is_reused_only_for_the_same_call_and_source(results, monkeypatch):
    fn, calls = counting(monkeypatch)
    first = stored.stored("r", fn, memory="linear", n_keys=4, seeds=[0, 1])
    assert len(calls) == 1 and isinstance(first, list)  # JSON data: what the file gives back
    assert stored.stored("r", fn, memory="linear", n_keys=4, seeds=[0, 1]) == first and len(calls) == 1
    stored.stored("r", fn, memory="linear", n_keys=5, seeds=[0, 1])  # other arguments: computed again
    assert len(calls) == 2
    rec = json.loads((results / "r.json").read_text())
    assert rec["fn"] == "kimilab.recall:rebinding" and "kimilab/recall.py" in rec["sources"]
    rec["digest"] = "0" * 64  # as if a source file had changed since
    (results / "r.json").write_text(json.dumps(rec))
    assert not stored.is_current("r")
    stored.stored("r", fn, memory="linear", n_keys=5, seeds=[0, 1])
    assert len(calls) == 3 and stored.is_current("r")
    monkeypatch.setenv("KIMILAB_RECOMPUTE", "1")
    stored.stored("r", fn, memory="linear", n_keys=5, seeds=[0, 1])
    assert len(calls) == 4


def test_check_recomputes_and_finds_a_changed_number(results, capsys):
    stored.stored("r", recall.rebinding, memory="linear", n_keys=4, seeds=[0])
    assert stored.check() == {"r": []}
    rec = json.loads((results / "r.json").read_text())
    rec["result"][0] += 1e-3
    (results / "r.json").write_text(json.dumps(rec))
    (diff,) = stored.check()["r"]
    assert diff.startswith("result[0]:")


def test_only_named_package_functions_can_be_stored(results):
    with pytest.raises(ValueError, match="fn: expected a module-level kimilab function"):
        stored.stored("x", lambda: 1)


def test_numbers_compare_to_a_relative_tolerance_and_volatile_keys_are_skipped():
    assert stored.differences({"a": 1.0, "run_wall_s": 3}, {"a": 1.0 + 1e-12, "run_wall_s": 9}) == []
    assert stored.differences({"a": [1, 2]}, {"a": [1]}) == ["result.a: 2 items, recomputed 1"]
    assert stored.differences({"a": "x"}, {"b": "x"}) == ["result: keys ['a', 'b'] differ"]


def test_every_shipped_result_was_computed_by_the_current_source():
    """Committing a change to the simulator without re-running the book leaves a stale file."""
    stale = [n for n in stored.names() if not stored.is_current(n)]
    assert not stale, f"stale stored results {stale}: run `make book` (or the chapter) to recompute them"


def test_restamp_marks_current_only_what_recomputes_the_same(results):
    stored.stored("same", recall.rebinding, memory="linear", n_keys=4, seeds=[0])
    stored.stored("moved", recall.rebinding, memory="linear", n_keys=4, seeds=[1])
    for name in ("same", "moved"):  # as if the source had changed since both were written
        rec = json.loads((results / f"{name}.json").read_text())
        rec["digest"] = "0" * 64
        if name == "moved":
            rec["result"][0] += 0.5
        (results / f"{name}.json").write_text(json.dumps(rec))
    got = stored.check(restamp=True)
    assert got["same"] == [] and got["moved"]
    assert stored.is_current("same") and not stored.is_current("moved")
