"""``MoEConfig(global_token_shuffle=True)`` (``parallel/expert_parallel/token_shuffle.py``):
the expert-parallel group's tokens permuted across its ranks before SMP's MoE layer
routes them, against one process that reproduces the shuffle as docs/expert-parallel.md
defines it (written here, not imported: the permutation ``torch.randperm`` seeded by
the first rank's draw from torch's generator, even shares in position order).

The tiny float64 Mixtral of ``test_smp_moe.py`` (4 experts, top-2) trains 3 SGD steps at
ep 2 on 2 ranks (and ``"sinkhorn"`` on 4: two groups, each shuffling its own): with
``"none"`` and ``"aux_loss"`` (token-independent choices) it equals one process on the
whole batch, as without the shuffle; with ``"sinkhorn"`` and ``"balanced"`` it equals one
process routing each even share of the permuted tokens as its own set, also inside
``checkpoint_wrapper``, whose gradients equal the run without it bit for bit (also with
two micro-batches forwarded before one backward). One layer on ranks holding different
numbers of tokens (3 and 8, 0 and 5) equals one process too; the misuse messages last.
"""

from __future__ import annotations

import functools

import torch
from test_smp_moe import ROWS, batches, build, optimizer, settings

SEED = 7  # torch's generator before training: the reference's and the first rank's
RANKS = 2


def shuffled_mix(layer, hidden: torch.Tensor, ranks: int,
                 generators: list[torch.Generator]) -> torch.Tensor:
    """One process's output of SMP's MoE ``layer`` for every rank's ``hidden`` (tokens in
    rank order) when each expert-parallel group of ``ranks`` consecutive ranks (one per
    generator: its first rank's) permutes its tokens and each even share of them is
    routed as its own set; the z-loss over every token, as the ranks sum it (no
    load-balancing loss: ``"sinkhorn"`` and ``"balanced"``)."""
    from modelparallel.parallel.expert_parallel.smp_router import (
        AddLossGradient,
        RouterSettings,
        route,
        z_loss,
    )

    shape = hidden.shape
    flat = hidden.reshape(-1, shape[-1])
    tokens = flat.shape[0] // len(generators)  # a group's
    orders, sizes = [], []
    for group, generator in enumerate(generators):
        seed = int(torch.randint(2**62, (1,), generator=generator))  # one draw per call
        permuted = torch.randperm(tokens, generator=torch.Generator().manual_seed(seed))
        orders.append(group * tokens + permuted)
        share, extra = divmod(tokens, ranks)
        sizes += [share + (1 if j < extra else 0) for j in range(ranks)]
    order = torch.cat(orders)
    logits = layer.gate(flat)[0][order]
    knobs = layer.settings
    if knobs.z_loss_coeff > 0:
        logits = AddLossGradient.apply(logits, z_loss(logits, knobs.z_loss_coeff, None))
    alone = RouterSettings(knobs.load_balancing, 0.0, 0.0)
    routed = [route(part, layer.top_k, alone, True, None) for part in logits.split(sizes)]
    weights = torch.cat([w for w, _ in routed])
    index = torch.cat([i for _, i in routed])
    out = layer.experts(flat[order], index, weights)
    return out[torch.argsort(order)].reshape(shape)


def shuffled_model(mode: str, groups: int):
    """One process's Mixtral whose MoE layers reproduce the shuffle of ``groups``
    expert-parallel groups of ``RANKS`` ranks, each group's first rank seeded ``SEED +
    its rank``."""
    from test_smp_moe import smp_model

    from modelparallel.parallel.expert_parallel.smp_layer import MoELayer

    model = smp_model("mixtral", mode)
    generators = [torch.Generator().manual_seed(SEED + g * RANKS) for g in range(groups)]
    for layer in model.modules():
        if isinstance(layer, MoELayer):
            layer.forward = functools.partial(shuffled_mix, layer, ranks=RANKS,
                                              generators=generators)
    return model


