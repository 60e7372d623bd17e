"""Where a submission runs: a student edition, a folder of its own, a sandboxed kernel, a time limit.

The grader never runs a student's notebook against the teacher's repository. Once per
grading run, :class:`Edition` builds the student edition (:mod:`kimilab.classroom.bundle`:
no checker modules, no answers) in a temporary folder, adds the teacher's stored results
(``data/results``: the book's own numbers, which a chapter would otherwise spend minutes
recomputing), and computes the key -- every expected value -- in the grader's own
process. Each notebook then gets :func:`run_isolated`:

* a fresh folder (``chapters/`` as its working directory, ``data`` linked to the
  edition's, its own ``HOME``, ``TMPDIR``, IPython and matplotlib folders);
* a kernel with a minimal environment whose ``PYTHONPATH`` is the edition, so
  ``import kimilab`` finds the student package and ``kimilab.exercises`` has no answers;
* where Linux Landlock exists (:mod:`kimilab.classroom.sandbox`), a kernel that can read
  only Python, the system and the edition and write only its own folder: the teacher's
  repository is neither readable nor writable from it;
* a limit per cell and one for the whole notebook.

Without Landlock the kernel could still reach the teacher's files, so :class:`Snapshot`
checks them (and the edition) after each notebook, restores any that changed, and
the grader scores that notebook 0 and says why.
"""

from __future__ import annotations

import compileall
import json
import os
import shutil
import site
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

from kimilab.classroom import sandbox

__all__ = ["Edition", "Snapshot", "Run", "run_isolated", "TimeLimit", "teacher_paths"]

ROOT = Path(__file__).resolve().parents[2]
_KEEP_ENV = ("PATH", "LANG", "LC_ALL", "LC_CTYPE", "OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS", "MKL_NUM_THREADS",
             "SYSTEMROOT")
_SYSTEM = ("/usr", "/lib", "/lib32", "/lib64", "/bin", "/sbin", "/etc", "/proc", "/sys", "/dev", "/opt")


class TimeLimit(Exception):
    """The notebook ran past its whole-notebook limit."""


def teacher_paths(root: Path = ROOT) -> list[Path]:
    """The teacher's files a submission must not change: the package, the chapters, the data, the docs."""
    out = []
    for top in ("kimilab", "chapters", "data"):
        out += [p for p in sorted((root / top).rglob("*")) if p.is_file() and "__pycache__" not in p.parts
                and ".ipynb_checkpoints" not in p.parts]
    return out + [root / name for name in ("TEACHING.md", "README.md", "pyproject.toml", "Makefile")
                  if (root / name).is_file()]


class Snapshot:
    """The bytes of a set of files, to find and undo changes a notebook made to them."""

    def __init__(self, paths: list[Path]):
        self.files = {p: p.read_bytes() for p in paths}

    def restore_changed(self) -> list[Path]:
        """Put back every file that changed or vanished (or became a folder or a link); returns them."""
        changed = []
        for p, data in self.files.items():
            try:
                same = p.is_file() and not p.is_symlink() and p.read_bytes() == data
            except OSError:
                same = False
            if same:
                continue
            if p.is_dir() and not p.is_symlink():
                shutil.rmtree(p)
            elif p.is_symlink():
                p.unlink()
            p.parent.mkdir(parents=True, exist_ok=True)
            p.write_bytes(data)
            changed.append(p)
        return changed


@dataclass
class Edition:
    """The student edition a grading run executes against, and the key it grades with (grader-side only)."""

    root: Path  # a temporary folder: edition/, and one folder per notebook
    expected: dict = field(default_factory=dict)  # id -> the expected value
    exercises: dict = field(default_factory=dict)  # id -> Exercise (title, tolerance)
    check_cells: dict = field(default_factory=dict)  # chapter -> {id: the check cell's source as handed out}
    landlock: int = 0

    @property
    def folder(self) -> Path:
        return self.root / "edition"

    @classmethod
    def build(cls, root: Path | None = None) -> "Edition":
        import nbformat

        from kimilab.classroom.bundle import build_bundle
        from kimilab.classroom.student import VERIFY
        from kimilab.exercises import all_exercises

        root = Path(root or tempfile.mkdtemp(prefix="kimilab-grade-"))
        exercises = all_exercises()
        ed = cls(root, {i: ex.expected() for i, ex in exercises.items()}, exercises, landlock=sandbox.abi())
        build_bundle(ed.folder, None, expected=ed.expected)
        # the teacher's stored results too, as the teacher's chapters read them: without them a kernel would
        # recompute them (chapter 11: minutes), and they are the book's public numbers, not the key
        shutil.copytree(ROOT / "data" / "results", ed.folder / "data" / "results", dirs_exist_ok=True)
        compileall.compile_dir(str(ed.folder / "kimilab"), quiet=1)  # the kernel cannot write bytecode there
        for nb_path in sorted((ed.folder / "chapters").glob("[0-9][0-9]_*.ipynb")):
            nb = nbformat.read(nb_path, as_version=4)
            cells = {m.group(1): _normal(c.source) for c in nb.cells if c.cell_type == "code"
                     for m in [VERIFY.search(c.source)] if m}
            ed.check_cells[int(nb_path.name[:2])] = cells
        return ed

    def snapshot(self) -> Snapshot:
        """The teacher's files and the edition's, as they are before any notebook runs."""
        edition = [p for p in sorted(self.folder.rglob("*")) if p.is_file()]
        return Snapshot(teacher_paths() + edition)

    def close(self) -> None:
        shutil.rmtree(self.root, ignore_errors=True)


