"""Answers as data: what a grading kernel records, and what the grader reads back.

While ``python -m kimilab grade`` runs a notebook, ``KIMILAB_ANSWERS`` names a file in
the kernel's own folder. Each ``verify("N.M", answer)`` appends one JSON line,
``{"id": "N.M", "answer": {...}}``: the answer as plain data (a number, an array's
shape and elements, a string, True/False, or "none"), never as an object the grader
would have to trust. The kernel records no verdict: the grader compares in its own
process, against values the kernel never sees. Reading back is defensive: a line that
is not a record is counted, not trusted, and the file's size is capped.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np

__all__ = ["ANSWERS_ENV", "encode", "decode", "record", "read_answers", "MAX_ELEMENTS", "MAX_TEXT", "MAX_BYTES"]

ANSWERS_ENV = "KIMILAB_ANSWERS"
MAX_ELEMENTS = 100_000  # an array answer larger than this is recorded by its shape only
MAX_TEXT = 10_000  # characters of a string answer
MAX_BYTES = 16 * 2**20  # of the whole file; past this the grader reads nothing from it


def encode(answer) -> dict:
    """``answer`` as JSON-ready data: ``{"type": ..., "value": ...}``; anything else is ``other``."""
    if answer is None:
        return {"type": "none"}
    if isinstance(answer, (bool, np.bool_)):
        return {"type": "bool", "value": bool(answer)}
    if isinstance(answer, str):
        return {"type": "str", "value": answer} if len(answer) <= MAX_TEXT else {
            "type": "other", "what": f"a string of {len(answer)} characters"}
    if isinstance(answer, (int, np.integer)):
        return {"type": "int", "value": int(answer)}
    if isinstance(answer, (float, np.floating)):
        return {"type": "float", "value": float(answer)}
    try:
        a = np.asarray(answer, dtype=float)
    except Exception:  # noqa: BLE001 -- any object may fail to convert; it is recorded as unreadable
        return {"type": "other", "what": f"a {type(answer).__name__}"}
    if a.ndim == 0:
        return {"type": "float", "value": float(a)}
    if a.size > MAX_ELEMENTS:
        return {"type": "other", "what": f"an array of shape {a.shape}"}
    return {"type": "array", "shape": list(a.shape), "value": a.ravel().tolist()}


def decode(data) -> object:
    """The answer an :func:`encode` record stands for; raises ValueError for anything else."""
    if not isinstance(data, dict) or data.get("type") not in ("none", "bool", "str", "int", "float", "array", "other"):
        raise ValueError("not an answer record")
    kind, value = data["type"], data.get("value")
    if kind == "none":
        return None
    if kind == "other":
        return _Unreadable(str(data.get("what", "something else"))[:80])
    types = {"bool": bool, "str": str, "int": int, "float": float}
    if kind in types:
        if type(value) is not types[kind] and not (kind == "float" and type(value) is int):
            raise ValueError(f"a {kind} record holding {type(value).__name__}")
        return float(value) if kind == "float" else value
    shape = data.get("shape")
    if (not isinstance(shape, list) or not all(type(n) is int and n >= 0 for n in shape)
            or not isinstance(value, list) or len(value) != int(np.prod(shape)) or len(value) > MAX_ELEMENTS
            or not all(type(v) in (int, float) for v in value)):
        raise ValueError("a malformed array record")
    return np.asarray(value, dtype=float).reshape(shape)


class _Unreadable:
    """An answer the kernel could not turn into data: it is wrong, and the message says what it was."""

    def __init__(self, what: str):
        self.what = what

    def __repr__(self) -> str:
        return self.what


def record(id: str, answer) -> None:
    """Append ``answer`` for exercise ``id`` to the file ``KIMILAB_ANSWERS`` names (nothing if unset)."""
    path = os.environ.get(ANSWERS_ENV)
    if path:
        with open(path, "a", encoding="utf-8") as f:
            f.write(json.dumps({"id": str(id), "answer": encode(answer)}) + "\n")


def read_answers(path: Path) -> tuple[dict[str, list], int]:
    """({id: [answer, ...] in the order recorded}, lines that were not a record) from a kernel's file."""
    out: dict[str, list] = {}
    bad = 0
    path = Path(path)
    if not path.is_file() or path.is_symlink():
        return out, 0
    if path.stat().st_size > MAX_BYTES:
        return out, 1
    for line in path.read_text(encoding="utf-8", errors="replace").splitlines():
        try:
            data = json.loads(line)
            id = data["id"]
            if not isinstance(id, str):
                raise ValueError("id")
            answer = decode(data["answer"])
            out.setdefault(id, []).append(answer)
        except (ValueError, TypeError, KeyError, RecursionError):
            bad += 1
    return out, bad
