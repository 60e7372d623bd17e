"""The command line under random arguments and malformed traces (issue 36).

Every run ends within its time limit with exit status 0 or 2, and a 2 comes with one line on
stderr and no traceback. `make test` runs a few derandomised examples of each; `make fuzz`
(which lists this file) runs ten times as many with a random seed.
"""

from __future__ import annotations

import contextlib
import gzip
import io
import json
import math
import signal
import tempfile
from pathlib import Path

from fuzzing import examples
from hypothesis import event, given, settings
from hypothesis import strategies as st

from kimilab.__main__ import main
from kimilab.fleet.routers import ROUTERS
from kimilab.prefix.policies import POLICIES
from kimilab.sim.sweep import CACHES, cache_options

LIMIT_S = 30  # one command's wall-clock limit: past it the example fails as a hang

# ----- trace lines: well-formed, slightly wrong, and not a trace at all -----

_numbers = st.one_of(st.integers(-5, 40_000), st.sampled_from([0, 1, 10**12, 10**15, -1]),
                     st.floats(allow_nan=True, allow_infinity=True), st.text(max_size=3), st.none())


@st.composite
def _good_line(draw, t):
    """A valid request: chained ids (two chains, so prompts share prefixes), ids per 512 tokens."""
    n_tokens = draw(st.integers(1, 20_000))
    base = draw(st.sampled_from([0, 1000]))
    n = math.ceil(n_tokens / 512)
    return {"timestamp": t, "input_length": n_tokens, "output_length": draw(st.integers(0, 64)),
            "hash_ids": list(range(base, base + n))}


@st.composite
def _bent_line(draw, t):
    """A valid request with one field replaced, dropped, or an id repeated."""
    d = draw(_good_line(t))
    how = draw(st.sampled_from(["replace", "drop", "repeat", "extra"]))
    key = draw(st.sampled_from(sorted(d)))
    if how == "replace":
        d[key] = draw(_numbers)
    elif how == "drop":
        del d[key]
    elif how == "repeat" and d["hash_ids"]:
        d["hash_ids"].append(d["hash_ids"][0])
    else:
        d["note"] = draw(st.text(max_size=5))
    return d


_json = st.recursive(st.none() | st.booleans() | st.integers() | st.text(max_size=5),
                     lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=3), inner,
                                                                                  max_size=3), max_leaves=8)


@st.composite
def trace_text(draw, clean: bool) -> str:
    """A valid trace when ``clean`` (so runs get through to the work), else any mix of lines."""
    lines, t = [], 0
    for _ in range(draw(st.integers(1 if clean else 0, 6))):
        t += draw(st.integers(0, 2_000))
        kind = "good" if clean else draw(st.sampled_from(["good", "good", "bent", "json", "text", "deep"]))
        if kind == "good":
            lines.append(json.dumps(draw(_good_line(t))))
        elif kind == "bent":
            lines.append(json.dumps(draw(_bent_line(t))))
        elif kind == "json":
            lines.append(json.dumps(draw(_json)))
        elif kind == "text":
            lines.append(draw(st.text(max_size=20)).replace("\n", " "))
        else:
            lines.append("[" * 5000 + "]" * 5000)
    return "\n".join(lines) + ("\n" if lines and draw(st.booleans()) else "")


@st.composite
def sessions_bytes(draw, clean: bool) -> bytes:
    """Converted Claude Code sessions (a .jsonl.gz): gzip-compressed session lines when ``clean``, else
    bent lines, and plain, truncated or not-gzip bytes too."""
    lines, t = [], 0
    for _ in range(draw(st.integers(1 if clean else 0, 6))):
        t += draw(st.integers(0, 2_000))
        d = draw(_good_line(t))
        d = {"session": draw(st.integers(0, 2)), "agent": 0, "t_ms": d.pop("timestamp"), "api_ms": 100, **d}
        if not clean and draw(st.booleans()):
            key = draw(st.sampled_from(sorted(d)))
            if draw(st.booleans()):
                del d[key]
            else:
                d[key] = draw(st.one_of(_numbers, _json))
        lines.append(json.dumps(d))
    text = ("\n".join(lines) + "\n").encode()
    how = "gzip" if clean else draw(st.sampled_from(["gzip", "gzip", "truncated", "plain", "binary"]))
    if how == "binary":
        return draw(st.binary(max_size=40))
    packed = text if how == "plain" else gzip.compress(text)
    return packed[:draw(st.integers(0, max(len(packed) - 1, 0)))] if how == "truncated" else packed


