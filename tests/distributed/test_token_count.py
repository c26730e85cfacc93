"""mp.global_token_count: token-sum losses over padded batches train as one process.

The global batch has rows of uneven length (padding is ``-100``), some rows all padding,
so the data-parallel ranks, the tensor-parallel ranks' rows and the microbatches each
hold a different number of valid targets. Every path is compared with one process
training ``loss_sum / C`` (C: the batch's valid targets) with AdamW: the loss at every
step, every parameter and every optimizer state tensor at the end. A plain mean per
rank is shown to be another training.
"""

from __future__ import annotations

import functools

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict
from torch.distributed.tensor import DTensor

import modelparallel as mp
from modelparallel.data import replica_rank_and_size
from modelparallel.data.tokens import StepLabelsError
from modelparallel.models import GPT, GPTConfig
from modelparallel.testing import full_parameters, local_rows, parity_problems
from modelparallel.testing.parity import TrainResult

STEPS, ROWS, SEQ, VOCAB = 3, 8, 16, 64
# valid targets per row (the rest is -100); every 2-row slice holds some, unevenly
LENGTHS = (16, 0, 11, 2, 0, 5, 14, 0)
RTOL = 1e-5


def batches() -> list[tuple[torch.Tensor, torch.Tensor]]:
    """(inputs, labels) per step; the padding pattern moves by 2 rows a step."""
    g = torch.Generator().manual_seed(1)
    out = []
    for step in range(STEPS):
        inputs = torch.randint(VOCAB, (ROWS, SEQ), generator=g)
        labels = torch.randint(VOCAB, (ROWS, SEQ), generator=g)
        lengths = torch.tensor(LENGTHS).roll(2 * step)
        labels[torch.arange(SEQ) >= lengths[:, None]] = -100
        out.append((inputs, labels))
    return out


def build(arch: str) -> nn.Module:
    torch.manual_seed(0)
    if arch == "gpt":
        model = GPT(GPTConfig(vocab_size=VOCAB, max_seq_len=SEQ, d_model=64, n_layers=2,
                              n_heads=4))
        for block in model.blocks:  # its exact gradient is 0: AdamW would step on round-off
            block.attn.k_proj.bias.requires_grad_(False)
        return model
    import transformers as T

    return T.LlamaForCausalLM(T.LlamaConfig(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=2 * SEQ,
        use_cache=False))


def adamw(params) -> torch.optim.Optimizer:
    # eps above round-off: Adam's first step is lr g / (|g| + eps), which turns the last
    # bits of a gradient near eps (a summation order's) into a step of lr / 2
    return torch.optim.AdamW(params, lr=1e-2, eps=1e-2, weight_decay=0.1)


def token_sum(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.reshape(-1, logits.size(-1)).float(), labels.reshape(-1),
                           reduction="sum")


def loss_of(model: nn.Module, arch: str, how: str, x: torch.Tensor, y: torch.Tensor):
    """The loss of one place: ``how`` is 'one' (one process's mean), 'plain' (a plain mean
    per place), 'sum' (token sum / divisor) or, for Hugging Face, 'inside' (the model's
    own loss given num_items_in_batch)."""
    if arch == "gpt":
        logits = model(x)
        if how in ("one", "plain"):
            return F.cross_entropy(logits.reshape(-1, VOCAB), y.reshape(-1))
        return token_sum(logits, y) / mp.global_token_count(y)
    if how in ("one", "plain"):
        return model(input_ids=x, labels=y).loss  # its mean over the shifted labels
    if how == "inside":
        return model(input_ids=x, labels=y,
                     num_items_in_batch=mp.global_token_count(y, shift=True)).loss
    logits = model(input_ids=x).logits
    return token_sum(logits[:, :-1], y[:, 1:]) / mp.global_token_count(y, shift=True)


