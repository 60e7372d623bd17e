"""Stored results of the book's long computations, keyed by their arguments and by the code that made them.

A chapter's fleet sweeps take minutes; a reader should wait seconds. ``stored(name, fn, **kwargs)``
returns ``fn(**kwargs)`` from ``data/results/<name>.json`` when that file was written by this call
(same function, same arguments) from this exact source: the digest of the code (docstrings and
comments aside) of every ``kimilab`` module loaded when it was written, and of every input file
under ``data/``. Anything else -- a changed
simulator, other arguments, a missing file, ``KIMILAB_RECOMPUTE=1`` -- runs ``fn`` and rewrites the
file. So a stored number is always one this code computes, and nbval still catches a change.

``check()`` (``python -m kimilab results --check``, run by CI on a clean clone) recomputes every
stored result, each in a fresh process, and fails if one differs: the file is a cache, never a source.
Restamping records the modules that one result's process loaded, so a result does not go stale
when code it never ran changes.
"""

from __future__ import annotations

import ast
import hashlib
import importlib
import io
import json
import math
import os
import sys
import tokenize
from functools import lru_cache
from pathlib import Path

__all__ = ["RESULTS", "stored", "is_current", "check", "digest"]

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "data" / "results"
REL_TOL = 1e-9  # a recomputed number must equal the stored one to this relative tolerance
VOLATILE = ("wall", "kimilab")  # keys holding a wall clock or the package's version: not compared


