"""SMP v1's ``smp.tensor_parallelism(enabled, **options)``: modules created inside are
marked for tensor parallelism. SMP's options configure the kernels of its own
distributed modules (fused softmax, fp32 attention, ...); modelparallel splits the
modules the script builds with DTensor plans and keeps their own computation, so the
options have no effect here, which one line says."""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator
from typing import Any

from modelparallel.parallel.tensor import plans
from modelparallel.smp.state import state

logger = logging.getLogger("modelparallel")

# SMP v1's per-module options of tensor_parallelism() / model_creation()
OPTIONS = ("fused_softmax", "fused_bias_gelu", "attention_in_fp32", "query_key_layer_scaling",
           "fused_dropout", "flash_attention", "fp32_residual_addition",
           "distribute_embedding", "use_alibi", "alibi_bias_max", "zero_init")


def no_effect(where: str, options: dict[str, Any]) -> None:
    """Say once (rank 0) that SMP's kernel options have no effect here; refuse others."""
    unknown = sorted(set(options) - set(OPTIONS))
    if unknown:
        raise TypeError(f"{where} got unknown option(s) {unknown}; SMP's options are "
                        f"{', '.join(OPTIONS)}")
    given = {k: v for k, v in options.items() if v is not None}
    if given and state.rank == 0:
        logger.info("%s(%s) has no effect: modelparallel splits the modules the script "
                    "builds with tensor-parallel plans and keeps their own computation",
                    where, ", ".join(f"{k}={v!r}" for k, v in sorted(given.items())))


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
    """Modules created inside are marked as with ``set_tensor_parallelism`` (SMP's
    kernel options: one line says they have no effect)."""
    options = {k: v for k, v in locals().items() if k in OPTIONS}
    no_effect("smp.tensor_parallelism", options)
    with plans.tensor_parallelism(enabled):
        yield
