"""Expert parallelism against one process: tiny Hugging Face mixture-of-experts models
(4 experts, top-2: Mixtral; Qwen2-MoE with its shared expert and gate, a dense layer and
unnormalized top-k weights; Qwen3-MoE with a dense first layer) transformed with
``tsm.transform(model, config=MoEConfig(smp_moe=False, moe_load_balancing="none"))`` at
``expert_parallel_degree`` 2 or 4 and sharded with ``mp.shard``, each rank training its
own rows of every batch.

Each case compares the loss of every step (the ranks' mean), every parameter and every
optimizer state at the end with one process training the whole batch, read as full
state dicts (each expert weight whole, ``(experts, ...)``, on every rank). The models
are built and trained in float64, so that round-off cannot flip a router's top-k choice
between the runs. The optimizer is SGD with momentum and weight decay: a wrong gradient
shows in every parameter, and a step skipped or taken where one process does the other
shows too.
"""

from __future__ import annotations

import contextlib
import functools

import torch
from torch import nn

STEPS, ROWS, SEQ, VOCAB = 3, 4, 16, 128
LR = 0.5
IDLE = 3  # the expert the idle-expert cases' routers never choose


def build(family: str = "mixtral", idle: bool = False) -> nn.Module:
    """A tiny model of ``family`` in float64; with ``idle``, its routers never choose
    expert ``IDLE`` (no token reaches it on any rank)."""
    import transformers

    torch.manual_seed(0)
    common = dict(vocab_size=VOCAB, hidden_size=64, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, num_experts_per_tok=2,
                  max_position_embeddings=SEQ, use_cache=False, tie_word_embeddings=False,
                  attn_implementation="eager",
                  experts_implementation="eager")  # grouped_mm has no float64 kernel
    if family == "mixtral":
        model = transformers.MixtralForCausalLM(transformers.MixtralConfig(
            intermediate_size=128, num_local_experts=4, sliding_window=None, **common))
    elif family == "qwen2_moe":  # layer 1 dense; top-k weights not renormalized
        model = transformers.Qwen2MoeForCausalLM(transformers.Qwen2MoeConfig(
            intermediate_size=96, moe_intermediate_size=32,
            shared_expert_intermediate_size=48, num_experts=4, norm_topk_prob=False,
            decoder_sparse_step=1, mlp_only_layers=[1], **common))
    else:  # qwen3_moe: layer 0 dense (every second layer sparse)
        model = transformers.Qwen3MoeForCausalLM(transformers.Qwen3MoeConfig(
            intermediate_size=96, moe_intermediate_size=32, num_experts=4,
            norm_topk_prob=True, decoder_sparse_step=2, head_dim=16, **common))
    if idle:
        for layer in model.model.layers:
            if hasattr(layer.mlp, "gate") and hasattr(layer.mlp, "experts"):
                layer.mlp.gate.register_forward_hook(_never_idle_expert)
    return model.to(torch.float64)


def _never_idle_expert(router: nn.Module, args: tuple, output: tuple) -> tuple:
    """The router's choice made again with expert ``IDLE``'s logit at -inf (Mixtral's
    router: softmax in float32, top-k, renormalized)."""
    logits = output[0].clone()
    logits[:, IDLE] = float("-inf")
    top, index = torch.topk(torch.softmax(logits.float(), dim=-1), router.top_k, dim=-1)
    return output[0], top / top.sum(dim=-1, keepdim=True), index


def batches() -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return [torch.randint(VOCAB, (ROWS, SEQ), generator=g) for _ in range(STEPS)]


def optimizer(model: nn.Module) -> torch.optim.Optimizer:
    return torch.optim.SGD(model.parameters(), lr=LR, momentum=0.9, weight_decay=0.01)


@functools.cache
def reference(family: str = "mixtral", idle: bool = False
              ) -> tuple[list[float], dict, dict, float, list[float]]:
    """One process's losses, parameters and momentum buffers, the largest gradient any
    step gave expert ``IDLE``, and each step's gradient norm."""
    return one_process(build(family, idle))


def one_process(model: nn.Module) -> tuple[list[float], dict, dict, float, list[float]]:
    """:func:`reference`'s figures for ``model`` trained on the whole batches."""
    opt = optimizer(model)
    losses, idle_grad, norms = [], 0.0, []
    for ids in batches():
        opt.zero_grad(set_to_none=True)
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        idle_grad = max([idle_grad] + [float(p.grad[IDLE].abs().max())
                                       for n, p in model.named_parameters()
                                       if ".experts." in n and p.grad is not None])
        norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), 1e9)))
        opt.step()
        losses.append(float(loss.detach()))
    names = {p: n for n, p in model.named_parameters()}
    states = {f"{names[p]}.{k}": v.clone() for p, s in opt.state.items()
              for k, v in s.items()}
    params = {n: p.detach().clone() for n, p in model.named_parameters()}
    return losses, params, states, idle_grad, norms


