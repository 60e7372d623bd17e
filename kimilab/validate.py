"""One way to check an argument and say what was wrong with it.

Every public function in kimilab that takes a count, a size or a choice checks it
here, so every bad call fails the same way: a ``ValueError`` whose message starts
with the argument's name and its value, then says what was expected.
"""

from __future__ import annotations

import argparse
import math
import os
from pathlib import Path
from typing import Iterable

import numpy as np

__all__ = ["writable_dir", "writable_file", "check_int", "check_float", "check_choice", "positive_int_arg", "positive_float_arg", "tokens_or_inf_arg",
           "gb_or_inf_arg", "HOST_GB_HELP",
           "nonnegative_float_arg", "HelpWithDefaults"]


def check_int(name: str, value, minimum: int = 0, *, unit: str = "") -> int:
    """``value`` as a Python int, or ValueError ``"name=value: expected an int >= minimum"``.

    Booleans are refused (``True`` is not a count); numpy integers are accepted.
    ``unit`` (e.g. ``"tokens"``) is added to the message.
    """
    if type(value) is int and value >= minimum:  # the common case, decided without the isinstance chain
        return value
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, np.integer)) or value < minimum:
        what = f"an int >= {minimum}" + (f" ({unit})" if unit else "")
        raise ValueError(f"{name}={value!r}: expected {what}")
    return int(value)


def check_float(name: str, value, *, minimum: float | None = None, finite: bool = True) -> float:
    """``value`` as a float (finite, and >= ``minimum`` when given), else ValueError naming it."""
    ok = isinstance(value, (int, float, np.integer, np.floating)) and not isinstance(value, (bool, np.bool_))
    if ok:
        value = float(value)
        ok = (not finite or math.isfinite(value)) and (minimum is None or value >= minimum)
    if not ok:
        what = "a finite number" if finite else "a number"
        raise ValueError(f"{name}={value!r}: expected {what}" + (f" >= {minimum}" if minimum is not None else ""))
    return value


def check_choice(name: str, value, choices: Iterable):
    """``value`` if it is one of ``choices``, else ValueError listing them."""
    choices = tuple(choices)
    if value not in choices:
        raise ValueError(f"{name}={value!r}: expected one of {choices}")
    return value


# The same checks as argparse ``type=`` functions (the command lines' one-line errors).
def _number_arg(text: str, convert, noun: str, ok, expected: str):
    try:
        value = convert(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not {noun}") from None
    if not ok(value):
        raise argparse.ArgumentTypeError(f"{text if convert is float else value} must be {expected}")
    return value


def positive_int_arg(text: str) -> int:
    """argparse type: an int >= 1."""
    return _number_arg(text, int, "an int", lambda v: v > 0, "a positive int")


def positive_float_arg(text: str) -> float:
    """argparse type: a finite number > 0."""
    return _number_arg(text, float, "a number", lambda v: 0 < v < math.inf, "a positive finite number")


def nonnegative_float_arg(text: str) -> float:
    """argparse type: a finite number >= 0."""
    return _number_arg(text, float, "a number", lambda v: 0 <= v < math.inf, "a finite number >= 0")


def probability_arg(text: str) -> float:
    """argparse type: a number in [0, 1]."""
    return _number_arg(text, float, "a number", lambda v: 0 <= v <= 1, "a probability in [0, 1]")


_INF = ("inf", "infinity", "unbounded")  # what an "or inf" argument accepts for no limit


def tokens_or_inf_arg(text: str) -> int | None:
    """argparse type: a positive int, or ``inf`` for an unbounded cache (None)."""
    if text.strip().lower() in _INF:
        return None
    return positive_int_arg(text)


def gb_or_inf_arg(text: str) -> float:
    """argparse type: GB (of host DRAM, per device) >= 0, or ``inf`` for no limit."""
    if text.strip().lower() in _INF:
        return math.inf
    return nonnegative_float_arg(text)


SPEC_HELP = ("speculative decoding in every engine: K drafts a step, each accepted with probability --spec-alpha "
             "given the ones before it (swept, not measured: the book's models are untrained), verified in one "
             "forward, rolled back with chapter 8's cheapest strategy (kimilab.engine.speculation)")
ALPHA_HELP = "with --spec-k: the acceptance probability of each draft"
DRAFTER_HELP = ("with --spec-k: mtp, one more layer whose weights, KV and k forwards a step are counted; ngram, "
                "prompt lookup, free")


HOST_GB_HELP = ("GB of host DRAM per device under the prefix cache: what HBM evicts (KV blocks and states) is kept "
                "there and loaded back when the load beats recomputing (kimilab.prefix.host; 'inf' for no limit)")


class HelpWithDefaults(argparse.ArgumentDefaultsHelpFormatter):
    """argparse help that ends each option's text with its default, written from the code (so
    the two cannot drift apart); options that are required, off, or without a default get none."""

    def _get_help_string(self, action):
        if action.required or action.default in (None, False) or action.default == []:
            return action.help
        return super()._get_help_string(action)


def writable_dir(name: str, path) -> Path:
    """Make ``path`` a directory and check that a file can be written there, before any work runs
    (ValueError naming ``name`` otherwise), so a long run never ends in a failed write."""
    out = Path(path)
    try:
        out.mkdir(parents=True, exist_ok=True)
        probe = out / f".kimilab-write-check-{os.getpid()}"
        probe.write_bytes(b"")
        probe.unlink()
    except OSError as err:
        raise ValueError(f"{name}={str(path)!r}: expected a writable directory ({err.strerror or err})") from None
    return out


def writable_file(name: str, path) -> Path:
    """Check that ``path`` can be written (its directory made if missing) before any work runs;
    ValueError naming ``name`` otherwise. An existing file is left as it is."""
    out = Path(path)
    if out.is_dir():
        raise ValueError(f"{name}={str(path)!r}: is a directory; expected a file to write")
    writable_dir(name, out.parent if str(out.parent) else ".")
    return out
