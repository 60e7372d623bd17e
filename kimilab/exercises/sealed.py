"""Checking an answer without holding it: the student bundle's ``key.json``.

The teacher's repository computes every expected value with kimilab
(``kimilab/exercises/chNN.py``). The student bundle ships none of those modules;
``make student`` seals each value instead (:func:`seal`): the number is cut to a grid
as fine as the checker's tolerance and only a salted, slow hash (PBKDF2-SHA256) of its
cell is stored. :func:`check_sealed` hashes the reader's answer the same way, so it can
say "correct", "a unit slip" (the answer times 2^20 hashes to the key), "the wrong
sign", "within 20% of the expected size", "too small by less than 44%" (coarser grids
whose origin is random, so they do not give the value's digits away), but it cannot print the value.

The grid is centred on the expected value, so an answer is accepted when
``|log(answer / expected)| < log(1 + rtol)`` (values that are 0, or smaller than
``atol / rtol``, use an absolute grid of half-width ``atol``). What this protects
against is reading the answer; a student who guesses can confirm a guess, as with
any checker, and the slow hash makes trying a million guesses take about an hour.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import random
from pathlib import Path

import numpy as np

from kimilab.exercises.core import (UNIT_SLIPS, ExerciseResult, as_numbers, hint_for, shape_clause, shown,
                                    unanswered, unit_slip_clause)

__all__ = ["KEY", "ITERATIONS", "seal", "check_sealed", "load_key", "write_key"]

KEY = Path(__file__).resolve().parent / "key.json"
ITERATIONS = 20_000
# the coarse bands' widths (as factors): being in the expected value's band says "within 20%" / "within 10x"
_BANDS = (1.2, 10.0)


def _digest(salt: str, *parts) -> str:
    text = "|".join(str(p) for p in parts).encode()
    return hashlib.pbkdf2_hmac("sha256", text, bytes.fromhex(salt), ITERATIONS).hex()[:32]


def _cell(x: float, grid: dict) -> str:
    """The grid cell of ``x``: a sign and an integer (or the exact value on a grid of width 0)."""
    if grid["mode"] == "rel":
        if x == 0:
            return "0"
        return ("-" if x < 0 else "+") + str(math.floor((math.log(abs(x)) - grid["offset"]) / grid["width"]))
    if grid["width"] == 0:
        return repr(float(x))
    return str(math.floor((x - grid["offset"]) / grid["width"]))


def _centred(value: float, width: float, relative: bool) -> float:
    """The grid origin that puts ``value`` in the middle of its cell."""
    if width == 0:
        return 0.0
    where = math.log(abs(value)) if relative else value
    return (where - width / 2) % width


def _scalar_grid(e: float, rtol: float, atol: float) -> dict:
    if e != 0 and rtol > 0 and rtol * abs(e) >= atol:
        width = 2 * math.log1p(rtol)
        return {"mode": "rel", "width": width, "offset": _centred(e, width, True)}
    return {"mode": "abs", "width": 2 * atol, "offset": _centred(e, 2 * atol, False)}


def seal(id: str, title: str, hints, expected, *, rtol: float, atol: float, rng: random.Random | None = None) -> dict:
    """The key record of one exercise: everything :func:`check_sealed` needs, and not the value."""
    rng = rng or random.SystemRandom()
    salt = os.urandom(16).hex()
    record = {"id": id, "title": title, "hints": [hints] if isinstance(hints, str) else list(hints),
              "rtol": rtol, "atol": atol, "salt": salt}
    if isinstance(expected, bool):
        return record | {"kind": "bool", "digest": _digest(salt, id, "bool", expected)}
    if isinstance(expected, str):
        return record | {"kind": "string", "digest": _digest(salt, id, "str", expected)}
    e = np.asarray(expected, dtype=float)
    if e.ndim == 0:
        e = float(e)
        grid = _scalar_grid(e, rtol, atol)
        record |= {"kind": "number", "integer": isinstance(expected, (int, np.integer)), "grid": grid,
                   "digest": _digest(salt, id, _cell(e, grid))}
        if grid["mode"] == "rel":
            record["sign"] = _digest(salt, id, "sign", "+" if e > 0 else "-")
            record["bands"] = []
            for factor in _BANDS:
                band = {"width": math.log(factor), "offset": rng.uniform(0, math.log(factor))}
                band["digest"] = _digest(salt, id, "band", factor,
                                         math.floor((math.log(abs(e)) - band["offset"]) / band["width"]))
                record["bands"].append(band)
        return record
    width = 2 * max(atol, rtol * float(np.max(np.abs(e))))
    offsets = [_centred(x, width, False) for x in e.ravel()]
    digests = [_digest(salt, id, i, _cell(x, {"mode": "abs", "width": width, "offset": o}))
               for i, (x, o) in enumerate(zip(e.ravel(), offsets))]
    return record | {"kind": "array", "shape": list(e.shape), "width": width, "offsets": offsets, "digests": digests}


def _scalar_ok(x: float, record: dict) -> bool:
    return _digest(record["salt"], record["id"], _cell(x, record["grid"])) == record["digest"]


def _elements_ok(a: np.ndarray, record: dict) -> list[bool]:
    salt, id, width = record["salt"], record["id"], record["width"]
    return [_digest(salt, id, i, _cell(x, {"mode": "abs", "width": width, "offset": o})) == d
            for i, (x, o, d) in enumerate(zip(a.ravel(), record["offsets"], record["digests"]))]


def _band_step(x: float, band: dict, salt: str, id: str, factor: float) -> int | None:
    """0 if ``x`` is in the expected value's band cell, +1 / -1 if that cell is the next one up / down, else None."""
    here = math.floor((math.log(abs(x)) - band["offset"]) / band["width"])
    for step in (0, 1, -1):
        if _digest(salt, id, "band", factor, here + step) == band["digest"]:
            return step
    return None


