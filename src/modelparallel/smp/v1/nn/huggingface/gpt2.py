"""SMP v1's GPT-2 state-dict translators
(``smdistributed.modelparallel.torch.nn.huggingface.gpt2``).

Hugging Face's ``GPT2LMHeadModel`` and SMP's ``DistributedTransformerLMHead`` (built
with GPT-2's arguments: ``pre_layernorm=True, post_layernorm=True,
causal_mask_size=n_positions``, GeLU with ``SMP_USE_HF_GELU=1`` for ``gelu_new``) hold
the same weights under other names and shapes: GPT-2's ``Conv1D`` stores ``(in, out)``
where ``nn.Linear`` stores ``(out, in)``, its ``c_attn`` is query, key and value side
by side, and its final ``ln_f`` is the post-layernorm of SMP's last layer. The
``*_layer`` variants translate a model whose GPT-2 blocks alone were replaced by
``DistributedTransformerLayer`` (names ``transformer.h.<i>.attention...``).

Tensors are views of the input's where possible (transposes); nothing is copied except
the fused ``c_attn``. Inputs are full (single-device) state dicts.
"""

from __future__ import annotations

import logging
import os
import re
from collections.abc import Callable
from typing import Any

import torch

from modelparallel.notices import notice
from modelparallel.smp.state import state
from modelparallel.smp.v1 import tp_register
from modelparallel.smp.v1.nn.transformer import DistributedTransformerLMHead

logger = logging.getLogger("modelparallel")

StateDict = dict[str, torch.Tensor]

# (SMP sub-path inside a layer, Hugging Face sub-path inside a block, transposed)
_LAYER_PARTS = (
    ("attention.pre_layernorm", "ln_1", False),
    ("attention.dense", "attn.c_proj", True),
    ("output.pre_layernorm", "ln_2", False),
    ("output.dense1", "mlp.c_fc", True),
    ("output.dense2", "mlp.c_proj", True),
)
_QKV = ("query", "key", "value")
_MASK_BUFFERS = (".attn.bias", ".attn.masked_bias")  # causal-mask buffers of old GPT-2
_HF_BLOCK = re.compile(r"transformer\.h\.(\d+)\.(.+)\.(weight|bias)$")


def _hf_to_smp_layers(state_dict: StateDict, layer_prefix: str) -> StateDict:
    """Translate the blocks ``transformer.h.<i>``; other keys are left out."""
    out: StateDict = {}
    for name, value in state_dict.items():
        match = _HF_BLOCK.match(name)
        if name.endswith(_MASK_BUFFERS) or match is None:
            continue
        index, part, kind = match.groups()
        prefix = f"{layer_prefix}{index}."
        if part == "attn.c_attn":
            for i, chunk in enumerate(value.chunk(3, dim=-1)):
                out[f"{prefix}attention.{_QKV[i]}.{kind}"] = chunk.t() if kind == "weight" \
                    else chunk
            continue
        smp, transposed = next(((s, t) for s, h, t in _LAYER_PARTS if h == part), (None, False))
        if smp is None:
            raise ValueError(f"unknown GPT-2 parameter {name!r}")
        out[f"{prefix}{smp}.{kind}"] = value.t() if transposed and kind == "weight" else value
    return out


def _smp_to_hf_layer(index: str, part: str, kind: str, value: torch.Tensor,
                     qkv: dict[str, dict[str, torch.Tensor]]) -> tuple[str, torch.Tensor] | None:
    """One SMP layer parameter as Hugging Face's; query/key/value are collected in
    ``qkv`` and fused later (None returned)."""
    block = f"transformer.h.{index}."
    sub, _, leaf = part.rpartition(".")
    if sub == "attention" and leaf in _QKV:
        qkv.setdefault(f"{block}attn.c_attn.{kind}", {})[leaf] = value
        return None
    for smp, hf, transposed in _LAYER_PARTS:
        if part == smp:
            return f"{block}{hf}.{kind}", value.t() if transposed and kind == "weight" else value
    raise ValueError(f"unknown parameter of an SMP transformer layer: {part}.{kind}")


