"""``torch.sagemaker.moe``: SMP v2's ``MoEConfig``, which ``tsm.transform(model,
config=MoEConfig(...))`` reads to split a Hugging Face mixture-of-experts model's experts
over ``expert_parallel_degree`` ranks (docs/expert-parallel.md). SMP's own MoE layer
(``smp_moe=True``, ``MoELayer``) is not built."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from torch import nn

SMP_MOE_NOT_BUILT = ("SMP's own mixture-of-experts implementation (smp_moe=True, MoELayer) is "
                     "not built yet; pass MoEConfig(smp_moe=False, ...) to keep the model's "
                     "own router and experts and split the experts over ranks")


@dataclass
class MoEConfig:
    """SMP v2's ``MoEConfig`` fields. Built: ``smp_moe=False`` (the model's own router and
    experts, split over ``expert_parallel_degree`` ranks) with the all-to-all dispatcher
    and ``moe_load_balancing`` ``"none"`` (the model as configured) or ``"aux_loss"`` (the
    model's own load-balancing loss turned on, weighted by ``moe_aux_loss_coeff``); the
    other choices are refused as not built yet. ``random_seed``,
    ``use_cpu_initialization`` and ``moe_z_loss_coeff`` (with ``"aux_loss"``) have no
    effect, one notice each when set; ``moe_aux_loss_coeff`` none with ``"none"``
    (docs/expert-parallel.md)."""

    smp_moe: bool = True
    random_seed: int = 12345
    moe_load_balancing: str = "sinkhorn"
    global_token_shuffle: bool = False
    moe_all_to_all_dispatcher: bool = True
    moe_aux_loss_coeff: float = 0.001
    moe_z_loss_coeff: float = 0.001
    use_cpu_initialization: bool = False

    def refusal(self) -> str | None:
        """Why this configuration cannot be built yet (None when it can)."""
        if self.smp_moe:
            return SMP_MOE_NOT_BUILT
        if self.global_token_shuffle:
            return ("MoEConfig(global_token_shuffle=True) is not built yet; pass "
                    "global_token_shuffle=False (each rank routes its own tokens)")
        if not self.moe_all_to_all_dispatcher:
            return ("MoEConfig(moe_all_to_all_dispatcher=False) is not built yet; pass "
                    "moe_all_to_all_dispatcher=True (tokens travel to their experts by "
                    "all-to-all)")
        return None

    def ignored(self) -> list[str]:
        """What a built configuration asks for that has no effect (one notice each)."""
        notices = []
        if self.moe_load_balancing == "aux_loss" and self.moe_z_loss_coeff:
            notices.append(
                f"MoEConfig(moe_z_loss_coeff={self.moe_z_loss_coeff}) has no effect: the "
                f"model's own router (smp_moe=False) has no z-loss (Hugging Face's "
                f"Mixtral and Qwen MoE models add none; SMP's is its own MoE layer's)")
        if self.random_seed != MoEConfig.random_seed:
            notices.append(
                f"MoEConfig(random_seed={self.random_seed}) has no effect: the model's own "
                f"router and experts (smp_moe=False) draw from torch's generator (seed it "
                f"with torch.manual_seed)")
        if self.use_cpu_initialization:
            notices.append(
                "MoEConfig(use_cpu_initialization=True) has no effect: with smp_moe=False "
                "the experts are the model's own, built where the script builds the model")
        return notices


class MoELayer(nn.Module):
    """SMP v2's expert layer class (scripts test ``isinstance`` against it); building
    one raises NotImplementedError."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        raise NotImplementedError(SMP_MOE_NOT_BUILT)