@functools.cache
def reference(mode: str, groups: int) -> tuple[list[float], dict, dict]:
    """One process on the whole batch, 3 steps (its MoE layers reproducing the shuffle
    of ``groups`` expert-parallel groups; none when 0): losses, parameters, momentum
    buffers."""
    from test_smp_moe import smp_model

    model = shuffled_model(mode, groups) if groups else smp_model("mixtral", mode)
    opt = optimizer(model)
    torch.manual_seed(SEED)
    losses = []
    for ids in batches():
        opt.zero_grad(set_to_none=True)
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()  # one loss over the batch: the ranks' average of theirs
        opt.step()
        losses.append(float(loss.detach()))
    names = {p: n for n, p in model.named_parameters()}
    states = {f"{names[p]}.{k}": v.clone() for p, s in opt.state.items() for k, v in s.items()}
    return losses, {n: p.detach().clone() for n, p in model.named_parameters()}, states


def transformed(mode: str, checkpointed: bool = False):
    """This rank's Mixtral under ``tsm.transform`` (shuffle on) and ``tsm.shard``."""
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import (
        apply_activation_checkpointing,
    )

    import modelparallel as tsm
    from modelparallel.smp.v2.moe import MoEConfig

    knobs = settings(mode)
    model = tsm.transform(build(), config=MoEConfig(
        smp_moe=True, moe_load_balancing=mode, moe_aux_loss_coeff=knobs.aux_loss_coeff,
        moe_z_loss_coeff=knobs.z_loss_coeff, global_token_shuffle=True))
    layer = type(model.model.layers[0])
    if checkpointed:  # as the v2 shared scripts: checkpoint_wrapper on each decoder layer
        apply_activation_checkpointing(model, check_fn=lambda m: isinstance(m, layer))
    return tsm.shard(model, blocks=(layer,))


