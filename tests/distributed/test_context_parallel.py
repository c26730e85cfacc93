"""Context parallelism against one process: Hugging Face causal LMs transformed with
``context_parallel_degree`` 2, each rank given its chunks of every sequence (SMP's
split, ``mp.split_for_context_parallel``), trained under FSDP1 (as SMP v2's scripts
wrap it, with activation checkpointing) or ``mp.shard``, with both ``cp_comm_type``s.

Each case compares the loss of every step (averaged over the ranks as the scripts do,
which with the loss's per-rank normalisation is the whole batch's mean), every
parameter and every optimizer state at the end with one process training the whole
sequences. Some labels are -100 (padding), so the ranks of a group hold different
numbers of targets: a per-rank mean would differ from one process there. The
optimizer is SGD with momentum: a wrong gradient shows in every parameter.

With attention dropout the one process runs dense attention dropping the weights that
the library's masks of global positions name (``context_parallel/dropout.py``), its
seeds drawn from the generator as the library draws them: the split run must drop the
same weights, in the forward and in the recomputation of activation checkpointing.
"""

from __future__ import annotations

import functools

import pytest
import torch
from torch import nn

STEPS, ROWS, SEQ, VOCAB = 3, 4, 16, 128
LR = 0.5


POSITIONAL_DROPOUT = "test_dense_positional_dropout"


def build(family: str, dropout: float = 0.0, attention: str = "eager") -> nn.Module:
    import transformers

    torch.manual_seed(0)
    common = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128,
                  num_hidden_layers=2, num_attention_heads=4, max_position_embeddings=SEQ,
                  use_cache=False, tie_word_embeddings=False, attn_implementation=attention,
                  attention_dropout=dropout)
    if family == "gpt_neox":
        config = transformers.GPTNeoXConfig(**common, rotary_pct=0.5, hidden_dropout=0.0)
        return transformers.GPTNeoXForCausalLM(config)
    kinds = {"llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM),
             "qwen3": (transformers.Qwen3Config, transformers.Qwen3ForCausalLM),
             "mistral": (transformers.MistralConfig, transformers.MistralForCausalLM)}
    config_class, model_class = kinds[family]
    extra = {"sliding_window": None} if family == "mistral" else {}
    config = config_class(**common, **extra, num_key_value_heads=2)  # grouped-query
    return model_class(config)


def transformers_class(name: str) -> type:
    import transformers

    return getattr(transformers, name)


def batches() -> list[tuple[torch.Tensor, torch.Tensor]]:
    """(input ids, labels) with some labels masked, differently in every row."""
    g = torch.Generator().manual_seed(1)
    out = []
    for _ in range(STEPS):
        ids = torch.randint(VOCAB, (ROWS, SEQ), generator=g)
        labels = ids.masked_fill(torch.rand(ROWS, SEQ, generator=g) < 0.3, -100)
        out.append((ids, labels))
    return out


def optimizer(model: nn.Module) -> torch.optim.Optimizer:
    return torch.optim.SGD(model.parameters(), lr=LR, momentum=0.9)


def dense_positional_dropout(module: nn.Module, query: torch.Tensor, key: torch.Tensor,
                             value: torch.Tensor, attention_mask: torch.Tensor | None,
                             scaling: float, dropout: float = 0.0, **kwargs):
    """Eager attention whose dropout drops what the library's masks name (a seed drawn per
    call from the generator, masks of positions in the whole sequence)."""
    from modelparallel.parallel.context_parallel.dropout import draw_seed, positional_masks

    groups = query.shape[1] // key.shape[1]
    key, value = key.repeat_interleave(groups, 1), value.repeat_interleave(groups, 1)
    weights = query @ key.transpose(2, 3) * scaling
    if attention_mask is not None:
        weights = weights + attention_mask[..., :key.shape[-2]]
    weights = weights.softmax(dim=-1, dtype=torch.float32).to(query.dtype)
    if dropout:
        every = torch.arange(query.shape[2])
        masks = positional_masks(draw_seed(query.device), dropout, *query.shape[:2])
        weights = weights * masks(every, every) / (1 - dropout)
    return (weights @ value).transpose(1, 2).contiguous(), weights


@functools.cache
def reference(family: str, dropout: float = 0.0) -> tuple[list[float], dict, dict]:
    if dropout:
        from transformers import AttentionInterface
        from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, eager_mask

        AttentionInterface.register(POSITIONAL_DROPOUT, dense_positional_dropout)
        ALL_MASK_ATTENTION_FUNCTIONS.register(POSITIONAL_DROPOUT, eager_mask)
    model = build(family, dropout, POSITIONAL_DROPOUT if dropout else "eager")
    opt = optimizer(model)
    losses = []
    for ids, labels in batches():
        opt.zero_grad(set_to_none=True)
        loss = model(input_ids=ids, labels=labels).loss
        loss.backward()
        opt.step()
        losses.append(float(loss.detach()))
    names = {p: n for n, p in model.named_parameters()}
    states = {f"{names[p]}.{k}": v.clone() for p, s in opt.state.items()
              for k, v in s.items()}
    return losses, {n: p.detach().clone() for n, p in model.named_parameters()}, states