def optimizer_state(model: nn.Module, opt: torch.optim.Optimizer) -> dict[str, dict]:
    """Every optimizer state tensor, whole, by parameter name (collective)."""
    sd = get_optimizer_state_dict(model, opt, options=StateDictOptions(full_state_dict=True))
    return {name: {k: (v.full_tensor() if isinstance(v, DTensor) else v).detach().cpu().clone()
                   for k, v in s.items()} for name, s in sd["state"].items()}


def state_problems(got: dict[str, dict], ref: dict[str, dict]) -> list[str]:
    problems = [f"optimizer state names differ: {sorted(set(got) ^ set(ref))}"] \
        if set(got) != set(ref) else []
    for name in sorted(set(got) & set(ref)):
        for key, b in ref[name].items():
            a = got[name][key].float().reshape(b.shape)
            diff, scale = (a - b.float()).abs().max().item(), b.float().abs().max().item()
            if not diff <= RTOL * scale + 1e-12:
                problems.append(f"{name} {key}: max difference {diff:.3e} > {RTOL} x {scale:.3e}")
    return problems


@functools.cache
def reference(arch: str) -> tuple[TrainResult, dict[str, dict]]:
    """One process on the whole batch: its loss is the mean over the valid targets."""
    model = build(arch)
    opt = adamw(model.parameters())
    losses = []
    for x, y in batches():
        opt.zero_grad()
        loss = loss_of(model, arch, "one", x, y)
        loss.backward()
        opt.step()
        losses.append(float(loss.detach()))
    return TrainResult(losses, full_parameters(model)), optimizer_state(model, opt)


def train_parallel(model: nn.Module, arch: str, how: str):
    """This rank's rows (as mp.data reads them); the loss averaged over the data-parallel
    group, which is the batch's loss whatever K is."""
    opt = adamw(model.parameters())
    losses = []
    for batch in batches():
        x, y = local_rows(batch, *replica_rank_and_size())
        opt.zero_grad()
        loss = loss_of(model, arch, how, x, y)
        loss.backward()
        opt.step()
        losses.append(mean_over_dp(loss))
    return TrainResult(losses, full_parameters(model)), optimizer_state(model, opt)


def mean_over_dp(loss: torch.Tensor) -> float:
    value = loss.detach().double().reshape(1)
    torch.distributed.all_reduce(value, group=mp.get_dp_process_group())
    return float(value) / mp.dp_size()


def problems_against_reference(arch: str, result: TrainResult, state: dict) -> list[str]:
    ref, ref_state = reference(arch)
    return parity_problems(result, ref, RTOL) + state_problems(state, ref_state)


def applier_case(config: dict, arch: str, wrap: str, how: str, plain_too: bool = False):
    mp.init(config)
    ref = reference(arch)  # before anything is split (the model is built seeded)

    def parallel(how: str):
        model = build(arch)
        if mp.tp_size() > 1:
            model = mp.transform(model)
        if wrap == "shard":
            mp.shard(model)
        elif wrap == "replicate":
            model = mp.replicate(model)
        return train_parallel(model, arch, how)

    problems = problems_against_reference(arch, *parallel(how))
    assert problems == [], "\n".join(problems)
    _, y = local_rows(batches()[0], *replica_rank_and_size())
    counted = mp.global_token_count(y, count=True)
    assert int(counted) == int((batches()[0][1] != -100).sum()), counted
    if not plain_too:
        return None
    plain, _ = parallel("plain")
    losses = [abs(a - b) / b for a, b in zip(plain.losses, ref[0].losses, strict=True)]
    params = max(float((p - ref[0].params[n]).abs().max() / ref[0].params[n].abs().max())
                 for n, p in plain.params.items())
    return losses, params


