"""Expert parallelism with tensor parallelism (beyond SMP, which refuses the mix) against
one process: the tiny float64 Hugging Face MoE models of ``test_expert_parallel.py``
(Mixtral; Qwen2-MoE with its shared expert, split over the tensor-parallel ranks, and a
dense layer; Qwen3-MoE with a dense first layer and per-head norms) transformed with
``tsm.transform(model, config=MoEConfig(...))`` at ``expert_parallel_degree`` 2 x
``tensor_parallel_degree`` 2 and sharded with ``mp.shard``, each rank passing its own
rows (the tensor-parallel group runs its ranks' rows together), with the load-balancing
loss off and on. Tensor parallelism alone splits these models too (their experts whole on
every rank), under ``mp.shard``, ``mp.replicate`` and torch's FSDP1; OLMoE, which no
plan splits, trains with its tensor-parallel ranks as replicas (its load-balancing loss
summed over them) and is refused with expert parallelism.

Each case compares the loss of every step (the ranks' mean), the gradient norm
(``tsm.clip_grad_norm_``) of every step, every parameter and every momentum buffer at the
end with one process training the whole batch, read as full state dicts. On 8 ranks
(extended tier) each expert also has 2 data-parallel copies, replicated or sharded. A
DCP checkpoint saved at ep 2 x tp 2 resumes without either and back; the state
attributes name the right groups.
"""

from __future__ import annotations

import functools

import pytest
import torch
from test_expert_parallel import ROWS, SEQ, VOCAB, batches, build, optimizer
from torch import nn

COEF = 0.5  # the load-balancing loss's weight when on (large, so that it weighs)
EP_TP = {"expert_parallel_degree": 2, "tensor_parallel_degree": 2}


def model_of(family: str) -> nn.Module:
    """A tiny float64 model of ``family``: ``test_expert_parallel.build``'s, or OLMoE
    (whose norms over all heads' queries and keys no tensor-parallel plan splits)."""
    if family != "olmoe":
        return build(family)
    import transformers

    torch.manual_seed(0)
    return transformers.OlmoeForCausalLM(transformers.OlmoeConfig(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=32, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, num_experts=4, num_experts_per_tok=2,
        max_position_embeddings=SEQ, use_cache=False, tie_word_embeddings=False,
        eos_token_id=None, pad_token_id=None, attn_implementation="eager",
        experts_implementation="eager")).to(torch.float64)


def with_router_loss(model: nn.Module, on: bool) -> nn.Module:
    """``model`` adding its routers' load-balancing loss weighted by ``COEF`` (when
    ``on``), as ``MoEConfig(moe_load_balancing="aux_loss", moe_aux_loss_coeff=COEF)``
    sets it."""
    if on:
        model.config.output_router_logits = True
        model.config.router_aux_loss_coef = COEF
        model.router_aux_loss_coef = COEF
    return model


@functools.cache
def reference(family: str, aux: bool) -> tuple[list[float], dict, dict, list[float]]:
    """One process's losses, parameters, momentum buffers and gradient norms."""
    model = with_router_loss(model_of(family), aux)
    opt = optimizer(model)
    losses, norms = [], []
    for ids in batches():
        opt.zero_grad(set_to_none=True)
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), 1e9)))
        opt.step()
        losses.append(float(loss.detach()))
    names = {p: n for n, p in model.named_parameters()}
    states = {f"{names[p]}.{k}": v.clone() for p, s in opt.state.items()
              for k, v in s.items()}
    return losses, {n: p.detach().clone() for n, p in model.named_parameters()}, states, norms


def moe_config(aux: bool):
    from modelparallel.smp.v2.moe import MoEConfig  # torch.sagemaker.moe.moe_config

    if aux:
        return MoEConfig(smp_moe=False, moe_load_balancing="aux_loss",
                         moe_aux_loss_coeff=COEF, moe_z_loss_coeff=0)
    return MoEConfig(smp_moe=False, moe_load_balancing="none")


