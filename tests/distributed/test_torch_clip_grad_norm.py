"""torch's own ``clip_grad_norm_(model.parameters(), c)``, what most FSDP and SMP v2
scripts call, on a tensor-parallel model that ``mp.shard`` or ``mp.replicate`` wraps:
one process's norm at every step, and one process's training with clipping on.

Every parameter of such a model is a DTensor on one mesh (the replicated ones
``Replicate()`` on ``tp``, ``sharding.replicate_on_tp``); before, FSDP2 put the split
ones on ``(dp_shard, tp)`` and the others on ``dp_shard``, and torch's function failed
("All operands in aten.stack.default must have the same mesh"). Where torch cannot add
the norms up (DTensors on several meshes under expert parallelism, or DTensors and plain
tensors with no data-parallel wrapper), ``mp.init`` routed torch's function to
``mp.clip_grad_norm_`` (smp/torch_clip_hook.py).
"""

import functools

import pytest
import torch
from test_tensor_parallel import Logits
from torch import nn

import modelparallel as mp
from modelparallel.data import replica_rank_and_size
from modelparallel.models import GPT, GPTConfig
from modelparallel.models.gpt import lm_loss
from modelparallel.testing import TrainResult, parity_problems, token_batches, train

STEPS, GLOBAL_BATCH, SEQ, VOCAB = 3, 8, 16, 64
MAX_NORM = 0.05  # below every step's norm: every step clips


def build(arch: str) -> nn.Module:
    torch.manual_seed(0)
    if arch == "gpt":
        return GPT(GPTConfig(vocab_size=VOCAB, max_seq_len=SEQ, d_model=64, n_layers=2,
                             n_heads=4))
    from transformers import Qwen3Config, Qwen3ForCausalLM

    # Qwen3: its per-head q_norm/k_norm are replicated parameters read inside a split
    # region, whose gradients regions.py sums over the tensor-parallel ranks
    return Logits(Qwen3ForCausalLM(Qwen3Config(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16,
        max_position_embeddings=SEQ, tie_word_embeddings=False)))


def sgd(model: nn.Module) -> torch.optim.Optimizer:
    return torch.optim.SGD(model.parameters(), lr=0.5, momentum=0.9)


def torch_clip(norms: list[float]):
    def clip(model: nn.Module) -> None:
        norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM)))
    return clip


def momenta(model: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, torch.Tensor]:
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict

    state = get_optimizer_state_dict(model, optimizer,
                                     options=StateDictOptions(full_state_dict=True))["state"]
    return {name: s["momentum_buffer"] for name, s in state.items()}


@functools.cache
def reference(arch: str) -> tuple[TrainResult, list[float], dict[str, torch.Tensor]]:
    norms: list[float] = []
    model, optimizers = build(arch), []
    result = train(model, token_batches(STEPS, GLOBAL_BATCH, SEQ, VOCAB, seed=1),
                   optimizer=lambda m: optimizers.append(sgd(m)) or optimizers[0],
                   loss_fn=lm_loss, before_step=torch_clip(norms))
    return result, norms, momenta(model, optimizers[0])


def clip_case(config: dict, wrap: str, arch: str) -> list[str]:
    mp.init(config)
    model = mp.transform(build(arch))
    model = mp.shard(model) if wrap == "shard" else mp.replicate(model)
    norms: list[float] = []
    optimizers: list[torch.optim.Optimizer] = []
    result = train(model, token_batches(STEPS, GLOBAL_BATCH, SEQ, VOCAB, seed=1),
                   optimizer=lambda m: optimizers.append(sgd(m)) or optimizers[0],
                   loss_fn=lm_loss, replica=replica_rank_and_size(),
                   group=mp.get_dp_process_group(), before_step=torch_clip(norms))
    ref, ref_norms, ref_momenta = reference(arch)
    assert all(n > MAX_NORM for n in ref_norms)
    problems = [f"step {i}: torch's norm {a:.7f} vs one process's {b:.7f}"
                for i, (a, b) in enumerate(zip(norms, ref_norms, strict=True))
                if not abs(a - b) <= 1e-5 * b]
    problems += parity_problems(result, ref)
    problems += parity_problems(TrainResult([], momenta(model, optimizers[0])),
                                TrainResult([], ref_momenta))
    return problems


def distributed_model_case(config: dict) -> list[str]:
    """SMP v1: ``DistributedModel`` (FSDP2 units under ``hybrid_shard_degree``), torch's
    clip between ``@smp.step`` and ``optimizer.step()``."""
    import torch.distributed as dist

    from modelparallel.testing import local_rows

    mp.init(config)
    model = mp.DistributedModel(build("gpt"))
    optimizer = mp.DistributedOptimizer(sgd(model))

    @mp.step
    def train_step(model, x, y):
        loss = lm_loss(model(x), y)
        model.backward(loss)
        return loss

    group = mp.get_dp_process_group()
    losses, norms = [], []
    for batch in token_batches(STEPS, GLOBAL_BATCH, SEQ, VOCAB, seed=1):
        optimizer.zero_grad()
        loss = train_step(model, *local_rows(batch, *replica_rank_and_size())).reduce_mean()
        norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM)))
        optimizer.step()
        value = loss.detach().double()
        dist.all_reduce(value, group=group)
        losses.append(float(value) / dist.get_world_size(group))
    ref, ref_norms, _ = reference("gpt")
    problems = [f"step {i}: torch's norm {a:.7f} vs one process's {b:.7f}"
                for i, (a, b) in enumerate(zip(norms, ref_norms, strict=True))
                if not abs(a - b) <= 1e-5 * b]
    # SMP v1's question "did tensor parallelism split it?" for a replicated DTensor
    held = dict(model.module.named_parameters())
    split = {n: model.is_distributed_parameter(held[n])
             for n in ("ln_f.weight", "blocks.0.attn.q_proj.weight")}
    if split != {"ln_f.weight": False, "blocks.0.attn.q_proj.weight": True}:
        problems.append(f"is_distributed_parameter: {split}")
    buffers = [model.is_distributed_buffer(b) for b in model.module.buffers()]
    as_buffer = model.is_distributed_buffer(held["blocks.0.attn.q_proj.weight"])
    if any(buffers) or not as_buffer:  # the same question of a buffer: whole ones are not
        problems.append(f"is_distributed_buffer: {buffers}, split tensor: {as_buffer}")
    return problems + parity_problems(TrainResult(losses, model.state_dict()), ref)


