"""Expert parallelism for Hugging Face mixture-of-experts models (transformers 5: Mixtral,
Qwen2-MoE, Qwen3-MoE, and any model whose experts module has the same form).

Such a model keeps each layer's experts in one module with fused 3-D weights,
``gate_up_proj`` (experts, 2 x intermediate, hidden) and ``down_proj`` (experts, hidden,
intermediate), called as ``experts(hidden, top_k_index, top_k_weights)`` after the
layer's router chose ``top_k`` experts per token. Here each rank keeps its range of the
experts, as a DTensor of the whole weight sharded along the experts dim over the
expert-parallel ranks (so that state dicts and checkpoints hold every expert at its
global index, whatever the layout), the module reads its local part in forward, and
it is called on what the ranks sent it: hooks around its forward dispatch the tokens before
it and combine its results after it (``dispatch.py``), so the module's own computation
(and the ``experts_implementation`` the model chose) runs on this rank's experts. The
router, a shared expert and everything else are the model's own, unchanged.
"""

from __future__ import annotations

import inspect

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor

from modelparallel.errors import ConfigError
from modelparallel.module_state import lookup, state_of
from modelparallel.parallel.expert_parallel import dispatch
from modelparallel.parallel.expert_parallel.ownership import ExpertRange, local_experts

EXPERT_WEIGHTS = ("gate_up_proj", "down_proj")
_ROUTED_NAMES = (("top_k_index", "top_k_weights"), ("router_indices", "routing_weights"))


def is_experts_module(module: nn.Module) -> bool:
    """Whether ``module`` holds a layer's experts as fused 3-D weights (one per expert
    along the first dim), as transformers 5's MoE models do."""
    total = expert_count(module)
    weights = [getattr(module, n, None) for n in EXPERT_WEIGHTS]
    return total is not None and all(
        isinstance(w, nn.Parameter) and w.dim() == 3 and w.shape[0] == total
        for w in weights)


def expert_tensors(module: nn.Module) -> list[str]:
    """The names of ``module``'s parameters that hold one slice per expert along their
    first dim: the fused weights, and per-expert biases where the model has them
    (GPT-OSS's ``gate_up_proj_bias`` and ``down_proj_bias``)."""
    total = expert_count(module)
    return [name for name, p in module.named_parameters(recurse=False)
            if name in EXPERT_WEIGHTS or (p.dim() >= 1 and p.shape[0] == total)]


def routed_arguments(module: nn.Module) -> tuple[str, ...] | None:
    """The names of ``module``'s forward arguments when it is called with the router's
    choices, ``(hidden_states, top_k_index, top_k_weights)`` (GPT-OSS names them
    ``router_indices, routing_weights``), what the dispatch hooks send it; None for
    experts called otherwise (Llama 4's take every token for every expert)."""
    names = tuple(inspect.signature(module.forward).parameters)[:3]
    return names if len(names) == 3 and names[1:] in _ROUTED_NAMES else None


def expert_count(module: nn.Module) -> int | None:
    """``module.num_experts`` when it is a number (None otherwise)."""
    total = getattr(module, "num_experts", None)
    return total if isinstance(total, int) else None