def ep_tp_case(config: dict, family: str, aux: bool, wrapper: str = "shard") -> list[str]:
    """This rank's run; what differs from :func:`reference` (empty when nothing does).
    ``wrapper``: ``mp.shard``, ``mp.replicate`` or torch's FSDP1 (no expert parallelism)."""
    import torch.distributed as dist
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        get_optimizer_state_dict,
    )

    import modelparallel as tsm
    from modelparallel.data import replica_rank_and_size
    from modelparallel.testing import TrainResult, full_parameters, parity_problems

    tsm.reset()
    tsm.init(config)
    model = tsm.transform(model_of(family), config=moe_config(aux))
    if wrapper == "shard":
        model = tsm.shard(model, blocks=(type(model.model.layers[0]),))
    elif wrapper == "replicate":
        model = tsm.replicate(model)
    else:
        from torch.distributed.fsdp import FullyShardedDataParallel

        model = FullyShardedDataParallel(model, use_orig_params=True)
    opt = optimizer(model)
    index, count = replica_rank_and_size()  # (dp_rank, dp_size): each rank its own rows
    rows = ROWS // count
    losses, norms = [], []
    for ids in batches():
        ids = ids[index * rows:(index + 1) * rows]
        opt.zero_grad(set_to_none=True)
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        norms.append(float(tsm.clip_grad_norm_(model, 1e9)))  # FSDP1 needs the model
        opt.step()
        value = loss.detach().double()
        dist.all_reduce(value)
        losses.append(float(value) / dist.get_world_size())
    ref_losses, ref_params, ref_states, ref_norms = reference(family, aux)
    problems = parity_problems(TrainResult(losses, full_parameters(model)),
                               TrainResult(ref_losses, ref_params))
    problems += [f"step {i}: gradient norm {a} vs {b}"
                 for i, (a, b) in enumerate(zip(norms, ref_norms, strict=True))
                 if not abs(a - b) <= 1e-12 * b]
    saved = get_optimizer_state_dict(model, opt,
                                     options=StateDictOptions(full_state_dict=True))["state"]
    states = {f"{name}.{k}": v for name, s in saved.items() for k, v in s.items()}
    problems += parity_problems(TrainResult([], states), TrainResult([], ref_states))
    return problems


def test_mixtral_at_ep_2_x_tp_2_trains_as_one_process(workers):
    # ep groups {0, 2} and {1, 3} (the data-parallel ranks of each tensor-parallel rank);
    # the load-balancing loss off and on
    for aux in (False, True):
        for rank, problems in enumerate(workers(4).run(ep_tp_case, config=EP_TP,
                                                       family="mixtral", aux=aux)):
            assert problems == [], (aux, rank)


def test_qwen_moe_models_with_tensor_parallelism_train_as_one_process(workers):
    # Qwen2-MoE's shared expert is split over the tensor-parallel ranks, its experts are
    # not; Qwen3-MoE's per-head norms are summed over them; tensor parallelism alone
    # splits a MoE model too (its experts whole on every rank), under every wrapper
    tp2 = {"tensor_parallel_degree": 2}
    cases = [(EP_TP, "qwen2_moe", True, "shard"), (EP_TP, "qwen3_moe", False, "shard"),
             (tp2, "qwen2_moe", True, "shard"), (tp2, "qwen2_moe", True, "replicate"),
             (tp2, "mixtral", True, "fsdp1"), (tp2, "olmoe", True, "shard")]
    for config, family, aux, wrapper in cases:
        for rank, problems in enumerate(workers(4).run(ep_tp_case, config=config,
                                                       family=family, aux=aux,
                                                       wrapper=wrapper)):
            assert problems == [], (config, family, aux, wrapper, rank)


@pytest.mark.extended  # about 40 s on 2 cores; the 4-rank test covers ep x tp
def test_expert_and_tensor_parallel_with_hybrid_sharding_on_8_ranks(workers):
    # ep 2 x tp 2 x 2 copies of each expert, replicated (hybrid_shard_degree 2) or
    # sharded (0) over them; the ranks of a tensor-parallel group pass the same rows
    # (prescaled_batch: 8 ranks, 4 rows)
    for hybrid in (2, 0):
        config = {**EP_TP, "hybrid_shard_degree": hybrid, "prescaled_batch": True}
        for rank, problems in enumerate(workers(8).run(ep_tp_case, config=config,
                                                       family="mixtral", aux=True)):
            assert problems == [], (hybrid, rank)


