"""SMP v2's ``torch.sagemaker.tensor_parallel.transformer``: ``TransformerLMHead``,
``TransformerLayer`` and ``TETransformerLayer``, from plain PyTorch modules.

In SMP v2 ``tsm.transform`` turns supported Hugging Face models into these
TransformerEngine-based classes, and scripts name the layer classes for FSDP's
auto-wrap policy and for activation checkpointing (``isinstance(m, TransformerLayer)``).
``tsm.transform`` here keeps the Hugging Face modules and splits them in place, so
``TransformerLayer`` and ``TETransformerLayer`` also count the transformer layers it
splits (Llama, Mistral, Mixtral, Qwen2/3, Qwen2/3-MoE, GPT-NeoX, GPT-2 and GPT-J layers, the
reference ``Block``) as their instances: those policies wrap and checkpoint each layer,
as in SMP.
"""

from __future__ import annotations

import inspect
from typing import Any

import torch
from torch import nn

from modelparallel.models.gpt import Block
from modelparallel.smp.v1.nn.transformer import (
    DistributedTransformerLayer,
    DistributedTransformerLMHead,
)

# transformer layers of the models tsm.transform splits, by class name
_HF_LAYERS = frozenset({"LlamaDecoderLayer", "MistralDecoderLayer", "MixtralDecoderLayer",
                        "Qwen2DecoderLayer", "Qwen3DecoderLayer", "Qwen2MoeDecoderLayer",
                        "Qwen3MoeDecoderLayer", "GPTNeoXLayer", "GPT2Block", "GPTJBlock"})


def is_transformer_layer(module: object) -> bool:
    """Whether ``module`` is a transformer layer in SMP v2's sense (see the module doc)."""
    cls = type(module)
    if isinstance(module, (DistributedTransformerLayer, Block)):
        return True
    return cls.__name__ in _HF_LAYERS and cls.__module__.startswith("transformers.")


class _LayerClass(type):
    """Metaclass: ``isinstance(m, TransformerLayer)`` holds for every transformer layer."""

    def __instancecheck__(cls, instance: object) -> bool:
        return type.__instancecheck__(cls, instance) or is_transformer_layer(instance)


class TransformerLayer(DistributedTransformerLayer, metaclass=_LayerClass):
    """A transformer layer (SMP v1's ``DistributedTransformerLayer``: same arguments and
    tuple ``forward``); ``isinstance`` is true of every layer ``tsm.transform`` splits."""


class TETransformerLayer(nn.Module, metaclass=_LayerClass):
    """The class SMP's TransformerEngine layers had, for ``isinstance`` checks only (FSDP
    auto-wrap, activation checkpointing); it cannot be built here (no TransformerEngine).
    """

    def __init__(self, *args: Any, **kwargs: Any):
        raise TypeError("TETransformerLayer is TransformerEngine's layer, which modelparallel "
                        "does not use: build a TransformerLayer, or let tsm.transform split "
                        "your Hugging Face model (isinstance(layer, TETransformerLayer) holds "
                        "for its layers)")


class LMHeadOutput(dict):
    """``{"loss": ..., "logits": ...}``, also readable as attributes (like Hugging Face's
    ``ModelOutput``): scripts read ``model(...)["loss"]`` or ``.loss``."""

    def __getattr__(self, name: str) -> Any:
        try:
            return self[name]
        except KeyError:
            raise AttributeError(name) from None


_LM_HEAD_ARGS = list(inspect.signature(DistributedTransformerLMHead.__init__).parameters)[1:-1]


class TransformerLMHead(DistributedTransformerLMHead):
    """A GPT-style causal language model: SMP v1's ``DistributedTransformerLMHead`` with
    GPT-2's defaults (pre-layernorm blocks and a final layer norm, a causal mask over
    ``num_positions``) and a Hugging Face-style ``forward``. The arguments are those of
    ``DistributedTransformerLMHead``; it is split over the tensor-parallel ranks by the
    same plan."""

    def __init__(self, *args: Any, **kwargs: Any):
        named = dict(zip(_LM_HEAD_ARGS, args, strict=False)) | kwargs
        defaults = {"pre_layernorm": True, "post_layernorm": True,
                    "causal_mask_size": named.get("num_positions", 1024)}
        for key, value in defaults.items():  # GPT-2's, where the caller gave none
            if named.get(key) is None and key not in _LM_HEAD_ARGS[:len(args)]:
                kwargs[key] = value
        super().__init__(*args, **kwargs)

    def forward(  # type: ignore[override]  # Hugging Face's keywords, not SMP v1's tuple
            self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None,
            labels: torch.Tensor | None = None, position_ids: torch.Tensor | None = None,
            token_type_ids: torch.Tensor | None = None) -> LMHeadOutput:
        """``input_ids`` ``[N, S]``; ``attention_mask`` ``[N, S]`` (1 = attended) or ``None``;
        ``labels`` ``[N, S]`` for the next-token loss (``-100`` ignored). Returns
        ``{"loss": loss or None, "logits": [N, S, vocab]}``."""
        if self.add_cross_attention:
            raise ValueError("TransformerLMHead.forward takes no cross-attention inputs; call "
                             "DistributedTransformerLMHead.forward with its tuple")
        out = super().forward((input_ids, attention_mask, token_type_ids, position_ids, labels))
        if labels is None:
            return LMHeadOutput(loss=None, logits=out)
        return LMHeadOutput(loss=out[0], logits=out[1])


__all__ = ["TETransformerLayer", "TransformerLMHead", "TransformerLayer",
           "is_transformer_layer"]
