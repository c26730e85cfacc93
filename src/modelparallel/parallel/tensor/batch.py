"""How the ranks of one tensor-parallel group share a batch (SMP v1's ``prescaled_batch``).

A split model computes one batch together on all ranks of its TP group.

- ``prescaled_batch: True``: every rank of the group passes the same batch (loaders shard
  by ``rdp_rank``). ``check_same_batch_once`` turns a mistake into an error.
- ``prescaled_batch: False`` (SMP v1's default): every rank passes its own batch (loaders
  shard by ``dp_rank``). ``gather_batches`` concatenates the group's batches before the
  model runs and gives each rank back the output rows of its own batch, so the script
  is the same as for data parallelism.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.utils._pytree as pytree
from torch import nn
from torch._subclasses.fake_tensor import is_fake  # the planner's tensors
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, Shard

from modelparallel.parallel import token_count


class DifferentBatchError(RuntimeError):
    """The ranks of one tensor-parallel group were given different inputs."""


class BatchSizeMismatchError(RuntimeError):
    """The ranks of one tensor-parallel group passed batches of different sizes."""


def gather_batches(model: nn.Module, mesh: DeviceMesh) -> None:
    """Run ``model`` on the concatenated batches of the TP group ``mesh``; return this
    rank's rows of every output.

    Inputs: every tensor whose first dimension is the batch size (that of the first
    tensor argument) is all-gathered along it; other arguments pass unchanged and must
    be the same on every rank; a ``mp.global_token_count`` divisor is multiplied by the
    degree (a loss the model computes sums the group's rows in one place). Outputs:
    every tensor with the gathered batch size as its first dimension is cut to this
    rank's rows. Its gradient is all-gathered in backward and divided by the degree, so
    each rank's loss counts as one data-parallel replica's (the same gradient as ``tp``
    data-parallel ranks, each on its own batch).
    """
    degree = mesh.size()
    rows: list[int] = []  # batch size of the forward in flight, per rank

    def gather(module, args, kwargs):
        rows.clear()
        leaves, spec = pytree.tree_flatten((args, kwargs))
        first = next((t for t in leaves if _batched(t)), None)
        if first is None:
            return None
        batch = first.shape[0]
        sizes = _all_gather_sizes(batch, mesh, first)
        if len(set(sizes)) > 1:
            raise BatchSizeMismatchError(
                f"the ranks of a tensor-parallel group passed batches of {sizes} rows; with "
                "prescaled_batch=False the group concatenates one batch per rank, so they "
                "must be the same size: use drop_last=True in the data loader, or "
                "prescaled_batch=True and pass the same batch on every rank of the group")
        rows.append(batch)
        leaves = [_all_gather_rows(t, mesh) if _batched(t) and t.shape[0] == batch
                  # a loss inside the model sums the group's rows in one place
                  else token_count.for_gathered_rows(t, degree)
                  if token_count.is_divisor(t) else t
                  for t in leaves]
        return pytree.tree_unflatten(leaves, spec)

    def take_own_rows(module, args, kwargs, output):
        if not rows:
            return output
        total = rows[0] * degree

        def own(t):
            if isinstance(t, DTensor):
                raise RuntimeError(
                    "the model returned a DTensor (loss_parallel or a plan with "
                    "use_local_output=False); with prescaled_batch=False each rank's rows "
                    "are cut from plain tensors only: set prescaled_batch=True")
            if _batched(t) and t.shape[0] == total:
                return _own_rows(t, mesh)
            return t

        return pytree.tree_map(own, output)

    model.register_forward_pre_hook(gather, with_kwargs=True)
    model.register_forward_hook(take_own_rows, with_kwargs=True)


def _all_gather_sizes(batch: int, mesh: DeviceMesh, first: torch.Tensor) -> list[int]:
    device = first.device
    if device.type != mesh.device_type:
        device = torch.device(mesh.device_type)
    sizes = _all_gather_rows(torch.tensor([batch], device=device), mesh)
    if is_fake(first):  # the planner's dry run (modelparallel.plan): ranks alike, no data
        return [batch] * mesh.size()
    return sizes.tolist()


def _batched(t: object) -> bool:
    return isinstance(t, torch.Tensor) and not isinstance(t, DTensor) and t.ndim > 0


def _all_gather_rows(t: torch.Tensor, mesh: DeviceMesh) -> torch.Tensor:
    return DTensor.from_local(t, mesh, [Shard(0)], run_check=False).full_tensor()


def _own_rows(t: torch.Tensor, mesh: DeviceMesh) -> torch.Tensor:
    """This rank's rows; in backward the group's row gradients, gathered, / degree."""
    full = DTensor.from_local(t, mesh, [Replicate()], run_check=False)
    own = full.redistribute(mesh, [Shard(0)]).to_local()
    if own.requires_grad:  # only gradients through these rows: ``t`` may feed a loss too
        degree = mesh.size()
        own.register_hook(lambda grad: grad / degree)
    return own


def check_same_batch_once(model: nn.Module, group: dist.ProcessGroup) -> None:
    """On the first forward, compare a checksum of the inputs over the TP group.

    With ``prescaled_batch`` every rank of a tensor-parallel group must pass the same
    inputs; a loader that shards by ``dp_rank`` gives them different ones and training
    would be silently wrong. One small all-reduce, once.
    """

    def check(module, args, kwargs):
        handle.remove()
        tensors = [t for t in pytree.tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)]
        total = sum((t.detach().double().sum() * (i + 1) for i, t in enumerate(tensors)),
                    torch.zeros((), dtype=torch.float64, device=tensors[0].device)) \
            if tensors else torch.zeros((), dtype=torch.float64)
        both = torch.stack([total, -total])
        dist.all_reduce(both, op=dist.ReduceOp.MAX, group=group)
        if both[0] != -both[1]:
            raise DifferentBatchError(
                "the ranks of a tensor-parallel group were given different inputs, but "
                "prescaled_batch=True says they pass the same batch: shard your data by "
                "mp.rdp_rank() / mp.rdp_size() (mp.data loaders do), or set "
                "prescaled_batch=False to let the group concatenate one batch per rank.")

    handle = model.register_forward_pre_hook(check, with_kwargs=True)
