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

``--only 02 05`` builds a subset; ``--no-html`` skips step 4; ``--jobs N`` executes N chapters at
once (default: one per core, at most 2). Each chapter runs in its own kernel on one BLAS
thread and reads no other chapter's output, so the stored notebooks are the same either way.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
import tempfile
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
    from jupyter_client import KernelManager
    from nbclient import NotebookClient

    nb = jupytext.read(src)
    os.environ["KIMILAB_FIGURES"] = str(FIGURES)
    os.environ.setdefault("PYTHONHASHSEED", "0")
    # Small matrices + a shared 2-core machine: one BLAS thread is faster and steadier.
    os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    # The kernel talks over Unix sockets in a private folder: no TCP port (ipykernel warns of one
    # without encryption), and nothing left behind.
    with tempfile.TemporaryDirectory(prefix="kimilab-kernel-") as sockets:
        km = KernelManager(kernel_name="python3", transport="ipc", ip=os.path.join(sockets, "kernel"))
        client = NotebookClient(nb, km=km, timeout=timeout, resources={"metadata": {"path": str(CHAPTERS)}},
                                record_timing=False)
        start = time.perf_counter()
        try:
            client.execute()
            seconds = time.perf_counter() - start
        finally:
            if km.has_kernel:  # the client shuts down only the kernels it started itself
                km.shutdown_kernel()
    _strip_volatile(nb)
    out = src.with_suffix(".ipynb")
    jupytext.write(nb, out, fmt="ipynb")
    return out, seconds


def _execute_reporting(src: Path) -> tuple[Path, float]:
    print(f"executing {src.name} ...", flush=True)
    out, seconds = execute_chapter(src)
    print(f"  {src.name}: {seconds:.1f} s", flush=True)
    return out, seconds


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m kimilab.book", description=__doc__.split("\n")[0])
    parser.add_argument("--only", nargs="+", metavar="NN", help="build only these chapter numbers")
    parser.add_argument("--no-html", action="store_true", help="skip rendering HTML")
    parser.add_argument("--jobs", type=int, default=min(2, os.cpu_count() or 1), metavar="N",
                        help="chapters executed at once (default: one per core, at most 2)")
    args = parser.parse_args(argv)
    if args.jobs < 1:
        parser.exit(2, f"{parser.prog}: error: --jobs={args.jobs}: expected an int >= 1\n")

    from nbclient.exceptions import CellExecutionError

    try:
        sources = chapter_paths(args.only)
    except ValueError as err:
        parser.exit(2, f"{parser.prog}: error: {err}\n")
    if not sources:
        print("no chapters found under chapters/", file=sys.stderr)
        return 1
    seconds: dict[str, float] = {}
    from concurrent.futures import FIRST_EXCEPTION, ThreadPoolExecutor, wait

    with ThreadPoolExecutor(max_workers=args.jobs) as pool:  # threads wait; each kernel is a process
        running = {pool.submit(_execute_reporting, src): src for src in sources}
        done, _ = wait(running, return_when=FIRST_EXCEPTION)
        for future in running:
            if future in done and isinstance(future.exception(), CellExecutionError):
                for other in running:
                    other.cancel()
                print(f"\nFAILED: {running[future].name}: a cell raised an error\n{future.exception()}",
                      file=sys.stderr)
                return 1
        for future, src in running.items():
            seconds[src.stem] = future.result()[1]  # re-raises anything that is not a cell error
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
