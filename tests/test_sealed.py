"""The student bundle's sealed check agrees with the teacher's check, and holds no value.

For every registered exercise the expected value is sealed (with a cheap hash, so this
runs in seconds) and a set of answers goes through both checks: the value itself and
values within the tolerance pass both; values 3x the tolerance away, unit slips, the
wrong sign, a string, the wrong shape fail both; unit slips are named by both.
"""

from __future__ import annotations

import json
import random
import re

import numpy as np
import pytest

from kimilab.exercises import all_exercises, check, sealed

EXERCISES = all_exercises()


@pytest.fixture(autouse=True)
def cheap_hash(monkeypatch):
    monkeypatch.setattr(sealed, "ITERATIONS", 50)


def _answers(value, rtol: float, atol: float):
    """(answer, should pass) pairs around ``value``."""
    if np.ndim(value):
        e = np.asarray(value, dtype=float)
        nudged = e.copy()
        nudged.flat[0] += 10 * max(atol, rtol * float(np.max(np.abs(e))), 1e-9)
        close = e + 0.4 * atol if atol else e * (1 + 0.4 * rtol)
        return [(e, True), (close, True), (nudged, False),
                (e[:1], False), ("x", False)]
    x = float(value)
    out = [(value, True), (x * (1 + 0.4 * rtol), True), (x * (1 - 0.4 * rtol), True), (None, False), ("x", False)]
    if x:
        out += [(x * (1 + 3 * rtol) + 3 * atol, False), (x * (1 - 3 * rtol) - 3 * atol, False),
                (-x, False), (x * 2**20, False), (x / 1e3, False), (x * 1.3, False), (x * 40, False)]
    return out


@pytest.mark.parametrize("id", list(EXERCISES))
def test_sealed_and_full_checks_agree(id):
    ex = EXERCISES[id]
    value = ex.expected()
    record = sealed.seal(id, ex.title, ex.hints, value, rtol=ex.rtol, atol=ex.atol, rng=random.Random(0))
    text = json.dumps(record)
    if not np.ndim(value) and len(repr(value)) >= 3:
        assert not re.search(r"(?<![\w.])" + re.escape(repr(value)) + r"(?![\w])", text), "the key holds the value"
    for answer, ok in _answers(value, ex.rtol, ex.atol):
        full = check(answer, value, name=id, hint=ex.hints, rtol=ex.rtol, atol=ex.atol, verbose=False)
        seal = sealed.check_sealed(answer, record, verbose=False)
        assert full.ok == seal.ok == ok, (answer, full.message, seal.message)
        assert full.status == seal.status
        if not ok and answer is not None and np.ndim(answer) == 0 and not isinstance(answer, str):
            x = float(answer)
            if x and abs(abs(x / float(value)) - 2**20) < 1:
                assert "2^20" in full.message and "2^20" in seal.message
            if x and abs(float(value) / x - 1e3) < 1e-3:
                assert "10^3" in seal.message


def test_sealed_feedback_is_true_whichever_way_the_grid_falls():
    """Within 20% / too small by less than 44% / more than a factor of 10: each claim holds for 50 random grids."""
    for seed in range(50):
        record = sealed.seal("9.9", "t", ("a", "b"), 1234.5, rtol=1e-6, atol=0.0, rng=random.Random(seed))
        for factor in (0.7, 0.9, 1.1, 1.3, 3.0, 0.2, 30.0, 0.01):
            message = sealed.check_sealed(1234.5 * factor, record, verbose=False).message
            ratio = max(factor, 1 / factor)
            if "within 20%" in message:
                assert ratio < 1.2
            if "by less than 44%" in message:
                assert ratio < 1.44 and ("too small" in message) == (factor < 1)
            if "more than 20% off" in message:
                assert 1.2 <= ratio < 10
            if "off by more than a factor of 10" in message:
                assert ratio >= 10