def resume_case(root: str, layouts: list[dict]) -> list[str]:
    """``test_expert_parallel_checkpoint.py``'s Mixtral, one AdamW step per layout, each
    resuming the previous step's DCP checkpoint (torch's ``get_state_dict``,
    ``tsm.checkpoint.save`` / ``load``, ``set_state_dict``); what differs from one
    process's three steps at the end (parameters and optimizer state)."""
    import test_expert_parallel_checkpoint as saved_at
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    import modelparallel as tsm
    from modelparallel.data import replica_rank_and_size
    from modelparallel.testing import TrainResult, full_parameters, parity_problems

    for step, config in enumerate(layouts):
        tsm.reset()
        tsm.init(config)
        model = saved_at.build()
        if config:  # ep x tp: transformed; none: sharded as it is
            model = tsm.transform(model, config=moe_config(False))
        model = tsm.shard(model, blocks=(type(model.model.layers[0]),))
        opt = saved_at.optimizer(model)
        if step > 0:
            model_sd, optim_sd = get_state_dict(model, opt)
            state = {"model": model_sd, "optimizer": optim_sd}
            tsm.checkpoint.load(state, checkpoint_id=f"{root}/step{step - 1}")
            set_state_dict(model, opt, model_state_dict=state["model"],
                           optim_state_dict=state["optimizer"])
        index, count = replica_rank_and_size()
        rows = saved_at.ROWS // count
        ids = saved_at.batches()[step][index * rows:(index + 1) * rows]
        opt.zero_grad(set_to_none=True)
        model(input_ids=ids, labels=ids).loss.backward()
        opt.step()
        model_sd, optim_sd = get_state_dict(model, opt)
        tsm.checkpoint.save({"model": model_sd, "optimizer": optim_sd},
                            checkpoint_id=f"{root}/step{step}")
    ref_params, ref_states = saved_at.reference()
    return parity_problems(TrainResult([], full_parameters(model)),
                           TrainResult([], ref_params)) + \
        parity_problems(TrainResult([], saved_at.flat_states(model, opt)),
                        TrainResult([], ref_states))


def test_a_checkpoint_saved_at_ep_tp_resumes_without_them_and_back(workers, tmp_path):
    # ep 2 x tp 2 -> neither (every parameter sharded over the 4 ranks) -> ep 2 x tp 2
    results = workers(4).run(resume_case, root=str(tmp_path), layouts=[EP_TP, {}, EP_TP])
    for rank, problems in enumerate(results):
        assert problems == [], rank


def state_case() -> dict[str, object]:
    """SMP v2's expert- and tensor-parallel state attributes on this rank, which experts
    it holds, the refusal of a model tensor parallelism does not split, and of
    ``mp.replicate`` (ep x tp is built under ``mp.shard``)."""
    import warnings

    import torch.distributed as dist

    import modelparallel as tsm
    from modelparallel.config import ConfigError

    tsm.reset()
    tsm.init(EP_TP)
    model = tsm.transform(build(), config=moe_config(False))
    held = model.model.layers[0].mlp.experts._parameters["gate_up_proj"]
    first = 2 * tsm.state.ep_rank
    whole = build().model.layers[0].mlp.experts.gate_up_proj
    try:
        with warnings.catch_warnings():  # the warning that OLMoE is left unsplit
            warnings.simplefilter("ignore")
            tsm.transform(model_of("olmoe"), config=moe_config(False))
        unsplit = "no error"
    except ConfigError as e:
        unsplit = str(e)
    try:  # expert and tensor parallelism are built under mp.shard only
        tsm.replicate(tsm.transform(build(), config=moe_config(False)))
        replicated = "no error"
    except ConfigError as e:
        replicated = str(e)
    return {"unsplit": unsplit, "replicate": replicated,
            "ep": (tsm.state.ep_rank, tsm.state.ep_size,
                   dist.get_process_group_ranks(tsm.state.ep_process_group)),
            "tp": (tsm.state.tp_rank, tsm.state.tp_size),
            "held": torch.equal(held.to_local(), whole[first:first + 2].detach()),
            "mesh": held.device_mesh.mesh.flatten().tolist()}


def test_state_attributes_name_the_data_parallel_ranks_of_a_tensor_parallel_rank(workers):
    # and a model whose tensor-parallel ranks would be replicas (no plan) is refused
    # tp is the innermost dim: tp groups {0, 1}, {2, 3}; the ep groups are the
    # data-parallel ranks with the same tp rank, and the experts' mesh holds only them
    for rank, got in enumerate(workers(4).run(state_case)):
        assert "expert_parallel_degree: 2 with tensor_parallel_degree=2 needs a model " \
               "tensor parallelism splits (Mixtral, Qwen2-MoE and Qwen3-MoE have plans); " \
               "OlmoeForCausalLM has none" in got.pop("unsplit"), rank
        assert "expert_parallel_degree: 2 with tensor_parallel_degree 2 under " \
               "mp.replicate() is not built yet" in got.pop("replicate"), rank
        group = [rank % 2, rank % 2 + 2]
        assert got == {"ep": (rank // 2, 2, group), "tp": (rank % 2, 2), "held": True,
                       "mesh": group}, rank
