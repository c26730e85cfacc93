"""Expert parallelism against one process: a tiny Hugging Face Mixtral (4 experts, top-2)
transformed with ``tsm.transform(model, config=MoEConfig(smp_moe=False,
moe_load_balancing="none"))`` at ``expert_parallel_degree`` 2 and sharded with
``mp.shard``, each rank training its own rows of every batch.

Each case compares the loss of every step (the ranks' mean), every parameter and every
optimizer state at the end with one process training the whole batch: the experts a
rank holds are gathered over its expert-parallel group. The model is built and trained
in float64, so that round-off cannot flip a router's top-k choice between the runs. The
optimizer is SGD with momentum: a wrong gradient shows in every parameter.
"""

from __future__ import annotations

import contextlib
import functools

import torch
from torch import nn

STEPS, ROWS, SEQ, VOCAB = 3, 4, 16, 128
LR = 0.5
EXPERT_WEIGHTS = ("experts.gate_up_proj", "experts.down_proj")


def build() -> nn.Module:
    import transformers

    torch.manual_seed(0)
    config = transformers.MixtralConfig(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, num_local_experts=4,
        num_experts_per_tok=2, max_position_embeddings=SEQ, use_cache=False,
        tie_word_embeddings=False, attn_implementation="eager", sliding_window=None,
        experts_implementation="eager")  # grouped_mm has no float64 kernel
    return transformers.MixtralForCausalLM(config).to(torch.float64)


def batches() -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return [torch.randint(VOCAB, (ROWS, SEQ), generator=g) for _ in range(STEPS)]


def optimizer(model: nn.Module) -> torch.optim.Optimizer:
    return torch.optim.SGD(model.parameters(), lr=LR, momentum=0.9)


@functools.cache
def reference() -> tuple[list[float], dict, dict]:
    model = build()
    opt = optimizer(model)
    losses = []
    for ids in batches():
        opt.zero_grad(set_to_none=True)
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        opt.step()
        losses.append(float(loss.detach()))
    names = {p: n for n, p in model.named_parameters()}
    states = {f"{names[p]}.{k}": v.clone() for p, s in opt.state.items()
              for k, v in s.items()}
    return losses, {n: p.detach().clone() for n, p in model.named_parameters()}, states


def whole_experts(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """``tensors`` with every expert weight (and its state) gathered over the
    expert-parallel group: each rank holds a range of the experts along dim 0."""
    import torch.distributed as dist

    import modelparallel as tsm

    group = tsm.state.ep_process_group
    out = dict(tensors)
    for name, t in tensors.items():
        if any(w in name for w in EXPERT_WEIGHTS):
            parts = [torch.empty_like(t) for _ in range(dist.get_world_size(group))]
            dist.all_gather(parts, t.contiguous(), group=group)
            out[name] = torch.cat(parts)
    return out


def ep_case(config: dict) -> list[str]:
    """This rank's run; what differs from :func:`reference` (empty when nothing does)."""
    import torch.distributed as dist
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        get_optimizer_state_dict,
    )

    import modelparallel as tsm
    from modelparallel.data import replica_rank_and_size
    from modelparallel.smp.v2.moe import MoEConfig  # torch.sagemaker.moe.moe_config
    from modelparallel.testing import TrainResult, full_parameters, parity_problems

    tsm.reset()
    tsm.init(config)
    moe = MoEConfig(smp_moe=False, moe_load_balancing="none")
    model = tsm.transform(build(), config=moe)
    model = tsm.shard(model, blocks=(type(model.model.layers[0]),))
    opt = optimizer(model)
    index, count = replica_rank_and_size()
    rows = ROWS // count
    losses = []
    for ids in batches():
        ids = ids[index * rows:(index + 1) * rows]
        opt.zero_grad(set_to_none=True)
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        opt.step()
        value = loss.detach().double()
        dist.all_reduce(value)
        losses.append(float(value) / dist.get_world_size())
    ref_losses, ref_params, ref_states = reference()
    problems = parity_problems(TrainResult(losses, whole_experts(full_parameters(model))),
                               TrainResult(ref_losses, ref_params))
    saved = get_optimizer_state_dict(model, opt,
                                     options=StateDictOptions(full_state_dict=True))["state"]
    states = {f"{name}.{k}": v for name, s in saved.items() for k, v in s.items()}
    problems += parity_problems(TrainResult([], whole_experts(states)),
                                TrainResult([], ref_states))
    return problems


def test_expert_parallel_trains_as_one_process(workers):
    # 2 ranks: ep 2 (each expert on one rank); 4 ranks: ep 2 x 2 data-parallel copies of
    # each expert, replicated (hybrid_shard_degree 2) or sharded (0) over them
    cases = [(2, {"expert_parallel_degree": 2}),
             (4, {"expert_parallel_degree": 2, "hybrid_shard_degree": 2}),
             (4, {"expert_parallel_degree": 2})]
    for world, config in cases:
        for rank, problems in enumerate(workers(world).run(ep_case, config=config)):
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
    got["replicate"] = message(lambda: tsm.replicate(tsm.transform(build(), config=plain)))
    got["DistributedModel"] = message(lambda: tsm.DistributedModel(build()))
    got["smp_moe"] = message(lambda: tsm.transform(build(), config=MoEConfig()))
    got["sinkhorn"] = message(lambda: tsm.transform(
        build(), config=MoEConfig(smp_moe=False, moe_load_balancing="sinkhorn")))
    with _captured_notices() as notices:  # transforms, and says the z-loss does nothing
        got["z-loss"] = message(lambda: tsm.transform(
            build(), config=MoEConfig(smp_moe=False, moe_load_balancing="aux_loss")))
    got["z-loss notices"] = notices
    odd = build()
    for layer in odd.model.layers:
        experts = layer.mlp.experts
        experts.num_experts = 3
        for name in ("gate_up_proj", "down_proj"):
            setattr(experts, name, nn.Parameter(getattr(experts, name)[:3].detach()))
    got["uneven experts"] = message(lambda: tsm.transform(odd, config=plain))
    held = tsm.transform(build(), config=plain).model.layers[0].mlp.experts
    got["held"] = f"{held.num_experts} {tuple(held.gate_up_proj.shape)}"
    return got


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
        assert got["held"] == "2 (2, 256, 64)"  # experts [2r, 2r + 2) of 4
        assert "the model given to mp.shard() was not split over the expert-parallel " \
               "ranks: call tsm.transform(model, config=MoEConfig(smp_moe=False, " \
               "moe_load_balancing='none')) first" in got["shard untransformed"]
        assert "expert_parallel_degree: 2 with mp.replicate() is not built yet" in \
            got["replicate"]
        assert "mp.DistributedModel (SMP v1) does not split experts" in \
            got["DistributedModel"]
        assert got["smp_moe"].startswith("SMP's own mixture-of-experts implementation "
                                         "(smp_moe=True, MoELayer) is not built yet")
        assert got["sinkhorn"].startswith(
            "moe_load_balancing='sinkhorn' is not built yet (it depends on the set of tokens "
            "each rank routes); use moe_load_balancing='aux_loss'")
        assert got["z-loss"] == "no error"
        assert got["z-loss notices"] == ([
            "MoEConfig(moe_z_loss_coeff=0.001) has no effect: the model's own router "
            "(smp_moe=False) has no z-loss (Hugging Face's Mixtral and Qwen MoE models add "
            "none; SMP's is its own MoE layer's)"] if rank == 0 else [])
        assert "2 does not divide the 3 experts of model.layers.0.mlp.experts" in \
            got["uneven experts"]
