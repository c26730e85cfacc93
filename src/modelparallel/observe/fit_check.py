"""Will the layout fit? The check the appliers (``mp.transform``, ``mp.shard``,
``DistributedModel``) run on rank 0 before the first step.

What a rank will hold whatever its batch: its parameters as laid out, a gradient of
each, and AdamW's two moments (the planner's default optimizer) — four times the
parameter bytes. When that alone exceeds the memory the rank can see (its GPU's, or on
CPU this machine's divided among its local ranks), rank 0 warns before any step runs
and points to ``modelparallel plan``, which predicts the whole peak with activations.
"""

from __future__ import annotations

import logging
import os

import torch
from torch import nn

from modelparallel.parallel.placement import is_meta

logger = logging.getLogger("modelparallel")
STATE_COPIES = 4  # parameters, gradients, AdamW's exp_avg and exp_avg_sq


def local_parameter_bytes(model: nn.Module) -> int:
    """Bytes of the parameters this rank holds (a DTensor's local shard; meta: none)."""
    total = 0
    for p in model.parameters():
        local = getattr(p, "_local_tensor", p)
        if not is_meta(local):
            total += local.numel() * local.element_size()
    return total


def visible_memory(device: torch.device) -> int:
    """What one rank on ``device`` can use: its GPU's total, or its share of this
    machine's memory among the ranks of this node (``LOCAL_WORLD_SIZE``)."""
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[1]
    physical = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    return physical // max(1, int(os.environ.get("LOCAL_WORLD_SIZE", "1")))


def warn_if_state_cannot_fit(model: nn.Module, rank: int, device: torch.device,
                             where: str) -> bool:
    """Warn (rank 0) when the rank's training state alone exceeds its memory; True if so."""
    if rank != 0:
        return False
    params = local_parameter_bytes(model)
    need, have = STATE_COPIES * params, visible_memory(device)
    if need <= have:
        return False
    logger.warning(
        "modelparallel: %s: this layout will not fit on rank 0: its parameters (%.2f GiB), "
        "their gradients and AdamW's two moments need %.2f GiB before any activation, and "
        "the rank sees %.2f GiB on %s. Shard more (hybrid_shard_degree), split the model "
        "(tensor_parallel_degree, pipeline_parallel_degree), or use more devices; "
        "`modelparallel plan` predicts the whole peak of each layout before launch.",
        where, params / 2**30, need / 2**30, have / 2**30, device)
    return True