def _magnitude(x: float, record: dict) -> str:
    """How far |x| is from |expected|, in words that are true whichever way the grids fall."""
    salt, id = record["salt"], record["id"]
    (fine, f1), (coarse, f2) = zip(record["bands"], _BANDS)
    step = _band_step(x, fine, salt, id, f1)
    if step == 0:
        return "within 20% of the expected size"
    if step is not None:  # the cells are ordered: a neighbour above means the answer is too small
        return f"too {'small' if step > 0 else 'large'} by less than 44%"
    step = _band_step(x, coarse, salt, id, f2)
    if step == 0:
        return "more than 20% off but within a factor of 10"
    if step is not None:
        return f"too {'small' if step > 0 else 'large'} by more than 20% and less than a factor of 100"
    return "off by more than a factor of 10"


def _number_clause(x: float, record: dict) -> str:
    for factor, _, _ in UNIT_SLIPS:
        if x and _scalar_ok(x * factor, record):
            return unit_slip_clause(factor, True)
        if x and _scalar_ok(x / factor, record):
            return unit_slip_clause(factor, False)
    if record.get("integer") and x != int(x):
        return ", which is not a whole number (an integer was expected)"
    if record["grid"]["mode"] != "rel":
        return f", not within the tolerance (absolute {record['atol']:g})"
    if _scalar_ok(-x, record):
        return ", which has the wrong sign"
    sign = "+" if x > 0 else "-"
    wrong_sign = _digest(record["salt"], record["id"], "sign", sign) != record["sign"]
    words = [] if x == 0 else [_magnitude(x, record)]
    if wrong_sign:
        words.insert(0, "the wrong sign")
    return ", " + (" and ".join(words)) + f" (tolerance: relative {record['rtol']:g})"


def _verdict(answer, record: dict) -> tuple[bool, str]:
    """(correct, the clause on what is off) for an attempted answer."""
    kind = record["kind"]
    if kind in ("bool", "string"):
        typed = isinstance(answer, (bool, np.bool_)) if kind == "bool" else isinstance(answer, str)
        if not typed:
            return False, f" ({'True or False' if kind == 'bool' else 'a string'} was expected)"
        value = bool(answer) if kind == "bool" else answer
        return _digest(record["salt"], record["id"], kind[:4], value) == record["digest"], ""
    a = as_numbers(answer)
    if a is None:
        wanted = "an integer" if record.get("integer") else ("a number" if kind == "number" else "an array")
        return False, f", which is not a number ({wanted} was expected)"
    shape = tuple(record.get("shape", ()))
    if a.shape != shape:
        return False, shape_clause(a.shape, shape)
    if not np.all(np.isfinite(a)):
        return False, ", which is not finite"
    if kind == "number":
        x = float(a)
        return (True, "") if _scalar_ok(x, record) else (False, _number_clause(x, record))
    ok = _elements_ok(a, record)
    if all(ok):
        return True, ""
    for factor, _, _ in UNIT_SLIPS:
        for scaled, small in ((a * factor, True), (a / factor, False)):
            if all(_elements_ok(scaled, record)):
                return False, unit_slip_clause(factor, small)
    wrong = [i for i, good in enumerate(ok) if not good]
    first = np.unravel_index(wrong[0], a.shape)
    index = tuple(int(i) for i in first) if len(first) > 1 else int(first[0])
    return False, f"; {len(wrong)} of {a.size} elements are off, the first at index {index}"


def check_sealed(answer, record: dict, *, verbose: bool = True, attempt: int = 1) -> ExerciseResult:
    """Check ``answer`` against a sealed record; prints and returns the verdict as ``check`` does."""
    name = f"{record['id']} {record['title']}"
    hints = record["hints"]
    if unanswered(answer):
        result = ExerciseResult(f"[{name}] not answered yet. {hint_for(hints, 1)}".rstrip(), False, "unanswered")
    else:
        ok, off = _verdict(answer, record)
        if ok:
            result = ExerciseResult(f"[{name}] correct.", True)
        else:
            text = hint_for(hints, attempt)
            text = f" Hint: {text}" if text else ""
            result = ExerciseResult(f"[{name}] not quite: you gave {shown(answer)}{off}.{text}", False)
    if verbose:
        print(result.message)
    return result


def load_key(path: Path = KEY) -> dict[str, dict]:
    """The sealed records by id, or ``{}`` where there is no key (the teacher's repository)."""
    if not path.exists():
        return {}
    return {r["id"]: r for r in json.loads(path.read_text(encoding="utf-8"))["exercises"]}


def write_key(path: Path, records: list[dict]) -> Path:
    """Write the key file the student bundle's ``verify`` reads."""
    doc = {"about": "Salted hashes that check exercise answers; see kimilab/exercises/sealed.py.",
           "iterations": ITERATIONS, "exercises": records}
    path.write_text(json.dumps(doc, indent=1) + "\n", encoding="utf-8")
    return path
