"""``torch.sagemaker.distributed.fsdp.fully_sharded_data_parallel``: SMP v2's FSDP hooks."""

from __future__ import annotations

from typing import Any

from modelparallel.notices import notice


def register_tp_processing_pre_comm_hook(*args: Any, **kwargs: Any) -> None:
    """No effect here: FSDP over a ``tsm.transform`` model already reduces the
    tensor-parallel parameters' gradients over the right ranks (says so once)."""
    notice("register_tp_processing_pre_comm_hook has no effect: modelparallel's FSDP "
           "integration reduces tensor-parallel gradients itself")
