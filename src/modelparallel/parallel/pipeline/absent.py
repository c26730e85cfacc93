"""What a stage sees of the parameters and buffers that other pipeline stages hold.

The model's own forward runs on every stage (``cut.py``), so it may read a tensor of a
module another stage holds: its metadata, as BERT implementations read
``embeddings.word_embeddings.weight.dtype`` for the attention mask and Hugging Face's
``model.dtype`` / ``model.device`` read the first of ``parameters()``; or its values, as
a language-model head computing with the embedding's weight does. An
:class:`AbsentTensor` stands in for such a tensor: it answers the metadata as the
holding stage's tensor does in its forward (the compute dtype, the shape,
``requires_grad``, this rank's device), and any operation that reads its values raises
:class:`AbsentValueError`, naming the tensor, the stage that holds it and the fix.

Inside the forward, stand-ins live in a :class:`cut.Stub`, which is in the model only
while a stage runs the model's forward. Outside it, the model keeps a stand-in in the
place of each parameter and buffer another stage holds (``engine``), in the storage
dtype, so that a script reading ``model.dtype``, ``model.device`` or ``p.device`` after
the split sees what one process sees. The library tells them from the tensors a rank
holds by :func:`modelparallel.parallel.placement.is_meta`: FSDP, state dicts,
checkpoints, gradient clipping and the optimizer take only what the rank holds.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.utils._pytree as pytree
from torch import nn

_aten = torch.ops.aten
# operations that read only the metadata of a tensor, not its values (the split's trace
# does not count them as reads either: ``crossing._FROM_METADATA``)
_SHAPED_LIKE = {_aten.empty_like, _aten.zeros_like, _aten.ones_like, _aten.full_like}
_DTYPE_AND_DEVICE_OF = {_aten.new_empty, _aten.new_zeros, _aten.new_ones, _aten.new_full,
                        _aten.new_empty_strided}
# operations that only rearrange or copy a tensor (besides views, ``OpOverload.is_view``):
# their result stands in for the same absent values (state-dict hooks reshape what they
# save, e.g. tensor parallelism's fused QKV); computing with it is what refuses
_REARRANGING = {_aten._unsafe_view, _aten.clone}


class AbsentValueError(RuntimeError):
    """The model read the values of a tensor another pipeline stage holds."""


@dataclass(frozen=True)
class Holder:
    """Where a stand-in's tensor is: the stage (and the pipeline rank running it)."""

    stage: int
    pp_rank: int


class AbsentTensor(torch.Tensor):
    """The metadata of a tensor another pipeline stage holds, without its values."""

    absent_name: str
    holder: Holder

    @staticmethod
    def __new__(cls, shape: torch.Size, dtype: torch.dtype, device: torch.device,
                requires_grad: bool, name: str, holder: Holder) -> AbsentTensor:
        t = torch.Tensor._make_wrapper_subclass(cls, shape, dtype=dtype, device=device,
                                                requires_grad=requires_grad)
        t.absent_name, t.holder = name, holder
        return t

    def __init__(self, *args: object, **kwargs: object) -> None:
        super().__init__()

    # metadata reads answer from the tensor's own fields, without any dispatch
    __torch_function__ = torch._C._disabled_torch_function_impl  # type: ignore[assignment]

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        packet = func.overloadpacket
        if packet is _aten.detach:
            t = args[0]
            return AbsentTensor(t.shape, t.dtype, t.device, False, t.absent_name, t.holder)
        if packet is _aten._to_copy:  # a cast or a move: still the metadata alone
            t = args[0]
            return AbsentTensor(t.shape, kwargs.get("dtype") or t.dtype,
                                kwargs.get("device") or t.device, False, t.absent_name,
                                t.holder)
        if packet in _SHAPED_LIKE or packet in _DTYPE_AND_DEVICE_OF:
            def real(t: object) -> object:
                if not isinstance(t, AbsentTensor):
                    return t
                shape = t.shape if packet in _SHAPED_LIKE else (0,)
                return torch.empty(shape, dtype=t.dtype, device=t.device)
            return func(*pytree.tree_map(real, args), **pytree.tree_map(real, kwargs))
        absent = next(t for t in pytree.tree_leaves((args, kwargs))
                      if isinstance(t, AbsentTensor))
        if func.is_view or packet in _REARRANGING:
            return _rearranged(func, args, kwargs, absent)
        raise AbsentValueError(value_read_message(absent.absent_name, absent.holder,
                                                  packet.__name__))

    def __deepcopy__(self, memo: dict) -> torch.Tensor:  # a copy of the model: no values
        copied: torch.Tensor = AbsentTensor(self.shape, self.dtype, self.device,
                                            self.requires_grad, self.absent_name, self.holder)
        if isinstance(self, nn.Parameter):
            copied = nn.Parameter(copied, self.requires_grad)
        memo[id(self)] = copied
        return copied

    def tolist(self):  # reads the values without dispatching
        raise AbsentValueError(value_read_message(self.absent_name, self.holder, "tolist"))

    def __repr__(self) -> str:  # type: ignore[override]
        return (f"AbsentTensor({self.absent_name!r}, shape={tuple(self.shape)}, "
                f"dtype={self.dtype}, held by pipeline stage {self.holder.stage})")


def _rearranged(func, args: tuple, kwargs: dict, absent: AbsentTensor) -> object:
    """``func`` (a view, reshape or copy) of stand-ins: stand-ins of the result's shapes,
    found on meta tensors."""
    def meta(t: object) -> object:
        if not isinstance(t, AbsentTensor):
            return t
        return torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device="meta")

    out = func(*pytree.tree_map(meta, args), **pytree.tree_map(meta, kwargs))
    return pytree.tree_map(
        lambda m: AbsentTensor(m.shape, m.dtype, absent.device, False, absent.absent_name,
                               absent.holder) if isinstance(m, torch.Tensor) else m, out)


def value_read_message(name: str, holder: Holder, operation: str) -> str:
    """Why the values of ``name`` cannot be read here, and what to do instead."""
    return (f"the model reads the values of {name!r} (in torch operation {operation!r}), "
            f"which pipeline stage {holder.stage} (on pipeline rank {holder.pp_rank}) "
            "holds. The model's forward runs on every stage, and the others have only that "
            "tensor's metadata (dtype, shape, device, requires_grad). Use its values only "
            "inside the forward of the module that holds it: call that module instead of "
            "computing with its weight, or move that computation into a module and place it "
            "on the same stage with mp.partition / mp.set_partition. Outside the forward, "
            "read them from model.state_dict() (every stage's, gathered) or on the rank "
            "that holds them (model.local_parameters())")


def stand_in(t: torch.Tensor, name: str, holder: Holder, device: torch.device,
             dtype: torch.dtype | None) -> AbsentTensor:
    """A stand-in for ``t`` on ``device``, its floating dtype cast to ``dtype`` if given
    (the compute dtype of the precision policy, which the holder's forward sees)."""
    cast = dtype if dtype is not None and t.is_floating_point() else t.dtype
    return AbsentTensor(t.shape, cast, device, t.requires_grad, name, holder)
