"""Appliers that turn a single-device model into a parallel one (see DESIGN.md)."""

from modelparallel.parallel.activation import set_activation_checkpointing
from modelparallel.parallel.blocks import find_blocks
from modelparallel.parallel.clip import clip_grad_norm_
from modelparallel.parallel.precision import LossScaler
from modelparallel.parallel.replicate import replicate
from modelparallel.parallel.sharding import shard
from modelparallel.parallel.state_dict import full_state_dict, load_full_state_dict
from modelparallel.parallel.tensor import (
    TPPlan,
    loss_parallel,
    set_tensor_parallelism,
    tensor_parallelism,
    tp_register_with_module,
    transform,
)

__all__ = ["LossScaler", "TPPlan", "clip_grad_norm_", "find_blocks", "full_state_dict",
           "load_full_state_dict", "loss_parallel", "replicate", "set_activation_checkpointing",
           "set_tensor_parallelism", "shard", "tensor_parallelism", "tp_register_with_module",
           "transform"]