def cp_case(family: str, config: dict, wrapper: str, comm: str, token_count: bool,
            dropout: float):
    """This rank's run; what differs from :func:`reference` (empty when nothing does)."""
    import torch.distributed as dist
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import (
        apply_activation_checkpointing,
    )
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        get_optimizer_state_dict,
    )
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
    from torch.distributed.fsdp import ShardingStrategy
    from torch.distributed.fsdp.wrap import ModuleWrapPolicy

    import modelparallel as tsm
    from modelparallel.data import replica_rank_and_size
    from modelparallel.testing import TrainResult, full_parameters, local_rows, parity_problems

    tsm.reset()
    tsm.init({**config, "prescaled_batch": True})
    model = tsm.transform(build(family, dropout), cp_comm_type=comm)
    layers = {type(model.model.layers[0] if family != "gpt_neox"
                   else model.gpt_neox.layers[0])}
    if wrapper == "fsdp1":
        model = FSDP(model, auto_wrap_policy=ModuleWrapPolicy(layers),
                     sharding_strategy=ShardingStrategy.HYBRID_SHARD,
                     device_id=torch.device("cpu"), use_orig_params=True)
        apply_activation_checkpointing(model, check_fn=lambda m: type(m) in layers)
    else:
        model = tsm.shard(model, blocks=tuple(layers))
    opt = optimizer(model)
    rows = replica_rank_and_size()
    losses = []
    for ids, labels in batches():
        ids, labels = tsm.split_for_context_parallel(*local_rows((ids, labels), *rows))
        opt.zero_grad(set_to_none=True)
        extra = {}
        if token_count:  # exact whatever the data-parallel ranks' counts
            extra["num_items_in_batch"] = tsm.global_token_count(labels, shift=True)
        loss = model(input_ids=ids, labels=labels, **extra).loss
        loss.backward()
        opt.step()
        value = loss.detach().double()
        dist.all_reduce(value)
        losses.append(float(value) / dist.get_world_size())
    ref_losses, ref_params, ref_states = reference(family, dropout)
    # without a global token count the data-parallel groups' means are averaged: the
    # losses are one process's only with one data-parallel group
    compare_losses = token_count or rows[1] == 1
    problems = parity_problems(TrainResult(losses if compare_losses else [],
                                           full_parameters(model)),
                               TrainResult(ref_losses if compare_losses else [], ref_params))
    saved = get_optimizer_state_dict(model, opt,
                                     options=StateDictOptions(full_state_dict=True))["state"]
    states = {f"{name}.{k}": v for name, s in saved.items() for k, v in s.items()}
    problems += parity_problems(TrainResult([], states), TrainResult([], ref_states))
    return problems


# id: (world size, configuration, wrapper, cp_comm_type, model, mp.global_token_count,
#      attention dropout)
CASES = {
    "llama-fsdp1-p2p": (2, {"context_parallel_degree": 2, "hybrid_shard_degree": 2},
                        "fsdp1", "p2p", "llama", False, 0.0),
    "llama-shard-all_gather": (2, {"context_parallel_degree": 2}, "shard", "all_gather",
                               "llama", False, 0.0),
    "qwen3-fsdp1-all_gather": (2, {"context_parallel_degree": 2, "hybrid_shard_degree": 2},
                               "fsdp1", "all_gather", "qwen3", False, 0.0),
    "gpt_neox-shard-p2p": (2, {"context_parallel_degree": 2}, "shard", "p2p", "gpt_neox",
                           False, 0.0),
    "mistral-shard-p2p": (2, {"context_parallel_degree": 2}, "shard", "p2p", "mistral",
                          False, 0.0),
    "llama-hsd2-4ranks-p2p-token-count": (
        4, {"context_parallel_degree": 2, "hybrid_shard_degree": 2}, "fsdp1", "p2p",
        "llama", True, 0.0),
    "llama-tp2-4ranks-all_gather": (
        4, {"context_parallel_degree": 2, "tensor_parallel_degree": 2,
            "hybrid_shard_degree": 2}, "fsdp1", "all_gather", "llama", True, 0.0),
    "llama-attention-dropout-fsdp1-p2p": (
        2, {"context_parallel_degree": 2, "hybrid_shard_degree": 2}, "fsdp1", "p2p",
        "llama", False, 0.2),
}


# the matrix's covering subset trains these models under cp in the default tier too
EXTENDED = {"llama-shard-all_gather", "qwen3-fsdp1-all_gather", "gpt_neox-shard-p2p",
            "mistral-shard-p2p"}


@pytest.mark.parametrize("case", [pytest.param(c, marks=pytest.mark.extended)
                                  if c in EXTENDED else c for c in CASES])
