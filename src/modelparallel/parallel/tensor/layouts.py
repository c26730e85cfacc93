"""Megatron's layouts as DTensor styles, the building blocks of tensor-parallel plans.

Attention splits by heads (q/k/v column-parallel, the output projection row-parallel),
MLPs column-then-row, embeddings vocabulary-parallel, the LM head column-parallel.
"""

from __future__ import annotations

from torch.distributed.tensor import Placement, Replicate, Shard
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    PrepareModuleInput,
    RowwiseParallel,
)

from modelparallel.parallel.tensor.plans import TPOptions


def vocab_embedding(o: TPOptions) -> RowwiseParallel:
    """Embedding rows (the vocabulary) split over ranks; the output is summed."""
    return RowwiseParallel(input_layouts=Replicate(),
                           output_layouts=Shard(1) if o.sequence_parallel else Replicate(),
                           use_local_output=not o.sequence_parallel)


def lm_head(o: TPOptions) -> ColwiseParallel:
    """Column-parallel LM head; with ``loss_parallel`` its logits stay vocabulary-sharded."""
    return ColwiseParallel(input_layouts=Shard(1) if o.sequence_parallel else Replicate(),
                           output_layouts=Shard(-1) if o.loss_parallel else Replicate(),
                           use_local_output=not o.loss_parallel)


def shared_input(**kwarg_names: None) -> PrepareModuleInput:
    """One DTensor input for layers that read the same activation (q, k and v): their
    input gradients add up first and are all-reduced once, not once per layer."""
    if kwarg_names:  # the module is called with keyword arguments (Hugging Face)
        layouts: dict[str, Placement] = {name: Replicate() for name in kwarg_names}
        return PrepareModuleInput(input_kwarg_layouts=layouts, desired_input_kwarg_layouts=layouts)
    return PrepareModuleInput(input_layouts=(Replicate(),), desired_input_layouts=(Replicate(),))
