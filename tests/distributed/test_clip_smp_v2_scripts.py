"""Gradient clipping as the SMP v2 shared-scripts do it, vs one process.

The scripts (``train_lib.py`` of SageMaker's ``sm-distributed_model_parallel_v2``
examples) build a Hugging Face model, ``tsm.transform`` it with
``--use_smp_implementation 1`` (else they set ``tsm.state.tensor_parallel_degree = 1``
before ``tsm.init()``), wrap it in torch's FSDP1 (a transformer auto-wrap policy,
``HYBRID_SHARD``, backward/forward prefetch, ``use_orig_params`` from the command line,
always on with SMP's implementation), apply reentrant activation checkpointing to the
layers, then torch's ``offload_wrapper`` (``sm_activation_offloading`` is SMP v2's
default), and clip with ``torch.sagemaker.grad_norm.clip_grad_norm_(model, 1.0)``
before AdamW with weight-decay groups. Here the same steps, written anew, train a tiny
Llama: the norm the call returns at every step, the losses, and every parameter and
optimizer state at the end equal one process's. The optimizer is SGD with momentum over
the same groups: its step is proportional to the clipped gradient, so a wrong norm shows
in every parameter (Adam's normalised step hides a wrong scale, and magnifies the
round-off of near-zero gradients beyond any fixed tolerance).
"""

import functools

import pytest
import torch
from torch import nn

STEPS = 3
ROWS, SEQ, VOCAB = 8, 16, 128
MAX_NORM = 0.5
LR, WEIGHT_DECAY = 0.5, 0.2


def build() -> nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=128,
                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=4,
                         max_position_embeddings=SEQ, use_cache=False,
                         tie_word_embeddings=False, pretraining_tp=1)
    return LlamaForCausalLM(config)


def batches() -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return [torch.randint(VOCAB, (ROWS, SEQ), generator=g) for _ in range(STEPS)]


def optimizer(model: nn.Module) -> torch.optim.Optimizer:
    """Two groups, as the scripts split them: no weight decay for the parameters of norms
    and biases. (FSDP1's flat parameters belong to no norm: all of them decay, in one
    process too.)"""
    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    decay, no_decay = [], []
    for module in model.modules():
        for name, p in module._parameters.items():
            if p is not None:
                norm = isinstance(module, LlamaRMSNorm) or name == "bias"
                (no_decay if norm else decay).append(p)
    return torch.optim.SGD([{"params": decay}, {"params": no_decay, "weight_decay": 0.0}],
                           lr=LR, momentum=0.9, weight_decay=WEIGHT_DECAY)


def loss_of(model: nn.Module, ids: torch.Tensor) -> torch.Tensor:
    return model(input_ids=ids, attention_mask=None, labels=ids)["loss"]


@functools.cache
def reference(flat: bool) -> tuple[list[float], list[float], dict, dict]:
    """One process: losses, norms, parameters and optimizer states by name (``flat``:
    every parameter decays, as for FSDP1's flat parameters)."""
    model = build()
    opt = optimizer(model)
    if flat:
        for group in opt.param_groups:
            group["weight_decay"] = WEIGHT_DECAY
    losses, norms = [], []
    for ids in batches():
        opt.zero_grad(set_to_none=True)
        loss = loss_of(model, ids)
        loss.backward()
        norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM)))
        opt.step()
        losses.append(float(loss.detach()))
    names = {p: n for n, p in model.named_parameters()}
    states = {names[p]: {k: v.clone() for k, v in s.items() if k != "step"}
              for p, s in opt.state.items()}
    return losses, norms, {n: p.detach().clone() for n, p in model.named_parameters()}, states


