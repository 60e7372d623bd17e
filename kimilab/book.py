"""Build the book: execute every chapter in order, store outputs, render HTML.

``python -m kimilab book`` (what ``make book`` runs; ``python -m kimilab.book`` works too):

1. reads each ``chapters/NN_slug.py`` (the reviewed jupytext source),
2. executes it in a fresh kernel from the chapters/ folder (any cell error fails
   the build), with ``KIMILAB_FIGURES`` pointing at ``figures/``,
3. writes ``chapters/NN_slug.ipynb`` with its outputs and without volatile
   metadata (no timestamps, no interpreter version), so an unchanged checkout
   rebuilds to the same bytes except for wall-clock cells,
4. renders the web edition into ``_build/html/`` and ``_build/html-student/`` (:mod:`kimilab.site`),
5. prints a table of per-chapter run times (also ``_build/timings.json``).

``--only 02 05`` builds a subset; ``--no-html`` skips step 4.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
import time
from pathlib import Path

__all__ = ["chapter_paths", "execute_chapter", "main"]

ROOT = Path(__file__).resolve().parent.parent
CHAPTERS = ROOT / "chapters"
BUILD = ROOT / "_build" / "html"
FIGURES = ROOT / "figures"
_CHAPTER_FILE = re.compile(r"^(\d\d)_[a-z0-9_]+\.py$")
_KEEP_NB_METADATA = ("kernelspec", "jupytext")


def chapter_paths(only: list[str] | None = None) -> list[Path]:
    """The chapter sources in order; ``only`` filters by two-digit number."""
    paths = sorted(p for p in CHAPTERS.glob("*.py") if _CHAPTER_FILE.match(p.name))
    if only:
        wanted = {n.zfill(2) for n in only}
        unknown = wanted - {p.name[:2] for p in paths}
        if unknown:
            raise ValueError(f"--only: no chapter numbered {sorted(unknown)}; have {[p.name for p in paths]}")
        paths = [p for p in paths if p.name[:2] in wanted]
    return paths


def _strip_volatile(nb) -> None:
    """Drop metadata that changes between runs or machines (timings, versions)."""
    for key in list(nb.metadata):
        if key not in _KEEP_NB_METADATA:
            del nb.metadata[key]
    for cell in nb.cells:
        if cell.cell_type == "code":  # how stdout got split into chunks depends on timing
            merged = []
            for out in cell.outputs:
                if (out.output_type == "stream" and merged and merged[-1].output_type == "stream"
                        and merged[-1].name == out.name):
                    merged[-1].text += out.text
                else:
                    merged.append(out)
            cell.outputs = merged
        cell.metadata.pop("execution", None)
        cell.metadata.pop("ExecuteTime", None)
        cell.pop("id", None)
    nb.nbformat_minor = 4  # no cell ids: keeps the stored file stable across tools


def execute_chapter(src: Path, *, timeout: int = 600) -> tuple[Path, float]:
    """Execute one chapter source and write its paired .ipynb; returns (path, seconds)."""
    import jupytext
    from nbclient import NotebookClient

    nb = jupytext.read(src)
    os.environ["KIMILAB_FIGURES"] = str(FIGURES)
    os.environ.setdefault("PYTHONHASHSEED", "0")
    # Small matrices + a shared 2-core machine: one BLAS thread is faster and steadier.
    os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    client = NotebookClient(
        nb,
        timeout=timeout,
        kernel_name="python3",
        resources={"metadata": {"path": str(CHAPTERS)}},
        record_timing=False,
    )
    start = time.perf_counter()
    client.execute()
    seconds = time.perf_counter() - start
    _strip_volatile(nb)
    out = src.with_suffix(".ipynb")
    jupytext.write(nb, out, fmt="ipynb")
    return out, seconds


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m kimilab.book", description=__doc__.split("\n")[0])
    parser.add_argument("--only", nargs="+", metavar="NN", help="build only these chapter numbers")
    parser.add_argument("--no-html", action="store_true", help="skip rendering HTML")
    args = parser.parse_args(argv)

    from nbclient.exceptions import CellExecutionError

    try:
        sources = chapter_paths(args.only)
    except ValueError as err:
        parser.exit(2, f"{parser.prog}: error: {err}\n")
    if not sources:
        print("no chapters found under chapters/", file=sys.stderr)
        return 1
    seconds: dict[str, float] = {}
    built: list[Path] = []
    for src in sources:
        print(f"executing {src.name} ...", flush=True)
        try:
            out, secs = execute_chapter(src)
        except CellExecutionError as exc:
            print(f"\nFAILED: {src.name}: a cell raised an error\n{exc}", file=sys.stderr)
            return 1
        seconds[src.stem] = secs
        built.append(out)
    if not args.no_html:
        from kimilab.site import build_sites

        for edition, index in build_sites().items():
            print(f"HTML ({edition} edition): {index.relative_to(ROOT)}")
    BUILD.mkdir(parents=True, exist_ok=True)
    (BUILD.parent / "timings.json").write_text(json.dumps(seconds, indent=1, sort_keys=True) + "\n")
    width = max(len(s) for s in seconds)
    print(f"\n{'chapter':<{width}}  seconds")
    for stem, secs in seconds.items():
        print(f"{stem:<{width}}  {secs:7.1f}")
    print(f"{'total':<{width}}  {sum(seconds.values()):7.1f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
