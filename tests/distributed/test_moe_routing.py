"""Routing semantics of a Hugging Face MoE model over data-parallel ranks.

The load-balancing loss over data-parallel ranks equals one process's over the whole
batch (``parallel/expert_parallel/router_loss.py``).

One process: a tiny Mixtral (4 experts, top-2) in float64 with its auxiliary loss on
(``output_router_logits``, a large ``router_aux_loss_coef`` so that it weighs), trained
for 3 SGD-with-momentum steps on batches whose attention mask hides a different number
of tokens in each row. The parallel runs train each rank's rows: at
``expert_parallel_degree`` 2 with ``MoEConfig(moe_load_balancing="aux_loss")``, and
without expert parallelism (the model's own configuration, ``mp.shard`` alone,
``mp.replicate`` and torch's FSDP1). Each compares the loss of every step, every parameter and every
momentum buffer with one process.

The first test checks, on one process, that the function computes what every modeling
file's ``load_balancing_loss_func`` computes, bit for bit: it fails if transformers
changes the loss.

Router jitter (Mixtral's ``router_jitter_noise``) is drawn by each rank from its own
generator for its own tokens; activation checkpointing recomputes the same noise.
"""

from __future__ import annotations

import functools
import importlib

import pytest
import torch
from torch import nn

STEPS, ROWS, SEQ, VOCAB, EXPERTS, TOP_K = 3, 4, 16, 128, 4, 2
LR, COEF = 0.5, 0.5
MODELING = ("mixtral", "qwen2_moe", "qwen3_moe", "olmoe")


@pytest.mark.parametrize("masked", [False, True])
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_one_process_loss_is_transformers_own(masked, dtype):
    from modelparallel.parallel.expert_parallel.router_loss import load_balancing_loss

    g = torch.Generator().manual_seed(0)
    logits = tuple(torch.randn(ROWS * SEQ, EXPERTS, generator=g, dtype=dtype) for _ in range(3))
    mask = torch.rand(ROWS, SEQ, generator=g) > 0.3 if masked else None
    ours = load_balancing_loss(logits, EXPERTS, TOP_K, mask)
    for name in MODELING:
        theirs = importlib.import_module(f"transformers.models.{name}.modeling_{name}")
        assert torch.equal(ours, theirs.load_balancing_loss_func(logits, EXPERTS, TOP_K, mask)), \
            name


def build(jitter: float = 0.0) -> nn.Module:
    import transformers

    torch.manual_seed(0)
    config = transformers.MixtralConfig(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, num_local_experts=EXPERTS,
        num_experts_per_tok=TOP_K, max_position_embeddings=SEQ, use_cache=False,
        tie_word_embeddings=False, attn_implementation="eager", sliding_window=None,
        experts_implementation="eager", router_aux_loss_coef=COEF,
        router_jitter_noise=jitter)
    return transformers.MixtralForCausalLM(config).to(torch.float64)


