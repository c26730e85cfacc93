"""SMP's own MoE layer (``MoEConfig(smp_moe=True)``, ``parallel/expert_parallel/
smp_layer.py`` and ``smp_router.py``) against one process.

One process first: with ``moe_load_balancing="none"`` the layer routes as Mixtral's own
block (softmax over the chosen logits = softmax then renormalised); with ``"aux_loss"``
and a z-loss the returned loss is unchanged and the gradients are those of the loss plus
the auxiliary losses computed here from the routers' logits by Megatron's formulas.

Then tiny models (hidden 64, 2 layers, 4 experts, top-2, float64 so that round-off
cannot flip a top-k choice) trained 3 SGD-with-momentum steps, each rank its own rows:
``"none"`` and ``"aux_loss"`` with a z-loss at ep 2 on 2 ranks and ep 2 x
``hybrid_shard_degree`` 2 on 4 (also inside torch's ``checkpoint_wrapper``) equal one
process on the whole batch; ``"sinkhorn"`` at ep 2 on 2 ranks equals one process that
runs each rank's rows as a forward and backward of their own and averages the gradients
(its choice depends on the tokens a rank routes). Each compares the loss of every step,
every parameter and every momentum buffer at the end, read as full state dicts.
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


def test_none_routes_as_the_model_and_names_stay():
    ids = batches()[0]
    for family in ("mixtral", "qwen2_moe", "qwen3_moe"):
        theirs = build(family)
        ours = smp_model(family, "none")
        assert [n for n, _ in ours.named_parameters()] == \
            [n for n, _ in theirs.named_parameters()]
        with torch.no_grad():
            a, b = ours(input_ids=ids).logits, theirs(input_ids=ids).logits
        # the models' routers weigh in float32, SMP's layer in the logits' float64
        assert (a - b).abs().max() < 1e-6, family


def test_auxiliary_losses_join_the_gradients_only():
    from modelparallel.parallel.expert_parallel.smp_layer import MoELayer

    ids = batches()[0]
    plain, balanced = smp_model("mixtral", "none"), smp_model("mixtral", "aux_loss")
    logits: list[torch.Tensor] = []
    for layer in plain.modules():
        if isinstance(layer, MoELayer):
            layer.gate.register_forward_hook(lambda m, a, out: logits.append(out[0]))
    loss = plain(input_ids=ids, labels=ids).loss
    extra = torch.zeros((), dtype=torch.float64)
    for layer_logits in logits:  # Megatron's formulas, one process
        probs = torch.softmax(layer_logits, dim=-1)
        tokens = probs.shape[0]
        chosen = torch.bincount(torch.topk(layer_logits, TOP_K).indices.reshape(-1),
                                minlength=EXPERTS).double()
        extra = extra + EXPERTS * AUX / (tokens * tokens * TOP_K) * (probs.sum(0) * chosen).sum()
        extra = extra + Z * torch.logsumexp(layer_logits, dim=-1).square().mean()
    (loss + extra).backward()
    returned = balanced(input_ids=ids, labels=ids).loss
    returned.backward()
    assert torch.equal(returned.detach(), loss.detach())  # the loss is the model's own
    worst = max((p.grad - q.grad).abs().max().item() / q.grad.abs().max().item()
                for p, q in zip(balanced.parameters(), plain.parameters(), strict=True))
    assert worst < 1e-12, worst
    assert extra.item() > 0.1  # the losses weigh: a gradient without them differs


def test_router_jitter_is_recomputed_the_same():
    """Mixtral's router jitter, drawn from torch's generator in training: inside torch's
    checkpoint_wrapper the recomputation draws the same noise (the same routing, the
    auxiliary gradients once), so gradients equal the run without checkpointing."""
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import (
        CheckpointWrapper,
        apply_activation_checkpointing,
    )

    ids = batches()[0]
    grads, losses = [], []
    for checkpointed in (False, True):
        model = smp_model("mixtral", "aux_loss")
        for layer in model.modules():
            if hasattr(layer, "jitter_noise"):
                layer.jitter_noise = 0.1
        if checkpointed:
            decoder = type(model.model.layers[0])
            apply_activation_checkpointing(
                model, check_fn=lambda m, decoder=decoder: isinstance(m, decoder))
            assert all(isinstance(m, CheckpointWrapper) for m in model.model.layers)
        torch.manual_seed(5)
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        losses.append(loss.detach())
        grads.append([p.grad for p in model.parameters()])
    assert torch.equal(losses[0], losses[1])
    assert all(torch.equal(a, b) for a, b in zip(*grads, strict=True))
    again = smp_model("mixtral", "aux_loss")
    for layer in again.modules():
        if hasattr(layer, "jitter_noise"):
            layer.jitter_noise = 0.1
    torch.manual_seed(6)  # other draws give another loss: the noise is used
    assert not torch.equal(again(input_ids=ids, labels=ids).loss.detach(), losses[0])


def test_sinkhorn_balances_tokens_and_experts():
    from modelparallel.parallel.expert_parallel.smp_router import RouterSettings, route

    g = torch.Generator().manual_seed(0)
    logits = torch.randn(32, EXPERTS, generator=g, dtype=torch.float64)
    logits[:, 0] += 2.0  # expert 0 favoured: the balanced choice differs from the top-k
    plan = logits.exp()
    for _ in range(200):  # Sinkhorn-Knopp: rows to 1/T, columns to 1/E
        plan = plan / (plan.sum(dim=1, keepdim=True) * plan.shape[0])
        plan = plan / (plan.sum(dim=0, keepdim=True) * EXPERTS)
    expected = torch.topk(plan, TOP_K).indices
    weights, index = route(logits, TOP_K, RouterSettings("sinkhorn", 0.0, 0.0), True, None)
    assert torch.equal(index, expected)
    assert not torch.equal(index, torch.topk(logits, TOP_K).indices)
    assert torch.equal(weights, torch.softmax(logits, dim=-1).gather(1, index))
    weights, index = route(logits, TOP_K, RouterSettings("sinkhorn", 0.0, 0.0), False, None)
    assert torch.equal(index, torch.topk(logits, TOP_K).indices)  # evaluation: the top-k
    assert torch.equal(weights, torch.softmax(logits, dim=-1).gather(1, index))


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
             (4, {"expert_parallel_degree": 4}, "qwen3_moe", "aux_loss", False, False)]
    for world, config, family, mode, checkpointed, fsdp1 in cases:
        for rank, (problems, figures) in enumerate(workers(world).run(
                parallel_case, config=config, family=family, mode=mode,
                checkpointed=checkpointed, fsdp1=fsdp1)):
            print(config, family, mode, checkpointed, fsdp1, rank,
                  "loss rel, params, momentum:", figures)
            assert problems == [], (config, family, mode, checkpointed, rank, problems)


def test_balanced_gives_every_expert_the_same_slots():
    from modelparallel.parallel.expert_parallel.smp_router import (
        RouterSettings,
        balanced_choice,
        route,
    )

    g = torch.Generator().manual_seed(0)
    for tokens, top_k, skew in ((32, 2, 3.0), (30, 3, 6.0), (7, 2, 0.0)):
        logits = torch.randn(tokens, EXPERTS, generator=g, dtype=torch.float64)
        logits[:, 0] += skew  # expert 0 favoured: its top-k share is above its capacity
        weights, index = route(logits, top_k, RouterSettings("balanced", 0.0, 0.0), True, None)
        counts = torch.bincount(index.reshape(-1), minlength=EXPERTS).tolist()
        share, extra = divmod(tokens * top_k, EXPERTS)
        assert counts == [share + (e < extra) for e in range(EXPERTS)], counts
        assert all(len(set(row)) == top_k for row in index.tolist())  # distinct experts
        chosen = logits.gather(1, index)
        assert torch.equal(weights, torch.softmax(chosen, dim=-1))
        if skew:
            assert not torch.equal(index, torch.topk(logits, top_k).indices)
    # a top-k that is balanced already is the greedy choice itself
    favourite = torch.eye(EXPERTS, dtype=torch.float64).repeat(8, 1) * 3
    favourite += torch.eye(EXPERTS, dtype=torch.float64).roll(1, 1).repeat(8, 1)
    probs = torch.softmax(favourite, dim=-1)
    assert torch.equal(balanced_choice(probs, 2), torch.topk(probs, 2).indices)
    _, index = route(logits, 2, RouterSettings("balanced", 0.0, 0.0), False, None)
    assert torch.equal(index, torch.topk(logits, 2).indices)  # evaluation: the top-k


def test_per_rank_modes_depend_on_the_tokens_routed_together():
    """Sinkhorn's and balanced's per-rank semantics is not one process's on the whole
    batch (else the parallel cases could not tell them apart)."""
    for mode in ("sinkhorn", "balanced"):
        apart, together = reference("mixtral", mode, 2)[0], reference("mixtral", mode, 1)[0]
        assert max(abs(a - b) / b for a, b in zip(apart, together, strict=True)) > 1e-4, mode


def uneven_losses_case() -> list[float]:
    """Each rank routes a different number of tokens (3 and 8): the auxiliary losses over
    both equal one process's on all of them, and each rank's gradient of its logits,
    averaged over the ranks as data parallelism does, one process's."""
    import torch.distributed as dist

    from modelparallel.parallel.expert_parallel.smp_router import load_balancing_loss, z_loss

    logits = torch.randn(11, EXPERTS, generator=torch.Generator().manual_seed(3),
                         dtype=torch.float64) * 2
    index = torch.topk(logits, TOP_K).indices
    mine = slice(0, 3) if dist.get_rank() == 0 else slice(3, 11)
    figures = []
    for loss in (lambda x, i, g: load_balancing_loss(x, i, AUX, g),
                 lambda x, i, g: z_loss(x, Z, g)):
        whole = logits.clone().requires_grad_()
        one = loss(whole, index, None)
        one.backward()
        part = logits[mine].clone().requires_grad_()
        ours = loss(part, index[mine], dist.group.WORLD)
        ours.backward()
        grad = part.grad / dist.get_world_size()  # the data-parallel average
        figures += [abs(ours.item() - one.item()),
                    (grad - whole.grad[mine]).abs().max().item()]
    return figures


def test_auxiliary_losses_span_uneven_ranks(workers):
    for figures in workers(2).run(uneven_losses_case):
        assert max(figures) < 1e-15, figures


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
    got["shuffle"] = message(lambda: tsm.transform(
        build(), config=MoEConfig(global_token_shuffle=True)))
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
        assert got["shuffle"].startswith("NotImplementedError: MoEConfig(global_token_"
                                         "shuffle=True) is not built yet")
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
