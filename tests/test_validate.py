"""The one argument check: what it accepts, what it refuses, and how it says so."""

import numpy as np
import pytest

from kimilab.validate import check_float, check_int


@pytest.mark.parametrize("value", [0, 7, np.int64(7), np.int32(3)])
def test_check_int_accepts_ints_and_returns_python_ints(value):
    got = check_int("n", value)
    assert got == value and type(got) is int


@pytest.mark.parametrize("value", [True, np.bool_(True), 2.0, "3", None, -1, np.int64(-1)])
def test_check_int_refuses_with_the_argument_name(value):
    with pytest.raises(ValueError, match=r"^n_pages=.*: expected an int >= 0 \(pages\)"):
        check_int("n_pages", value, unit="pages")


def test_check_int_minimum_is_inclusive():
    assert check_int("k", 1, 1) == 1
    with pytest.raises(ValueError, match="expected an int >= 2"):
        check_int("k", 1, 2)


@pytest.mark.parametrize("value,ok", [(1, True), (0.5, True), (np.float32(2), True), (float("nan"), False),
                                      (float("inf"), False), (True, False), ("1", False), (-1.0, False)])
def test_check_float(value, ok):
    if ok:
        assert type(check_float("x", value, minimum=0.0)) is float
    else:
        with pytest.raises(ValueError, match="^x="):
            check_float("x", value, minimum=0.0)