def _normal(source: str) -> str:
    """A cell's source without trailing spaces or blank lines at either end: what counts as unedited."""
    return "\n".join(line.rstrip() for line in source.strip().splitlines())


def cell_intact(source: str, handed_out: str) -> bool:
    return _normal(source) == handed_out


def _read_roots(edition: Path) -> list[str]:
    roots = set(_SYSTEM) | {sys.prefix, sys.base_prefix, sys.exec_prefix, sys.base_exec_prefix, str(edition)}
    roots |= set(site.getsitepackages()) | {os.path.dirname(os.path.dirname(os.path.realpath(sys.executable)))}
    return sorted(r for r in roots if r and os.path.exists(r))


def package_exposed(edition: Path) -> bool:
    """True if the teacher's kimilab lies inside a tree the sandbox lets a kernel read (say, a non-editable
    install into site-packages): its answer modules would be readable from a student's kernel."""
    here = Path(__file__).resolve().parents[1]
    return any(here.is_relative_to(Path(r).resolve()) for r in _read_roots(edition))


@dataclass
class Run:
    """What a notebook's run left behind: the executed notebook, the answers file, why it stopped early."""

    nb: object
    answers: Path
    stopped: str | None
    seconds: float


def _stopped(err: Exception, timeout: int, limit: int) -> str:
    name = type(err).__name__
    if isinstance(err, TimeLimit):
        return f"the notebook ran past its {limit} s limit; it was stopped there"
    if name == "CellTimeoutError":
        return f"a cell ran past the {timeout} s limit; the notebook was stopped there"
    if name == "DeadKernelError":
        return "the kernel died (the notebook exited or ran out of memory); the rest did not run"
    return f"the notebook stopped: {name}: {' '.join(str(err).split())[:160]}"


def run_isolated(nb, edition: Edition, work: Path, *, timeout: int, limit: int) -> Run:
    """Execute ``nb`` in ``work`` (created here) against ``edition``: sandboxed where Landlock exists."""
    from jupyter_client import AsyncKernelManager
    from jupyter_client.kernelspec import KernelSpecManager
    from jupyter_core.utils import run_sync
    from nbclient import NotebookClient

    for sub in ("chapters", "tmp", "home", "ipython", "mpl", "figures", "spec/kimilab-grade"):
        (work / sub).mkdir(parents=True, exist_ok=True)
    (work / "data").symlink_to(edition.folder / "data", target_is_directory=True)
    answers = work / "answers.jsonl"
    env = {k: os.environ[k] for k in _KEEP_ENV if k in os.environ}
    env |= {"PYTHONPATH": str(edition.folder), "PYTHONDONTWRITEBYTECODE": "1", "HOME": str(work / "home"),
            "TMPDIR": str(work / "tmp"), "IPYTHONDIR": str(work / "ipython"), "MPLCONFIGDIR": str(work / "mpl"),
            "JUPYTER_CONFIG_DIR": str(work / "home"), "JUPYTER_DATA_DIR": str(work / "home"),
            "JUPYTER_RUNTIME_DIR": str(work / "home"), "KIMILAB_FIGURES": str(work / "figures"),
            "KIMILAB_ANSWERS": str(answers), "MPLBACKEND": "agg"}
    kernel = [sys.executable, "-m", "ipykernel_launcher", "-f", "{connection_file}"]
    if edition.landlock:
        kernel = sandbox.launcher(_read_roots(edition.folder), [str(work), "/dev/null", "/dev/shm"], kernel)
    spec = {"argv": kernel, "display_name": "kimilab grading", "language": "python"}
    (work / "spec" / "kimilab-grade" / "kernel.json").write_text(json.dumps(spec), encoding="utf-8")
    # Unix sockets in the submission's own folder (the sandbox lets it make them there, nowhere else): no
    # TCP port on the machine, and no ipykernel warning about one without encryption
    km = AsyncKernelManager(kernel_name="kimilab-grade", kernel_spec_manager=KernelSpecManager(
        kernel_dirs=[str(work / "spec")]), transport="ipc", ip=str(work / "home" / "kernel"))
    km.connection_file = str(work / "home" / "kernel.json")
    deadline = time.monotonic() + limit

    def cell_timeout(cell) -> int:
        return max(1, min(timeout, int(deadline - time.monotonic()) + 1))

    def past_limit(cell, cell_index) -> None:
        if time.monotonic() > deadline:
            raise TimeLimit()

    stopped = None
    start = time.perf_counter()
    client = NotebookClient(nb, km=km, timeout_func=cell_timeout, allow_errors=True, on_cell_start=past_limit,
                            resources={"metadata": {"path": str(work / "chapters")}})
    try:
        client.execute(env=env)
    except Exception as err:  # noqa: BLE001 -- a dead or hung kernel ends this notebook, not the class
        if type(err).__name__ == "CellTimeoutError" and time.monotonic() >= deadline - 0.5:
            err = TimeLimit()  # the cell's limit was what was left of the notebook's
        stopped = _stopped(err, timeout, limit)
    finally:
        try:
            if km.has_kernel:
                run_sync(km.shutdown_kernel)(now=True)
        except Exception:  # noqa: BLE001 -- the kernel may already be gone
            pass
    return Run(nb, answers, stopped, time.perf_counter() - start)
