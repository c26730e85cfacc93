"""A Hugging Face MoE model's load-balancing loss over the whole batch, not one rank's.

Mixtral, Qwen2-MoE, Qwen3-MoE and OLMoE (transformers 5) add, when
``output_router_logits`` is on, ``router_aux_loss_coef`` times Switch Transformer's
auxiliary loss: ``E * sum_e f_e * P_e``, with ``f_e`` the share of the (token, k)
choices routed to expert ``e`` and ``P_e`` the mean router probability of ``e``, both
over every token of every layer (tokens the attention mask hides left out). Each rank
of a data-parallel run computes it from its own tokens; the loss is not linear in the
tokens, so the mean of the ranks' losses is not one process's. Here the three sums
it is made of (choices per expert, router probability per expert, tokens) are
all-reduced over the ranks holding the batch's tokens, so every rank computes one
process's loss. The all-reduce's backward is a sum: the gradient of a rank's router
probabilities collects every rank's (equal) loss, and the data-parallel average of the
gradients divides by their number again, as one process's gradient is.

The model's own function (a module global each modeling file calls by name) is left
as it is: :func:`install` turns the model's own loss off for each call (its
``output_router_logits`` argument) and adds this one, recording the routers' logits
with forward hooks on the router modules the model names in ``_can_record_outputs``.
``tests/distributed/test_moe_routing.py`` checks that it computes the modeling files'
function exactly on one process (so a change in transformers fails there).
"""

from __future__ import annotations

import inspect
from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from modelparallel.module_state import lookup, state_of

# the attributes of a model that adds the loss (MixtralForCausalLM and its kin)
_MODEL_ATTRIBUTES = ("num_experts", "num_experts_per_tok", "router_aux_loss_coef")


