"""How hard the property tests look.

`make test` loads the ``repro`` profile (see conftest.py): derandomised, no example
database, so its result depends only on the code, on every machine. `make fuzz` loads
``fuzz`` (random, with the seed it prints) and sets KIMILAB_FUZZ_FACTOR, which
:func:`examples` multiplies every property test's example count by.
"""

from __future__ import annotations

import os

__all__ = ["FACTOR", "examples"]


def _factor() -> int:
    raw = os.environ.get("KIMILAB_FUZZ_FACTOR", "1")
    if not raw.isdigit() or int(raw) < 1:
        raise ValueError(f"KIMILAB_FUZZ_FACTOR={raw!r}: expected a whole number >= 1")
    return int(raw)


FACTOR = _factor()


def examples(n: int) -> int:
    """A test's example count under the current budget (n for `make test`)."""
    return n * FACTOR
