"""environment.yml (conda/Binder) lists exactly the packages pyproject.toml installs."""

from __future__ import annotations

import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - Python 3.10
    tomllib = None


def _name(req: str) -> str:
    return re.split(r"[<>=!~ ;\[]", req.strip(), maxsplit=1)[0].lower().replace("_", "-")


def _pyproject_names() -> set[str]:
    text = (ROOT / "pyproject.toml").read_text()
    if tomllib is not None:
        data = tomllib.loads(text)
        project = data["project"]
        reqs = list(project["dependencies"]) + list(project["optional-dependencies"]["dev"])
    else:  # minimal parse for 3.10: quoted strings in the two lists
        block = re.search(r"dependencies = \[(.*?)\]", text, re.S).group(1)
        dev = re.search(r"\ndev = \[(.*?)\]", text, re.S).group(1)
        reqs = re.findall(r'"([^"]+)"', block + dev)
    return {_name(r) for r in reqs}


def _environment_names() -> set[str]:
    names = set()
    text = (ROOT / "environment.yml").read_text()
    for line in text.split("\ndependencies:\n", 1)[1].splitlines():
        # conda packages, and the pip: section's packages (those not on conda-forge); not the -e . line
        m = re.match(r"^(?:  |      )- ([A-Za-z][A-Za-z0-9_.\-]*)", line)
        if m and m.group(1) not in ("python", "pip"):
            names.add(_name(m.group(1)))
    return names


def test_environment_matches_pyproject():
    py, env = _pyproject_names(), _environment_names()
    assert py == env, f"only in pyproject.toml: {sorted(py - env)}; only in environment.yml: {sorted(env - py)}"


def test_versions_agree():
    text = (ROOT / "environment.yml").read_text()
    for req in re.findall(r'"([^"]+)"', (ROOT / "pyproject.toml").read_text()):
        m = re.match(r"^([A-Za-z0-9_\-]+)(>=[0-9.]+)$", req)
        if m and _name(m.group(1)) in _environment_names():
            assert f"{m.group(1)}{m.group(2)}" in text, f"environment.yml should pin {req} like pyproject.toml"


def _deps(path: Path) -> list[str]:
    text = path.read_text()
    return [line for line in text.split("\ndependencies:\n", 1)[1].splitlines() if line.strip() != "- -e ."]


def test_binder_builds_the_same_environment_then_installs_the_package():
    """repo2docker builds .binder/environment.yml before the repository is copied in, so it may not
    install `-e .`; postBuild does that. Otherwise it is environment.yml, package for package."""
    binder = ROOT / ".binder"
    assert "- -e ." not in [line.strip() for line in (binder / "environment.yml").read_text().splitlines()]
    assert _deps(binder / "environment.yml") == _deps(ROOT / "environment.yml")
    post = (binder / "postBuild").read_text()
    assert "pip install --no-deps -e ." in post and (binder / "postBuild").stat().st_mode & 0o111