def _fuse(qkv: dict[str, dict[str, torch.Tensor]]) -> StateDict:
    out = {}
    for name, parts in qkv.items():
        if set(parts) != set(_QKV):
            raise ValueError(f"{name}: needs query, key and value, got {sorted(parts)}")
        chunks = [parts[p] for p in _QKV]
        if name.endswith(".weight"):
            chunks = [c.t() for c in chunks]
        out[name] = torch.cat(chunks, dim=-1)
    return out


def _max_seq_len_note(max_seq_len: int | None) -> None:
    if max_seq_len is not None:
        notice("translate_state_dict_to_hf_gpt2(max_seq_len=%s): no effect here: it sized "
               "GPT-2's causal-mask buffers, which transformers has not saved in state "
               "dicts since 4.27", max_seq_len)


def _already(state_dict: StateDict, form: str, prefixes: tuple[str, ...],
             other: tuple[str, ...]) -> bool:
    """Whether ``state_dict`` is already in ``form`` (keys under ``prefixes``, none under
    ``other``): then it is returned as is, with one line saying so (a Hugging Face GPT-2
    split in place by modelparallel keeps Hugging Face's names)."""
    if any(k.startswith(prefixes) for k in state_dict) and \
            not any(k.startswith(other) for k in state_dict):
        logger.info("GPT-2 state dict already in %s's names: returned unchanged", form)
        return True
    return False


_HF_KEYS = ("transformer.h.", "transformer.wte.")
_SMP_KEYS = ("transformer.seq_layers.", "word_embedding.")


def translate_hf_state_dict_to_smdistributed_gpt2(state_dict: StateDict) -> StateDict:
    """A ``GPT2LMHeadModel`` state dict in ``DistributedTransformerLMHead``'s names."""
    if _already(state_dict, "DistributedTransformerLMHead", _SMP_KEYS, _HF_KEYS):
        return dict(state_dict)
    out = _hf_to_smp_layers(state_dict, "transformer.seq_layers.")
    blocks = {int(m.group(1)) for k in state_dict if (m := _HF_BLOCK.match(k))}
    last = max(blocks, default=-1)
    simple = {"transformer.wte": "word_embedding", "transformer.wpe": "position_embedding",
              "transformer.ln_f": f"transformer.seq_layers.{last}.output.layernorm",
              "lm_head": "lm_head"}
    for name, value in state_dict.items():
        module, _, kind = name.rpartition(".")
        if module in simple:
            out[f"{simple[module]}.{kind}"] = value
        elif not name.startswith("transformer.h."):
            raise ValueError(f"unknown GPT-2 parameter {name!r}")
    return out


def translate_state_dict_to_hf_gpt2(state_dict: StateDict,
                                    max_seq_len: int | None = None) -> StateDict:
    """A ``DistributedTransformerLMHead`` state dict (GPT-2's arguments) in
    ``GPT2LMHeadModel``'s names, loadable with ``load_state_dict``."""
    _max_seq_len_note(max_seq_len)
    if _already(state_dict, "GPT2LMHeadModel", _HF_KEYS, _SMP_KEYS):
        return dict(state_dict)
    out: StateDict = {}
    qkv: dict[str, dict[str, torch.Tensor]] = {}
    layer = re.compile(r"transformer\.seq_layers\.(\d+)\.(.+)\.(weight|bias)$")
    last = max((int(m.group(1)) for k in state_dict if (m := layer.match(k))), default=-1)
    for name, value in state_dict.items():
        module, _, kind = name.rpartition(".")
        match = layer.match(name)
        if module in ("word_embedding", "position_embedding", "lm_head"):
            hf = {"word_embedding": "transformer.wte", "position_embedding": "transformer.wpe",
                  "lm_head": "lm_head"}[module]
            out[f"{hf}.{kind}"] = value
        elif match and match.group(2) == "output.layernorm" and int(match.group(1)) == last:
            out[f"transformer.ln_f.{kind}"] = value
        elif match:
            pair = _smp_to_hf_layer(match.group(1), match.group(2), kind, value, qkv)
            if pair is not None:
                out[pair[0]] = pair[1]
        else:
            raise ValueError(f"unknown parameter of DistributedTransformerLMHead: {name!r}")
    out.update(_fuse(qkv))
    return out


