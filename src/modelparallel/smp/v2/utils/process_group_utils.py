"""``torch.sagemaker.utils.process_group_utils``."""

from __future__ import annotations

import torch.distributed as dist


def get_global_ranks(process_group: dist.ProcessGroup | None = None) -> list[int]:
    """The global ranks of ``process_group`` (default: the whole job), in group order."""
    if process_group is None:
        return list(range(dist.get_world_size()))
    return dist.get_process_group_ranks(process_group)