def parallel_case(mode: str, checkpointed: bool,
                  config: dict) -> tuple[list[str], list[float]]:
    """This rank's 3 steps at ep 2 (``config``'s layout) against one process (the whole
    batch for ``"none"`` and ``"aux_loss"``, the shuffled shares of each expert-parallel
    group otherwise): what differs, and the largest differences (losses relative,
    parameters, momentum)."""
    import torch.distributed as dist
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        get_model_state_dict,
        get_optimizer_state_dict,
    )

    import modelparallel as tsm
    from modelparallel.testing import TrainResult, parity_problems

    tsm.reset()
    tsm.init(config)
    model = transformed(mode, checkpointed)
    opt = optimizer(model)
    rank, world = dist.get_rank(), dist.get_world_size()
    rows = slice(rank * ROWS // world, (rank + 1) * ROWS // world)
    torch.manual_seed(SEED + rank)  # the ranks' generators differ: the first rank's seeds
    losses = []
    for ids in batches():
        opt.zero_grad(set_to_none=True)
        loss = model(input_ids=ids[rows], labels=ids[rows]).loss
        loss.backward()
        opt.step()
        value = loss.detach().double()
        dist.all_reduce(value)
        losses.append(float(value) / world)
    full = StateDictOptions(full_state_dict=True)
    params = get_model_state_dict(model, options=full)
    states = {f"{name}.{k}": v for name, s in
              get_optimizer_state_dict(model, opt, options=full)["state"].items()
              for k, v in s.items()}
    groups = world // RANKS if mode in ("sinkhorn", "balanced") else 0
    ref_losses, ref_params, ref_states = reference(mode, groups)
    problems = parity_problems(TrainResult(losses, params), TrainResult(ref_losses, ref_params))
    problems += parity_problems(TrainResult([], states), TrainResult([], ref_states))
    figures = [max(abs(a - b) / abs(b) for a, b in zip(losses, ref_losses, strict=True)),
               max((params[n] - p).abs().max().item() for n, p in ref_params.items()),
               max((states[n] - s).abs().max().item() for n, s in ref_states.items())]
    return problems, figures


def test_shuffled_training_equals_one_process(workers):
    ep2 = {"expert_parallel_degree": RANKS}
    hybrid = {"expert_parallel_degree": RANKS, "hybrid_shard_degree": 2}
    for world, config, mode, checkpointed in [
            (2, ep2, "none", False), (2, ep2, "aux_loss", False), (2, ep2, "sinkhorn", False),
            (2, ep2, "balanced", False), (2, ep2, "sinkhorn", True),
            (4, hybrid, "sinkhorn", False)]:  # two groups, each shuffling its own tokens
        for rank, (problems, figures) in enumerate(workers(world).run(
                parallel_case, mode=mode, checkpointed=checkpointed, config=config)):
            print(world, mode, checkpointed, rank, "loss rel, params, momentum:", figures)
            assert problems == [], (world, mode, checkpointed, rank, problems)


def test_the_shuffle_changes_what_sinkhorn_and_balanced_route():
    """The shuffled reference differs from each rank routing its own rows (and from the
    whole batch routed together), so the parallel cases tell the semantics apart."""
    from test_smp_moe import reference as unshuffled

    for mode in ("sinkhorn", "balanced"):
        shuffled = reference(mode, 1)[0]
        for pieces in (1, RANKS):
            other = unshuffled("mixtral", mode, pieces)[0]
            assert max(abs(a - b) / b for a, b in zip(shuffled, other, strict=True)) > 1e-5


def checkpoint_case(micro_batches: int) -> list[bool]:
    """Whether each gradient of one step with ``"sinkhorn"`` + z-loss is bit-identical
    with and without ``checkpoint_wrapper`` on each decoder layer, this rank's rows
    forwarded as ``micro_batches`` forwards before one backward of their summed losses
    (each recomputation then runs after every forward of the step)."""
    import torch.distributed as dist

    import modelparallel as tsm

    tsm.reset()
    tsm.init({"expert_parallel_degree": RANKS})
    ids = batches()[0][dist.get_rank() * 2:dist.get_rank() * 2 + 2]
    grads = []
    for checkpointed in (False, True):
        model = transformed("sinkhorn", checkpointed)
        torch.manual_seed(SEED + dist.get_rank())
        sum(model(input_ids=rows, labels=rows).loss
            for rows in ids.chunk(micro_batches)).backward()
        grads.append([p.grad.to_local() for p in model.parameters()])
    return [torch.equal(a, b) for a, b in zip(*grads, strict=True)]


def test_checkpointing_recomputes_the_same_shuffle(workers):
    for micro_batches in (1, 2):
        for same in workers(RANKS).run(checkpoint_case, micro_batches=micro_batches):
            assert same and all(same), (micro_batches, same)


def uneven_case(counts: tuple[int, int], mode: str) -> dict[str, torch.Tensor]:
    """One MoE layer at ep 2, this rank holding ``counts[rank]`` of the tokens of
    ``tokens(counts)``: its output, the input's and router's gradients and its experts'
    (a loss weighting every output by a fixed random weight; no z-loss)."""
    import torch.distributed as dist

    import modelparallel as tsm
    from modelparallel.smp.v2.moe import MoEConfig

    tsm.reset()
    tsm.init({"expert_parallel_degree": RANKS})
    model = tsm.transform(build(), config=MoEConfig(
        moe_load_balancing=mode, moe_aux_loss_coeff=0.0, moe_z_loss_coeff=0.0,
        global_token_shuffle=True))
    layer = model.model.layers[0].mlp.train()
    rank = dist.get_rank()
    own = slice(sum(counts[:rank]), sum(counts[:rank + 1]))
    hidden, weight = tokens(counts)
    mine = hidden[own].clone().requires_grad_()
    torch.manual_seed(SEED + rank)  # the first rank's generator draws the permutation
    out = layer(mine[None])[0]
    (out * weight[own]).sum().backward()
    return {"out": out.detach(), "input": mine.grad, "gate": layer.gate.weight.grad,
            "experts": layer.experts.gate_up_proj.grad.to_local()}


def tokens(counts: tuple[int, int]) -> tuple[torch.Tensor, torch.Tensor]:
    """The group's hidden states and the loss's weights, in rank order."""
    g = torch.Generator().manual_seed(3)
    return (torch.randn(sum(counts), 64, generator=g, dtype=torch.float64),
            torch.randn(sum(counts), 64, generator=g, dtype=torch.float64))


def test_ranks_holding_different_token_counts(workers):
    from test_smp_moe import smp_model

    from modelparallel.parallel.expert_parallel.smp_router import RouterSettings

    for counts in [(3, 8), (0, 5)]:
        for mode in ("sinkhorn", "balanced"):
            got = workers(RANKS).run(uneven_case, counts=counts, mode=mode)
            layer = smp_model("mixtral", mode).model.layers[0].mlp.train()
            layer.settings = RouterSettings(mode, 0.0, 0.0)  # as the ranks': no z-loss
            hidden, weight = tokens(counts)
            hidden.requires_grad_()
            torch.manual_seed(SEED)
            out = shuffled_mix(layer, hidden[None], RANKS,
                               [torch.Generator().manual_seed(SEED)])[0]
            (out * weight).sum().backward()
            pairs = [(torch.cat([r["out"] for r in got]), out.detach()),
                     (torch.cat([r["input"] for r in got]), hidden.grad),
                     (sum(r["gate"] for r in got), layer.gate.weight.grad),
                     (torch.cat([r["experts"] for r in got]), layer.experts.gate_up_proj.grad)]
            worst = max((a - b).abs().max().item() for a, b in pairs)
            print(counts, mode, "largest difference:", worst)
            assert worst < 1e-13, (counts, mode, worst)


def misuse_case() -> dict[str, object]:
    """What transform says to the shuffle without SMP's layer, at ep 1, and with tensor
    parallelism."""
    from test_expert_parallel import _captured_notices  # the notices rank 0 logs

    import modelparallel as tsm
    from modelparallel.smp.v2.moe import MoEConfig

    tsm.reset()
    tsm.init({})
    got: dict[str, object] = {}
    try:
        tsm.transform(build(), config=MoEConfig(smp_moe=False, moe_load_balancing="none",
                                                global_token_shuffle=True))
        got["own router"] = "no error"
    except NotImplementedError as e:
        got["own router"] = str(e)
    with _captured_notices() as notices:
        tsm.transform(build(), config=MoEConfig(moe_load_balancing="none",
                                                global_token_shuffle=True))
    got["ep 1"] = notices
    tsm.reset()
    tsm.init({"tensor_parallel_degree": 2})
    try:
        tsm.transform(build(), config=MoEConfig(moe_load_balancing="sinkhorn",
                                                global_token_shuffle=True))
        got["tp"] = "no error"
    except NotImplementedError as e:
        got["tp"] = str(e)
    return got


def test_misuse(workers):
    for rank, got in enumerate(workers(RANKS).run(misuse_case)):
        assert got["own router"] == (
            "MoEConfig(global_token_shuffle=True) shuffles the tokens SMP's MoE layer "
            "routes; with smp_moe=False (the model's own router) it is not built: pass "
            "smp_moe=True, or global_token_shuffle=False")
        assert got["ep 1"] == ([
            "MoEConfig(global_token_shuffle=True) has no effect at expert_parallel_degree "
            "1: the tokens are shuffled across the ranks of an expert-parallel group, and "
            "each rank routes its own"] if rank == 0 else [])
        assert got["tp"] == (
            "MoEConfig(global_token_shuffle=True) with tensor_parallel_degree 2 is not built "
            "yet; pass global_token_shuffle=False, or set tensor_parallel_degree to 1")

