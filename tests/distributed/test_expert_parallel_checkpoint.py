"""Checkpoints under expert parallelism resume at any other expert-parallel layout.

A tiny Hugging Face Mixtral (4 experts, top-2, float64 so that round-off cannot flip a
router's top-k choice) trains one AdamW step per layout on 4 ranks, saving after each
step with torch's ``get_state_dict`` and ``tsm.checkpoint.save`` or SMP v2's
``state_dict_saver.save`` (DCP) and resuming the next step at another layout with
``load`` and ``set_state_dict``, as SMP v2 scripts do. After three steps every
parameter and every optimizer state (``exp_avg``, ``exp_avg_sq``, ``step``), read as
full state dicts (whole ``(experts, ...)`` tensors on every rank), must equal one
process's three steps on the whole batch. A checkpoint that held each rank's slice of
the experts under the same key would resume with some ranks' experts in every
rank's place.
"""

from __future__ import annotations

import functools

import torch
from torch import nn

STEPS, ROWS, SEQ, VOCAB = 3, 4, 16, 128
LR = 0.05


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
    return torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.1)


def flat_states(model: nn.Module, opt: torch.optim.Optimizer) -> dict[str, torch.Tensor]:
    """``name.key`` -> the optimizer's state of each parameter, whole, on CPU."""
    import torch.distributed as dist
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        get_optimizer_state_dict,
    )

    if not dist.is_initialized():
        names = {p: n for n, p in model.named_parameters()}
        return {f"{names[p]}.{k}": torch.as_tensor(v).clone()
                for p, s in opt.state.items() for k, v in s.items()}
    saved = get_optimizer_state_dict(model, opt,
                                     options=StateDictOptions(full_state_dict=True))["state"]
    return {f"{n}.{k}": torch.as_tensor(v).cpu() for n, s in saved.items()
            for k, v in s.items()}


@functools.cache
def reference() -> tuple[dict, dict]:
    model = build()
    opt = optimizer(model)
    for ids in batches():
        opt.zero_grad(set_to_none=True)
        model(input_ids=ids, labels=ids).loss.backward()
        opt.step()
    return ({n: p.detach().clone() for n, p in model.named_parameters()},
            flat_states(model, opt))


def resume_case(root: str, layouts: list[dict], api: str,
                recompute: bool = False) -> list[str]:
    """Train step ``i`` at ``layouts[i]``, resuming from step ``i - 1``'s checkpoint;
    what differs from one process at the end (empty when nothing does). ``api``: "dcp"
    (``tsm.checkpoint.save`` / ``load`` of torch's ``get_state_dict``), "smp_modules"
    (SMP v2's ``torch.sagemaker.distributed.checkpoint`` modules), "partial" or "full"
    (``tsm.save_checkpoint`` / ``tsm.resume_from_checkpoint``, SMP's checkpoint calls).
    With ``recompute`` the layers are activation-checkpointed (Hugging Face's
    ``gradient_checkpointing_enable``): the dispatch runs again in the backward."""
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    import modelparallel as tsm
    from modelparallel.data import replica_rank_and_size
    from modelparallel.smp.v2.checkpoint import state_dict_loader, state_dict_saver
    from modelparallel.smp.v2.moe import MoEConfig
    from modelparallel.testing import TrainResult, full_parameters, parity_problems

    save = state_dict_saver.save if api == "smp_modules" else tsm.checkpoint.save
    load = state_dict_loader.load if api == "smp_modules" else tsm.checkpoint.load

    def phase(config: dict, step: int) -> tuple[nn.Module, torch.optim.Optimizer]:
        tsm.reset()
        tsm.init(config)
        model = build()
        if recompute:
            model.gradient_checkpointing_enable({"use_reentrant": False})
        if config.get("expert_parallel_degree", 1) > 1:
            model = tsm.transform(model, config=MoEConfig(smp_moe=False,
                                                          moe_load_balancing="none"))
        model = tsm.shard(model, blocks=(type(model.model.layers[0]),))
        opt = optimizer(model)
        if step > 0 and api in ("partial", "full"):
            tsm.resume_from_checkpoint(root, f"step{step - 1}", partial=api == "partial",
                                       model=model, optimizer=opt)
        elif step > 0:
            model_sd, optim_sd = get_state_dict(model, opt)
            target = {"model": model_sd, "optimizer": optim_sd}
            load(target, checkpoint_id=f"{root}/step{step - 1}")
            set_state_dict(model, opt, model_state_dict=target["model"],
                           optim_state_dict=target["optimizer"])
        index, count = replica_rank_and_size()
        rows = ROWS // count
        ids = batches()[step][index * rows:(index + 1) * rows]
        opt.zero_grad(set_to_none=True)
        model(input_ids=ids, labels=ids).loss.backward()
        opt.step()
        if api in ("partial", "full"):
            tsm.save_checkpoint(root, f"step{step}", partial=api == "partial", model=model,
                                optimizer=opt)
            return model, opt
        model_sd, optim_sd = get_state_dict(model, opt)
        save({"model": model_sd, "optimizer": optim_sd}, checkpoint_id=f"{root}/step{step}")
        return model, opt

    for step, config in enumerate(layouts):
        model, opt = phase(config, step)
    ref_params, ref_states = reference()
    return parity_problems(TrainResult([], full_parameters(model)),
                           TrainResult([], ref_params)) + \
        parity_problems(TrainResult([], flat_states(model, opt)),
                        TrainResult([], ref_states))


def test_checkpoints_resume_across_expert_parallel_layouts(workers, tmp_path):
    ep2_replicated = {"expert_parallel_degree": 2, "hybrid_shard_degree": 2}
    ep2_sharded = {"expert_parallel_degree": 2}
    ep4 = {"expert_parallel_degree": 4}
    none = {}  # no expert parallelism, every parameter sharded over the 4 ranks
    # the second chain saves and loads with SMP v2's state_dict_saver / state_dict_loader
    chains = {"ep2 -> none -> ep4": ([ep2_replicated, none, ep4], "dcp"),
              "ep4 -> ep2 sharded -> ep2 replicated": ([ep4, ep2_sharded, ep2_replicated],
                                                       "smp_modules")}
    for name, (layouts, api) in chains.items():
        root = tmp_path / name.replace(" ", "").replace(">", "")
        results = workers(4).run(resume_case, root=str(root), layouts=layouts, api=api)
        for rank, problems in enumerate(results):
            assert problems == [], (name, rank)


def test_smp_checkpoints_resume_across_expert_parallel_layouts(workers, tmp_path):
    # SMP's save_checkpoint / resume_from_checkpoint, partial (each rank its part, DCP) and
    # full (rank 0 writes the whole model), with activation checkpointing on 2 ranks
    ep2, none = {"expert_parallel_degree": 2}, {}
    for api in ("partial", "full"):
        results = workers(2).run(resume_case, root=str(tmp_path / api),
                                 layouts=[ep2, none, ep2], api=api, recompute=True)
        for rank, problems in enumerate(results):
            assert problems == [], (api, rank)
