"""Expert parallelism on Hugging Face mixture-of-experts families beyond the ones
test_expert_parallel.py names, as a user would bring them: GPT-OSS (per-expert biases
beside the fused weights, the experts' arguments named ``router_indices,
routing_weights``), OLMoE, DeepSeek-V3 (a shared expert, grouped routing with a score
correction bias, a float32 router) and HunYuan-MoE, each tiny (hidden 64, 2 layers, 4
experts, top-2) in float64, at ep 2 on 2 ranks under ``mp.shard``, against one process:
the loss of every step and every parameter (and persistent buffer) at the end. Llama 4,
whose experts take every token for every expert rather than the router's choices, is
refused in one line.
"""

from __future__ import annotations

import functools

import torch
from torch import nn

STEPS, ROWS, SEQ, VOCAB = 2, 4, 16, 128
FAMILIES = ("gpt_oss", "olmoe", "deepseek_v3", "hunyuan_v1_moe")


def build(family: str) -> nn.Module:
    import transformers

    config_class = type(transformers.AutoConfig.for_model(family))
    options = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96,
                   moe_intermediate_size=32, num_hidden_layers=2, num_attention_heads=4,
                   num_key_value_heads=2, head_dim=16, num_experts=4, num_local_experts=4,
                   n_routed_experts=4, num_experts_per_tok=2, max_position_embeddings=SEQ,
                   use_cache=False, tie_word_embeddings=False, pad_token_id=0)
    if family == "gpt_oss":  # its layers alternate sliding and full attention
        options["sliding_window"] = 8
    if family == "deepseek_v3":  # multi-head latent attention, dense layers none
        options.pop("head_dim")
        options.update(num_key_value_heads=4, first_k_dense_replace=0, n_group=1,
                       topk_group=1, n_shared_experts=1, kv_lora_rank=16, q_lora_rank=16,
                       qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=16)
    config = config_class(**options)
    config._attn_implementation = "eager"
    config._experts_implementation = "eager"  # grouped_mm has no float64 kernel
    torch.manual_seed(0)
    model_class = transformers.AutoModelForCausalLM._model_mapping[config_class]
    return model_class(config).to(torch.float64)


def batches() -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return [torch.randint(VOCAB, (ROWS, SEQ), generator=g) for _ in range(STEPS)]


def train(model: nn.Module, rows: slice = slice(None)) -> list[float]:
    opt = torch.optim.SGD(model.parameters(), lr=0.5, momentum=0.9)
    losses = []
    for ids in batches():
        opt.zero_grad(set_to_none=True)
        loss = model(input_ids=ids[rows], labels=ids[rows]).loss
        loss.backward()
        opt.step()
        losses.append(float(loss.detach()))
    return losses


@functools.cache
def reference(family: str) -> tuple[list[float], dict[str, torch.Tensor]]:
    model = build(family)
    losses = train(model)
    # parameters and persistent buffers (DeepSeek-V3's score correction bias), as
    # full_parameters reads them
    return losses, {n: t.detach().clone() for n, t in model.state_dict().items()}


def families_case() -> dict[str, list[str]]:
    """Each family's differences from one process on this rank (empty: none)."""
    import torch.distributed as dist

    import modelparallel as tsm
    from modelparallel.data import replica_rank_and_size
    from modelparallel.parallel.expert_parallel import split_experts
    from modelparallel.smp.v2.moe import MoEConfig
    from modelparallel.testing import TrainResult, full_parameters, parity_problems

    got = {}
    for family in FAMILIES:
        tsm.reset()
        tsm.init({"expert_parallel_degree": 2})
        model = tsm.transform(build(family),
                              config=MoEConfig(smp_moe=False, moe_load_balancing="none"))
        problems = [] if len(split_experts(model)) == 2 else ["not every layer split"]
        model = tsm.shard(model, blocks=(type(model.model.layers[0]),))
        index, count = replica_rank_and_size()
        rows = ROWS // count
        losses = []
        for loss in train(model, slice(index * rows, (index + 1) * rows)):
            value = torch.tensor(loss, dtype=torch.float64)
            dist.all_reduce(value)
            losses.append(float(value) / dist.get_world_size())
        ref_losses, ref_params = reference(family)
        got[family] = problems + parity_problems(TrainResult(losses, full_parameters(model)),
                                                 TrainResult(ref_losses, ref_params))
    return got


def test_other_moe_families_train_as_one_process(workers):
    for rank, got in enumerate(workers(2).run(families_case)):
        assert got == {family: [] for family in FAMILIES}, rank


def llama4_case() -> str:
    import modelparallel as tsm
    from modelparallel.config import ConfigError
    from modelparallel.smp.v2.moe import MoEConfig

    tsm.reset()
    tsm.init({"expert_parallel_degree": 2})
    model = build("llama4_text")
    try:
        tsm.transform(model, config=MoEConfig(smp_moe=False, moe_load_balancing="none"))
    except ConfigError as error:
        return str(error)
    return "no error"


def test_experts_not_called_with_the_routers_choices_are_refused_in_one_line(workers):
    for message in workers(2).run(llama4_case):
        assert ("expert_parallel_degree: 2, but the experts modules "
                "model.layers.0.feed_forward.experts (Llama4TextExperts), "
                "model.layers.1.feed_forward.experts (Llama4TextExperts) are not called with "
                "the router's choices (hidden_states, top_k_index, top_k_weights)") in message
        assert message.endswith("set expert_parallel_degree to 1"), message
