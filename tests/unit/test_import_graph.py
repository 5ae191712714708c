"""The package's import graph: no cycles (counting imports inside functions too, which only defer one), and
the config package stays light (no torch), so reading a config or `--help` needs no model code.

Read from the source with `ast`, so nothing is imported. An edge is an `import` of a grpo module anywhere in
a file except under `if TYPE_CHECKING:`; importing a submodule does not count as importing its parent
packages (every `grpo.x` would otherwise reach `grpo/__init__.py`, which re-exports the public API)."""

from __future__ import annotations

import ast
import importlib
import os
import subprocess
import sys
from pathlib import Path

import pytest

import grpo

SRC = Path(__file__).resolve().parents[2] / "src" / "grpo"


def _module_names(root: Path) -> dict[str, Path]:
    names = {}
    for path in root.rglob("*.py"):
        parts = list(path.relative_to(root.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        names[".".join(parts)] = path
    return names


def _imports(
    name: str, path: Path, modules: dict[str, Path], top_level_only: bool, typing_too: bool = False
) -> set[str]:
    """What this module imports: for `from a import b`, `a.b` when that is a module of ours, else `a`.
    `typing_too` counts the imports under `if TYPE_CHECKING:` as well."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found: set[str] = set()

    def visit(statements: list) -> None:
        for node in statements:
            if not typing_too and isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
                continue
            if top_level_only and isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                continue
            if isinstance(node, ast.Import):
                found.update(alias.name for alias in node.names)
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:  # relative: `from .x import y`
                    anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                    base = ".".join([*anchor, *([node.module] if node.module else [])])
                found.update(
                    f"{base}.{a.name}" if f"{base}.{a.name}" in modules else base for a in node.names
                )
            for field in ("body", "orelse", "finalbody", "handlers"):
                visit(getattr(node, field, []))

    visit(ast.parse(path.read_text(encoding="utf-8")).body)
    return found


def import_graph(root: Path, top_level_only: bool = False, typing_too: bool = False) -> dict[str, set[str]]:
    modules = _module_names(root)
    return {
        name: {
            m for m in _imports(name, path, modules, top_level_only, typing_too) if m in modules and m != name
        }
        for name, path in modules.items()
    }


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found = []

    def connect(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in graph[v]:
            if w not in index:
                connect(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while not component or component[-1] != v:
                component.append(stack.pop())
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            connect(v)
    return found


def test_cycle_finder_sees_a_deferred_import(tmp_path):
    pkg = tmp_path / "pkg"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "a.py").write_text("from pkg.b import thing\n")
    (pkg / "b.py").write_text("def f():\n    from pkg import a\n")
    (pkg / "c.py").write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from pkg import a\n")
    assert cycles(import_graph(pkg)) == [["pkg.a", "pkg.b"]]
    assert cycles(import_graph(pkg, top_level_only=True)) == []


def test_no_import_cycles():
    found = cycles(import_graph(SRC))
    assert not found, "import cycles (an import inside a function counts): " + "; ".join(
        " <-> ".join(c) for c in found
    )


def test_no_import_cycles_through_type_annotations():
    """A circle closed only by a `TYPE_CHECKING` import still means two modules need each other to be read
    (config/tree ↔ config/validate and model/packed → records → rewards → model were such circles)."""
    found = cycles(import_graph(SRC, typing_too=True))
    assert not found, "import cycles counting TYPE_CHECKING imports: " + "; ".join(
        " <-> ".join(c) for c in found
    )


# The floors, highest first (docs/architecture.md): a module imports from its own floor or lower ones only.
# Named by the top-level module or package under grpo/; a new one must be placed here to pass.
FLOORS = (
    ("cli", "cli_eval", "__main__"),
    ("trainer",),
    ("train",),
    ("stages", "run", "evaluation"),
    ("learner", "rollout", "agents", "gateway", "trl_compat"),
    ("algorithm", "checkpoint", "data", "distributed", "model", "rewards"),
    ("records", "config", "plugins", "redact", "files", "ranges", "assets", "configs", "kernels"),
)
# Upward imports still there, each with why it stays for now; an entry that no longer occurs fails too.
ALLOWED_UPWARD: set[tuple[str, str]] = set()


def floor_of(module: str) -> int | None:
    """0 for the lowest floor; None for the package itself (grpo/__init__.py re-exports lazily)."""
    parts = module.split(".")
    if len(parts) == 1:
        return None
    for height, names in enumerate(reversed(FLOORS)):
        if parts[1] in names:
            return height
    raise AssertionError(f"{module} has no floor: place it in FLOORS (tests/unit/test_import_graph.py)")


def upward_imports(graph: dict[str, set[str]]) -> set[tuple[str, str]]:
    found = set()
    for module, imported in graph.items():
        for target in imported:
            here, there = floor_of(module), floor_of(target)
            if here is not None and there is not None and there > here:
                found.add((module, target))
    return found


def test_direction_finder_sees_an_upward_import(tmp_path):
    pkg = tmp_path / "grpo"
    for sub in ("records", "learner", "train"):
        (pkg / sub).mkdir(parents=True)
        (pkg / sub / "__init__.py").write_text("")
    (pkg / "__init__.py").write_text("")
    (pkg / "records" / "a.py").write_text("def f():\n    from grpo.learner import b\n")
    (pkg / "learner" / "b.py").write_text("from grpo.records import a\n")
    (pkg / "train" / "c.py").write_text("from grpo.learner import b\n")
    assert upward_imports(import_graph(pkg)) == {("grpo.records.a", "grpo.learner.b")}


def test_imports_point_down_the_floors():
    """Imports inside functions count; those under TYPE_CHECKING too (a type named from a floor above is
    still a dependency on it)."""
    found = upward_imports(import_graph(SRC, typing_too=True))
    new = sorted(found - ALLOWED_UPWARD)
    assert not new, "imports up the floors (FLOORS in this file, docs/architecture.md): " + "; ".join(
        f"{a} -> {b}" for a, b in new
    )
    gone = sorted(ALLOWED_UPWARD - found)
    assert not gone, f"no longer imported, remove from ALLOWED_UPWARD: {gone}"


def test_the_floors_are_the_ones_docs_architecture_draws():
    """docs/architecture.md draws the floors as `7  cli.py  __main__.py` ... `1  records.py  config/ ...`."""
    text = (SRC.parents[1] / "docs" / "architecture.md").read_text(encoding="utf-8")
    drawn = text.split("## The floors", 1)[1].split("```")[1]
    lines = [line.split() for line in drawn.splitlines() if line[:1].isdigit()]
    docs = {int(words[0]): {w.removesuffix(".py").removesuffix("/") for w in words[1:]} for words in lines}
    data_packages = {"assets", "configs"}
    assert docs == {height: set(names) - data_packages for height, names in enumerate(reversed(FLOORS), 1)}


def test_config_imports_no_torch():
    """Everything grpo.config imports when it is imported (module level, transitively) is torch-free; the
    registries behind `choices` are read at validation (schema.Registry)."""
    modules = _module_names(SRC)
    reached, todo = set(), [m for m in modules if m == "grpo.config" or m.startswith("grpo.config.")]
    heavy = set()
    while todo:
        name = todo.pop()
        if name in reached:
            continue
        reached.add(name)
        for imported in _imports(name, modules[name], modules, top_level_only=True):
            if imported.split(".")[0] in ("torch", "transformers", "numpy"):
                heavy.add(f"{name} -> {imported}")
            elif imported in modules:
                todo.append(imported)
    assert not heavy, sorted(heavy)


_HEAVY = ("torch", "transformers", "numpy")
_HELP = "from grpo.cli import main\ntry:\n    main({argv})\nexcept SystemExit:\n    pass"


@pytest.mark.parametrize(
    "code",
    [
        "import grpo.config",
        "from grpo import GRPOConfig",
        _HELP.format(argv=["--help"]),
        _HELP.format(argv=["train", "--help"]),
    ],
    ids=["import grpo.config", "from grpo import GRPOConfig", "grpo --help", "grpo train --help"],
)
def test_light_entry_points_load_no_torch(code):
    """What really runs, grpo/__init__.py included (the graph above leaves package parents out): the CLI's
    help and the config stay quick because nothing on their way imports torch."""
    report = f"import sys; print(sorted(m for m in {_HEAVY!r} if m in sys.modules))"
    done = subprocess.run(
        [sys.executable, "-c", f"{code}\n{report}"],
        capture_output=True,
        text=True,
        check=True,
        env={**os.environ, "PYTHONPATH": str(SRC.parent)},
    )
    assert done.stdout.splitlines()[-1] == "[]", done.stdout


def test_every_public_name_loads_from_its_home():
    assert sorted(grpo.__all__) == sorted(grpo._HOMES)
    for name, home in grpo._HOMES.items():
        assert getattr(grpo, name) is getattr(importlib.import_module(home), name)
    with pytest.raises(AttributeError, match="no attribute 'GRPOTrainr'"):
        grpo.GRPOTrainr  # noqa: B018 - the attribute access is what is tested
