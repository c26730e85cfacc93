"""Tensor parallelism: plans per module class, applied with DTensor by
``transform.transform``."""

from torch.distributed.tensor.parallel import loss_parallel

from modelparallel.parallel.tensor.plans import (
    REPLICATED,
    SHARDED,
    TPOptions,
    TPPlan,
    set_tensor_parallelism,
    tensor_parallelism,
    tp_register_with_module,
)
from modelparallel.parallel.tensor.transform import UnsplitModelWarning

__all__ = ["REPLICATED", "SHARDED", "TPOptions", "TPPlan", "UnsplitModelWarning", "loss_parallel",
           "set_tensor_parallelism", "tensor_parallelism", "tp_register_with_module"]
