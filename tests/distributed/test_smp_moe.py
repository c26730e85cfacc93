"""SMP's own MoE layer (``MoEConfig(smp_moe=True)``, ``parallel/expert_parallel/
smp_layer.py`` and ``smp_router.py``) against one process.

Tiny models (hidden 64, 2 layers, 4 experts, top-2, float64 so that round-off cannot
flip a top-k choice) trained 3 SGD-with-momentum steps, each rank its own rows:
``"none"`` and ``"aux_loss"`` with a z-loss at ep 2 on 2 ranks (Mixtral, Qwen2-MoE with
its shared expert), ep 2 x ``hybrid_shard_degree`` 2 on 4 (also inside torch's
``checkpoint_wrapper``), ep 4 (Qwen3-MoE) and torch's FSDP1 without expert parallelism
equal one process on the whole batch; ``"sinkhorn"`` and ``"balanced"`` at ep 2 on 2
ranks equal one process that runs each rank's rows as a forward and backward of their
own and averages the gradients (their choice depends on the tokens a rank routes). Each
compares the loss of every step, every parameter and every momentum buffer at the end,
read as full state dicts. Then the misuse messages and notices. The router on one
process: ``test_smp_router.py``.
"""

from __future__ import annotations

import functools

import torch
from torch import nn

STEPS, ROWS, SEQ, VOCAB, EXPERTS, TOP_K = 3, 4, 16, 128, 4, 2
LR, AUX, Z = 0.5, 0.5, 0.1


def build(family: str = "mixtral") -> nn.Module:
    """A tiny model of ``family`` in float64 (Qwen2-MoE: a shared expert and its gate)."""
    import transformers

    torch.manual_seed(0)
    common = dict(vocab_size=VOCAB, hidden_size=64, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, num_experts_per_tok=TOP_K,
                  max_position_embeddings=SEQ, use_cache=False, tie_word_embeddings=False,
                  attn_implementation="eager", experts_implementation="eager")
    if family == "mixtral":
        model = transformers.MixtralForCausalLM(transformers.MixtralConfig(
            intermediate_size=128, num_local_experts=EXPERTS, sliding_window=None, **common))
    elif family == "qwen3_moe":
        model = transformers.Qwen3MoeForCausalLM(transformers.Qwen3MoeConfig(
            intermediate_size=96, moe_intermediate_size=32, num_experts=EXPERTS,
            norm_topk_prob=True, head_dim=16, **common))
    else:
        model = transformers.Qwen2MoeForCausalLM(transformers.Qwen2MoeConfig(
            intermediate_size=96, moe_intermediate_size=32, shared_expert_intermediate_size=48,
            num_experts=EXPERTS, norm_topk_prob=True, **common))
        for layer in model.model.layers:  # Qwen2-MoE's router starts at zero: no choice
            nn.init.normal_(layer.mlp.gate.weight, std=0.2)
    return model.to(torch.float64)


def batches() -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return [torch.randint(VOCAB, (ROWS, SEQ), generator=g) for _ in range(STEPS)]


def settings(mode: str):
    from modelparallel.parallel.expert_parallel.smp_router import RouterSettings

    return RouterSettings(mode, AUX if mode == "aux_loss" else 0.0,
                          0.0 if mode == "none" else Z)


def smp_model(family: str, mode: str) -> nn.Module:
    """One process's model with SMP's layer (no ranks to sum over)."""
    from modelparallel.parallel.expert_parallel.smp_layer import replace_sparse_blocks

    return replace_sparse_blocks(build(family), settings(mode))


def optimizer(model: nn.Module) -> torch.optim.Optimizer:
    return torch.optim.SGD(model.parameters(), lr=LR, momentum=0.9, weight_decay=0.01)


@functools.cache
def reference(family: str, mode: str, pieces: int) -> tuple[list[float], dict, dict]:
    """One process's losses, parameters and momentum buffers, each batch run as
    ``pieces`` forwards and backwards of its consecutive rows, the gradients averaged."""
    model = smp_model(family, mode)
    opt = optimizer(model)
    losses = []
    for ids in batches():
        opt.zero_grad(set_to_none=True)
        total = 0.0
        for rows in ids.chunk(pieces):
            loss = model(input_ids=rows, labels=rows).loss
            loss.backward()  # the auxiliary losses' gradients join with weight 1
            total += float(loss.detach()) / pieces
        for p in model.parameters():
            p.grad /= pieces
        opt.step()
        losses.append(total)
    names = {p: n for n, p in model.named_parameters()}
    states = {f"{names[p]}.{k}": v.clone() for p, s in opt.state.items()
              for k, v in s.items()}
    return losses, {n: p.detach().clone() for n, p in model.named_parameters()}, states


