"""SMP's own mixture-of-experts layer (``MoEConfig(smp_moe=True)``, SMP v2's default).

``tsm.transform`` replaces each sparse MoE block of a Hugging Face model (transformers 5:
a ``gate`` router with a ``(experts, hidden)`` weight and a fused 3-D ``experts`` module
called as ``experts(hidden, top_k_index, top_k_weights)``; Qwen2-MoE's ``shared_expert``
and ``shared_expert_gate`` too) with a :class:`MoELayer` that keeps those modules under
the same names (state dicts and checkpoints stay interchangeable with ``smp_moe=False``,
and expert parallelism finds and splits the experts module as before) and routes with
SMP's router (``smp_router.py``) instead of the block's own.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from modelparallel.errors import ConfigError
from modelparallel.notices import notice
from modelparallel.parallel.expert_parallel import token_shuffle
from modelparallel.parallel.expert_parallel.hugging_face import is_experts_module
from modelparallel.parallel.expert_parallel.smp_router import (
    SMP_LOAD_BALANCING,
    RouterSettings,
    route,
)

# the submodules of a block the layer keeps; a block with others is not replaced
_KEPT = {"gate", "experts", "shared_expert", "shared_expert_gate"}


def _module(block: nn.Module, name: str) -> nn.Module | None:
    """``block``'s submodule ``name`` (None without one)."""
    found = getattr(block, name, None)
    return found if isinstance(found, nn.Module) else None


def is_sparse_block(module: nn.Module) -> bool:
    """Whether ``module`` is a Hugging Face sparse MoE block :class:`MoELayer` replaces:
    a ``gate`` whose only parameter is an (experts, hidden) weight (a linear router:
    biases and score corrections are the model's own routing) and whose ``top_k`` is a
    number, a fused ``experts`` module of the same number of experts, and at most a
    shared expert and its gate besides."""
    gate, experts = getattr(module, "gate", None), getattr(module, "experts", None)
    weight = getattr(gate, "weight", None)
    return (isinstance(gate, nn.Module) and isinstance(experts, nn.Module)
            and is_experts_module(experts) and isinstance(weight, nn.Parameter)
            and weight.dim() == 2 and weight.shape[0] == getattr(experts, "num_experts", None)
            and isinstance(getattr(gate, "top_k", None), int)
            and [name for name, _ in gate.named_parameters()] == ["weight"]  # a linear router
            and {name for name, _ in module.named_children()} <= _KEPT
            and not isinstance(module, MoELayer))