def script_case(config: dict, smp_implementation: bool, use_orig_params: bool):
    """The scripts' model, wrappers and clipping on this rank; what differs from
    :func:`reference` (an empty list when nothing does)."""
    import torch.distributed as dist
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import (
        CheckpointImpl,
        apply_activation_checkpointing,
        checkpoint_wrapper,
        offload_wrapper,
    )
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        get_optimizer_state_dict,
    )
    from torch.distributed.fsdp import BackwardPrefetch, ShardingStrategy
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
    from torch.distributed.fsdp.wrap import transformer_auto_wrap_policy
    from transformers.models.llama.modeling_llama import LlamaDecoderLayer

    import modelparallel as tsm
    from modelparallel.data import replica_rank_and_size
    from modelparallel.smp.v2.grad_norm import clip_grad_norm_  # torch.sagemaker.grad_norm's
    from modelparallel.smp.v2.nn.tensor_parallel_transformer import TransformerLayer
    from modelparallel.testing import TrainResult, full_parameters, local_rows, parity_problems

    tsm.reset()
    if not smp_implementation:  # the scripts drop SMP's degrees before tsm.init()
        tsm.state.tensor_parallel_degree = 1
    tsm.init(config)
    model = build()
    if smp_implementation:
        model = tsm.transform(model)
    layer = TransformerLayer if smp_implementation else LlamaDecoderLayer
    model = FSDP(model,
                 auto_wrap_policy=functools.partial(transformer_auto_wrap_policy,
                                                    transformer_layer_cls={layer}),
                 mixed_precision=None, sharding_strategy=ShardingStrategy.HYBRID_SHARD,
                 backward_prefetch=BackwardPrefetch.BACKWARD_PRE, forward_prefetch=True,
                 limit_all_gathers=True, device_id=torch.device("cpu"),
                 use_orig_params=use_orig_params,
                 param_init_fn=None, sync_module_states=False)
    apply_activation_checkpointing(
        model, check_fn=lambda m: isinstance(m, layer),
        checkpoint_wrapper_fn=functools.partial(checkpoint_wrapper,
                                                checkpoint_impl=CheckpointImpl.REENTRANT))
    model = offload_wrapper(model)
    opt = optimizer(model)
    replica = replica_rank_and_size()
    group = tsm.get_dp_process_group()
    losses, norms = [], []
    for ids in batches():
        opt.zero_grad(set_to_none=True)
        loss = loss_of(model, local_rows((ids, ids), *replica)[0])
        loss.backward()
        norms.append(float(clip_grad_norm_(model, MAX_NORM)))
        opt.step()
        value = loss.detach().double()
        dist.all_reduce(value, group=group)
        losses.append(float(value) / dist.get_world_size(group))
    ref_losses, ref_norms, ref_params, ref_states = reference(not use_orig_params)
    assert all(n > MAX_NORM for n in ref_norms)  # every step clips
    problems = [f"step {i}: norm {a:.7f} vs one process's {b:.7f}"
                for i, (a, b) in enumerate(zip(norms, ref_norms, strict=True))
                if not abs(a - b) <= 1e-5 * b]
    problems += parity_problems(TrainResult(losses, full_parameters(model)),
                                TrainResult(ref_losses, ref_params))
    saved = get_optimizer_state_dict(model, opt,
                                     options=StateDictOptions(full_state_dict=True))["state"]
    states = {f"{name}.{k}": v for name, s in saved.items() for k, v in s.items() if k != "step"}
    ref = {f"{name}.{k}": v for name, s in ref_states.items() for k, v in s.items()}
    problems += parity_problems(TrainResult([], states), TrainResult([], ref))
    return problems


# id: (world size, configuration, --use_smp_implementation, use_orig_params: always on
# with SMP's implementation, as the scripts set it)
CASES = {
    "hsd0": (2, {"tensor_parallel_degree": 2}, False, False),
    "hsd1-orig-params": (2, {"hybrid_shard_degree": 1}, False, True),
    "hsd2": (2, {"hybrid_shard_degree": 2}, False, False),
    "hsd2-orig-params": (2, {"hybrid_shard_degree": 2}, False, True),
    "smp-hsd0": (2, {"hybrid_shard_degree": 0}, True, True),
    "smp-tp2": (2, {"tensor_parallel_degree": 2, "hybrid_shard_degree": 1}, True, True),
    "hsd2-4ranks": (4, {"hybrid_shard_degree": 2}, False, False),
    "smp-tp2-hsd1-4ranks": (4, {"tensor_parallel_degree": 2, "hybrid_shard_degree": 1},
                            True, True),
    "smp-tp2-hsd2-4ranks": (4, {"tensor_parallel_degree": 2, "hybrid_shard_degree": 2},
                            True, True),
}


@pytest.mark.parametrize("case", list(CASES))
def test_script_clipping_matches_one_process(workers, case):
    world, config, smp_implementation, use_orig_params = CASES[case]
    for rank, problems in enumerate(workers(world).run(
            script_case, config=config, smp_implementation=smp_implementation,
            use_orig_params=use_orig_params)):
        assert problems == [], rank


def internals_case() -> dict[str, bool]:
    import torch.distributed.fsdp._optim_utils as fsdp_optim_utils
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
    from torch.distributed.fsdp import ShardingStrategy
    from torch.distributed.fsdp.wrap import ModuleWrapPolicy

    import modelparallel as tsm
    from modelparallel.parallel import fsdp1_torch

    tsm.reset()
    tsm.init({})  # hybrid_shard_degree 0: torch's own HYBRID_SHARD groups, one rank each
    model = FSDP(nn.Sequential(nn.Linear(4, 4)), auto_wrap_policy=ModuleWrapPolicy({nn.Linear}),
                 sharding_strategy=ShardingStrategy.HYBRID_SHARD, device_id=torch.device("cpu"))
    return {
        "FSDP1's replica group of a hybrid unit": "_inter_node_pg" in model.__dict__,
        "one-rank shard groups stay hybrid": model.sharding_strategy is
                                             ShardingStrategy.HYBRID_SHARD,
        "FSDP1's optimizer key mapping found":
            fsdp_optim_utils._map_param_key_to_optim_keys
            is fsdp1_torch._map_param_key_to_optim_keys,
    }


def test_fsdp1_internals_the_hybrid_fixes_rely_on(workers):
    """Fails, naming what moved, if torch changes what fsdp1_torch's fixes for hybrid
    strategies over one-rank shard groups use."""
    for got in workers(2).run(internals_case):
        assert got == dict.fromkeys(got, True)
