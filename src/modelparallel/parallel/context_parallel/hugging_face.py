"""Context parallelism in a Hugging Face causal LM (Llama, Mistral, Qwen2/3, GPT-NeoX).

``install`` makes a model take this rank's chunks of each sequence (SMP's split,
``split.py``) and compute exactly what one process computes on the whole sequence:

- attention: the model's attention implementation is replaced by ring attention over
  the context-parallel group (``ring.py``), registered with transformers'
  ``AttentionInterface``; eager and sdpa compute the same softmax attention, so either
  may have been set;
- positions: ``position_ids`` default to the global positions of the rank's chunks, so
  rotary embeddings see where each token really is;
- labels: a causal LM predicts token ``t + 1`` at position ``t``, which for the last
  position of a chunk lies in another chunk; the labels are gathered over the group,
  shifted on the whole sequence and split again (passed as ``shift_labels``);
- normalisation: each rank's loss is its summed token losses over the group's count of
  targets divided by ``cp`` (``num_items_in_batch``), so that the data-parallel
  average of the gradients (over every rank of the group) is the gradient of the
  whole sequence's mean loss; a ``num_items_in_batch`` the caller passes (e.g.
  ``mp.global_token_count(labels, shift=True)``) is kept.

Attention dropout drops the weights the model's own attention would, with masks of
global positions (``dropout.py``). Padding masks are refused (mask labels with -100
instead), as is sliding-window attention (as SMP refuses it).
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from modelparallel.config import ConfigError
from modelparallel.module_state import lookup, state_of
from modelparallel.parallel.context_parallel import split
from modelparallel.parallel.context_parallel.ring import COMM_TYPES, ring_attention
from modelparallel.parallel.token_count import IGNORE_INDEX, valid_targets

ATTENTION = "modelparallel_context_parallel"
MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3", "gpt_neox")
USER_IMPLEMENTATIONS = ("eager", "sdpa")


@dataclass(frozen=True)
class SequenceSplit:
    """How a model's sequences are split: the group, this rank's place, the exchange."""

    group: dist.ProcessGroup
    cp_rank: int
    cp_size: int
    comm_type: str
    replaced_implementation: str  # the attention implementation the model had


def install(model: nn.Module, group: dist.ProcessGroup, comm_type: str) -> nn.Module:
    """Make ``model`` (a Hugging Face causal LM) compute on this rank's chunks of each
    sequence with ring attention over ``group``. Raises ``ConfigError`` for a model this
    cannot split exactly."""
    if comm_type not in COMM_TYPES:
        raise ValueError(f"cp_comm_type={comm_type!r}; use 'p2p' or 'all_gather'")
    causal_lm = find_causal_lm(model)
    config = _check_model(model if causal_lm is None else causal_lm)
    assert causal_lm is not None  # _check_model refused a model without one
    setting = SequenceSplit(group, dist.get_rank(group), dist.get_world_size(group),
                            comm_type, config._attn_implementation)
    _register()
    causal_lm.set_attn_implementation(ATTENTION)  # type: ignore[operator]
    for module in causal_lm.modules():
        if _is_attention(module):
            state_of(module).context_parallel = setting
    state_of(causal_lm).context_parallel = setting
    state_of(model).context_parallel = setting  # what the appliers check
    causal_lm.register_forward_pre_hook(_before_forward, with_kwargs=True)
    return model


def find_causal_lm(model: nn.Module) -> nn.Module | None:
    """The outermost module of ``model`` (itself, or one inside a script's own wrapper)
    whose Hugging Face ``model_type`` context parallelism knows; None if none is."""
    for module in model.modules():
        if getattr(getattr(module, "config", None), "model_type", None) in MODEL_TYPES:
            return module
    return None


def _check_model(model: nn.Module) -> Any:
    config: Any = getattr(model, "config", None)
    model_type = getattr(config, "model_type", None)
    name = type(model).__name__
    problems = []
    if model_type not in MODEL_TYPES or not hasattr(model, "set_attn_implementation"):
        problems.append(f"{name} (model_type {model_type!r}) is not a model context "
                        f"parallelism knows how to split; supported: Hugging Face causal LMs "
                        f"of the types {', '.join(MODEL_TYPES)}")
    elif not name.endswith(("ForCausalLM", "Model")):
        problems.append(f"{name} is not a causal language model (nor its base model): a "
                        "rank holds only its chunks of each sequence, so a head that reads "
                        "one position of it (classification, question answering) would "
                        "read the wrong one; context parallelism splits *ForCausalLM "
                        "models and their base models")
    else:
        if config._attn_implementation not in USER_IMPLEMENTATIONS:
            problems.append(f"{name} uses attn_implementation="
                            f"{config._attn_implementation!r}; with context parallelism use "
                            f"{' or '.join(map(repr, USER_IMPLEMENTATIONS))} (both are "
                            "replaced by ring attention)")
        windows = {getattr(m, "sliding_window", None) for m in model.modules()}
        if getattr(config, "sliding_window", None) is not None and (
                model_type == "mistral" or windows - {None}):
            problems.append(f"{name} uses sliding-window attention (sliding_window="
                            f"{config.sliding_window}), which context parallelism does not "
                            "support (nor does SMP); set config.sliding_window = None")
    if problems:
        raise ConfigError([("context_parallel_degree", p) for p in problems])
    return config


def _is_attention(module: nn.Module) -> bool:
    return hasattr(module, "scaling") and any(
        hasattr(module, proj) for proj in ("q_proj", "query_key_value"))


def _register() -> None:
    from transformers import AttentionInterface

    AttentionInterface.register(ATTENTION, _attention)


def _attention(module: nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
               attention_mask: torch.Tensor | None, scaling: float | None = None,
               dropout: float = 0.0, **kwargs: Any) -> tuple[torch.Tensor, None]:
    """transformers' attention-function signature: (B, H, L, D) in, (B, L, H, D) out."""
    setting: SequenceSplit | None = lookup(module, "context_parallel")
    if setting is None:
        raise RuntimeError(f"{type(module).__name__} runs attn_implementation={ATTENTION!r} but "
                           "was not transformed with context parallelism (tsm.transform)")
    if kwargs.get("sliding_window") is not None:
        raise ConfigError([("context_parallel_degree", "sliding-window attention cannot be "
                            "split over context-parallel ranks")])
    out = ring_attention(query, key, value, setting.group, setting.comm_type, scaling,
                         dropout)
    return out.transpose(1, 2).contiguous(), None


def _before_forward(model: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
    setting: SequenceSplit = state_of(model).context_parallel
    bound = inspect.signature(model.forward).bind_partial(*args, **kwargs).arguments
    extra = bound.pop("kwargs", {})
    inputs = {**bound, **extra}
    tokens = inputs.get("input_ids")
    if tokens is None:
        tokens = inputs.get("inputs_embeds")
    if tokens is None:
        return args, kwargs
    length = tokens.shape[1]
    split.check_local_length(length, setting.cp_size)
    mask = inputs.get("attention_mask")
    if mask is not None:
        if not bool(mask.all()):
            raise ValueError(
                "attention_mask masks positions: with context parallelism a rank holds only "
                "its chunks of each sequence, so padding masks are not supported; pass "
                "attention_mask=None and set the labels of padding to -100")
        inputs["attention_mask"] = None
    if inputs.get("position_ids") is None:
        inputs["position_ids"] = split.positions(setting.cp_rank, setting.cp_size, length,
                                                 tokens.device).unsqueeze(0)
    labels = inputs.get("labels")
    if labels is not None and inputs.get("shift_labels") is None:
        inputs["shift_labels"] = shifted_labels(labels, setting)
        if inputs.get("num_items_in_batch") is None:
            inputs["num_items_in_batch"] = _mean_count(inputs["shift_labels"], setting)
    return (), inputs


def shifted_labels(labels: torch.Tensor, setting: SequenceSplit) -> torch.Tensor:
    """This rank's targets: the labels shifted by one on the whole sequence (the last
    position of a sequence predicts nothing)."""
    whole = split.gather_whole(labels, setting.group)
    shifted = torch.nn.functional.pad(whole[:, 1:], (0, 1), value=IGNORE_INDEX)
    return split.split(shifted, setting.cp_rank, setting.cp_size)


def _mean_count(targets: torch.Tensor, setting: SequenceSplit) -> torch.Tensor:
    """The group's count of targets over ``cp``: each rank's summed loss over it is its
    share of the whole sequences' mean loss times ``cp`` (the data-parallel average
    divides by ``cp`` again)."""
    count = valid_targets(targets).to(torch.get_default_dtype())
    dist.all_reduce(count, group=setting.group)
    return count / setting.cp_size