class MoELayer(nn.Module):
    """SMP's MoE layer over a Hugging Face sparse MoE block's own router weight, experts
    and shared expert (the same modules, the same parameter names): the router's logits
    are the block's ``gate``'s, the choice of experts and their weights SMP's
    (``settings``), the auxiliary losses' sums taken over ``group`` (every rank holding
    the batch's samples; this rank's alone when None). With
    ``settings.global_token_shuffle`` the tokens are shuffled over ``shuffle_group`` (the
    expert-parallel group) in training before they are routed (``token_shuffle.py``).
    Built by ``tsm.transform(model, config=MoEConfig(smp_moe=True))``
    (:func:`replace_sparse_blocks`)."""

    def __init__(self, block: nn.Module, settings: RouterSettings | None = None,
                 group: dist.ProcessGroup | None = None,
                 shuffle_group: dist.ProcessGroup | None = None) -> None:
        if not isinstance(block, nn.Module) or not is_sparse_block(block):
            raise TypeError(
                f"MoELayer is built from a Hugging Face sparse MoE block (a gate router and a "
                f"fused 3-D experts module, as Mixtral's, Qwen2-MoE's and Qwen3-MoE's in "
                f"transformers 5), not from {type(block).__name__}: call tsm.transform(model, "
                f"config=MoEConfig(smp_moe=True, ...)), which replaces every such block")
        super().__init__()
        for name, child in block.named_children():  # the block's order: the same state dict
            self.add_module(name, child)
        self.gate = block.get_submodule("gate")  # is_sparse_block checked both
        self.experts = block.get_submodule("experts")
        # Qwen2-MoE's: an expert every token goes through, weighted by a sigmoid gate
        self.shared_expert: nn.Module | None = _module(block, "shared_expert")
        self.shared_expert_gate: nn.Module | None = _module(block, "shared_expert_gate")
        self.top_k = int(getattr(self.gate, "top_k"))  # noqa: B009 (mypy types it a tensor)
        self.num_experts = int(getattr(self.gate, "weight").shape[0])  # noqa: B009
        # Mixtral's router jitter: a noise multiplying the hidden states in training
        self.jitter_noise = float(getattr(block, "jitter_noise", 0.0) or 0.0)
        self.settings = settings or RouterSettings()
        self.group = group
        self.shuffle_group = shuffle_group if self.settings.global_token_shuffle else None
        self.replaced = type(block).__name__

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        """The block's output for ``hidden_states`` (batch, sequence, hidden)."""
        shape = hidden_states.shape
        if self.training and self.jitter_noise > 0:  # drawn as the model draws it
            noise = torch.empty_like(hidden_states).uniform_(1.0 - self.jitter_noise,
                                                              1.0 + self.jitter_noise)
            hidden_states = hidden_states * noise
        flat = hidden_states.reshape(-1, shape[-1])
        if self.training and self.shuffle_group is not None:
            shuffle = token_shuffle.plan(flat.shape[0], self.shuffle_group, flat.device)
            return shuffle.unshuffle(self._mix(shuffle.shuffle(flat))).reshape(shape)
        return self._mix(flat).reshape(shape)

    def _mix(self, flat: torch.Tensor) -> torch.Tensor:
        """The block's output for the tokens ``flat`` (tokens, hidden), routed together."""
        # the model's own router module: its logits are what output_router_logits records
        logits = self.gate(flat)[0]
        if not (isinstance(logits, torch.Tensor) and logits.is_floating_point()
                and logits.shape == (flat.shape[0], self.num_experts)):
            raise TypeError(
                f"{type(self.gate).__name__} does not return the router's logits (tokens, "
                f"experts) first, as Mixtral's and Qwen's routers do; SMP's MoE layer "
                f"(smp_moe=True) is not built for this model: pass MoEConfig(smp_moe=False)")
        weights, index = route(logits, self.top_k, self.settings, self.training, self.group)
        out = self.experts(flat, index, weights)
        if self.shared_expert is not None:
            shared = self.shared_expert(flat)
            if self.shared_expert_gate is not None:
                shared = torch.sigmoid(self.shared_expert_gate(flat)) * shared
            out = out + shared
        return out

    def extra_repr(self) -> str:
        return (f"top_k={self.top_k}, load_balancing={self.settings.load_balancing!r}, "
                f"replaces {self.replaced}")


def replace_sparse_blocks(model: nn.Module, settings: RouterSettings,
                          group: dist.ProcessGroup | None = None,
                          shuffle_group: dist.ProcessGroup | None = None) -> nn.Module:
    """Replace every Hugging Face sparse MoE block of ``model`` with a :class:`MoELayer`
    (in place: ``model`` is returned, or the layer when ``model`` is one block), its
    auxiliary sums over ``group``, its tokens shuffled over ``shuffle_group``. Raises
    ConfigError when there is none."""
    found = [(name, m) for name, m in model.named_modules() if is_sparse_block(m)]
    if not found and not any(isinstance(m, MoELayer) for m in model.modules()):
        raise ConfigError([("smp_moe", (
            f"True, but {type(model).__name__} has no sparse MoE block SMP's MoE layer "
            f"replaces (a gate router and a fused 3-D experts module, as Hugging Face's "
            f"Mixtral, Qwen2-MoE and Qwen3-MoE in transformers 5); pass a mixture-of-experts "
            f"model, or no MoEConfig"))])
    for name, block in found:
        if not name:  # the model is one block
            return MoELayer(block, settings, group, shuffle_group)
        parent, _, attribute = name.rpartition(".")
        setattr(model.get_submodule(parent), attribute,
                MoELayer(block, settings, group, shuffle_group))
    return model


def install(model: nn.Module, settings: RouterSettings, group: dist.ProcessGroup | None,
            shuffle_group: dist.ProcessGroup | None = None) -> nn.Module:
    """``MoEConfig(smp_moe=True)``: SMP's MoE layer in place of every sparse MoE block of
    ``model``, its auxiliary losses' sums over ``group`` (the ranks holding different
    samples), its tokens shuffled over ``shuffle_group`` (the expert-parallel group) when
    the settings ask. ValueError for a ``moe_load_balancing`` SMP does not know."""
    if settings.load_balancing not in SMP_LOAD_BALANCING:
        raise ValueError(f"moe_load_balancing={settings.load_balancing!r}; SMP's MoE layer "
                         f"accepts {', '.join(map(repr, SMP_LOAD_BALANCING))}")
    if settings.global_token_shuffle and shuffle_group is None:
        notice("MoEConfig(global_token_shuffle=True) has no effect at "
               "expert_parallel_degree 1: the tokens are shuffled across the ranks of an "
               "expert-parallel group, and each rank routes its own")
    return replace_sparse_blocks(model, settings, group, shuffle_group)