# ----- arguments: each command's flags with good and bad values -----

@st.composite
def argv(draw, trace: str, clean: bool) -> list[str]:
    """One command's argv. Each flag has good values and bad ones; when ``clean`` only good ones
    are drawn, so the command gets through to its work rather than stopping at the first flag."""

    def pick(good, bad=()):
        return draw(st.sampled_from(list(good) + ([] if clean else list(bad))))

    def opt(flag, good, bad=()):
        return [] if draw(st.booleans()) else [flag, pick(good, bad)]

    caps = (["inf", "512", "100000", "99999999999999"], ["0", "511", "-5", "abc", "1e3"])
    cmd = draw(st.sampled_from(["prefix", "stats", "fleet", "memory"]))
    if cmd == "prefix":
        policy = pick(CACHES, ["bogus"])
        takes = set(cache_options(policy)) if policy in CACHES else set()
        sessions = trace.endswith(".jsonl.gz")
        out = ["prefix", trace, "--policy", policy, "--capacity-tokens", pick(*caps)]
        out += opt("--block-size", ["512"], ["16", "0", "x", "1000000"])
        # when clean, only the options this cache and this kind of trace take (the others are refused)
        out += opt("--interval", ["1024", "8192"], ["7", "0", "-1"]) if "interval" in takes or not clean else []
        out += opt("--alpha", ["0", "0.5"], ["-1", "nan", "x"]) if "alpha" in takes or not clean else []
        if sessions or not clean:
            out += opt("--sessions-per-s", ["0.05", "10"], ["0", "-1", "inf", "1e-320"])
            out += opt("--seed", ["0", "7"], ["-1", "x"])
        out += draw(st.sampled_from([[], ["--partial-blocks"]])) if policy in POLICIES or not clean else []
        out += opt("--deployment", ["vllm-tp4-h200", "dp4-ep4-h200"], ["nope"])
    elif cmd == "stats":
        out = ["traces", "stats", trace] + opt("--block-size", ["512"], ["1", "0", "-3"])
    elif cmd == "fleet":
        out = ["fleet", trace, "--instances", pick(["1", "2"], ["0", "100000", "x"]), "--router",
               pick(ROUTERS, ["bogus"]), "--capacity-tokens", pick(*caps)]
        out += opt("--rate-scale", ["1", "1e6", "0.01"], ["1e-300", "0", "-1", "inf", "nan"])
        out += opt("--isolation", ["none", "quota"], ["x"])
        for _ in range(draw(st.integers(0, 2))):
            out += ["--fail", pick(["0@1"], ["1@0.5", "5@2", "x", "0@-1", "0@inf"])]
    else:
        out = ["memory"] + opt("--model", ["kimi_linear_48b", "tiny"], ["nope"])
        out += opt("--deployment", ["vllm-tp4-h200", "one-h200"], ["nope"])
    return out


def _alarm(signum, frame):
    raise TimeoutError(f"the command ran past {LIMIT_S} s")


def run(args: list[str]) -> tuple[int, str]:
    """``main(args)`` in this process with a wall-clock limit: (exit status, stderr)."""
    err = io.StringIO()
    old = signal.signal(signal.SIGALRM, _alarm)
    signal.alarm(LIMIT_S)
    try:
        with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(err):
            try:
                rc = main(args)
            except SystemExit as done:
                rc = done.code
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, old)
    return (0 if rc is None else rc), err.getvalue()


@settings(max_examples=examples(25), deadline=None)
@given(data=st.data(), clean=st.booleans())
def test_any_arguments_on_any_trace_end_in_0_or_one_line_and_2(data, clean):
    """Half the examples are clean (a valid trace and good flags) and half anything goes."""
    with tempfile.TemporaryDirectory() as tmp:
        if data.draw(st.integers(0, 3)):  # a Mooncake trace, or (one time in four) Claude Code sessions
            trace = Path(tmp) / "t.jsonl"
            trace.write_text(data.draw(trace_text(clean)), encoding="utf-8")
        else:
            trace = Path(tmp) / "t.jsonl.gz"
            trace.write_bytes(data.draw(sessions_bytes(clean)))
        args = data.draw(argv(str(trace), clean))
        rc, err = run(args)
    event(f"{args[0]}: exit {rc}")  # --hypothesis-show-statistics: how many runs got through
    assert rc in (0, 2), (args, rc, err)
    assert "Traceback" not in err, (args, err)
    if rc == 2:
        assert err.count("\n") == 1 and err.endswith("\n"), (args, err)
