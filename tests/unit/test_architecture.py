"""The architecture's rules, read from the source (docs/architecture.md#rules).

- no import cycles among the package's modules, counting imports inside functions
  (those under ``if TYPE_CHECKING:`` only name types and are not counted);
- the core (``parallel/``, ``checkpoint/``, ``observe/``, ``models/``, and the core
  modules beside them) never imports the SMP facade, which alone holds process state;
- ``parallel/tensor/`` imports no model: models own their tensor-parallel plans;
- no source file is longer than 400 lines.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

SRC = Path(__file__).resolve().parents[2] / "src"
PACKAGE = "modelparallel"
MAX_LINES = 400


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(SRC).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


MODULES = {_module_name(p): p for p in sorted((SRC / PACKAGE).rglob("*.py"))}


def _is_type_checking(node: ast.If) -> bool:
    test = node.test
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def _imported(name: str, path: Path) -> set[str]:
    """The package's modules ``name`` imports, at any depth but TYPE_CHECKING blocks."""
    tree = ast.parse(path.read_text(), str(path))
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found: set[str] = set()

    def visit(node: ast.AST) -> None:
        if isinstance(node, ast.If) and _is_type_checking(node):
            for child in node.orelse:
                visit(child)
            return
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")
                anchor = anchor[:len(anchor) - node.level + 1]
                base = ".".join([*anchor, base] if base else anchor)
            for alias in node.names:  # `from pkg import module` imports the module
                sub = f"{base}.{alias.name}"
                found.add(sub if sub in MODULES else base)
        for child in ast.iter_child_nodes(node):
            visit(child)

    visit(tree)
    return {m for m in found if m in MODULES and m != name}


GRAPH = {name: _imported(name, path) for name, path in MODULES.items()}


def _cycles() -> list[list[str]]:
    """Every strongly connected group of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    groups: list[list[str]] = []

    def connect(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(GRAPH[v]):
            if w not in index:
                connect(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            group = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                group.append(w)
                if w == v:
                    break
            if len(group) > 1:
                groups.append(sorted(group))

    for v in sorted(GRAPH):
        if v not in index:
            connect(v)
    return groups


def test_the_checker_sees_function_local_imports():
    assert "modelparallel.smp.state" in GRAPH["modelparallel.smp.v1.distributed_model"]
    assert _imported("x", _write_probe()) == {"modelparallel.topology"}


def _write_probe() -> Path:
    import tempfile

    probe = Path(tempfile.mkdtemp()) / "probe.py"
    probe.write_text("from typing import TYPE_CHECKING\n"
                     "if TYPE_CHECKING:\n    from modelparallel import config\n"
                     "def f():\n    from modelparallel.topology import Topology\n")
    return probe


def test_no_import_cycles():
    assert _cycles() == []


CORE = ("parallel", "checkpoint", "observe", "models", "context", "topology", "config")
FACADE = f"{PACKAGE}.smp"


def _inside(folder: str) -> list[str]:
    """The modules of ``folder`` (a module or a package); a rule naming one that does not
    exist checks nothing, so it fails."""
    inside = [m for m in GRAPH if m == f"{PACKAGE}.{folder}" or
              m.startswith(f"{PACKAGE}.{folder}.")]
    assert inside, f"the architecture rule names {PACKAGE}.{folder}, which does not exist"
    return inside


def test_a_rule_naming_a_missing_module_fails():
    with pytest.raises(AssertionError, match="does not exist"):
        _inside("precision")


@pytest.mark.parametrize("folder", CORE)
def test_the_core_does_not_import_the_facade(folder: str):
    inside = _inside(folder)
    wrong = {m: sorted(d for d in GRAPH[m] if d == FACADE or d.startswith(FACADE + "."))
             for m in inside}
    assert {m: d for m, d in wrong.items() if d} == {}


def test_tensor_parallel_imports_no_model():
    inside = _inside("parallel.tensor")
    wrong = {m: sorted(d for d in GRAPH[m] if d.startswith(f"{PACKAGE}.models")
                       or d.startswith(f"{PACKAGE}.testing")) for m in inside}
    assert {m: d for m, d in wrong.items() if d} == {}


def test_no_source_file_is_longer_than_the_limit():
    long = {str(p.relative_to(SRC)): n for p in MODULES.values()
            if (n := len(p.read_text().splitlines())) > MAX_LINES}
    assert long == {}


# the bottom layers, each importing only those below it: a walk from init() down never
# climbs back up (docs/architecture.md, "One step, from configuration to collective")
LAYERS = {
    "errors": set(),
    "notices": set(),
    "schedule_rules": set(),
    "config_keys": {"errors"},
    "config_files": {"errors"},
    "config": {"errors", "notices", "schedule_rules", "config_keys", "config_files"},
    "topology": {"errors", "schedule_rules", "config"},
    "precision_policy": {"config"},
    "context": {"config", "topology", "precision_policy"},
}


@pytest.mark.parametrize("module", sorted(LAYERS))
def test_the_bottom_layers_import_only_what_is_below_them(module: str):
    (name,) = _inside(module)
    allowed = {f"{PACKAGE}.{m}" for m in LAYERS[module]}
    assert GRAPH[name] <= allowed, sorted(GRAPH[name] - allowed)
