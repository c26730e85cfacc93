"""``torch.sagemaker.moe``: SMP v2's ``MoEConfig``, which ``tsm.transform(model,
config=MoEConfig(...))`` reads to route a Hugging Face mixture-of-experts model with SMP's
own MoE layer (``smp_moe=True``, ``MoELayer``) or the model's own router
(``smp_moe=False``), and to split its experts over ``expert_parallel_degree`` ranks
(docs/expert-parallel.md)."""

from __future__ import annotations

from dataclasses import dataclass

from modelparallel.parallel.expert_parallel.smp_layer import MoELayer
from modelparallel.parallel.expert_parallel.smp_router import RouterSettings

__all__ = ["MoEConfig", "MoELayer"]


@dataclass
class MoEConfig:
    """SMP v2's ``MoEConfig`` fields. Built, with the all-to-all dispatcher:

    - ``smp_moe=True`` (SMP's default): each sparse MoE block becomes SMP's
      :class:`MoELayer` (the block's own router weight and experts), routing per
      ``moe_load_balancing`` ``"none"``, ``"aux_loss"`` (Switch's load-balancing loss,
      weighted by ``moe_aux_loss_coeff``, over the whole batch), ``"sinkhorn"`` (each
      rank's own tokens) or ``"balanced"`` (each expert the same number of each rank's
      token slots); ``moe_z_loss_coeff`` > 0 adds the router z-loss (whole batch);
      ``global_token_shuffle=True`` permutes the expert-parallel group's tokens across
      its ranks before routing (each rank routes an even share of the permuted tokens).
    - ``smp_moe=False``: the model's own router and experts, ``moe_load_balancing``
      ``"none"`` (the model as configured) or ``"aux_loss"`` (the model's own
      load-balancing loss turned on, weighted by ``moe_aux_loss_coeff``).

    ``moe_all_to_all_dispatcher=False`` and, with ``smp_moe=False``,
    ``global_token_shuffle``, ``"sinkhorn"`` and ``"balanced"`` are refused as not built
    yet.
    ``random_seed``, ``use_cpu_initialization``, ``moe_z_loss_coeff`` with
    ``smp_moe=False`` and ``moe_aux_loss_coeff`` with ``"sinkhorn"`` have no effect, one
    notice each when set; ``moe_aux_loss_coeff`` none with ``"none"`` and ``"balanced"``
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
        if self.global_token_shuffle and not self.smp_moe:
            return ("MoEConfig(global_token_shuffle=True) shuffles the tokens SMP's MoE "
                    "layer routes; with smp_moe=False (the model's own router) it is not "
                    "built: pass smp_moe=True, or global_token_shuffle=False")
        if not self.moe_all_to_all_dispatcher:
            return ("MoEConfig(moe_all_to_all_dispatcher=False) is not built yet; pass "
                    "moe_all_to_all_dispatcher=True (tokens travel to their experts by "
                    "all-to-all)")
        return None

    def router_settings(self) -> RouterSettings:
        """What SMP's router (``smp_moe=True``) is asked to do."""
        return RouterSettings(self.moe_load_balancing, self.moe_aux_loss_coeff,
                              self.moe_z_loss_coeff, self.global_token_shuffle)

    def ignored(self) -> list[str]:
        """What a built configuration asks for that has no effect (one notice each)."""
        notices = []
        if not self.smp_moe and self.moe_load_balancing == "aux_loss" and self.moe_z_loss_coeff:
            notices.append(
                f"MoEConfig(moe_z_loss_coeff={self.moe_z_loss_coeff}) has no effect: the "
                f"model's own router (smp_moe=False) has no z-loss (Hugging Face's "
                f"Mixtral and Qwen MoE models add none; SMP's is its own MoE layer's)")
        if self.smp_moe and self.moe_load_balancing == "sinkhorn" and self.moe_aux_loss_coeff:
            notices.append(
                f"MoEConfig(moe_aux_loss_coeff={self.moe_aux_loss_coeff}) has no effect with "
                f"moe_load_balancing='sinkhorn': Sinkhorn routing balances the experts "
                f"itself and adds no load-balancing loss (as Megatron-core's)")
        router = ("SMP's MoE layer (smp_moe=True) keeps the model's own router and experts"
                  if self.smp_moe else "the model's own router and experts (smp_moe=False)")
        if self.random_seed != MoEConfig.random_seed:
            notices.append(
                f"MoEConfig(random_seed={self.random_seed}) has no effect: {router} "
                f"draw from torch's generator (seed it with torch.manual_seed)"
                if not self.smp_moe else
                f"MoEConfig(random_seed={self.random_seed}) has no effect: {router}, "
                f"initialised where the script builds the model, and draws its router "
                f"jitter from torch's generator (seed it with torch.manual_seed)")
        if self.use_cpu_initialization:
            notices.append(
                "MoEConfig(use_cpu_initialization=True) has no effect: with smp_moe=False the "
                "experts are the model's own, built where the script builds the model"
                if not self.smp_moe else
                "MoEConfig(use_cpu_initialization=True) has no effect: SMP's MoE layer "
                "(smp_moe=True) keeps the model's own experts, built where the script builds "
                "the model")
        return notices
