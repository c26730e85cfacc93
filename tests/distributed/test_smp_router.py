"""SMP's router (``parallel/expert_parallel/smp_router.py``) and MoE layer on one
process, and its auxiliary losses over ranks that route different numbers of tokens.

With ``moe_load_balancing="none"`` the layer routes as each model's own block (softmax
over the chosen logits = softmax then renormalised) and keeps the block's parameter
names and order; with ``"aux_loss"`` and a z-loss the returned loss is unchanged and the
gradients are those of the loss plus the auxiliary losses computed here by Megatron's
formulas; router jitter is recomputed the same inside ``checkpoint_wrapper``; the
Sinkhorn and balanced choices are checked against their definitions. Training against
one process over ranks: ``test_smp_moe.py``.
"""

from __future__ import annotations

import torch
from test_smp_moe import AUX, EXPERTS, TOP_K, Z, batches, build, smp_model


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


def test_routers_it_cannot_read_are_refused():
    """A router with parameters besides its weight is not replaced (its routing is the
    model's own); one that does not return the logits first is refused in one message."""
    import pytest

    from modelparallel.parallel.expert_parallel.smp_layer import MoELayer, is_sparse_block

    model = build()
    block = model.model.layers[0].mlp
    assert is_sparse_block(block)
    block.gate.bias = torch.nn.Parameter(torch.zeros(EXPERTS, dtype=torch.float64))
    assert not is_sparse_block(block)
    del block.gate.bias
    layer = MoELayer(block)
    layer.gate.forward = lambda hidden: (torch.topk(hidden, TOP_K).indices,)
    with pytest.raises(TypeError, match=r"MixtralTopKRouter does not return the router's "
                                        r"logits \(tokens, experts\) first"):
        layer(torch.zeros(1, 3, 64, dtype=torch.float64))