def translate_hf_state_dict_to_smdistributed_gpt2_layer(state_dict: StateDict) -> StateDict:
    """A ``GPT2LMHeadModel`` state dict whose blocks became ``DistributedTransformerLayer``:
    block parameters renamed (``transformer.h.<i>.attention.query.weight``), the rest as is."""
    out = _hf_to_smp_layers(state_dict, "transformer.h.")
    out.update({k: v for k, v in state_dict.items()
                if not k.startswith("transformer.h.")})
    return out


def translate_state_dict_to_hf_gpt2_layer(state_dict: StateDict,
                                          max_seq_len: int | None = None) -> StateDict:
    """The inverse of :func:`translate_hf_state_dict_to_smdistributed_gpt2_layer`."""
    _max_seq_len_note(max_seq_len)
    out: StateDict = {}
    qkv: dict[str, dict[str, torch.Tensor]] = {}
    layer = re.compile(r"transformer\.h\.(\d+)\.(.+)\.(weight|bias)$")
    for name, value in state_dict.items():
        match = layer.match(name)
        if match is None:
            out[name] = value
            continue
        pair = _smp_to_hf_layer(match.group(1), match.group(2), match.group(3), value, qkv)
        if pair is not None:
            out[pair[0]] = pair[1]
    out.update(_fuse(qkv))
    return out


# -- SMP's hooks replacing a GPT2LMHeadModel by a DistributedTransformerLMHead ----------

def hf_gpt2_transformer_lm_head_init_hook(config: Any) -> tuple[tuple, dict[str, Any]]:
    """``DistributedTransformerLMHead``'s arguments for a ``GPT2Config`` (SMP's init hook:
    ``gelu_new`` becomes ``"gelu"``, which is GPT-2's only with ``SMP_USE_HF_GELU=1``)."""
    if config.n_embd % config.n_head:
        raise ValueError(f"GPT-2: n_embd ({config.n_embd}) must be divisible by n_head "
                         f"({config.n_head})")
    if config.activation_function not in ("gelu_new", "relu"):
        raise ValueError("GPT-2: only the 'gelu_new' and 'relu' activations are supported, not "
                         f"{config.activation_function!r}")
    if getattr(config, "add_cross_attention", False):
        raise ValueError("GPT-2 with add_cross_attention is not supported (as in SMP)")
    if config.activation_function == "gelu_new" and os.environ.get("SMP_USE_HF_GELU") != "1" \
            and state.rank == 0:
        logger.warning("GPT-2's gelu_new (tanh approximation) becomes the exact GeLU in "
                       "DistributedTransformerLMHead, as in SMP; set SMP_USE_HF_GELU=1 to keep "
                       "GPT-2's own")
    return (), dict(
        num_layers=config.n_layer, num_attention_heads=config.n_head,
        attention_head_size=config.n_embd // config.n_head, hidden_size=config.n_embd,
        intermediate_size=config.n_inner or 4 * config.n_embd, vocab_size=config.vocab_size,
        num_positions=config.n_positions, attention_dropout_prob=config.attn_pdrop,
        hidden_dropout_prob=config.resid_pdrop, embedding_dropout_prob=config.embd_pdrop,
        activation="gelu" if config.activation_function == "gelu_new" else "relu",
        layernorm_epsilon=config.layer_norm_epsilon, initializer_range=config.initializer_range,
        use_normal_initialization=True, pre_layernorm=True, post_layernorm=True,
        causal_mask_size=config.n_positions, add_lm_head=True,
        scale_attention_scores=config.scale_attn_weights,
        scale_attn_by_layer_idx=config.scale_attn_by_inverse_layer_idx,
        attention_in_fp32=config.reorder_and_upcast_attn)


