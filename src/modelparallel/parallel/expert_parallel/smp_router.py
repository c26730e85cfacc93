"""SMP's router (``MoEConfig(smp_moe=True)``): which experts each token goes to, with
what weight, per ``moe_load_balancing``, as Megatron-core (which SMP v2 builds on)
routes; and the router's auxiliary losses.

- ``"none"`` and ``"aux_loss"``: the top-k of the router's logits, weighted by the
  softmax over the ``k`` chosen logits (at least float32).
- ``"sinkhorn"`` (training): the top-k of the Sinkhorn-normalised logits (float32, no
  gradient), weighted by the router's activation at the chosen experts: the softmax
  over every expert (the sigmoid for top-1), not renormalised. In evaluation the top-k
  of that activation.
- ``"balanced"`` (training): each expert receives the same number of this rank's
  (token, k) slots (:func:`balanced_choice`), weighted as ``"none"``; in evaluation
  ``"none"``'s choice.
- ``"aux_loss"`` adds Switch Transformer's load-balancing loss, ``E * coeff / (T * T *
  k) * sum_e P_e * N_e`` (``P_e`` the summed router probability of expert ``e``, ``N_e``
  its (token, k) choices, ``T`` the tokens); a ``z_loss_coeff`` above 0 adds the router
  z-loss, ``coeff * mean_t logsumexp(logits_t)^2``. Their sums are taken over every
  rank of ``group`` (the ranks holding the batch's samples), so every rank computes one
  process's losses over the whole batch. They do not change the returned loss: their
  gradients join the backward where the router's output is used
  (:class:`AddLossGradient`, Megatron's ``MoEAuxLossAutoScaler`` idea).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from modelparallel.parallel.expert_parallel.router_loss import _AllReduceSum

SMP_LOAD_BALANCING = ("none", "aux_loss", "sinkhorn", "balanced")  # built for smp_moe=True
SINKHORN_TOLERANCE = 1e-4  # Megatron's: mean change of the expert scaling per iteration


@dataclass(frozen=True)
class RouterSettings:
    """What ``MoEConfig`` asks of SMP's router."""

    load_balancing: str = "sinkhorn"
    aux_loss_coeff: float = 0.001
    z_loss_coeff: float = 0.001
    global_token_shuffle: bool = False  # over the expert-parallel group (token_shuffle.py)


