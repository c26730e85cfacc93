"""SageMaker's module paths, resolved to modelparallel: the one alias table.

``ALIASES`` maps each module path a SageMaker script imports to the module that
implements it here. An entry covers the path's whole subtree: with ``"torch.sagemaker":
"modelparallel"``, ``torch.sagemaker.delayed_param`` is ``modelparallel.delayed_param``,
which the entry for that path maps to ``modelparallel.smp.delayed_param``. ``None``
marks a package that is only a namespace (``smdistributed``).

Two ways in:

- **Import line.** ``import modelparallel`` installs the finder for the paths under
  ``modelparallel`` (``modelparallel.delayed_param``, ``modelparallel.distributed.
  checkpoint.state_dict_saver``, ...), so a script ported by changing
  ``torch.sagemaker`` to ``modelparallel`` finds every submodule it imports.
- **Zero lines.** :func:`install` with ``sagemaker=True`` also resolves SageMaker's own
  paths (``smdistributed.modelparallel.torch``, ``torch.sagemaker``,
  ``smdistributed.dataparallel.torch.torch_smddp``, ...), without touching the installed
  torch: ``modelparallel run --compat sagemaker``, or ``MODELPARALLEL_COMPAT=sagemaker``
  in the environment of any launcher (a ``.pth`` file installed with the package reads
  it at interpreter start), and jobs whose ``distribution`` uses the ``smdistributed``
  form.

An alias is a module object of its own whose attributes are the target's (module
``__getattr__``), so the target is never renamed or altered. This module imports only
the standard library: the ``.pth`` file imports it in every interpreter.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import os
import sys
import types
from collections.abc import Sequence

ENVIRONMENT_SWITCH = "MODELPARALLEL_COMPAT"
MODES = ("sagemaker",)

# SMP's own paths (zero-line mode only). SMP v1, SMP v2 and SMDDP.
SAGEMAKER: dict[str, str | None] = {
    "smdistributed": None,
    "smdistributed.modelparallel": "modelparallel.smp.v1.smdistributed_package",
    "smdistributed.modelparallel.torch": "modelparallel",
    "smdistributed.modelparallel.test": None,
    "smdistributed.modelparallel.test.torch": None,
    "smdistributed.modelparallel.test.torch.utils": "modelparallel.smp.v1.weight_comparison",
    "smdistributed.dataparallel": None,
    "smdistributed.dataparallel.torch": None,
    "smdistributed.dataparallel.torch.distributed": "modelparallel.dataparallel",
    "smdistributed.dataparallel.torch.torch_smddp": "modelparallel.dataparallel",
    "smdistributed.dataparallel.torch.parallel": "modelparallel.dataparallel",
    "smdistributed.dataparallel.torch.parallel.distributed": "modelparallel.dataparallel",
    "torch.sagemaker": "modelparallel",
}

# SMP's submodule paths under modelparallel (always on once modelparallel is imported),
# mapped to where each is implemented.
MODELPARALLEL: dict[str, str | None] = {
    "modelparallel.test": None,
    "modelparallel.test.torch": None,
    "modelparallel.test.torch.utils": "modelparallel.smp.v1.weight_comparison",
    "modelparallel.grad_norm": "modelparallel.smp.v2.grad_norm",
    "modelparallel.logger": "modelparallel.smp.v2.logger",
    "modelparallel.utils": "modelparallel.smp.v2.utils",
    "modelparallel.checkpoint.utils": "modelparallel.smp.v2.utils.checkpoint_utils",
    "modelparallel.checkpoint.constants": "modelparallel.smp.v2.checkpoint.constants",
    "modelparallel.distributed": None,
    "modelparallel.distributed.checkpoint": "modelparallel.smp.v2.checkpoint",
    "modelparallel.distributed.fsdp": None,
    "modelparallel.distributed.fsdp.checkpoint":
        "modelparallel.smp.v2.checkpoint.fsdp_checkpoint",
    "modelparallel.amp": "modelparallel.smp.v1.amp",
    "modelparallel.delayed_param": "modelparallel.smp.delayed_param",
    "modelparallel.utils.module_utils": "modelparallel.smp.delayed_param",
    "modelparallel.ranker": "modelparallel.smp.v2.ranker",
    "modelparallel.state_handler": "modelparallel.smp.state",
    "modelparallel.state_mod": "modelparallel.smp.state",
    "modelparallel.context_parallel": None,
    "modelparallel.context_parallel.utils": "modelparallel.smp.v2.context_parallel",
    "modelparallel.distributed.fsdp.fully_sharded_data_parallel": "modelparallel.smp.v2.fsdp_hooks",
    "modelparallel.optimizers": "modelparallel.smp.v1.fused_optimizers",
    "modelparallel.nn": "modelparallel.smp.nn",  # SMP v1's and v2's modules together
    "modelparallel.nn.attn": "modelparallel.smp.v2.nn.flash_attention",
    "modelparallel.nn.huggingface": "modelparallel.smp.v1.nn.huggingface",
    "modelparallel.nn.tensor_parallel_transformer":
        "modelparallel.smp.v2.nn.tensor_parallel_transformer",
    "modelparallel.tensor_parallel": None,
    "modelparallel.tensor_parallel.transformer":
        "modelparallel.smp.v2.nn.tensor_parallel_transformer",
    "modelparallel.moe": "modelparallel.smp.v2.moe",
    "modelparallel.moe.moe_config": "modelparallel.smp.v2.moe",
    "modelparallel.moe.moe_layer": "modelparallel.smp.v2.moe",
}


NAMESPACE = ""  # resolve(): a path that is only a package of other aliases
MISSING = "?"  # resolve(): under an alias, but not a module modelparallel provides


def resolve(name: str, sagemaker: bool) -> str | None:
    """What module ``name`` stands for: a module path, ``NAMESPACE``, ``MISSING``, or
    None when ``name`` is no alias.

    The longest table path that is ``name`` or a package above it decides; the rest of
    ``name`` is appended to its target.
    """
    tables = (MODELPARALLEL, SAGEMAKER) if sagemaker else (MODELPARALLEL,)
    parts = name.split(".")
    for end in range(len(parts), 0, -1):
        prefix = ".".join(parts[:end])
        for table in tables:
            if prefix in table:
                target, rest = table[prefix], parts[end:]
                if target is None:
                    return MISSING if rest else NAMESPACE
                return ".".join([target, *rest])
    return None


def _not_provided(name: str) -> str:
    return (f"No module named {name!r}: modelparallel does not provide SMP's {name}; "
            f"docs/smp-compatibility.md lists the SMP modules and names it provides")


class AliasModule(types.ModuleType):
    """A module path that stands for another module: attributes are read from the
    target; submodules are found through the table (``__path__`` is empty)."""

    def __init__(self, name: str, target: types.ModuleType | None) -> None:
        super().__init__(name, getattr(target, "__doc__", None))
        self.__path__: list[str] = []
        self.__alias_of__ = target

    def __getattr__(self, attr: str) -> object:
        target = self.__dict__.get("__alias_of__")
        if target is None or attr.startswith("__alias"):
            raise AttributeError(f"module {self.__name__!r} has no attribute {attr!r}")
        try:
            return getattr(target, attr)
        except AttributeError:
            raise AttributeError(
                f"module {self.__name__!r} (modelparallel's {target.__name__}) has no "
                f"attribute {attr!r}; docs/smp-compatibility.md lists the SMP names "
                f"modelparallel provides") from None

    def __dir__(self) -> list[str]:
        own = set(self.__dict__)
        target = self.__dict__.get("__alias_of__")
        return sorted(own | set(dir(target)) if target is not None else own)


class _AliasLoader(importlib.abc.Loader):
    def __init__(self, target: str) -> None:
        self.target = target

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> types.ModuleType:
        if self.target == NAMESPACE:
            return AliasModule(spec.name, None)
        if self.target == MISSING:
            raise ModuleNotFoundError(_not_provided(spec.name), name=spec.name)
        try:
            module = importlib.import_module(self.target)
        except ModuleNotFoundError as e:
            if e.name is None or not (self.target == e.name
                                      or self.target.startswith(e.name + ".")):
                raise  # something the implementation imports is missing
            raise ModuleNotFoundError(_not_provided(spec.name), name=spec.name) from None
        return AliasModule(spec.name, module)

    def exec_module(self, module: types.ModuleType) -> None:
        pass  # the target ran when it was imported


class AliasFinder(importlib.abc.MetaPathFinder):
    """Finds the table's module paths (first on ``sys.meta_path``)."""

    def __init__(self) -> None:
        self.sagemaker = False

    def find_spec(self, fullname: str, path: Sequence[str] | None = None,
                  target: types.ModuleType | None = None,
                  ) -> importlib.machinery.ModuleSpec | None:
        resolved = resolve(fullname, self.sagemaker)
        if resolved is None:
            return None
        return importlib.machinery.ModuleSpec(fullname, _AliasLoader(resolved),
                                              is_package=True)


def _finder() -> AliasFinder:
    for finder in sys.meta_path:
        if isinstance(finder, AliasFinder):
            return finder
    finder = AliasFinder()
    sys.meta_path.insert(0, finder)
    return finder


def install(sagemaker: bool = False) -> None:
    """Resolve modelparallel's SMP submodule paths and, with ``sagemaker``, SageMaker's
    own module paths too (zero-line mode). Idempotent; never turns a mode off."""
    finder = _finder()
    if sagemaker:
        finder.sagemaker = True


def sagemaker_active() -> bool:
    """Whether SageMaker's module paths resolve to modelparallel in this process."""
    return any(isinstance(f, AliasFinder) and f.sagemaker for f in sys.meta_path)


def install_from_environment() -> None:
    """Install the mode ``MODELPARALLEL_COMPAT`` names, if any (the ``.pth`` file and
    the launcher's workers call this)."""
    mode = os.environ.get(ENVIRONMENT_SWITCH, "").strip().lower()
    if not mode:
        return
    if mode not in MODES:
        sys.stderr.write(f"modelparallel: {ENVIRONMENT_SWITCH}={mode!r} is not a known "
                         f"mode; known: {', '.join(MODES)} (ignored)\n")
        return
    install(sagemaker=True)
