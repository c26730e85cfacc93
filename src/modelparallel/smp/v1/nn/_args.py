"""The arguments SMP v1's distributed modules take beyond their documented signatures.

SMP's source reads more keyword arguments than its documentation lists (Hugging Face
init hooks and ``smp.tensor_parallelism(**kwargs)`` pass them). Each one here either
works, is refused with the reason, or has no effect on the result here (a fused
kernel, or SMP's own batch bookkeeping) and says so once in the log. Anything else is
a ``TypeError``, as for any Python function.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, fields
from typing import Any

from modelparallel.notices import notice

_NO_EFFECT = {
    "fused_softmax": "fused softmax is a kernel choice; SDPA computes the same softmax",
    "fused_bias_gelu": "fused bias+GeLU is a kernel choice; the result is the same",
    "fused_dropout": "fused dropout is a kernel choice; the result is the same",
    "flash_attention": "attention runs in torch's scaled_dot_product_attention, which picks "
                       "the flash kernel where it applies",
    "zero_init": "SMP's parameter bookkeeping for sharded data parallelism",
    "query_key_layer_scaling": "Megatron's fp16 rescaling of attention scores leaves the "
                               "softmax unchanged",
    "distribute_embedding": "the word embedding is split over the vocabulary under "
                            "tensor parallelism (Megatron's layout) either way",
    "num_layers": "only SMP's query_key_layer_scaling read it",
    "input_layer": "modelparallel gathers a tensor-parallel group's batches at the model's "
                   "input, not per layer",
    "output_layer": "modelparallel gathers a tensor-parallel group's batches at the model's "
                    "input, not per layer",
    "full_attention_mask_and_cross_states": "SMP's per-layer batch bookkeeping",
    "full_hidden_states_sharded_hidden_dim": "SMP's per-layer batch bookkeeping",
    "_scale_qkv_fan_out": "an initialisation detail of SMP's memory-optimised layout",
    "_precision_test": "an SMP test switch",
}
_logged: set[str] = set()


@dataclass
class Extra:
    """The source-only options that change what a module computes."""

    fp32_residual_addition: bool = False  # residual sums in float32
    attention_in_fp32: bool = False  # attention scores and softmax in float32
    scale_attention_scores: bool = True  # divide scores by sqrt(head size)
    scale_attn_by_layer_idx: bool = False  # and by layer_idx + 1 (GPT-2's option)
    layer_idx: int = 0
    embedding_dropout_prob: float | None = None  # LM head; default hidden_dropout_prob
    use_alibi: bool = False
    alibi_bias_max: int = 8
    rotary_dim: int | None = None
    hf_gelu: bool = False  # SMP_USE_HF_GELU=1: GeLU's tanh approximation (HF's gelu_new)

    def passed_on(self) -> dict[str, Any]:
        """What a container passes to the modules it builds."""
        return {f.name: getattr(self, f.name) for f in fields(self) if f.name != "hf_gelu"}


def extra(kwargs: dict[str, Any], owner: str) -> Extra:
    """Read the source-only keyword arguments ``kwargs`` of module ``owner``."""
    known = {f.name for f in fields(Extra)} - {"hf_gelu"}
    unknown = sorted(set(kwargs) - known - set(_NO_EFFECT))
    if unknown:
        raise TypeError(f"{owner}() got unexpected keyword arguments {unknown}")
    for key in sorted(set(kwargs) & set(_NO_EFFECT)):
        if key not in _logged:
            _logged.add(key)
            notice("%s(%s=%r): no effect here: %s", owner, key, kwargs[key], _NO_EFFECT[key])
    out = Extra(**{k: v for k, v in kwargs.items() if k in known})
    out.hf_gelu = os.environ.get("SMP_USE_HF_GELU") == "1"
    if out.use_alibi:
        raise ValueError(f"{owner}(use_alibi=True): ALiBi is not supported by modelparallel's "
                         "smp.nn modules (SMP runs it in a Triton kernel); use the default "
                         "position embeddings")
    if out.rotary_dim is not None:
        raise ValueError(f"{owner}(rotary_dim={out.rotary_dim}): rotary embeddings (SMP's GPT-J "
                         "layout) are not supported by modelparallel's smp.nn modules")
    return out


def check_activation(activation: str, owner: str) -> None:
    if activation not in ("gelu", "relu"):
        raise ValueError(f"{owner}: activation must be 'gelu' or 'relu', not {activation!r}")


def check_layernorms(pre: bool, post: bool, owner: str) -> None:
    if not pre and not post:
        raise ValueError(f"{owner}: at least one of pre_layernorm and post_layernorm must be "
                         "True")