def find_experts(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """Every experts module of ``model`` (name, module), outermost first."""
    return [(name, m) for name, m in model.named_modules() if is_experts_module(m)]


class ExpertParallelExperts:
    """One experts module's share of expert parallelism: the experts this rank holds and
    the hooks that send tokens to their experts and bring the results back."""

    def __init__(self, experts: ExpertRange, group: dist.ProcessGroup,
                 tensors: list[str], arguments: tuple[str, ...]) -> None:
        self.experts = experts
        self.group = group
        self.tensors = tensors  # the module's per-expert parameters (expert_tensors)
        self.arguments = arguments  # its forward's (hidden, index, weights) names
        # how the rows each rank sends and receives are known: read from the exchanged
        # counts; replaceable by a simulation without values (the planner's routing
        # assumption, docs/planner.md)
        self.counts: dispatch.CountsReader = dispatch.read_counts
        # routings of forwards in flight (a recomputation nests inside its backward)
        self._pending: list[tuple[dispatch.Routing, torch.Tensor, dict[str, torch.Tensor]]] = []

    def before(self, module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        hidden, index, weights = _bind(args, kwargs, self.arguments)
        received, routing = dispatch.dispatch(hidden, index, weights, self.experts, self.group,
                                              self.counts)
        self._pending.append((routing, hidden, _local_views(module, self.tensors)))
        module.__dict__[_LOCAL_VIEWS] = self._pending[-1][2]
        # weight 1 here: the router's weights are applied where the token lives (combine)
        ones = torch.ones(received.hidden.shape[0], 1, dtype=weights.dtype,
                          device=weights.device)
        return (received.hidden, received.local_expert[:, None], ones), {}

    def after(self, module: nn.Module, args: tuple, output: torch.Tensor) -> torch.Tensor:
        routing, hidden, _ = self._pending.pop()
        module.__dict__[_LOCAL_VIEWS] = self._pending[-1][2] if self._pending else None
        rows = args[0]
        if rows.shape[0] == 0 and rows.requires_grad and not output.requires_grad:
            # no token came to this rank's experts: the module returned zeros outside the
            # graph, but the backward's all-to-alls must run here as on the other ranks
            output = output + rows
        return dispatch.combine(output, routing, self.group, like=hidden)


def _local_views(module: nn.Module, names: list[str]) -> dict[str, torch.Tensor]:
    """This rank's part of each expert weight, as FSDP gathered it for this forward: one
    differentiable view per forward, read by the module's forward (and by the hooks that
    note which parameters a forward used, ``parallel/unused_grads.py``)."""
    views: dict[str, torch.Tensor] = {}
    for name in names:
        weight = module._parameters[name]
        assert weight is not None
        views[name] = weight.to_local() if isinstance(weight, DTensor) else weight
    return views


def _bind(args: tuple, kwargs: dict, names: tuple[str, ...]
          ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    values = dict(zip(names, args, strict=False)) | kwargs
    if any(values.get(n) is None for n in names) or len(values) != len(names):
        raise TypeError(f"an expert-parallel experts module takes ({', '.join(names)}); "
                        f"got {len(args)} positional arguments and {sorted(kwargs)}")
    hidden, index, weights = (values[n] for n in names)
    return hidden, index, weights


def _whole_weights_to_layout(module: nn.Module, state_dict: dict, prefix: str,
                             *args: object) -> None:
    """``load_state_dict`` pre-hook: a whole expert weight (or bias) given as a plain
    tensor (a full state dict: FSDP1's ``FULL_STATE_DICT``, one process's) becomes this
    rank's part, laid out as the module's DTensor (copying a tensor into a DTensor is
    refused)."""
    for name, held in module._parameters.items():
        given = state_dict.get(prefix + name)
        if isinstance(held, DTensor) and isinstance(given, torch.Tensor) and \
                not isinstance(given, DTensor) and given.shape == held.shape:
            state_dict[prefix + name] = distribute_tensor(
                given.to(held.device), held.device_mesh, held.placements,
                src_data_rank=None)  # this rank's part, no traffic


_LOCAL_READERS: dict[type, type] = {}
_LOCAL_VIEWS = "_expert_parallel_views"  # instance attribute: the forward's local weights


def _reading_local_experts(cls: type) -> type:
    """A subclass of ``cls`` whose expert weights read as this rank's part (the
    DTensor's local tensor, differentiable) inside the module's own forward (between the
    hooks of :class:`ExpertParallelExperts`); elsewhere (state dicts, optimizers, FSDP)
    they are the DTensors of the whole weights."""
    if cls not in _LOCAL_READERS:
        def __getattr__(self: nn.Module, name: str):
            views = self.__dict__.get(_LOCAL_VIEWS)
            if views is not None and name in views:
                return views[name]
            return nn.Module.__getattr__(self, name)

        name = f"ExpertParallel{cls.__name__}"
        _LOCAL_READERS[cls] = type(name, (cls,), {"__getattr__": __getattr__,
                                                  "__module__": cls.__module__})
    return _LOCAL_READERS[cls]


def install(model: nn.Module, group: dist.ProcessGroup, ep_rank: int,
            mesh: DeviceMesh) -> nn.Module:
    """Keep this rank's experts in every experts module of ``model`` and route their
    tokens over ``group`` (this rank is ``ep_rank`` of it). ``mesh`` is the experts' mesh
    (``ep_index`` = ``group``, then the ranks holding the same experts): the weights
    become DTensors of their whole shape on it, sharded along dim 0 over ``ep_index``.
    Raises ConfigError for a model with no experts module or experts that do not split
    evenly."""
    if lookup(model, "expert_parallel") is not None:
        return model  # transformed already
    found = find_experts(model)
    if not found:
        raise ConfigError([("expert_parallel_degree", (
            f"{dist.get_world_size(group)}, but {type(model).__name__} has no experts "
            f"module expert parallelism knows (fused 3-D gate_up_proj and down_proj, one "
            f"per expert, as Mixtral's, Qwen2-MoE's and Qwen3-MoE's in transformers 5); "
            f"set expert_parallel_degree to 1"))])
    size = dist.get_world_size(group)
    unroutable = [f"{name} ({type(m).__name__})" for name, m in found
                  if routed_arguments(m) is None]
    if unroutable:
        raise ConfigError([("expert_parallel_degree", (
            f"{size}, but the experts modules {', '.join(unroutable[:2])} are not called "
            f"with the router's choices (hidden_states, top_k_index, top_k_weights), which "
            f"expert parallelism sends each rank's experts; expert parallelism of this "
            f"model's experts is not built yet: set expert_parallel_degree to 1"))])
    # experts on the meta device on some rank (delayed initialization, or real weights on
    # rank 0 only, which the wrappers refuse) have nothing to send: no rank broadcasts
    metas: list[object] = [None] * size
    dist.all_gather_object(metas, any(p.is_meta for _, m in found for p in m.parameters()),
                           group=group)
    for name, module in found:
        total = expert_count(module)
        assert total is not None
        experts = local_experts(total, ep_rank, size, where=name)
        tensors = expert_tensors(module)
        for weight in tensors:
            whole = getattr(module, weight)
            # every rank keeps the group's first rank's experts, as every other parameter
            # starts from data-parallel rank 0's (scripts seed ranks apart): the ranks
            # holding the same experts are made equal after this (replicas.synchronize)
            if not any(metas):
                dist.broadcast(whole.detach(), src=dist.get_global_rank(group, 0), group=group)
            held = whole.detach()[experts.first:experts.first + experts.count].clone()
            spread = DTensor.from_local(held, mesh, (Shard(0), Replicate(), Replicate()),
                                        run_check=False, shape=whole.shape,
                                        stride=whole.stride())
            # not setattr: a script may transform inside accelerate's init_empty_weights(),
            # whose register_parameter rebuilds a parameter by its class (DTensor's fails)
            module._parameters[weight] = nn.Parameter(spread, requires_grad=whole.requires_grad)
        # what the module's own forward indexes (setattr: mypy types module attributes
        # as tensors or modules)
        setattr(module, "num_experts", experts.count)  # noqa: B010
        module.__class__ = _reading_local_experts(type(module))
        module.register_load_state_dict_pre_hook(_whole_weights_to_layout)
        arguments = routed_arguments(module)
        assert arguments is not None
        share = ExpertParallelExperts(experts, group, tensors, arguments)
        module.register_forward_pre_hook(share.before, with_kwargs=True)
        module.register_forward_hook(share.after)
        state_of(module).expert_parallel = share
    state_of(model).expert_parallel = [module for _, module in found]
    return model
