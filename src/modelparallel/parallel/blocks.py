"""Find the repeated blocks of a model (the units FSDP shards one at a time)."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import cast

from torch import nn

# What a user may pass as ``blocks``: classes, modules, or a predicate over modules.
BlockSpec = Iterable[type[nn.Module] | nn.Module] | Callable[[nn.Module], bool] | None


def find_blocks(model: nn.Module, blocks: BlockSpec = None) -> list[nn.Module]:
    """The outermost repeated blocks of ``model``, in module order.

    ``blocks=None`` finds them automatically: the classes a Hugging Face model names
    in ``_no_split_modules``, else the children of any ``nn.ModuleList`` or
    ``nn.Sequential`` whose two or more children share one class and hold
    parameters (transformer layers, ResNet stages, ...). Pass module classes,
    module instances or a predicate to choose them yourself; ``[]`` means none.
    """
    if blocks is None:
        names = set(getattr(model, "_no_split_modules", None) or ())
        if names:
            return _outermost(model, lambda m: type(m).__name__ in names)
        return _repeated_children(model)
    if callable(blocks) and not isinstance(blocks, type):
        return _outermost(model, blocks)
    chosen = list(cast(Iterable[type[nn.Module] | nn.Module], blocks))
    classes = tuple(b for b in chosen if isinstance(b, type))
    instances = {id(b) for b in chosen if isinstance(b, nn.Module)}
    if len(classes) + len(instances) != len(chosen):
        bad = [b for b in chosen if not isinstance(b, (type, nn.Module))]
        raise TypeError(f"blocks must be module classes or modules, got {bad!r}")
    return _outermost(model, lambda m: isinstance(m, classes) or id(m) in instances)


def _outermost(model: nn.Module, is_block: Callable[[nn.Module], bool]) -> list[nn.Module]:
    found: list[nn.Module] = []

    def visit(module: nn.Module) -> None:
        for child in module.children():
            if is_block(child):
                found.append(child)
            else:
                visit(child)

    visit(model)
    return found


def _repeated_children(model: nn.Module) -> list[nn.Module]:
    def is_block_list(m: nn.Module) -> bool:
        if not isinstance(m, (nn.ModuleList, nn.Sequential)):
            return False
        kids = list(m.children())
        return (len(kids) >= 2 and len({type(k) for k in kids}) == 1
                and all(any(True for _ in k.parameters()) for k in kids))

    found: list[nn.Module] = []

    def visit(module: nn.Module) -> None:
        for child in module.children():
            if is_block_list(child):
                found.extend(child.children())
            else:
                visit(child)

    if is_block_list(model):
        return list(model.children())
    visit(model)
    return found