TP2 = {"tensor_parallel_degree": 2}
APPLIER_CASES = [
    # (world size, config, model, data-parallel wrapper, loss)
    (2, {"hybrid_shard_degree": 1}, "gpt", "replicate", "sum"),  # DDP
    (2, TP2, "gpt", "", "sum"),  # each tp rank's own rows, gathered inside the model
    (2, {**TP2, "prescaled_batch": True}, "gpt", "", "sum"),
    (2, {}, "llama", "shard", "inside"),  # Hugging Face: num_items_in_batch=
    (2, {}, "llama", "shard", "outside"),
    (2, TP2, "llama", "", "inside"),  # the model's loss sums both tp ranks' rows
    (4, {**TP2, "hybrid_shard_degree": 2}, "gpt", "shard", "sum"),
]


@pytest.mark.parametrize(("world", "config", "arch", "wrap", "how"), APPLIER_CASES,
                         ids=[f"{w}ranks-{a}-{wr or 'tp'}-{h}"
                              + ("-prescaled" if c.get("prescaled_batch") else "")
                              for w, c, a, wr, h in APPLIER_CASES])
def test_token_sum_trains_as_one_process(workers, world, config, arch, wrap, how):
    workers(world).run(applier_case, config=config, arch=arch, wrap=wrap, how=how)


def test_fsdp2_token_sum_is_one_process_and_a_plain_mean_is_not(workers):
    """FSDP2 over 2 ranks. What docs/data-parallel.md says: with a plain mean loss it
    averages the ranks' means, far from one process's mean over the batch."""
    losses, params = workers(2).run(applier_case, config={}, arch="gpt", wrap="shard",
                                    how="sum", plain_too=True)[0]
    assert min(losses) > 10 * RTOL, losses  # relative errors of the losses, every step
    assert params > 100 * RTOL, params  # of the parameters at the end


# -- SMP v1: @mp.step, microbatches, a pipeline --------------------------------------------


@mp.step
def counted_inside(model, x, y):
    loss = token_sum(model(x), y) / mp.global_token_count(y)  # last stage only, mb's labels
    model.backward(loss)
    return loss


@mp.step
def divisor_given(model, x, y, divisor):  # a 0-dim tensor reaches every microbatch whole
    loss = token_sum(model(x), y) / divisor
    model.backward(loss)
    return loss


@mp.step
def sliced_labels(model, x, y):
    return mp.global_token_count(y[:, 1:])


def step_case(config: dict, given: bool):
    mp.init(config)
    reference("gpt")
    model = mp.DistributedModel(build("gpt"))
    opt = mp.DistributedOptimizer(adamw(model.parameters()))
    losses = []
    for batch in batches():
        x, y = local_rows(batch, *replica_rank_and_size())
        opt.zero_grad()
        out = divisor_given(model, x, y, mp.global_token_count(y)) if given else \
            counted_inside(model, x, y)
        losses.append(mean_over_dp(out.reduce_mean()))
        opt.step()
    params = model.state_dict()
    torch_opt = opt.torch_optimizer()
    state = {name: {k: v.detach().cpu().clone() for k, v in torch_opt.state[p].items()}
             for name, p in model.engine.local.items() if p.requires_grad}
    ref, ref_state = reference("gpt")
    problems = parity_problems(TrainResult(losses, params), ref, RTOL) + state_problems(
        state, {name: ref_state[name] for name in state})
    assert problems == [], "\n".join(problems)
    with pytest.raises(StepLabelsError, match="shift=True"):
        sliced_labels(model, *local_rows(batches()[0], *replica_rank_and_size()))
    return sorted(state)


PP2 = {"pipeline_parallel_degree": 2, "microbatches": 2}


@pytest.mark.parametrize(("world", "config", "given"), [
    (2, PP2, True),  # counted before the step, the divisor an argument
    # counted inside the step function, on the last stage: over its 2 replicas
    (4, {**PP2, "hybrid_shard_degree": 1}, False),
], ids=["2ranks-pp2-given", "4ranks-pp2-dp2-inside"])
def test_smp_v1_step_trains_as_one_process(workers, world, config, given):
    held = workers(world).run(step_case, config=config, given=given)
    trained = {name for name, p in build("gpt").named_parameters() if p.requires_grad}
    assert set().union(*held) == trained  # the stages' optimizer states cover the model
