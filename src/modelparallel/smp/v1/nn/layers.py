"""SMP v1's ``smp.nn`` building blocks: ``DistributedModule``, ``FusedLayerNorm``,
``DistributedLayerNorm``, ``DistributedLinear``, ``DistributedEmbedding``.

Each is an ordinary single-device module. Under ``tensor_parallel_degree`` > 1 its
tensor-parallel plan (``plans.py``) splits it over the tensor-parallel ranks when the
model is transformed (``smp.DistributedModel`` or ``tsm.transform``), so one process
and tensor parallelism train the same model.
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import DTensor, Replicate, Shard


class DistributedModule(nn.Module):
    """Base class of SMP's distributed modules (and of users' own ones)."""

    @staticmethod
    def can_distribute(*args: Any, **kwargs: Any) -> bool:
        """Whether a module built with these arguments can be split (SMP's hook)."""
        return True

    def can_shard_activation_offloading(self) -> bool:
        return False


class FusedLayerNorm(nn.LayerNorm):
    """Drop-in for apex's ``FusedLayerNorm(normalized_shape, eps=1e-5,
    elementwise_affine=True)``: torch's layer norm (the same result, no apex kernel)."""


class DistributedLayerNorm(nn.LayerNorm, DistributedModule):
    """SMP's layer norm over hidden-dimension shards; here the hidden dimension stays whole
    (Megatron's layout), so it is a layer norm replicated over the tensor-parallel ranks."""


class DistributedLinear(nn.Linear, DistributedModule):
    """``nn.Linear(in_features, out_features)`` split over the tensor-parallel ranks by input
    features (row-parallel: each rank multiplies its slice, the outputs are summed).
    ``in_features`` and ``out_features`` are the global sizes."""

    def __init__(self, in_features: int, out_features: int, bias: bool = True):
        super().__init__(in_features, out_features, bias=bias)


class DistributedEmbedding(nn.Embedding, DistributedModule):
    """``nn.Embedding`` split over the tensor-parallel ranks along ``embedding_dim`` (as SMP
    splits it); the output is gathered. Weights start from ``N(0, initializer_range)``.
    ``max_norm`` and ``_weight`` are refused, as in SMP."""

    def __init__(self, num_embeddings: int, embedding_dim: int, padding_idx: int | None = None,
                 max_norm: float | None = None, norm_type: float = 2.0,
                 scale_grad_by_freq: bool = False, sparse: bool = False,
                 _weight: torch.Tensor | None = None, initializer_range: float = 0.02,
                 _skip_allgather: bool = False, _skip_scatter_and_merge: bool = False):
        if max_norm is not None:
            raise ValueError("DistributedEmbedding: max_norm is not supported (as in SMP); pass "
                             "max_norm=None")
        if _weight is not None:
            raise ValueError("DistributedEmbedding: _weight is not supported (as in SMP)")
        if _skip_allgather or _skip_scatter_and_merge:
            raise ValueError("DistributedEmbedding: _skip_allgather/_skip_scatter_and_merge are "
                             "SMP-internal (its LM head's sharded layout) and not supported")
        super().__init__(num_embeddings, embedding_dim, padding_idx, None, norm_type,
                         scale_grad_by_freq, sparse)
        self.initializer_range = initializer_range
        with torch.no_grad():
            nn.init.normal_(self.weight, std=initializer_range)
            if padding_idx is not None:
                self.weight[padding_idx].zero_()


# -- helpers of the transformer modules ---------------------------------------------------

def init_linear(layer: nn.Linear, normal: bool, std: float) -> None:
    """SMP's ``use_normal_initialization``: weights ``N(0, std)``, biases 0; otherwise
    PyTorch's default (already applied)."""
    if normal:
        with torch.no_grad():
            nn.init.normal_(layer.weight, std=std)
            if layer.bias is not None:
                layer.bias.zero_()


def layer_norm(enabled: bool, hidden_size: int, eps: float) -> nn.LayerNorm | None:
    return nn.LayerNorm(hidden_size, eps=eps) if enabled else None


def activate(x: torch.Tensor, activation: str, hf_gelu: bool) -> torch.Tensor:
    if activation == "relu":
        return F.relu(x)
    return F.gelu(x, approximate="tanh" if hf_gelu else "none")


def residual(skip: torch.Tensor, out: torch.Tensor, fp32: bool) -> torch.Tensor:
    """``skip + out``; with ``fp32_residual_addition`` summed in float32 (no fp16 overflow)
    and rounded once to the branch's dtype."""
    if fp32:
        return (skip.float() + out.float()).to(out.dtype)
    return skip + out


def shared_input(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """``x`` as one replicated DTensor when ``weight`` is column-split over the
    tensor-parallel ranks, so the layers reading it (q, k, v) add their input gradients
    first and all-reduce once; ``x`` itself otherwise."""
    if (isinstance(weight, DTensor) and weight.device_mesh.ndim == 1
            and weight.placements == (Shard(0),)):
        return DTensor.from_local(x, weight.device_mesh, [Replicate()], run_check=False)
    return x


def attention_scale(head_size: int, scale_scores: bool, by_layer: bool, layer_idx: int) -> float:
    scale = 1.0 / math.sqrt(head_size) if scale_scores else 1.0
    return scale / (layer_idx + 1) if by_layer else scale


__all__ = ["DistributedEmbedding", "DistributedLayerNorm", "DistributedLinear",
           "DistributedModule", "FusedLayerNorm"]
