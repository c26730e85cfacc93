"""Tensor parallelism: plans per module class, applied with DTensor (see transform())."""

from torch.distributed.tensor.parallel import loss_parallel

from modelparallel.parallel.tensor import architectures  # noqa: F401  (registers built-in plans)
from modelparallel.parallel.tensor.plans import (
    REPLICATED,
    SHARDED,
    TPOptions,
    TPPlan,
    set_tensor_parallelism,
    tensor_parallelism,
    tp_register_with_module,
)
from modelparallel.parallel.tensor.transform import UnsplitModelWarning, transform

__all__ = ["REPLICATED", "SHARDED", "TPOptions", "TPPlan", "UnsplitModelWarning", "loss_parallel",
           "set_tensor_parallelism", "tensor_parallelism", "tp_register_with_module", "transform"]