def batches() -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Token ids and an attention mask hiding the last ``2 * row`` positions of each row:
    the ranks hold different numbers of tokens."""
    g = torch.Generator().manual_seed(1)
    mask = (torch.arange(SEQ)[None, :] < SEQ - 2 * torch.arange(ROWS)[:, None]).long()
    return [(torch.randint(VOCAB, (ROWS, SEQ), generator=g), mask) for _ in range(STEPS)]


def optimizer(model: nn.Module) -> torch.optim.Optimizer:
    return torch.optim.SGD(model.parameters(), lr=LR, momentum=0.9)


@functools.cache
def reference() -> tuple[list[float], dict, dict]:
    model = build()
    model.config.output_router_logits = True
    opt = optimizer(model)
    losses = []
    for ids, mask in batches():
        opt.zero_grad(set_to_none=True)
        loss = model(input_ids=ids, attention_mask=mask, labels=ids).loss
        loss.backward()
        opt.step()
        losses.append(float(loss.detach()))
    names = {p: n for n, p in model.named_parameters()}
    states = {f"{names[p]}.{k}": v.clone() for p, s in opt.state.items()
              for k, v in s.items()}
    return losses, {n: p.detach().clone() for n, p in model.named_parameters()}, states


def parallel_case(config: dict, wrap: str) -> tuple[list[str], list[float]]:
    """This rank's run: what differs from :func:`reference`, and the largest differences
    (losses relative, parameters, optimizer state)."""
    import torch.distributed as dist
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        get_model_state_dict,
        get_optimizer_state_dict,
    )

    import modelparallel as tsm
    from modelparallel.data import replica_rank_and_size
    from modelparallel.smp.v2.moe import MoEConfig
    from modelparallel.testing import TrainResult, parity_problems

    tsm.reset()
    tsm.init(config)
    model = build()
    if wrap == "aux_loss":  # SMP's switch: the model's own loss, weighted by the MoEConfig
        model.config.router_aux_loss_coef = 0.0
        setattr(model, "router_aux_loss_coef", 0.0)  # noqa: B010 (what the forward reads)
        model = tsm.transform(model, config=MoEConfig(
            smp_moe=False, moe_load_balancing="aux_loss", moe_aux_loss_coeff=COEF,
            moe_z_loss_coeff=0))
    else:  # the model's own configuration
        model.config.output_router_logits = True
    if wrap == "replicate":
        model = tsm.replicate(model)
    elif wrap == "fsdp1":  # torch's FSDP1, as SMP v2 scripts wrap a model
        from torch.distributed.fsdp import FullyShardedDataParallel

        model = FullyShardedDataParallel(model, use_orig_params=True)
    else:
        model = tsm.shard(model, blocks=(type(model.model.layers[0]),))
    opt = optimizer(model)
    index, count = replica_rank_and_size()
    rows = slice(index * ROWS // count, (index + 1) * ROWS // count)
    losses = []
    for ids, mask in batches():
        opt.zero_grad(set_to_none=True)
        loss = model(input_ids=ids[rows], attention_mask=mask[rows], labels=ids[rows]).loss
        loss.backward()
        opt.step()
        value = loss.detach().double()
        dist.all_reduce(value)
        losses.append(float(value) / dist.get_world_size())
    full = StateDictOptions(full_state_dict=True)
    params = {k.removeprefix("module.").removeprefix("_fsdp_wrapped_module."): v
              for k, v in get_model_state_dict(model, options=full).items()}
    saved = get_optimizer_state_dict(model, opt, options=full)["state"]
    states = {f"{name.removeprefix('module.')}.{k}": v for name, s in saved.items()
              for k, v in s.items()}
    result = TrainResult(losses, params)  # full state dicts hold every expert
    ref_losses, ref_params, ref_states = reference()
    problems = parity_problems(result, TrainResult(ref_losses, ref_params))
    problems += parity_problems(TrainResult([], states),
                                TrainResult([], ref_states))
    figures = [max(abs(a - b) / abs(b) for a, b in zip(losses, ref_losses, strict=True)),
               max((result.params[n] - p).abs().max().item() for n, p in ref_params.items()),
               max((states[n] - s).abs().max().item()
                   for n, s in ref_states.items())]
    return problems, figures


def test_load_balancing_loss_over_ranks_is_one_process(workers):
    cases = [(2, {"expert_parallel_degree": 2}, "aux_loss"),  # ep 2 on 2 ranks
             (4, {"expert_parallel_degree": 2, "hybrid_shard_degree": 2}, "aux_loss"),
             (2, {}, "shard"),  # plain data parallelism, the model's own configuration
             (2, {}, "replicate"),
             (2, {}, "fsdp1")]
    for world, config, wrap in cases:
        for rank, (problems, figures) in enumerate(workers(world).run(
                parallel_case, config=config, wrap=wrap)):
            print(config, wrap, rank, "loss rel, params, momentum:", figures)
            assert problems == [], (config, wrap, rank)


JITTER = 0.1


def jitter_case() -> dict[str, bool]:
    """One training step at ep 2 with router jitter, this rank's generator seeded with
    ``100 + rank`` (a script's ``seed + dp_rank``): what it drew, and whether activation
    checkpointing recomputed it."""
    import torch.distributed as dist
    from torch.distributed.tensor import DTensor

    import modelparallel as tsm
    from modelparallel.smp.v2.moe import MoEConfig

    tsm.reset()
    tsm.init({"expert_parallel_degree": 2})
    rank = dist.get_rank()
    ids = batches()[0][0][rank * 2:(rank + 1) * 2]  # this rank's rows

    def step(checkpointed: bool) -> tuple[torch.Tensor, dict[str, torch.Tensor], torch.Tensor]:
        model = build(JITTER)
        if checkpointed:
            model.gradient_checkpointing_enable({"use_reentrant": False})
        model = tsm.transform(model, config=MoEConfig(smp_moe=False, moe_load_balancing="none"))
        model = tsm.shard(model, blocks=(type(model.model.layers[0]),))
        torch.manual_seed(100 + rank)
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        grads = {n: (p.grad.to_local() if isinstance(p.grad, DTensor) else p.grad).clone()
                 for n, p in model.named_parameters()}
        return loss.detach(), grads, torch.get_rng_state()

    def one_process(seed: int) -> torch.Tensor:
        model = build(JITTER)  # seeds the generator itself
        torch.manual_seed(seed)
        return model(input_ids=ids, labels=ids).loss.detach()

    loss, grads, generator = step(checkpointed=False)
    again, recomputed, generator_after_recompute = step(checkpointed=True)
    own, other = one_process(100 + rank), one_process(100 + 1 - rank)
    return {"own noise": bool(torch.allclose(loss, own, rtol=1e-6, atol=0)),
            "other rank's noise differs": not torch.allclose(loss, other, rtol=1e-5, atol=0),
            "checkpointing: same loss": torch.equal(loss, again),
            "checkpointing: same gradients": all(torch.equal(g, recomputed[n])
                                                 for n, g in grads.items()),
            "checkpointing: same generator": torch.equal(generator, generator_after_recompute)}


def test_router_jitter_is_each_ranks_own_and_recomputed_alike(workers):
    for rank, got in enumerate(workers(2).run(jitter_case)):
        assert all(got.values()), (rank, got)
