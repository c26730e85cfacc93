"""SMP v1's ``smp.tensor_parallelism(enabled, **options)`` and
``smp.set_tensor_parallelism(module, enabled, **options)``: modules are marked for tensor
parallelism. SMP's options are arguments of its distributed modules: they reach the
``smp.nn`` modules that replace marked ones (``tp_register``: Hugging Face GPT-2, and
classes registered with ``tp_register_with_module(cls, dist_module)``), which apply or
refuse each or say it has no effect. Modules split in place by a tensor-parallel plan
keep their own computation; one line says the options have no effect on them."""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator
from typing import Any

from torch import nn

from modelparallel.module_state import lookup, state_of
from modelparallel.parallel.tensor import plans
from modelparallel.smp.state import state
from modelparallel.smp.v1 import tp_register

logger = logging.getLogger("modelparallel")

# SMP v1's per-module options of tensor_parallelism() / model_creation()
OPTIONS = ("fused_softmax", "fused_bias_gelu", "attention_in_fp32", "query_key_layer_scaling",
           "fused_dropout", "flash_attention", "fp32_residual_addition",
           "distribute_embedding", "use_alibi", "alibi_bias_max", "zero_init")


def given(where: str, options: dict[str, Any]) -> dict[str, Any]:
    """The options set (not None); unknown ones are refused."""
    unknown = sorted(set(options) - set(OPTIONS))
    if unknown:
        raise TypeError(f"{where} got unknown option(s) {unknown}; SMP's options are "
                        f"{', '.join(OPTIONS)}")
    return {k: v for k, v in options.items() if v is not None}


def no_effect(where: str, options: dict[str, Any]) -> None:
    """Say once (rank 0) that SMP's module options have no effect where no module is
    marked for tensor parallelism (``model_creation(tensor_parallelism=False)``)."""
    set_options = given(where, options)
    if set_options and state.rank == 0:
        logger.warning("%s(%s) has no effect: the options are arguments of the smp.nn modules "
                    "that replace modules marked for tensor parallelism, and none are marked "
                    "here", where, _listed(set_options))


def in_place(modules: list[nn.Module]) -> None:
    """Say once (rank 0) that options given to modules split in place have no effect."""
    options: dict[str, Any] = {}
    for module in modules:
        options.update(lookup(module, "tp_options", {}))
    if options and state.rank == 0:
        names = sorted({type(m).__name__ for m in modules})
        logger.warning("smp.tensor_parallelism(%s) has no effect on %s: split in place by a "
                    "tensor-parallel plan, they keep their own computation (SMP's options "
                    "apply to the smp.nn modules that replace GPT-2 or registered classes)",
                    _listed(options), ", ".join(names))


def _listed(options: dict[str, Any]) -> str:
    return ", ".join(f"{k}={v!r}" for k, v in sorted(options.items()))


@contextlib.contextmanager
def tensor_parallelism(enabled: bool = True, fused_softmax: bool | None = None,
                       fused_bias_gelu: bool | None = None,
                       attention_in_fp32: bool | None = None,
                       query_key_layer_scaling: bool | None = None,
                       fused_dropout: bool | None = None, flash_attention: bool | None = None,
                       fp32_residual_addition: bool | None = None,
                       distribute_embedding: bool | None = None,
                       use_alibi: bool | None = None, alibi_bias_max: int | None = None,
                       zero_init: bool | None = None) -> Iterator[None]:
    """Modules created inside are marked as with ``set_tensor_parallelism``; the options
    go to the modules that replace them (module docstring)."""
    options = given("smp.tensor_parallelism", {k: v for k, v in locals().items()
                                               if k in OPTIONS})
    with plans.tensor_parallelism(enabled), tp_register.creating_with(options):
        yield


def set_tensor_parallelism(module: nn.Module, enabled: bool = True, **options: Any) -> None:
    """Mark ``module`` (and what it contains) as split (``True``) or kept whole
    (``False``), as the core's ``set_tensor_parallelism``; SMP's options go to the
    module that replaces it (module docstring)."""
    set_options = given("smp.set_tensor_parallelism", options)
    plans.set_tensor_parallelism(module, enabled)
    if set_options:
        state_of(module).tp_options = set_options
