"""``torch.sagemaker.moe``: expert parallelism is not built, so its configuration
object exists (scripts build it before deciding) but every use of it is refused."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from torch import nn

NOT_SUPPORTED = ("expert parallelism (mixture-of-experts layers split over ranks) is not "
                 "supported yet by modelparallel; leave expert_parallel_degree at 1 and do "
                 "not pass a MoEConfig to transform()")


@dataclass
class MoEConfig:
    """SMP v2's ``MoEConfig`` fields; ``transform(model, config=MoEConfig(...))`` raises
    NotImplementedError (expert parallelism is not built)."""

    smp_moe: bool = True
    random_seed: int = 12345
    moe_load_balancing: str = "sinkhorn"
    global_token_shuffle: bool = False
    moe_all_to_all_dispatcher: bool = True
    moe_aux_loss_coeff: float = 0.001
    moe_z_loss_coeff: float = 0.001
    use_cpu_initialization: bool = False


class MoELayer(nn.Module):
    """SMP v2's expert layer class (scripts test ``isinstance`` against it); building
    one raises NotImplementedError."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        raise NotImplementedError(NOT_SUPPORTED)
