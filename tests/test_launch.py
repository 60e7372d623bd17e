"""Opening the book elsewhere (kimilab.site.launch): Colab's setup cell, the browser's limits, Binder.

What runs here: the setup cell in a fresh clone as Colab would run it (only pip's install is a
stand-in, which records what it was asked); the cell doing nothing off Colab; a chapter that needs
threads or processes stopping in the browser with a message; and a static check that no other
chapter calls code that starts threads or processes. ``make launch`` adds what needs the package
index: the Binder environment resolving in a clean virtual environment.
"""

from __future__ import annotations

import ast
import json
import os
import shutil
import subprocess
import sys
import venv
from pathlib import Path

import pytest

from kimilab.site import launch

ROOT = Path(__file__).resolve().parent.parent
CHAPTERS = ROOT / "chapters"
SOURCES = sorted(CHAPTERS.glob("[0-9][0-9]_*.py"))


def _body(cell: str) -> str:
    """The cell's code without its ``# %%`` line."""
    return cell.split("\n", 1)[1]


def test_every_chapter_has_the_current_setup_cell(tmp_path):
    for path in SOURCES:
        shutil.copy(path, tmp_path / path.name)
    assert launch.sync_setup_cells(tmp_path) == [], "a setup cell is out of date: python -m kimilab.site.launch"
    for path in SOURCES:
        nb = json.loads(path.with_suffix(".ipynb").read_text(encoding="utf-8"))
        first = next(c for c in nb["cells"] if c["cell_type"] == "code")
        assert list(launch.SETUP_TAGS) == first["metadata"].get("tags"), f"{path.stem}: the setup cell is not first"
        assert "".join(first["source"]).strip() == _body(launch.setup_cell(path.stem)).strip()
        assert not first.get("outputs"), f"{path.stem}: the setup cell printed something off Colab"


def test_the_repository_address_is_written_in_one_place():
    """Apart from the setup cells generated from it, only kimilab/site/launch.py names the repository."""
    seen = []
    for path in [*ROOT.glob("*.md"), *ROOT.glob("*.toml"), *ROOT.glob("*.yml"), *(ROOT / "kimilab").rglob("*.py*"),
                 *(ROOT / "kimilab" / "templates").rglob("*"), *CHAPTERS.glob("*.md")]:
        if path.is_file() and launch.REPOSITORY in path.read_text(encoding="utf-8", errors="replace"):
            seen.append(path.relative_to(ROOT).as_posix())
    assert seen == ["kimilab/site/launch.py"], seen


def test_launch_addresses():
    stem = "01_naive_kv_cache"
    assert launch.colab_url(stem) == (f"{launch.COLAB}/github/{launch.REPOSITORY.removeprefix('https://github.com/')}"
                                      f"/blob/{launch.BRANCH}/chapters/{stem}.ipynb")
    assert launch.binder_url(stem).endswith(f"/{launch.BRANCH}?urlpath=lab/tree/chapters/{stem}.ipynb")


def test_off_colab_the_setup_cell_does_nothing(monkeypatch, tmp_path):
    def refuse(*a, **k):
        raise AssertionError("the setup cell started a process off Colab")

    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(subprocess, "run", refuse)
    path = list(sys.path)
    for stem in (p.stem for p in SOURCES):
        exec(compile(_body(launch.setup_cell(stem)), stem, "exec"), {})
    assert Path.cwd() == tmp_path and sys.path == path


def test_in_the_browser_a_chapter_that_needs_processes_stops_and_says_why(monkeypatch):
    monkeypatch.setattr(sys, "platform", "emscripten")
    for stem in (p.stem for p in SOURCES):
        code = compile(_body(launch.setup_cell(stem)), stem, "exec")
        if stem in launch.NEEDS_PROCESSES:
            with pytest.raises(SystemExit, match="browser cannot start.*Binder or Colab"):
                exec(code, {})
        else:
            exec(code, {})


