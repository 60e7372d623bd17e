"""Where a reader opens a chapter besides this checkout: Binder, Colab, and Python in the browser.

``REPOSITORY`` is the one setting: the public address of the book's git repository. The web
edition's launch buttons (Binder, Colab) are built from it, and so is each chapter's *setup cell*,
the first code cell, which :func:`sync_setup_cells` writes:

* on Colab (where ``google.colab`` is imported) it clones the repository, installs the package
  and moves into ``chapters/``, so ``import kimilab`` and the ``../data`` paths work;
* in the browser (JupyterLite's Pyodide, ``sys.platform == "emscripten"``), a chapter that needs
  threads or processes stops there and says so (:data:`NEEDS_PROCESSES`);
* anywhere else it does nothing.

A fork changes ``REPOSITORY`` (and ``BRANCH``), runs ``python -m kimilab.site.launch`` to rewrite
the setup cells, and re-executes the book; a test fails while any chapter's cell is out of date.
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

__all__ = ["REPOSITORY", "BRANCH", "BINDER", "COLAB", "NEEDS_PROCESSES", "SETUP_TAGS", "binder_url", "colab_url",
           "setup_cell", "sync_setup_cells", "main"]

REPOSITORY = "https://github.com/kimilab/kimilab"  # the one place the book's address is written
BRANCH = "main"
BINDER = "https://mybinder.org"
COLAB = "https://colab.research.google.com"
SETUP_TAGS = ("setup", "remove-cell")  # read by kimilab.readability (not reading) and myst-nb (not shown)
COLAB_HOME = "/content/kimilab"  # where Colab's setup cell clones the book

# Chapters whose core runs threads or processes, which Python in the browser cannot start.
NEEDS_PROCESSES = {
    "09_context_parallel": "Chapter 9 runs its ranks as threads, and as processes under mpiexec",
}

_CHAPTERS = Path(__file__).resolve().parents[2] / "chapters"
_CELL = re.compile(r"^# %% tags=\[\"setup\"[^\n]*\n(?:(?!# %%).*\n)*", re.M)
_FIRST_CODE = re.compile(r"^# %%\n", re.M)


def _owner_repo() -> str:
    return REPOSITORY.removeprefix("https://github.com/")


def colab_url(stem: str) -> str:
    """The address that opens chapter ``stem`` (``"01_naive_kv_cache"``) in Colab."""
    return f"{COLAB}/github/{_owner_repo()}/blob/{BRANCH}/chapters/{stem}.ipynb"


def binder_url(stem: str) -> str:
    """The address that builds the repository on Binder and opens chapter ``stem`` in JupyterLab."""
    return f"{BINDER}/v2/gh/{_owner_repo()}/{BRANCH}?urlpath=lab/tree/chapters/{stem}.ipynb"


def setup_cell(stem: str) -> str:
    """The jupytext source (``# %% tags=...`` line included) of chapter ``stem``'s setup cell."""
    tags = ", ".join(f'"{t}"' for t in SETUP_TAGS)
    lines = [
        f"# %% tags=[{tags}]",
        "# Setup. On Colab this fetches the book and installs it; on your own machine it does nothing.",
        "import os",
        "import subprocess",
        "import sys",
        "",
        'if "google.colab" in sys.modules:',
        f'    BOOK = "{COLAB_HOME}"',
        "    if not os.path.isdir(BOOK):",
        f'        subprocess.run(["git", "clone", "-q", "--depth", "1", "-b", "{BRANCH}", "{REPOSITORY}", BOOK],',
        "                       check=True)",
        '        subprocess.run([sys.executable, "-m", "pip", "install", "-q", "-e", BOOK], check=True)',
        "    sys.path.insert(0, BOOK)",
        '    os.chdir(os.path.join(BOOK, "chapters"))',
    ]
    if stem in NEEDS_PROCESSES:
        lines += [
            'if sys.platform == "emscripten":  # Python in the browser (JupyterLite) starts no threads or processes',
            f'    raise SystemExit("{NEEDS_PROCESSES[stem]}, which Python in the browser cannot start. "',
            '                     "Open it in Binder or Colab, or read its stored outputs on the web.")',
        ]
    return "\n".join(lines) + "\n\n"


def sync_setup_cells(folder: Path = _CHAPTERS) -> list[Path]:
    """Write :func:`setup_cell` as the first code cell of every ``NN_slug.py`` under ``folder``
    (replacing the one there); returns the files that changed. Re-execute those chapters after."""
    changed = []
    for path in sorted(Path(folder).glob("[0-9][0-9]_*.py")):
        text = path.read_text(encoding="utf-8")
        cell = setup_cell(path.stem)
        if _CELL.search(text):
            new = _CELL.sub(lambda _: cell, text, count=1)
        else:
            first = _FIRST_CODE.search(text)
            if first is None:
                raise ValueError(f"{path}: no code cell to put the setup cell before")
            new = text[:first.start()] + cell + text[first.start():]
        if new != text:
            path.write_text(new, encoding="utf-8")
            changed.append(path)
    return changed


def main(argv: list[str] | None = None) -> int:
    """``python -m kimilab.site.launch [CHAPTERS_DIR]``: rewrite the setup cells; list what changed."""
    argv = sys.argv[1:] if argv is None else argv
    folder = Path(argv[0]) if argv else _CHAPTERS
    if not folder.is_dir():
        print(f"CHAPTERS_DIR={folder}: expected a folder of NN_slug.py chapters", file=sys.stderr)
        return 2
    for path in sync_setup_cells(folder):
        print(f"rewrote the setup cell of {path.name}: re-execute it (python -m kimilab book --only {path.name[:2]})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
