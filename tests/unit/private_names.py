"""Find the private names of torch (and of Python and other libraries) the package reaches.

A private name is one with a leading underscore (dunders aside). The package uses one
when it

- imports it: ``from torch.x import _y``, or anything from a module path with a private
  part (``torch.distributed.fsdp._flat_param``);
- reaches it as an attribute of a name bound to a torch import (``torch._C``,
  ``dist_c10d._get_default_group``), whatever the package itself defines;
- reaches it as an attribute (or through ``getattr``/``hasattr``/``setattr`` with a
  literal name) of any other object, where the package defines no such name itself
  (a ``def``, a class, an assignment, an attribute of ``self``/``cls``);
- calls a base class's private method through ``super()`` (an override of it).

The second rule catches what the package replaces in torch (a module global it swaps);
the third cannot tell whose object it is, so a private name the package defines as
well as reaches on a torch object goes unseen: the allow-list's owners say whose each is.
Attributes the package sets on modules are named ``_mp_*`` and are its own.
"""

from __future__ import annotations

import ast
from collections import defaultdict
from pathlib import Path

SRC = Path(__file__).resolve().parents[2] / "src"
_PROBES = ("getattr", "hasattr", "setattr", "delattr")


def _private(name: str) -> bool:
    return name.startswith("_") and not name.startswith("__") and not name.startswith("_mp_")


def _root(node: ast.expr) -> str | None:
    while isinstance(node, ast.Attribute):
        node = node.value
    return node.id if isinstance(node, ast.Name) else None


def _defined(trees: list[ast.Module]) -> set[str]:
    names: set[str] = set()
    for tree in trees:
        for n in ast.walk(tree):
            if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                names.add(n.name)
            elif isinstance(n, ast.Name) and isinstance(n.ctx, ast.Store):
                names.add(n.id)
            elif isinstance(n, ast.arg):
                names.add(n.arg)
            elif (isinstance(n, ast.Attribute) and isinstance(n.ctx, (ast.Store, ast.Del))
                  and _root(n) in ("self", "cls")):
                names.add(n.attr)
            elif (isinstance(n, ast.Subscript) and isinstance(n.value, ast.Attribute)
                  and n.value.attr == "__dict__" and isinstance(n.slice, ast.Constant)):
                names.add(str(n.slice.value))  # self.__dict__["_name"] = ...
    return names


def _on_super(node: ast.Attribute) -> bool:
    """``super()._name``: a private method of a base class, which the package overrides
    (its own ``def`` of the name does not make the base's its own)."""
    call = node.value
    return (isinstance(call, ast.Call) and isinstance(call.func, ast.Name)
            and call.func.id == "super")


def _torch_aliases(tree: ast.Module) -> set[str]:
    """Names a module binds to torch modules or objects by its imports."""
    aliases = set()
    for n in ast.walk(tree):
        if isinstance(n, ast.Import):
            for a in n.names:
                if a.name.split(".")[0] == "torch":
                    aliases.add(a.asname or "torch")
        elif isinstance(n, ast.ImportFrom) and (n.module or "").split(".")[0] == "torch":
            aliases.update(a.asname or a.name for a in n.names)
    return aliases


def private_uses(src: Path = SRC) -> dict[str, list[str]]:
    """Each private name used -> where (``path:line``). Imports are keyed by their dotted
    path (``torch.utils._pytree``); attributes by ``.name``."""
    files = sorted(src.rglob("*.py"))
    trees = [ast.parse(f.read_text(), str(f)) for f in files]
    defined = _defined(trees)
    uses: dict[str, list[str]] = defaultdict(list)
    for path, tree in zip(files, trees, strict=True):
        where = str(path.relative_to(src))
        torch_names = _torch_aliases(tree)
        for n in ast.walk(tree):
            if isinstance(n, ast.ImportFrom) and (n.module or "").split(".")[0] == "torch":
                module = n.module or ""
                in_private = any(part.startswith("_") for part in module.split("."))
                for a in n.names:
                    if in_private or _private(a.name):
                        uses[f"{module}.{a.name}"].append(f"{where}:{n.lineno}")
            elif isinstance(n, ast.Import):
                for a in n.names:
                    parts = a.name.split(".")
                    if parts[0] == "torch" and any(p.startswith("_") for p in parts):
                        uses[a.name].append(f"{where}:{n.lineno}")
            elif isinstance(n, ast.Attribute) and _private(n.attr):
                if _root(n) in torch_names or n.attr not in defined or _on_super(n):
                    uses[f".{n.attr}"].append(f"{where}:{n.lineno}")
            elif (isinstance(n, ast.Call) and isinstance(n.func, ast.Name)
                  and n.func.id in _PROBES and len(n.args) > 1
                  and isinstance(n.args[1], ast.Constant) and isinstance(n.args[1].value, str)
                  and _private(n.args[1].value) and n.args[1].value not in defined):
                uses[f".{n.args[1].value}"].append(f"{where}:{n.lineno}")
    return dict(uses)
