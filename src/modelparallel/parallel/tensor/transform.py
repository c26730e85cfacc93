"""``transform(model)``: find the tensor-parallel plans of a model, check them, apply them."""

from __future__ import annotations

import math
import warnings
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.parallel import parallelize_module

from modelparallel.config import ConfigError
from modelparallel.context import ParallelContext
from modelparallel.module_state import state_of
from modelparallel.parallel.blocks import find_blocks
from modelparallel.parallel.placement import (
    is_meta,
    materialize_meta,
    to_device,
)

# the one predicate of whether tensor parallelism split a model lives in placement.py,
# which expert parallelism imports without this module's imports (replicas.py imports
# expert_parallel); its callers import it here
from modelparallel.parallel.placement import tp_ranks_are_replicas as tp_ranks_are_replicas
from modelparallel.parallel.precision import compute_as
from modelparallel.parallel.replicas import broadcast_from_first
from modelparallel.parallel.tensor import batch, rng
from modelparallel.parallel.tensor.plans import TPOptions, TPPlan, marked, plan_for
from modelparallel.parallel.tensor.regions import SplitRegions
from modelparallel.topology import CommGroup


class UnsplitModelWarning(UserWarning):
    """``tensor_parallel_degree`` > 1, but nothing in the model has a tensor-parallel plan."""


@dataclass
class _Found:
    path: str
    module: nn.Module
    plan: TPPlan


