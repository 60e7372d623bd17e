"""The student bundle's self-checks: public sanity tests that do not hold the answer.

The teacher's repository computes every expected value with kimilab
(``kimilab/exercises/chNN.py``) and grades in its own process
(:mod:`kimilab.classroom.grade`). The student bundle ships neither the values nor any
digest of them. Its ``public.json`` says only what the question already implies: the
kind of answer (an integer, a number, an array of a given shape, a string), its sign,
and a range three powers of ten wide that holds its size, placed at random around
it. :func:`check_public` tests an answer against those and says "plausible" or
what is off (not a whole number, the wrong sign, outside the range: a unit slip or
an order of magnitude). Two answers of the same kind, sign and range get the same
verdict, so no number of tries narrows the answer down further.
"""

from __future__ import annotations

import json
import math
import random
from pathlib import Path

import numpy as np

from kimilab.exercises.core import ExerciseResult, as_numbers, hint_for, shape_clause, shown, unanswered

__all__ = ["PUBLIC", "describe", "check_public", "load_public", "write_public"]

PUBLIC = Path(__file__).resolve().parent / "public.json"
_DECADES = 3  # the width of the plausible range, in powers of ten


def describe(id: str, title: str, hints, expected, *, rng: random.Random | None = None) -> dict:
    """The public record of one exercise: what a sanity check may know, and not the value."""
    rng = rng or random.SystemRandom()
    record = {"id": id, "title": title, "hints": [hints] if isinstance(hints, str) else list(hints)}
    if isinstance(expected, (bool, np.bool_)):
        return record | {"kind": "bool"}
    if isinstance(expected, str):
        return record | {"kind": "string"}
    e = np.asarray(expected, dtype=float)
    if e.ndim:
        return record | {"kind": "array", "shape": list(e.shape)}
    x = float(e)
    record["kind"] = "integer" if isinstance(expected, (int, np.integer)) else "number"
    if x != 0 and math.isfinite(x):
        record["sign"] = "positive" if x > 0 else "negative"
        low = math.floor(math.log10(abs(x))) - rng.randint(1, _DECADES - 1)  # its decade: the 2nd or 3rd of 3, at random
        record["range"] = [10.0 ** low, 10.0 ** (low + _DECADES)]
    return record


def _off(answer, record: dict) -> str:
    """The clause on what a public check finds off, or "" if the answer passes them all."""
    kind = record["kind"]
    if kind in ("bool", "string"):
        typed = isinstance(answer, (bool, np.bool_)) if kind == "bool" else isinstance(answer, str)
        return "" if typed else f" ({'True or False' if kind == 'bool' else 'a string'} was expected)"
    a = as_numbers(answer)
    if a is None:
        wanted = {"integer": "an integer", "number": "a number"}.get(kind, "an array")
        return f", which is not a number ({wanted} was expected)"
    shape = tuple(record.get("shape", ()))
    if a.shape != shape:
        return shape_clause(a.shape, shape)
    if not np.all(np.isfinite(a)):
        return ", which is not finite"
    if kind == "array":
        return ""
    x = float(a)
    if kind == "integer" and x != int(x):
        return ", which is not a whole number (an integer was expected)"
    sign = record.get("sign")
    if sign and (x > 0) != (sign == "positive"):
        return f", which is {'zero' if x == 0 else 'of the wrong sign'} (a {sign} value was expected)"
    if "range" in record:
        low, high = record["range"]
        if not low <= abs(x) < high:
            return (f", which is {'smaller' if abs(x) < low else 'larger'} than any plausible answer "
                    f"(between {low:.0e} and {high:.0e} in size): check its unit and its order of magnitude")
    return ""


def _passes(record: dict) -> str:
    kind = record["kind"]
    what = {"integer": "an integer", "number": "a number", "bool": "True or False", "string": "a string"}.get(
        kind, f"an array of shape {tuple(record.get('shape', ()))}")
    parts = [what] + [record["sign"]] * ("sign" in record)
    if "range" in record:
        parts.append(f"between {record['range'][0]:.0e} and {record['range'][1]:.0e} in size")
    return ", ".join(parts)


def check_public(answer, record: dict, *, verbose: bool = True, attempt: int = 1) -> ExerciseResult:
    """Run the public checks on ``answer``; prints and returns the verdict (status ``plausible`` when it passes)."""
    name = f"{record['id']} {record['title']}"
    hints = record["hints"]
    if unanswered(answer):
        result = ExerciseResult(f"[{name}] not answered yet. {hint_for(hints, 1)}".rstrip(), False, "unanswered")
    else:
        off = _off(answer, record)
        if off:
            text = hint_for(hints, attempt)
            text = f" Hint: {text}" if text else ""
            result = ExerciseResult(f"[{name}] not quite: you gave {shown(answer)}{off}.{text}", False)
        else:
            result = ExerciseResult(f"[{name}] recorded {shown(answer)}: it passes the public checks "
                                    f"({_passes(record)}). Whether it is right, your teacher's grader decides.",
                                    True, "plausible")
    if verbose:
        print(result.message)
    return result


def load_public(path: Path = PUBLIC) -> dict[str, dict]:
    """The public records by id, or ``{}`` where there are none (the teacher's repository)."""
    if not path.exists():
        return {}
    return {r["id"]: r for r in json.loads(path.read_text(encoding="utf-8"))["exercises"]}


def write_public(path: Path, records: list[dict]) -> Path:
    """Write the file the student bundle's ``verify`` reads."""
    doc = {"about": "Public sanity checks of the exercises (kind, sign, a range of sizes); no answer and no "
                    "digest of one. See kimilab/exercises/public.py.", "exercises": records}
    path.write_text(json.dumps(doc, indent=1) + "\n", encoding="utf-8")
    return path
