"""The package's shape: small modules, and imports that only go down the layers.

Data flows one way through the book (traffic -> simulation -> caches -> model ->
kernels -> costs -> plots); so do imports. A module may import its own layer
and the layers below it, never above. These tests read the source (no imports
executed), so a violation is reported with the file and line that made it.
"""

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parent.parent / "kimilab"
MAX_LINES = 450

# Lower number = lower layer. Top-level modules and subpackages of kimilab.
LAYERS = {
    "config": 0, "validate": 0, "verdict": 0, "timing": 0, "gcpause": 0, "tokenizer": 0, "plots": 0, "notebook": 0,
    "readability": 0, "stored": 0, "parallel": 0,
    "ops": 1,
    "kda": 2, "traffic": 2,
    "costs": 3, "recall": 3,
    "model": 4,
    "pool": 5,
    "prefix": 6,
    "sim": 7, "speculative": 7, "cp": 7, "engine": 7,
    "fleet": 8,
    "experiment": 9, "book": 9, "site": 9, "classroom": 9, "exercises": 9,
    "__main__": 10,
}

MODULES = sorted(p for p in PACKAGE.rglob("*.py") if "__pycache__" not in p.parts)


def _unit(path: Path) -> str:
    """The top-level module or subpackage a file belongs to (``kimilab/pool/pages.py`` -> ``pool``)."""
    rel = path.relative_to(PACKAGE)
    return rel.parts[0] if len(rel.parts) > 1 else rel.stem


def _imports(path: Path):
    """(line, imported kimilab unit) for every ``kimilab`` import in the file."""
    tree = ast.parse(path.read_text(), filename=str(path))
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names = [node.module] if node.module != "kimilab" else [f"kimilab.{a.name}" for a in node.names]
        else:
            continue
        for name in names:
            parts = name.split(".")
            if parts[0] == "kimilab" and len(parts) > 1:
                yield node.lineno, parts[1]


def test_every_module_is_in_a_layer():
    units = {_unit(p) for p in MODULES} - {"__init__"}
    assert units <= set(LAYERS), f"modules without a layer: {sorted(units - set(LAYERS))}"


@pytest.mark.parametrize("path", MODULES, ids=lambda p: str(p.relative_to(PACKAGE)))
def test_module_is_at_most_450_lines(path):
    n = len(path.read_text().splitlines())
    assert n <= MAX_LINES, f"{path.relative_to(PACKAGE)} has {n} lines; split it by concept (limit {MAX_LINES})"


@pytest.mark.parametrize("path", MODULES, ids=lambda p: str(p.relative_to(PACKAGE)))
def test_imports_only_go_down(path):
    unit = _unit(path)
    if unit == "__init__":
        return
    mine = LAYERS[unit]
    for line, other in _imports(path):
        assert other in LAYERS, f"{path.name}:{line} imports unknown kimilab.{other}"
        assert LAYERS[other] <= mine, (
            f"{path.relative_to(PACKAGE)}:{line} imports kimilab.{other} (layer {LAYERS[other]}) from "
            f"kimilab.{unit} (layer {mine}): lower layers never import higher ones")


def test_no_module_is_a_forwarding_shim_for_an_old_path():
    """The restructure moved these; nothing may stand in their old places."""
    for old in ("attention", "conv", "cache", "memory", "paged", "radix", "workloads", "admission", "checks"):
        assert not (PACKAGE / f"{old}.py").exists(), f"kimilab/{old}.py came back"


def test_no_module_starts_processes_at_import():
    """Process pools are imported where they are used, so every module imports where there are no
    processes (JupyterLite's Pyodide): no top-level import of concurrent.futures or multiprocessing."""
    import ast

    bad = []
    for path in sorted(PACKAGE.rglob("*.py")):
        for node in ast.parse(path.read_text(encoding="utf-8")).body:
            names = ([a.name for a in node.names] if isinstance(node, ast.Import)
                     else [node.module or ""] if isinstance(node, ast.ImportFrom) else [])
            bad += [f"{path.relative_to(PACKAGE)}: {n}" for n in names
                    if n.split(".")[0] in ("concurrent", "multiprocessing")]
    assert not bad, bad