def transform(model: nn.Module, ctx: ParallelContext, *, sequence_parallel: bool = False,
              loss_parallel: bool = False, device: torch.device | str | None = None,
              dtype: torch.dtype | None = None, weights_from_rank0: bool = False,
              ) -> nn.Module:
    """Split ``model`` over the tensor-parallel ranks (SMP v2's ``tsm.transform``).

    Every module with a plan (built-in for the reference models and for Hugging Face
    GPT-2, Llama/Mistral/Qwen2/Qwen3, GPT-NeoX and ViT; or registered with
    ``tp_register_with_module``) is split with DTensor's ``parallelize_module`` on the
    ``tp`` mesh dimension. All sizes are checked first: a head count, width or
    vocabulary the degree does not divide raises ``ConfigError`` on every rank before
    any collective. Module names and full shapes are kept (``full_state_dict``).

    ``sequence_parallel``: norms and dropout work on sequence shards (reference
    models). ``loss_parallel``: the LM head's logits stay split over the vocabulary
    as a DTensor; compute the loss and call ``backward()`` inside
    ``mp.loss_parallel()`` and full logits are never gathered. Without it the logits
    are gathered and any loss code works unchanged.

    Batches follow SMP v1's ``prescaled_batch``. ``False`` (default): each rank passes
    its own batch (``mp.data`` loaders shard by ``dp_rank``); the tensor-parallel group
    runs them concatenated and each rank gets the output rows of its own batch back.
    ``True``: every rank of the group passes the same batch (sharded by ``rdp_rank``),
    checked once on the first forward; needed for ``loss_parallel``.

    The ranks of a tensor-parallel group start from its first rank's parameters and
    random state. Gradients of replicated tensors that split activations read (Qwen3's
    per-head norms) are summed over the group (``regions.py``). A model with no plan
    is left whole and the tensor-parallel ranks train it as data-parallel replicas.
    ``bf16``/``fp16`` in the config make the forward and backward compute in that type
    with float32 parameters (``precision.py``), with or without tensor parallelism.

    ``weights_from_rank0`` (SMP v2's ``load_state_dict_from_rank0``): only global rank
    0's model holds real weights (the others may be on the meta device); the first rank
    of every tensor-parallel group gets them from rank 0 before the split, so every
    rank ends with its part of rank 0's model. With degree 1 nothing is done here: the
    data-parallel wrapper's ``sync_module_states=True`` distributes them, as in SMP.

    With ``tensor_parallel_degree`` 1 nothing is split. Apply data parallelism
    afterwards (``mp.shard``, FSDP1, ``mp.replicate``).
    """
    if device is not None or dtype is not None:
        model.to(device=device, dtype=dtype)
    compute_as(model, ctx.precision, find_blocks(model))
    degree = ctx.topology.tp
    if degree == 1:
        return model
    if loss_parallel and not ctx.config.prescaled_batch:
        raise ConfigError([("prescaled_batch", "loss_parallel=True keeps the logits split over "
                            "the vocabulary, so they cannot be cut back into each rank's own "
                            "batch: set prescaled_batch=True (every rank of a tensor-parallel "
                            "group passes the same batch; mp.data loaders shard by rdp_rank)")])
    if weights_from_rank0:
        _take_rank0_weights(model, ctx)
    options = TPOptions(degree, sequence_parallel, loss_parallel)
    found = find_plans(model, options)
    state_of(model).tensor_parallel_split = bool(found)
    if not found:
        if ctx.rank == 0:
            warnings.warn(_unsplit_message(model, degree), UnsplitModelWarning, stacklevel=2)
        return model
    to_device(model, ctx.device)  # a pipeline stage's model has other stages' parts on meta
    tp_group = ctx.process_group(CommGroup.TP_GROUP)
    # the ranks of a group compute one model: start from tp rank 0's values (split
    # parameters are cut from its copy below) and draw the same random numbers outside
    # split regions
    broadcast_from_first([*model.parameters(), *model.buffers()], tp_group)
    rng.synchronize_global(tp_group, ctx.device)
    tied = tied_groups(model)
    mesh = ctx.meshes["tp"]
    regions: dict[str, str] = {}
    styled = []
    for f in found:
        for attr in f.plan.divide_attrs:
            _divide_attr(f.module, attr, degree)
        for sub, style in f.plan.styles.items():
            module = f.module.get_submodule(sub)
            parallelize_module(module, mesh, style)
            styled.append((_join(f.path, sub), module, style))
        regions |= {_join(f.path, sub): stream for sub, stream in f.plan.rng.items()}
    _retie(model, tied)
    SplitRegions(model, styled, mesh)
    seeds = rng.RegionSeeds(random_seed=ctx.config.random_seed,
                            tensor_parallel_seed=ctx.config.tensor_parallel_seed,
                            tp_rank=ctx.coordinate("tp"),
                            dp_rank=ctx.topology.rank_in(ctx.rank, CommGroup.RDP_GROUP))
    rng.install_regions(model, regions, seeds, ctx.device)
    if ctx.config.prescaled_batch:
        batch.check_same_batch_once(model, tp_group)
    else:
        batch.gather_batches(model, mesh)
    return model


def _take_rank0_weights(model: nn.Module, ctx: ParallelContext) -> None:
    """Give the first rank of each tensor-parallel group global rank 0's parameters and
    buffers (collective over the world, then over rank 0's data-parallel group)."""
    tensors = [*model.parameters(), *model.buffers()]
    flag = torch.tensor([float(any(is_meta(t) for t in tensors))], device=ctx.device)
    dist.broadcast(flag, src=0)
    if flag.item():
        raise ConfigError([("load_state_dict_from_rank0", "rank 0's model is on the meta "
                            "device: with load_state_dict_from_rank0=True, rank 0 must build "
                            "the model with its weights (the other ranks may use meta)")])
    materialize_meta(model, ctx.device)
    to_device(model, ctx.device)
    if ctx.coordinate("tp") == 0:  # rank 0's group: the ranks that begin a tp group
        broadcast_from_first([*model.parameters(), *model.buffers()],
                             ctx.process_group(CommGroup.RDP_GROUP))