def train_own_rows(model: nn.Module, opt: torch.optim.Optimizer, clip
                   ) -> tuple[list[float], list[float]]:
    """Train on this rank's rows of :func:`batches`, ``clip(model.parameters())`` before
    each step: every step's loss (the ranks' mean) and the norm ``clip`` returned."""
    import torch.distributed as dist

    from modelparallel.data import replica_rank_and_size

    index, count = replica_rank_and_size()
    rows = ROWS // count
    losses, norms = [], []
    for ids in batches():
        ids = ids[index * rows:(index + 1) * rows]
        opt.zero_grad(set_to_none=True)
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        norms.append(float(clip(model.parameters())))
        opt.step()
        value = loss.detach().double()
        dist.all_reduce(value)
        losses.append(float(value) / dist.get_world_size())
    return losses, norms


def ep_case(config: dict, family: str = "mixtral", idle: bool = False) -> list[str]:
    """This rank's run; what differs from :func:`reference` (empty when nothing does)."""
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        get_optimizer_state_dict,
    )

    import modelparallel as tsm
    from modelparallel.smp.v2.moe import MoEConfig  # torch.sagemaker.moe.moe_config
    from modelparallel.testing import TrainResult, full_parameters, parity_problems

    tsm.reset()
    tsm.init(config)
    moe = MoEConfig(smp_moe=False, moe_load_balancing="none")
    model = tsm.transform(build(family, idle), config=moe)
    model = tsm.shard(model, blocks=(type(model.model.layers[0]),))
    opt = optimizer(model)
    # SMP's clip_grad_norm_: the norm over every expert of every rank
    losses, norms = train_own_rows(model, opt, lambda p: tsm.clip_grad_norm_(p, 1e9))
    ref_losses, ref_params, ref_states, _, ref_norms = reference(family, idle)
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


def test_expert_parallel_trains_as_one_process(workers):
    # 2 ranks: ep 2 (each expert on one rank); 4 ranks: ep 2 x 2 data-parallel copies of
    # each expert, replicated (hybrid_shard_degree 2) or sharded (0) over them
    cases = [(2, {"expert_parallel_degree": 2}, "mixtral"),
             (4, {"expert_parallel_degree": 2, "hybrid_shard_degree": 2}, "mixtral"),
             (4, {"expert_parallel_degree": 2}, "mixtral")]
    for world, config, family in cases:
        for rank, problems in enumerate(workers(world).run(ep_case, config=config,
                                                           family=family)):
            assert problems == [], (family, config, rank)


def test_qwen_moe_models_train_as_one_process(workers):
    # Qwen2-MoE: shared expert and gate, a dense layer, unnormalized top-k weights, also
    # at ep 4 (one expert per rank); Qwen3-MoE: a dense first layer
    cases = [(2, {"expert_parallel_degree": 2}, "qwen2_moe"),
             (4, {"expert_parallel_degree": 4}, "qwen2_moe"),
             (2, {"expert_parallel_degree": 2}, "qwen3_moe")]
    for world, config, family in cases:
        for rank, problems in enumerate(workers(world).run(ep_case, config=config,
                                                           family=family)):
            assert problems == [], (family, config, rank)


def test_an_expert_no_token_reaches_trains_as_one_process(workers):
    # one process gives the idle expert a zero gradient (its fused weight is used), which
    # weight decay and momentum step; at ep 4 its rank receives no row at all
    assert reference("mixtral", idle=True)[3] == 0.0
    for world, config in [(2, {"expert_parallel_degree": 2}),
                          (4, {"expert_parallel_degree": 4})]:
        for rank, problems in enumerate(workers(world).run(ep_case, config=config,
                                                           idle=True)):
            assert problems == [], (config, rank)