def parallel_case(config: dict, family: str, mode: str, checkpointed: bool = False,
                  fsdp1: bool = False) -> tuple[list[str], list[float]]:
    """This rank's run (``mp.shard``, or torch's FSDP1 as SMP v2 scripts wrap a model):
    what differs from one process, and the largest differences (losses relative,
    parameters, momentum)."""
    import torch.distributed as dist
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import (
        apply_activation_checkpointing,
    )
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        get_model_state_dict,
        get_optimizer_state_dict,
    )

    import modelparallel as tsm
    from modelparallel.data import replica_rank_and_size
    from modelparallel.parallel.expert_parallel.smp_layer import MoELayer
    from modelparallel.smp.v2.moe import MoEConfig
    from modelparallel.testing import TrainResult, parity_problems

    tsm.reset()
    tsm.init(config)
    knobs = settings(mode)
    model = tsm.transform(build(family), config=MoEConfig(
        smp_moe=True, moe_load_balancing=mode, moe_aux_loss_coeff=knobs.aux_loss_coeff,
        moe_z_loss_coeff=knobs.z_loss_coeff))
    assert sum(isinstance(m, MoELayer) for m in model.modules()) == 2  # each layer's
    layer = type(model.model.layers[0])
    if checkpointed:  # as the v2 shared scripts: checkpoint_wrapper on each decoder layer
        apply_activation_checkpointing(model, check_fn=lambda m: isinstance(m, layer))
    if fsdp1:
        from torch.distributed.fsdp import FullyShardedDataParallel

        model = FullyShardedDataParallel(model, use_orig_params=True)
    else:
        model = tsm.shard(model, blocks=(layer,))
    opt = optimizer(model)
    index, count = replica_rank_and_size()
    rows = slice(index * ROWS // count, (index + 1) * ROWS // count)
    losses = []
    for ids in batches():
        opt.zero_grad(set_to_none=True)
        loss = model(input_ids=ids[rows], labels=ids[rows]).loss
        loss.backward()
        opt.step()
        value = loss.detach().double()
        dist.all_reduce(value)
        losses.append(float(value) / dist.get_world_size())
    full = StateDictOptions(full_state_dict=True)
    params = {n.removeprefix("_fsdp_wrapped_module."): v
              for n, v in get_model_state_dict(model, options=full).items()}
    states = {f"{name.removeprefix('_fsdp_wrapped_module.')}.{k}": v for name, s in
              get_optimizer_state_dict(model, opt, options=full)["state"].items()
              for k, v in s.items()}
    # sinkhorn, balanced: one process runs each rank's rows on their own
    per_rank = mode in ("sinkhorn", "balanced")
    ref_losses, ref_params, ref_states = reference(family, mode, count if per_rank else 1)
    problems = parity_problems(TrainResult(losses, params), TrainResult(ref_losses, ref_params))
    problems += parity_problems(TrainResult([], states), TrainResult([], ref_states))
    figures = [max(abs(a - b) / abs(b) for a, b in zip(losses, ref_losses, strict=True)),
               max((params[n] - p).abs().max().item() for n, p in ref_params.items()),
               max((states[n] - s).abs().max().item() for n, s in ref_states.items())]
    return problems, figures


def test_smp_moe_trains_as_one_process(workers):
    ep2, hybrid = {"expert_parallel_degree": 2}, {"expert_parallel_degree": 2,
                                                  "hybrid_shard_degree": 2}
    cases = [(2, ep2, "mixtral", "none", False, False),
             (2, ep2, "mixtral", "aux_loss", False, False),
             (2, ep2, "qwen2_moe", "aux_loss", False, False),
             (2, ep2, "mixtral", "sinkhorn", False, False),
             (2, ep2, "mixtral", "balanced", False, False),
             (2, {}, "mixtral", "aux_loss", True, True),  # plain data parallelism, FSDP1
             (4, hybrid, "mixtral", "none", False, False),
             (4, hybrid, "mixtral", "aux_loss", False, False),
             (4, hybrid, "mixtral", "aux_loss", True, False),
             (4, {"expert_parallel_degree": 4}, "qwen3_moe", "aux_loss", False, False),
             # beyond SMP: with tensor parallelism (the shared expert split, experts whole)
             (4, {"expert_parallel_degree": 2, "tensor_parallel_degree": 2}, "qwen2_moe",
              "aux_loss", False, False)]
    for world, config, family, mode, checkpointed, fsdp1 in cases:
        for rank, (problems, figures) in enumerate(workers(world).run(
                parallel_case, config=config, family=family, mode=mode,
                checkpointed=checkpointed, fsdp1=fsdp1)):
            print(config, family, mode, checkpointed, fsdp1, rank,
                  "loss rel, params, momentum:", figures)
            assert problems == [], (config, family, mode, checkpointed, rank, problems)


def test_per_rank_modes_depend_on_the_tokens_routed_together():
    """Sinkhorn's and balanced's per-rank semantics is not one process's on the whole
    batch (else the parallel cases could not tell them apart)."""
    for mode in ("sinkhorn", "balanced"):
        apart, together = reference("mixtral", mode, 2)[0], reference("mixtral", mode, 1)[0]
        assert max(abs(a - b) / b for a, b in zip(apart, together, strict=True)) > 1e-4, mode


def misuse_case() -> dict[str, object]:
    """What transform says to each misuse at ep 2, the notices of SMP's defaults, and
    what the layer holds."""
    from modelparallel.moe.moe_layer import MoELayer  # torch.sagemaker.moe.moe_layer
    from test_expert_parallel import _captured_notices  # the notices rank 0 logs
    from torch.distributed.tensor import DTensor

    import modelparallel as tsm
    from modelparallel.models import GPT, GPTConfig
    from modelparallel.smp.v2.moe import MoEConfig

    def message(call) -> str:
        try:
            call()
        except Exception as e:  # the message is the result
            return f"{type(e).__name__}: {e}"
        return "no error"

    tsm.reset()
    tsm.init({"expert_parallel_degree": 2})
    got: dict[str, object] = {}
    got["bogus"] = message(lambda: tsm.transform(
        build(), config=MoEConfig(moe_load_balancing="bogus")))
    got["no block"] = message(lambda: tsm.transform(GPT(GPTConfig(
        vocab_size=VOCAB, max_seq_len=SEQ, d_model=16, n_layers=1, n_heads=2)),
        config=MoEConfig()))
    got["by hand"] = message(lambda: MoELayer(MoEConfig()))
    with _captured_notices() as notices:  # SMP's defaults: sinkhorn with an aux coefficient
        model = tsm.transform(build(), config=MoEConfig())
    got["default notices"] = notices
    with _captured_notices() as notices:
        tsm.transform(build(), config=MoEConfig(moe_load_balancing="none", random_seed=7,
                                                use_cpu_initialization=True))
    got["unused options"] = notices
    layer = model.model.layers[0].mlp
    weight = layer.experts._parameters["gate_up_proj"]
    got["layer"] = (f"{isinstance(layer, MoELayer)} {isinstance(weight, DTensor)} "
                    f"{tuple(weight.to_local().shape)} {layer.settings.load_balancing}")
    return got


def test_misuse_is_refused_in_one_message(workers):
    for rank, got in enumerate(workers(2).run(misuse_case)):
        assert got["bogus"] == ("ValueError: moe_load_balancing='bogus'; SMP's MoE layer "
                                "accepts 'none', 'aux_loss', 'sinkhorn', 'balanced'")
        assert "  - smp_moe: True, but GPT has no sparse MoE block SMP's MoE layer " \
               "replaces" in got["no block"]
        assert got["by hand"].startswith("TypeError: MoELayer is built from a Hugging Face "
                                         "sparse MoE block"), got["by hand"]
        assert got["layer"] == "True True (2, 256, 64) sinkhorn"  # split, 2 experts a rank
        assert got["default notices"] == ([
            "MoEConfig(moe_aux_loss_coeff=0.001) has no effect with moe_load_balancing="
            "'sinkhorn': Sinkhorn routing balances the experts itself and adds no "
            "load-balancing loss (as Megatron-core's)"] if rank == 0 else [])
        assert got["unused options"] == ([
            "MoEConfig(random_seed=7) has no effect: SMP's MoE layer (smp_moe=True) keeps "
            "the model's own router and experts, initialised where the script builds the "
            "model, and draws its router jitter from torch's generator (seed it with "
            "torch.manual_seed)",
            "MoEConfig(use_cpu_initialization=True) has no effect: SMP's MoE layer "
            "(smp_moe=True) keeps the model's own experts, built where the script builds "
            "the model"] if rank == 0 else [])