def find_plans(model: nn.Module, options: TPOptions) -> list[_Found]:
    """The plan of every module to split, outermost first; raises ``ConfigError`` if the
    degree does not divide a size a plan splits, or a plan cannot honour the options."""
    found: list[_Found] = []
    problems: list[tuple[str, str]] = []
    claimed: set[int] = set()
    skipped: list[str] = []
    for path, module in model.named_modules():
        if any(path == p or path.startswith(p + ".") for p in skipped):
            continue
        if marked(module) is False:
            skipped.append(path)
            continue
        if id(module) in claimed:
            continue
        name = f"{path or 'model'} ({type(module).__name__})"
        try:
            plan = plan_for(module, options)
        except NotImplementedError as e:
            problems.append(("tensor_parallel_degree", f"{name}: {e}"))
            continue
        if plan is None:
            continue
        if options.sequence_parallel and not plan.sequence_parallel:
            problems.append(("sequence_parallel", f"{name}: its tensor-parallel plan does not "
                             "support sequence parallelism; call transform() without it"))
        for label, size in plan.sizes.items():
            if size % options.degree:
                problems.append(("tensor_parallel_degree",
                                 f"{name}: {label} = {size} is not divisible by "
                                 f"tensor_parallel_degree={options.degree}"))
        for sub in plan.styles:
            claimed.update(id(m) for m in module.get_submodule(sub).modules())
        found.append(_Found(path, module, plan))
    if any(key == "tensor_parallel_degree" for key, _ in problems):
        sizes = [size for f in found for size in f.plan.sizes.values()]
        largest = math.gcd(*sizes) if sizes else 1
        allowed = [d for d in range(1, largest + 1) if largest % d == 0]
        problems.append(("tensor_parallel_degree",
                         f"this model allows tensor_parallel_degree in {allowed}"))
    if problems:
        raise ConfigError(problems)
    return found


def _join(path: str, sub: str) -> str:
    return ".".join(p for p in (path, sub) if p)


def _divide_attr(module: nn.Module, dotted: str, degree: int) -> None:
    owner_path, _, attr = dotted.rpartition(".")
    owner = module.get_submodule(owner_path)
    if hasattr(owner, attr):
        setattr(owner, attr, getattr(owner, attr) // degree)


def tied_groups(model: nn.Module) -> list[list[tuple[nn.Module, str]]]:
    """(module, parameter name) of every parameter used by more than one module."""
    users: dict[int, list[tuple[nn.Module, str]]] = {}
    for module in model.modules():
        for name, param in module.named_parameters(recurse=False):
            users.setdefault(id(param), []).append((module, name))
    return [u for u in users.values() if len(u) > 1]


def _retie(model: nn.Module, tied: list[list[tuple[nn.Module, str]]]) -> None:
    """Parameters shared before the split (tied embeddings) are shared after it."""
    for group in tied:
        params = [getattr(m, n) for m, n in group]
        first = params[0]
        if all(p is first for p in params):
            continue
        specs = {(p.placements, p.device_mesh) if isinstance(p, DTensor) else None for p in params}
        if len(specs) > 1:
            names = [f"{type(m).__name__}.{n}" for m, n in group]
            raise ConfigError([("tensor_parallel_degree",
                                f"tied parameters {names} would be split differently; split "
                                "both the same way or neither (mp.set_tensor_parallelism)")])
        for module, name in group:
            setattr(module, name, first)


def _unsplit_message(model: nn.Module, degree: int) -> str:
    classes = sorted({type(m).__name__ for m in model.modules()
                      if next(m.parameters(recurse=False), None) is not None})
    return (f"tensor_parallel_degree={degree}, but no module of {type(model).__name__} has a "
            f"tensor-parallel plan (modules with parameters: {', '.join(classes)}). It is left "
            f"unsplit: each of the {degree} tensor-parallel ranks holds the whole model and "
            "trains it as a data-parallel replica (gradients averaged over them too). Register "
            "a plan with mp.tp_register_with_module(cls, plan) or mark modules "
            "with mp.set_tensor_parallelism(module); see docs/tensor-parallel.md.")