def test_context_parallel_trains_as_one_process(workers, case):
    world, config, wrapper, comm, family, token_count, dropout = CASES[case]
    for rank, problems in enumerate(workers(world).run(
            cp_case, family=family, config=config, wrapper=wrapper, comm=comm,
            token_count=token_count, dropout=dropout)):
        assert problems == [], rank


def refusals_case() -> dict[str, str]:
    """What a user meets on each misuse, and SMP v2's state attributes, on this rank."""
    import torch.distributed as dist

    import modelparallel as tsm
    from modelparallel.config import ConfigError

    def message(call) -> str:
        try:
            call()
        except (ConfigError, ValueError) as e:
            return str(e)
        return "no error"

    tsm.reset()
    tsm.init({"context_parallel_degree": 2, "hybrid_shard_degree": 2})
    got = {"state": (f"{tsm.state.cp_rank} {tsm.state.cp_size} "
                     f"{dist.get_world_size(tsm.state.cp_process_group)} "
                     f"{tsm.state.context_parallel_degree}")}
    got["shard untransformed"] = message(lambda: tsm.shard(build("llama")))
    got["DistributedModel"] = message(lambda: tsm.DistributedModel(build("llama")))
    mistral = build("mistral")
    mistral.config.sliding_window = 8
    got["sliding window"] = message(lambda: tsm.transform(mistral))
    classifier = transformers_class("LlamaForSequenceClassification")(build("llama").config)
    got["classification head"] = message(lambda: tsm.transform(classifier))
    model = tsm.transform(build("llama"))
    ids = torch.zeros(2, 8, dtype=torch.long)
    got["padding mask"] = message(lambda: model(input_ids=ids, attention_mask=ids))
    got["odd length"] = message(lambda: model(input_ids=ids[:, :7]))
    got["split helper"] = str(tsm.split_for_context_parallel(torch.arange(8)[None]).tolist())
    return got


def test_misuse_is_refused_in_one_message(workers):
    results = workers(2).run(refusals_case)
    for rank, got in enumerate(results):
        assert got["state"] == f"{rank} 2 2 2"
        assert got["split helper"] == ("[[0, 1, 6, 7]]" if rank == 0 else "[[2, 3, 4, 5]]")
        assert "the model given to mp.shard() was not split over the context-parallel " \
               "ranks: call tsm.transform(model) first" in got["shard untransformed"]
        assert "mp.DistributedModel (SMP v1) does not split sequences" in \
            got["DistributedModel"]
        assert "uses sliding-window attention (sliding_window=8), which context " \
               "parallelism does not support" in got["sliding window"]
        assert "padding masks are not supported; pass attention_mask=None and set the " \
               "labels of padding to -100" in got["padding mask"]
        assert "has 7 positions, but it holds two equal chunks" in got["odd length"]
        assert "LlamaForSequenceClassification is not a causal language model" in \
            got["classification head"]


def resume_case(root: str) -> list[str]:
    """Train step 0 without context parallelism (hybrid_shard_degree 1) and save; resume
    at context parallel 2 for step 1 and save; resume without it again for step 2. The
    end must be one process's three steps."""
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    import modelparallel as tsm
    from modelparallel.data import replica_rank_and_size
    from modelparallel.testing import TrainResult, full_parameters, local_rows, parity_problems

    def phase(config: dict, step: int, load_from: str | None, save_to: str):
        tsm.reset()
        tsm.init(config)
        model = tsm.shard(tsm.transform(build("llama")))
        opt = optimizer(model)
        if load_from is not None:
            model_sd, optim_sd = get_state_dict(model, opt)
            target = {"model": model_sd, "optimizer": optim_sd}
            tsm.checkpoint.load(target, checkpoint_id=load_from)
            set_state_dict(model, opt, model_state_dict=target["model"],
                           optim_state_dict=target["optimizer"])
        ids, labels = tsm.split_for_context_parallel(
            *local_rows(batches()[step], *replica_rank_and_size()))
        opt.zero_grad(set_to_none=True)
        divisor = tsm.global_token_count(labels, shift=True)
        model(input_ids=ids, labels=labels, num_items_in_batch=divisor).loss.backward()
        opt.step()
        model_sd, optim_sd = get_state_dict(model, opt)
        tsm.checkpoint.save({"model": model_sd, "optimizer": optim_sd}, checkpoint_id=save_to)
        return model

    plain, split = {"hybrid_shard_degree": 1}, {"context_parallel_degree": 2}
    phase(plain, 0, None, f"{root}/step0")
    phase(split, 1, f"{root}/step0", f"{root}/step1")
    model = phase(plain, 2, f"{root}/step1", f"{root}/step2")
    _, ref_params, _ = reference("llama")
    return parity_problems(TrainResult([], full_parameters(model)),
                           TrainResult([], ref_params))


def test_checkpoints_resume_across_context_parallel_layouts(workers, tmp_path):
    for rank, problems in enumerate(workers(2).run(resume_case, root=str(tmp_path))):
        assert problems == [], rank