def hf_gpt2_transformer_lm_head_forward_hook(
        input_ids: Any = None, past_key_values: Any = None, attention_mask: Any = None,
        token_type_ids: Any = None, position_ids: Any = None, head_mask: Any = None,
        inputs_embeds: Any = None, encoder_hidden_states: Any = None,
        encoder_attention_mask: Any = None, labels: Any = None, use_cache: Any = None,
        output_attentions: Any = None, output_hidden_states: Any = None,
        return_dict: Any = None) -> tuple[tuple, dict]:
    """``GPT2LMHeadModel.forward``'s arguments as the LM head's input tuple (SMP's hook)."""
    unsupported = {"past_key_values": past_key_values, "head_mask": head_mask,
                   "inputs_embeds": inputs_embeds, "use_cache": use_cache,
                   "output_attentions": output_attentions,
                   "output_hidden_states": output_hidden_states,
                   "encoder_hidden_states": encoder_hidden_states}
    given = sorted(k for k, v in unsupported.items() if v is not None and v is not False)
    if given or return_dict is False:
        raise ValueError(f"GPT-2 replaced by DistributedTransformerLMHead: {given or ''} "
                         f"{'return_dict=False ' if return_dict is False else ''}"
                         "not supported (as in SMP)")
    return ((input_ids, attention_mask, token_type_ids, position_ids, labels),), {}


def hf_gpt2_transformer_lm_head_return_hook(outputs: Any) -> Any:
    """The LM head's ``logits`` or ``(loss, logits)`` as Hugging Face's output (SMP's hook)."""
    from transformers.modeling_outputs import CausalLMOutputWithCrossAttentions

    loss, logits = outputs if isinstance(outputs, tuple) else (None, outputs)
    return CausalLMOutputWithCrossAttentions(loss=loss, logits=logits)


def get_hf_gpt2_transformer_lm_head_hooks() -> tuple[Callable, Callable, Callable]:
    """SMP's ``(init_hook, forward_hook, return_hook)`` for ``GPT2LMHeadModel`` ->
    ``DistributedTransformerLMHead`` (``smp.tp_register_with_module``'s hooks)."""
    return (hf_gpt2_transformer_lm_head_init_hook, hf_gpt2_transformer_lm_head_forward_hook,
            hf_gpt2_transformer_lm_head_return_hook)


__all__ = ["get_hf_gpt2_transformer_lm_head_hooks",
           "hf_gpt2_transformer_lm_head_forward_hook", "hf_gpt2_transformer_lm_head_init_hook",
           "hf_gpt2_transformer_lm_head_return_hook",
           "translate_hf_state_dict_to_smdistributed_gpt2",
           "translate_hf_state_dict_to_smdistributed_gpt2_layer",
           "translate_state_dict_to_hf_gpt2", "translate_state_dict_to_hf_gpt2_layer"]


@tp_register.builtin("GPT2LMHeadModel")
def _lm_head_replacement() -> tp_register.Replacement:
    """SMP's out-of-the-box replacement of a marked ``GPT2LMHeadModel``."""
    init_hook, forward_hook, return_hook = get_hf_gpt2_transformer_lm_head_hooks()
    return tp_register.Replacement(DistributedTransformerLMHead, init_hook, forward_hook,
                                  return_hook, translate_hf_state_dict_to_smdistributed_gpt2,
                                  _layers_also_as_h)


def _layers_also_as_h(lm_head: torch.nn.Module) -> None:
    """``transformer.h`` names the same layers as ``transformer.seq_layers``: SMP scripts
    (train_gpt_simple.py) read either, depending on their own flags. Not a registered
    submodule, so the state dict keeps SMP's names only."""
    transformer = lm_head.get_submodule("transformer")
    object.__setattr__(transformer, "h", transformer.get_submodule("seq_layers"))