class AddLossGradient(torch.autograd.Function):
    """Returns ``activations`` unchanged; its backward adds the gradient of ``loss`` (as if
    ``loss`` were added to the training loss) to the backward of whatever computed it."""

    @staticmethod
    def forward(ctx: Any, activations: torch.Tensor, loss: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(loss)
        return activations

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        (loss,) = ctx.saved_tensors
        return grad, torch.ones_like(loss)


def _summed(values: torch.Tensor, group: dist.ProcessGroup | None) -> torch.Tensor:
    """``values`` summed over ``group`` (differentiable; its backward sums too)."""
    if group is None or dist.get_world_size(group) == 1:
        return values
    return _AllReduceSum.apply(values, group)


def _precision(logits: torch.Tensor) -> torch.dtype:
    """At least float32, as Megatron's float32 softmax; float64 stays float64."""
    return torch.promote_types(logits.dtype, torch.float32)


def load_balancing_loss(logits: torch.Tensor, top_k_index: torch.Tensor, coeff: float,
                        group: dist.ProcessGroup | None) -> torch.Tensor:
    """Switch Transformer's load-balancing loss of ``logits`` (tokens, experts) and the
    experts chosen (tokens, k), Megatron's ``E * coeff / (T * T * k) * sum_e P_e * N_e``,
    its sums over every rank of ``group``."""
    experts, top_k = logits.shape[-1], top_k_index.shape[-1]
    probs = torch.softmax(logits, dim=-1, dtype=_precision(logits))
    chosen = torch.zeros(experts, dtype=probs.dtype, device=probs.device).index_add_(
        0, top_k_index.reshape(-1), torch.ones(top_k_index.numel(), dtype=probs.dtype,
                                               device=probs.device))
    tokens = torch.full((1,), float(logits.shape[0]), dtype=probs.dtype, device=probs.device)
    sums = _summed(torch.cat([probs.sum(dim=0), chosen.detach(), tokens]), group)
    probability, chosen, tokens = sums.split([experts, experts, 1])
    return (probability * chosen).sum() * (experts * coeff / (tokens * tokens * top_k)).squeeze()


def z_loss(logits: torch.Tensor, coeff: float, group: dist.ProcessGroup | None) -> torch.Tensor:
    """The router z-loss, ``coeff`` x the mean over every token of ``group``'s ranks of
    ``logsumexp(logits)^2``."""
    squares = torch.logsumexp(logits.to(_precision(logits)), dim=-1).square()
    tokens = torch.full((1,), float(logits.shape[0]), dtype=squares.dtype,
                        device=squares.device)
    total, tokens = _summed(torch.cat([squares.sum().reshape(1), tokens]), group).split(1)
    return (coeff * total / tokens).squeeze()


def sinkhorn(logits: torch.Tensor, tolerance: float = SINKHORN_TOLERANCE) -> torch.Tensor:
    """``exp(logits)`` scaled by a factor per token and one per expert until every token's
    row and every expert's column hold the same mass (the Sinkhorn-Knopp iteration, in
    float32, without gradient): the balanced assignment whose top-k Sinkhorn routing
    takes."""
    with torch.no_grad():
        cost = torch.exp(logits.float())
        tokens, experts = cost.shape
        per_token = torch.ones(tokens, dtype=cost.dtype, device=cost.device)
        per_expert = torch.ones(experts, dtype=cost.dtype, device=cost.device)
        tiny = 1e-8  # keeps an all-zero row or column finite
        change = float("inf")
        while change > tolerance:
            per_token = 1.0 / (tokens * ((cost * per_expert).sum(dim=1) + tiny))
            updated = 1.0 / (experts * ((cost * per_token[:, None]).sum(dim=0) + tiny))
            change = float((updated - per_expert).abs().mean())
            per_expert = updated
        return cost * per_expert * per_token[:, None]


def expert_capacities(tokens: int, top_k: int, experts: int) -> list[int]:
    """The (token, k) slots each expert receives under ``"balanced"``: ``tokens x top_k``
    split evenly, the first experts one more when it does not divide."""
    share, extra = divmod(tokens * top_k, experts)
    return [share + (1 if e < extra else 0) for e in range(experts)]


def balanced_choice(scores: torch.Tensor, top_k: int) -> torch.Tensor:
    """``top_k`` distinct experts per token (tokens, k) such that every expert receives its
    :func:`expert_capacities` of the slots: the (token, expert) pairs taken greedily in
    order of decreasing ``scores`` (router probabilities) while the token needs one and
    the expert has room; a token left short (the only experts with room are its own) gets
    one by an exchange: another token moves from an expert the short one lacks to one
    with room, the exchange that loses the least score. Deterministic (no gradient)."""
    tokens, experts = scores.shape
    room = expert_capacities(tokens, top_k, experts)
    chosen: list[list[int]] = [[] for _ in range(tokens)]
    order = torch.argsort(scores.reshape(-1), descending=True, stable=True).tolist()
    left = tokens * top_k
    for pair in order:
        token, expert = divmod(pair, experts)
        if room[expert] and len(chosen[token]) < top_k:
            chosen[token].append(expert)
            room[expert] -= 1
            left -= 1
            if not left:
                break
    value = scores.tolist()
    for short in (t for t in range(tokens) for _ in range(top_k - len(chosen[t]))):
        free = next(e for e in range(experts) if room[e])  # the short token holds it
        # (other token, expert it gives up) maximising the score after the exchange
        other, given = max(((u, f) for u in range(tokens) if free not in chosen[u]
                            for f in chosen[u] if f not in chosen[short]),
                           key=lambda p: value[p[0]][free] - value[p[0]][p[1]]
                           + value[short][p[1]])
        chosen[other][chosen[other].index(given)] = free
        chosen[short].append(given)
        room[free] -= 1
    return torch.tensor(chosen, dtype=torch.long, device=scores.device).reshape(tokens, top_k)


def route(logits: torch.Tensor, top_k: int, settings: RouterSettings, training: bool,
          group: dist.ProcessGroup | None) -> tuple[torch.Tensor, torch.Tensor]:
    """The experts each token of ``logits`` (tokens, experts) goes to, (tokens, k), and
    their weights, in ``logits``' dtype. In training the auxiliary losses the settings
    ask for join the backward of the weights."""
    if training and settings.z_loss_coeff > 0:
        logits = AddLossGradient.apply(logits, z_loss(logits, settings.z_loss_coeff, group))
    if settings.load_balancing == "sinkhorn":
        activation = (torch.sigmoid(logits) if top_k == 1 else
                      torch.softmax(logits, dim=-1, dtype=_precision(logits)).to(logits.dtype))
        if training:
            index = torch.topk(sinkhorn(logits), top_k, dim=-1).indices
            return torch.gather(activation, 1, index), index
        weights, index = torch.topk(activation, top_k, dim=-1)
        return weights, index
    if training and settings.load_balancing == "balanced":
        with torch.no_grad():
            index = balanced_choice(torch.softmax(logits.float(), dim=-1), top_k)
        chosen = torch.gather(logits, 1, index)
    else:
        chosen, index = torch.topk(logits, top_k, dim=-1)
    weights = torch.softmax(chosen, dim=-1, dtype=_precision(logits)).to(logits.dtype)
    if training and settings.load_balancing == "aux_loss":
        aux = load_balancing_loss(logits, index, settings.aux_loss_coeff, group)
        weights = AddLossGradient.apply(weights, aux)
    return weights, index