def refusals_case() -> dict[str, str]:
    """SMP v2's state attributes and what a user meets on each misuse, on this rank."""
    import torch.distributed as dist

    import modelparallel as tsm
    from modelparallel.config import ConfigError
    from modelparallel.smp.v2.moe import MoEConfig

    def message(call) -> str:
        try:
            call()
        except (ConfigError, ValueError, NotImplementedError) as e:
            return str(e)
        return "no error"

    tsm.reset()
    tsm.init({"expert_parallel_degree": 2})
    got = {"state": (f"{tsm.state.ep_rank} {tsm.state.ep_size} "
                     f"{dist.get_world_size(tsm.state.ep_process_group)} "
                     f"{tsm.state.expert_parallel_degree}")}
    plain = MoEConfig(smp_moe=False, moe_load_balancing="none")
    got["shard untransformed"] = message(lambda: tsm.shard(build()))
    got["replicate untransformed"] = message(lambda: tsm.replicate(build()))
    got["FSDP1 untransformed"] = message(lambda: _fsdp1(build()))
    got["DistributedModel"] = message(lambda: tsm.DistributedModel(build()))
    got["smp_moe"] = message(lambda: tsm.transform(build(), config=MoEConfig()))
    got["sinkhorn"] = message(lambda: tsm.transform(
        build(), config=MoEConfig(smp_moe=False, moe_load_balancing="sinkhorn")))
    with _captured_notices() as notices:  # transforms, and says the z-loss does nothing
        got["z-loss"] = message(lambda: tsm.transform(
            build(), config=MoEConfig(smp_moe=False, moe_load_balancing="aux_loss")))
    got["z-loss notices"] = notices
    with _captured_notices() as notices:  # SMP's own MoE layer's options
        tsm.transform(build(), config=MoEConfig(smp_moe=False, moe_load_balancing="none",
                                                random_seed=7, use_cpu_initialization=True))
    got["unused options"] = notices
    odd = build()
    for layer in odd.model.layers:
        experts = layer.mlp.experts
        experts.num_experts = 3
        for name in ("gate_up_proj", "down_proj"):
            setattr(experts, name, nn.Parameter(getattr(experts, name)[:3].detach()))
    got["uneven experts"] = message(lambda: tsm.transform(odd, config=plain))
    held = tsm.transform(build(), config=plain).model.layers[0].mlp.experts
    weight = held._parameters["gate_up_proj"]  # a DTensor of all 4 experts
    first = 2 * tsm.state.ep_rank
    same = torch.equal(weight.to_local(),
                       build().model.layers[0].mlp.experts.gate_up_proj[first:first + 2])
    got["held"] = (f"{held.num_experts} {tuple(weight.shape)} "
                   f"{tuple(weight.to_local().shape)} {same}")
    return got


def _fsdp1(model: nn.Module) -> nn.Module:
    from torch.distributed.fsdp import FullyShardedDataParallel

    return FullyShardedDataParallel(model)


@contextlib.contextmanager
def _captured_notices():
    """The WARNING lines the ``modelparallel`` logger writes meanwhile."""
    import logging

    lines: list[str] = []

    class Keep(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            lines.append(record.getMessage())

    logger = logging.getLogger("modelparallel")
    handler = Keep(logging.WARNING)
    logger.addHandler(handler)
    try:
        yield lines
    finally:
        logger.removeHandler(handler)


def test_state_and_misuse_are_refused_in_one_message(workers):
    for rank, got in enumerate(workers(2).run(refusals_case)):
        assert got["state"] == f"{rank} 2 2 2"
        assert got["held"] == "2 (4, 256, 64) (2, 256, 64) True"  # experts [2r, 2r + 2)
        assert "the model given to mp.shard() was not split over the expert-parallel " \
               "ranks: call tsm.transform(model, config=MoEConfig(smp_moe=False, " \
               "moe_load_balancing='none')) first" in got["shard untransformed"]
        for call, name in [("mp.replicate()", "replicate"),
                           ("FullyShardedDataParallel", "FSDP1")]:
            assert f"the model given to {call} was not split over the expert-parallel " \
                   f"ranks" in got[f"{name} untransformed"]
        assert "mp.DistributedModel (SMP v1) does not split experts" in \
            got["DistributedModel"]
        assert got["smp_moe"] == "no error"  # SMP's own MoE layer: test_smp_moe.py
        assert got["sinkhorn"].startswith(
            "moe_load_balancing='sinkhorn' is not built yet (it depends on the set of tokens "
            "each rank routes); use moe_load_balancing='aux_loss'")
        assert got["z-loss"] == "no error"
        assert got["unused options"] == ([
            "MoEConfig(random_seed=7) has no effect: the model's own router and experts "
            "(smp_moe=False) draw from torch's generator (seed it with torch.manual_seed)",
            "MoEConfig(use_cpu_initialization=True) has no effect: with smp_moe=False the "
            "experts are the model's own, built where the script builds the model"]
            if rank == 0 else [])
        assert got["z-loss notices"] == ([
            "MoEConfig(moe_z_loss_coeff=0.001) has no effect: the model's own router "
            "(smp_moe=False) has no z-loss (Hugging Face's Mixtral and Qwen MoE models add "
            "none; SMP's is its own MoE layer's)"] if rank == 0 else [])
        assert "2 does not divide the 3 experts of model.layers.0.mlp.experts" in \
            got["uneven experts"]