TP2 = {"tensor_parallel_degree": 2}
CASES = {  # id: (world size, configuration, wrapper, model)
    "tp2-shard": (2, TP2, "shard", "gpt"),
    "tp2-shard-qwen3": (2, TP2, "shard", "qwen3"),
    "tp2-hsd2-shard": (4, {**TP2, "hybrid_shard_degree": 2}, "shard", "gpt"),
    "tp2-hsd2-shard-qwen3": (4, {**TP2, "hybrid_shard_degree": 2}, "shard", "qwen3"),
    "tp2-replicate": (4, {**TP2, "hybrid_shard_degree": 1}, "replicate", "gpt"),
}


@pytest.mark.parametrize("case", list(CASES))
def test_torch_clip_grad_norm_matches_one_process(workers, case):
    world, config, wrap, arch = CASES[case]
    for rank, problems in enumerate(workers(world).run(clip_case, config=config, wrap=wrap,
                                                       arch=arch)):
        assert problems == [], rank


def test_torch_clip_grad_norm_of_a_distributed_model_matches_one_process(workers):
    for rank, problems in enumerate(workers(4).run(
            distributed_model_case, config={**TP2, "hybrid_shard_degree": 2})):
        assert problems == [], rank


def unwrapped_case() -> tuple[float, float, float]:
    """Tensor parallelism alone (split DTensors and plain tensors, which torch's function
    cannot stack): after ``mp.init`` torch's function gives one process's norm, as
    ``mp.clip_grad_norm_`` does."""
    mp.init(TP2)
    x, y = token_batches(1, GLOBAL_BATCH, SEQ, VOCAB, seed=1)[0]
    ref = build("gpt")
    lm_loss(ref(x), y).backward()
    expected = float(torch.nn.utils.clip_grad_norm_(ref.parameters(), 1e9))
    model = mp.transform(build("gpt"))
    lm_loss(model(x), y).backward()
    torch_norm = float(torch.nn.utils.clip_grad_norm_(model.parameters(), 1e9))
    return torch_norm, float(mp.clip_grad_norm_(model, 1e9)), expected


def test_torch_clip_grad_norm_of_a_model_without_data_parallel_wrapper(workers):
    for torch_norm, ours, expected in workers(2).run(unwrapped_case):
        assert torch_norm == pytest.approx(expected, rel=1e-5)
        assert ours == pytest.approx(expected, rel=1e-5)


@functools.cache
def expert_reference() -> tuple[list[float], list[float], dict[str, torch.Tensor]]:
    """One process training the tiny float64 Mixtral with torch's clip on every step."""
    from test_expert_parallel import batches, build, optimizer

    model = build("mixtral")
    opt = optimizer(model)
    losses, norms = [], []
    for ids in batches():
        opt.zero_grad(set_to_none=True)
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), EP_MAX_NORM)))
        opt.step()
        losses.append(float(loss.detach()))
    return losses, norms, {n: p.detach().clone() for n, p in model.named_parameters()}


EP_MAX_NORM = 0.5  # below every step's norm: every step clips


def expert_parallel_case(config: dict) -> list[str]:
    """Expert parallelism under ``mp.shard``: the experts are DTensors on the experts' mesh,
    the rest on the data-parallel mesh; torch's own function on ``model.parameters()``."""
    from test_expert_parallel import build, optimizer, train_own_rows

    from modelparallel.smp.v2.moe import MoEConfig
    from modelparallel.testing import full_parameters

    mp.init(config)
    model = mp.transform(build("mixtral"),
                         config=MoEConfig(smp_moe=False, moe_load_balancing="none"))
    model = mp.shard(model, blocks=(type(model.model.layers[0]),))
    losses, norms = train_own_rows(
        model, optimizer(model), lambda p: torch.nn.utils.clip_grad_norm_(p, EP_MAX_NORM))
    ref_losses, ref_norms, ref_params = expert_reference()
    problems = [f"step {i}: torch's norm {a!r} vs one process's {b!r}"
                for i, (a, b) in enumerate(zip(norms, ref_norms, strict=True))
                if not (b > EP_MAX_NORM and abs(a - b) <= 1e-12 * b)]
    return problems + parity_problems(TrainResult(losses, full_parameters(model)),
                                      TrainResult(ref_losses, ref_params))


@pytest.mark.parametrize("world, config", [
    (2, {"expert_parallel_degree": 2}),
    (4, {"expert_parallel_degree": 2, "hybrid_shard_degree": 2})])
def test_torch_clip_grad_norm_under_expert_parallelism_matches_one_process(
        workers, world, config):
    for rank, problems in enumerate(workers(world).run(expert_parallel_case, config=config)):
        assert problems == [], rank