class _AllReduceSum(torch.autograd.Function):
    """Sum over ``group``; the backward sums the gradients over it (every rank's loss
    depends on every rank's input)."""

    @staticmethod
    def forward(ctx: Any, values: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
        ctx.group = group
        out = values.clone()
        dist.all_reduce(out, group=group)
        return out

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        # summed in float64: the ranks' gradients are equal (every rank's loss holds the
        # same sums), and adding 8 equal float32 values rounds (the routers' weights
        # were 2.5e-7 of their change off one process at 8 ranks); n x g is exact
        out = grad.double()
        dist.all_reduce(out, group=ctx.group)
        return out.to(grad.dtype), None


def load_balancing_loss(router_logits: Sequence[torch.Tensor], num_experts: int, top_k: int,
                        attention_mask: torch.Tensor | None = None,
                        group: dist.ProcessGroup | None = None) -> torch.Tensor:
    """Switch Transformer's auxiliary loss of the routers' ``router_logits`` (one
    (tokens, experts) tensor per layer), as transformers' ``load_balancing_loss_func``
    computes it (float32 sums), over the tokens of every rank of ``group`` (this rank's
    alone when None). ``attention_mask`` (batch, sequence) leaves padding out."""
    device = router_logits[0].device
    mask = (torch.ones(router_logits[0].shape[0], device=device) if attention_mask is None
            else attention_mask.reshape(-1).to(device=device, dtype=torch.float32))
    chosen = torch.zeros(num_experts, dtype=torch.float32, device=device)
    probability = torch.zeros(num_experts, dtype=torch.float32, device=device)
    for logits in router_logits:
        probs = torch.softmax(logits.to(device), dim=-1)
        _, experts = torch.topk(probs, top_k, dim=-1)
        chosen = chosen + torch.zeros_like(chosen).scatter_add_(
            0, experts.reshape(-1), mask.repeat_interleave(top_k))
        probability = probability + (probs.float() * mask[:, None]).sum(dim=0)
    tokens = mask.sum().reshape(1) * len(router_logits)
    sums = torch.cat([chosen, probability, tokens])
    if group is not None and dist.get_world_size(group) > 1:
        sums = _AllReduceSum.apply(sums, group)
    chosen, probability, tokens = sums.split([num_experts, num_experts, 1])
    return torch.sum((chosen / tokens) * (probability / tokens)) * num_experts


def router_classes(model: nn.Module) -> tuple[type[nn.Module], int] | None:
    """The router module class whose output ``index`` is a layer's router logits, as
    ``model``'s class declares for recording them (None for a model without a
    load-balancing loss of this form)."""
    # transformers' private declaration (allow-listed in tests/unit/test_private_names.py):
    # the only place a model names its router modules
    recorders = getattr(type(model), "_can_record_outputs", None) or {}
    recorder = recorders.get("router_logits") if isinstance(recorders, dict) else None
    target = getattr(recorder, "target_class", None)
    if not isinstance(target, type) or not all(hasattr(model, a) for a in _MODEL_ATTRIBUTES):
        return None
    if "output_router_logits" not in inspect.signature(model.forward).parameters:
        return None
    return target, int(getattr(recorder, "index", 0))


def has_router_loss(model: nn.Module) -> bool:
    """Whether ``model`` can add a load-balancing loss :func:`install` knows."""
    return router_classes(model) is not None


class GlobalRouterLoss:
    """The hooks that compute one model's load-balancing loss over ``group``."""

    def __init__(self, model: nn.Module, group: dist.ProcessGroup, index: int) -> None:
        self.model = model
        self.group = group
        self.index = index
        self.signature = inspect.signature(model.forward)
        # calls in flight: (logits recorded, attention mask, labels given, asked for)
        self._calls: list[tuple[list[torch.Tensor], Any, bool, bool]] = []

    def record(self, module: nn.Module, args: tuple, output: Any) -> None:
        # a recomputation (activation checkpointing) runs outside the model's call
        if self._calls and self._calls[-1][3]:
            self._calls[-1][0].append(output[self.index])

    def before(self, module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        bound = self.signature.bind(*args, **kwargs)
        asked = bound.arguments.get("output_router_logits")
        if asked is None:
            asked = bool(getattr(self.model.config, "output_router_logits", False))
        if asked and kwargs.get("return_dict") is False:
            raise NotImplementedError(
                "return_dict=False with the load-balancing loss over data-parallel ranks is "
                "not built yet; call the model with return_dict=True (the default)")
        labels = bound.arguments.get("labels") is not None
        self._calls.append(([], bound.arguments.get("attention_mask"), labels, asked))
        bound.arguments["output_router_logits"] = False  # the model's own: this rank's only
        return bound.args, bound.kwargs

    def after(self, module: nn.Module, args: tuple, output: Any) -> Any:
        logits, mask, labels, asked = self._calls.pop()
        if not asked:
            return output
        # plain attributes of the model (router_classes checked them); getattr for mypy
        experts, top_k, coefficient = (getattr(self.model, a) for a in _MODEL_ATTRIBUTES)
        aux = load_balancing_loss(logits, experts, top_k, mask, self.group)
        output.aux_loss = aux
        output.router_logits = tuple(logits)
        if labels and output.loss is not None:
            output.loss = output.loss + coefficient * aux.to(output.loss.device)
        return output


def install(model: nn.Module, group: dist.ProcessGroup) -> bool:
    """Compute ``model``'s load-balancing loss (when a call asks for it) over the tokens
    of every rank of ``group``; False (nothing done) for a model without one, or with
    ``group`` of one rank. Idempotent."""
    found = router_classes(model)
    if found is None or dist.get_world_size(group) == 1:
        return False
    if lookup(model, "router_loss") is not None:
        return True
    router_class, index = found
    hooks = GlobalRouterLoss(model, group, index)
    for module in model.modules():
        if isinstance(module, router_class):
            module.register_forward_hook(hooks.record)
    model.register_forward_pre_hook(hooks.before, with_kwargs=True)
    model.register_forward_hook(hooks.after)
    state_of(model).router_loss = hooks
    return True