def test_the_colab_setup_cell_runs_in_a_fresh_clone(tmp_path):
    """As on Colab: ``google.colab`` imported, the book cloned (from this repository's commits), the
    package installed (pip is a stand-in that records its arguments), ``import kimilab`` from the
    clone, the working folder ``chapters/`` so ``../data`` resolves. A second run clones nothing."""
    home = tmp_path / "content" / "kimilab"
    cell = _body(launch.setup_cell("05_prefix_caching"))
    cell = cell.replace(f'"-b", "{launch.BRANCH}", "{launch.REPOSITORY}"', f'"file://{ROOT}"')
    cell = cell.replace(launch.COLAB_HOME, str(home))
    assert str(home) in cell and f"file://{ROOT}" in cell
    fake = tmp_path / "fake"
    (fake / "pip").mkdir(parents=True)
    (fake / "pip" / "__init__.py").write_text("")
    (fake / "pip" / "__main__.py").write_text(
        "import json, os, sys\n"
        "with open(os.environ['PIP_LOG'], 'a') as f:\n"
        "    f.write(json.dumps(sys.argv[1:]) + '\\n')\n")
    script = (
        "import json, os, sys, types\n"
        "sys.modules['google.colab'] = types.ModuleType('google.colab')\n"
        f"exec(compile({cell!r}, 'setup', 'exec'))\n"
        "import kimilab\n"
        "from kimilab import traffic\n"
        "print(json.dumps({'kimilab': kimilab.__file__, 'cwd': os.getcwd(),\n"
        "                  'data': os.path.exists('../data/' + traffic.MOONCAKE_CONVERSATION)}))\n")
    env = dict(os.environ, PYTHONPATH=str(fake), PIP_LOG=str(tmp_path / "pip.log"))
    for run in range(2):
        done = subprocess.run([sys.executable, "-c", script], cwd=tmp_path, env=env, capture_output=True, text=True,
                              timeout=120)
        assert done.returncode == 0, done.stderr[-2000:]
        got = json.loads(done.stdout.strip().splitlines()[-1])
        assert Path(got["kimilab"]).resolve().is_relative_to(home.resolve())
        assert Path(got["cwd"]).resolve() == (home / "chapters").resolve() and got["data"]
    installs = [json.loads(line) for line in (tmp_path / "pip.log").read_text().splitlines()]
    assert installs == [["install", "-q", "-e", str(home)]], installs


# Calls that start a thread or a process. kimilab.parallel's pool is not one: it runs its jobs in this
# process where processes cannot start.
_STARTERS = {"run_local", "Thread", "Popen", "ProcessPoolExecutor", "ThreadPoolExecutor", "Pool"}


def _called_names(node: ast.AST) -> set[str]:
    names = set()
    for call in ast.walk(node):
        if isinstance(call, ast.Call):
            f = call.func
            if isinstance(f, ast.Name):
                names.add(f.id)
            elif isinstance(f, ast.Attribute):
                base = f.value.id if isinstance(f.value, ast.Name) else ""
                names.add("Popen" if base == "subprocess" else f.attr)
    return names


def _starting_functions() -> set[str]:
    """Every kimilab function (by name) that starts threads or processes, directly or through another."""
    calls = {}
    for path in (ROOT / "kimilab").rglob("*.py"):
        rel = path.relative_to(ROOT / "kimilab").as_posix()
        if rel.startswith(("classroom/", "site/", "parallel.py", "book.py", "__main__.py", "stored.py")):
            continue  # the tools around the book, not code a chapter runs
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                calls.setdefault(node.name, set()).update(_called_names(node))
    starting = set(_STARTERS)
    while True:
        more = {name for name, called in calls.items() if called & starting} - starting
        if not more:
            return starting
        starting |= more


def test_only_the_chapters_that_say_so_start_threads_or_processes():
    """Python in the browser (Pyodide) starts neither; a chapter that does must be in NEEDS_PROCESSES,
    whose setup cell stops it there with a message."""
    starting = _starting_functions()
    assert {"launch", "context_parallel_kda", "context_parallel_prefill"} <= starting  # the check sees them
    for path in SOURCES:
        code = path.read_text(encoding="utf-8").replace(launch.setup_cell(path.stem), "")  # Colab's git and pip
        used = _called_names(ast.parse(code)) & starting
        if path.stem in launch.NEEDS_PROCESSES:
            assert used, f"{path.stem} starts no thread or process: take it out of NEEDS_PROCESSES"
        else:
            assert not used, f"{path.stem} calls {sorted(used)}, which start threads or processes (not in Pyodide)"


@pytest.mark.network
def test_the_binder_environment_resolves_in_a_clean_venv(tmp_path):
    """repo2docker's pip step, dry: .binder/environment.yml's packages (their conda and PyPI names are the
    same) resolve together from the package index in an empty environment, and postBuild's install of
    the package itself resolves there too."""
    specs = []
    for line in (ROOT / ".binder" / "environment.yml").read_text().split("\ndependencies:\n", 1)[1].splitlines():
        item = line.split("#")[0].strip().removeprefix("- ").strip()
        if item and not item.startswith(("python", "pip")):
            specs.append(item)
    venv.create(tmp_path / "env", with_pip=True)
    python = str(tmp_path / "env" / "bin" / "python")
    for args in (["--ignore-installed", *specs], ["--no-deps", "-e", str(ROOT)]):
        done = subprocess.run([python, "-m", "pip", "install", "-q", "--dry-run", *args], capture_output=True,
                              text=True, timeout=600)
        assert done.returncode == 0, done.stderr[-3000:]