def _portable(x):
    """``x`` with this checkout's absolute path written as ``.`` (so two clones store the same JSON)."""
    if isinstance(x, dict):
        return {k: _portable(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_portable(v) for v in x]
    if isinstance(x, str) and x.startswith(str(ROOT)):
        return "." + x[len(str(ROOT)):]
    return x


def _inputs() -> list[Path]:
    """Every data file a computation may read (the stored results, notes and licences excluded)."""
    data = ROOT / "data"
    return sorted(p for p in data.rglob("*") if p.is_file() and RESULTS not in p.parents
                  and p.suffix != ".md" and not p.name.startswith("LICENSE"))


# modules that present or grade results and compute none (editing them leaves every stored result current)
# (kimilab.sim.command is the prefix command, moved out of __main__: no stored result calls it)
PRESENTATION = ("kimilab.notebook", "kimilab.plots", "kimilab.exercises", "kimilab.site", "kimilab.classroom",
                "kimilab.readability", "kimilab.book", "kimilab.stored", "kimilab.__main__", "kimilab.sim.command")


def _loaded_sources() -> list[str]:
    """The package's modules loaded in this process (presentation aside), as paths relative to the repository."""
    out = set()
    for name, mod in list(sys.modules.items()):
        f = getattr(mod, "__file__", None)
        if name.startswith(PRESENTATION):
            continue
        if (name == "kimilab" or name.startswith("kimilab.")) and f and f.endswith(".py"):
            out.add(Path(f).resolve().relative_to(ROOT).as_posix())
    return sorted(out)


def _code(path: Path) -> bytes:
    """A Python file's code: a comment or docstring edit changes nothing."""
    st = path.stat()
    return _code_of(str(path), st.st_mtime_ns, st.st_size)


@lru_cache(maxsize=1024)
def _code_of(path: str, mtime_ns: int, size: int) -> bytes:  # keyed by the file's stamp: read once per version
    """The file's lines less docstrings, comments and blank lines. Found by position (ast and tokenize
    agree on positions across Python versions, unlike ``ast.dump``), so the digest is the same on any
    Python the book supports."""
    src = Path(path).read_text(encoding="utf-8")
    docs = set()
    for node in ast.walk(ast.parse(src)):
        body = getattr(node, "body", None)
        if isinstance(body, list) and body and isinstance(body[0], ast.Expr) \
                and isinstance(body[0].value, ast.Constant) and isinstance(body[0].value.value, str):
            docs.update(range(body[0].lineno, body[0].end_lineno + 1))
    cut = {t.start[0]: t.start[1] for t in tokenize.generate_tokens(io.StringIO(src).readline)
           if t.type == tokenize.COMMENT}
    lines = [line[:cut.get(i, len(line))].rstrip() for i, line in enumerate(src.splitlines(), 1) if i not in docs]
    return "\n".join(line for line in lines if line).encode()


def digest(sources) -> str:
    """sha256 over the named source files' code (:func:`_code`) and every data input's bytes (a missing
    file counts as changed)."""
    h = hashlib.sha256()
    for rel in list(sources) + [p.relative_to(ROOT).as_posix() for p in _inputs()]:
        p = ROOT / rel
        body = b"<missing>" if not p.exists() else _code(p) if p.suffix == ".py" else p.read_bytes()
        h.update(rel.encode() + b"\0" + body + b"\0")
    return h.hexdigest()


def _call_id(fn) -> str:
    mod, qual = fn.__module__, fn.__qualname__
    if not mod.startswith("kimilab") or "<" in qual:
        raise ValueError(f"fn: expected a module-level kimilab function (CI recomputes it by name), got {mod}.{qual}")
    return f"{mod}:{qual}"


def _load(name: str):
    p = RESULTS / f"{name}.json"
    return json.loads(p.read_text()) if p.exists() else None


def is_current(name: str, fn=None, kwargs: dict | None = None) -> bool:
    """Is ``data/results/<name>.json`` this call's result from the current source?"""
    rec = _load(name)
    if rec is None or rec.get("digest") != digest(rec.get("sources", [])):
        return False
    return fn is None or (rec["fn"] == _call_id(fn) and rec["kwargs"] == json.loads(json.dumps(kwargs)))


def stored(name: str, fn, **kwargs):
    """``fn(**kwargs)`` (JSON data), from ``data/results/<name>.json`` if it is current, else computed and stored."""
    if os.environ.get("KIMILAB_RECOMPUTE") != "1" and is_current(name, fn, kwargs):
        return _load(name)["result"]
    result = json.loads(json.dumps(_portable(fn(**kwargs))))  # what the file will give back next time, exactly
    sources = _loaded_sources()
    rec = {"fn": _call_id(fn), "kwargs": kwargs, "sources": sources, "digest": digest(sources), "result": result}
    RESULTS.mkdir(parents=True, exist_ok=True)
    tmp = RESULTS / f".{name}.json.tmp"
    tmp.write_text(json.dumps(rec, indent=1) + "\n")  # key order kept: a chapter may iterate a dict
    tmp.replace(RESULTS / f"{name}.json")
    return result


def differences(a, b, path: str = "result") -> list[str]:
    """Where two JSON values differ (numbers to REL_TOL)."""
    if isinstance(a, dict) and isinstance(b, dict):
        if a.keys() != b.keys():
            return [f"{path}: keys {sorted(set(a) ^ set(b))} differ"]
        return [d for k in a if not any(v in k for v in VOLATILE) for d in differences(a[k], b[k], f"{path}.{k}")]
    if isinstance(a, list) and isinstance(b, list):
        if len(a) != len(b):
            return [f"{path}: {len(a)} items, recomputed {len(b)}"]
        return [d for i, (x, y) in enumerate(zip(a, b)) for d in differences(x, y, f"{path}[{i}]")]
    num = (int, float)
    if isinstance(a, num) and isinstance(b, num) and not isinstance(a, bool) and not isinstance(b, bool):
        return [] if a == b or math.isclose(a, b, rel_tol=REL_TOL, abs_tol=1e-12) else [f"{path}: {a!r} != {b!r}"]
    return [] if a == b else [f"{path}: {a!r} != {b!r}"]


def names() -> list[str]:
    return sorted(p.stem for p in RESULTS.glob("*.json"))


CHECK_TIMEOUT_S = 3600.0  # one result's recomputation; the longest (chapter 11's Part B) takes minutes


def _recompute(name: str, restamp: bool) -> list[str]:
    """Recompute one stored result in this process and compare it with its file. ``restamp``: an equal one is
    marked current for this source, its sources the modules this process loaded for it (a fresh process, so
    no other result's)."""
    rec = _load(name)
    if rec is None:
        return [f"data/results/{name}.json does not exist"]
    mod, qual = rec["fn"].split(":")
    fn = importlib.import_module(mod)
    for part in qual.split("."):
        fn = getattr(fn, part)
    diffs = differences(rec["result"], json.loads(json.dumps(_portable(fn(**rec["kwargs"])))))
    if restamp and not diffs:
        rec["sources"] = _loaded_sources()
        rec["digest"] = digest(rec["sources"])
        (RESULTS / f"{name}.json").write_text(json.dumps(rec, indent=1) + "\n")
    return diffs


def _child(argv: list[str]) -> None:
    """``RESULTS_DIR NAME OUT [--restamp]``: :func:`_recompute` one result, its differences to OUT as JSON."""
    global RESULTS
    RESULTS = Path(argv[0])
    Path(argv[2]).write_text(json.dumps(_recompute(argv[1], "--restamp" in argv[3:])))


def check(only=None, progress=None, restamp: bool = False, jobs: int = 1,
          timeout_s: float = CHECK_TIMEOUT_S) -> dict[str, list[str]]:
    """Recompute each stored result (all, or ``only``), each in a fresh process, ``jobs`` at a time, and return
    name -> its differences (empty: equal). ``restamp``: where the recomputed result equals the file, mark the file
    current for this source (after a change that should move no number, such as a refactor: proven equal
    rather than assumed). A result not recomputed within ``timeout_s`` seconds, or whose process fails, differs."""
    import subprocess
    import tempfile
    from concurrent.futures import ThreadPoolExecutor

    todo = list(only or names())

    def one(item) -> list[str]:
        i, name = item
        if progress:
            progress(f"[{i}/{len(todo)}] recomputing {name} ({(_load(name) or {}).get('fn', 'missing')})")
        with tempfile.TemporaryDirectory(prefix="kimilab-check-") as tmp:
            out = Path(tmp) / "differences.json"
            code = "import sys; from kimilab.stored import _child; _child(sys.argv[1:])"
            cmd = [sys.executable, "-c", code, str(RESULTS), name, str(out)] + (["--restamp"] if restamp else [])
            try:
                proc = subprocess.run(cmd, cwd=ROOT, timeout=timeout_s, check=False)
            except subprocess.TimeoutExpired:
                return [f"{name}: not recomputed within {timeout_s:g} s"]
            if proc.returncode != 0 or not out.exists():
                return [f"{name}: its recomputation failed (exit status {proc.returncode}; the error is above)"]
            return json.loads(out.read_text())

    with ThreadPoolExecutor(max_workers=max(1, int(jobs))) as pool:
        return dict(zip(todo, pool.map(one, enumerate(todo, 1))))


def add_arguments(parser) -> None:
    """``python -m kimilab results``' options."""
    parser.add_argument("names", nargs="*", metavar="NAME", help="stored results to check (default: every one)")
    parser.add_argument("--check", action="store_true",
                        help="recompute each stored result and exit 1 if any differs from its file")
    parser.add_argument("--restamp", action="store_true",
                        help="with --check: mark each result that recomputes the same as current for this source")
    parser.add_argument("--jobs", type=int, default=1,
                        help="with --check: results recomputed at once, each in its own process")


def run(args, parser) -> int:
    """List the stored results (current or stale), or recompute and compare them (``--check``)."""
    unknown = sorted(set(args.names) - set(names()))
    if unknown:
        parser.error(f"NAME: no stored result {unknown[0]!r}; expected one of {names()}")
    if not args.check:
        for name in args.names or names():
            rec = _load(name)
            print(f"{name}: {rec['fn']} ({'current' if is_current(name) else 'stale: the source changed'})")
        return 0
    if args.restamp and not args.check:
        parser.error("--restamp: only with --check (a result is marked current only once it recomputes the same)")
    if args.jobs < 1:
        parser.error(f"--jobs={args.jobs}: expected at least 1")
    got = check(args.names or None, progress=lambda line: print(line, file=sys.stderr, flush=True),
                restamp=args.restamp, jobs=args.jobs)
    for name, diffs in got.items():
        print(f"{name}: " + ("same" if not diffs else f"{len(diffs)} differences, first: {diffs[0]}"))
    return 1 if any(got.values()) else 0
