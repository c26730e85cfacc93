"""An SMP v2 script in the style of SageMaker's shared-scripts (train_lib.py): a Hugging
Face Llama made tensor parallel by tsm.transform, wrapped in PyTorch's FSDP with a
transformer auto-wrap policy (hybrid_shard_degree decides the sharding), fine-tuning
weights that only rank 0 holds (load_state_dict_from_rank0, DelayedParamIniter and
sync_module_states), tsm's gradient clipping, and a sharded checkpoint written with
torch.sagemaker.distributed.checkpoint and resumed from.

It needs transformers (`pip install -e ".[hf]"`). It keeps SageMaker's import lines;
run it unchanged with

    modelparallel run --compat sagemaker --nproc-per-node 4 examples/sagemaker/smp_v2_fsdp.py

or change `torch.sagemaker` to `modelparallel` in the imports and drop `--compat`.
"""

import argparse
import functools
import json
import os

import torch
import torch.distributed as dist
import torch.sagemaker as tsm
import torch.sagemaker.checkpoint.utils as tsm_checkpoint
from common import (
    init_empty_weights,
    llama_config,
    make_optimizer,
    rows,
    token_batches,
    write_results,
)
from torch.distributed.checkpoint.optimizer import load_sharded_optimizer_state_dict
from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
from torch.distributed.fsdp import ShardingStrategy, StateDictType
from torch.distributed.fsdp.wrap import transformer_auto_wrap_policy
from torch.sagemaker import transform
from torch.sagemaker.delayed_param import DelayedParamIniter
from torch.sagemaker.distributed.checkpoint.filesystem import DistributedFileSystemReader
from torch.sagemaker.distributed.checkpoint.state_dict_loader import load
from torch.sagemaker.distributed.checkpoint.state_dict_saver import save
from torch.sagemaker.grad_norm import clip_grad_norm_
from torch.sagemaker.tensor_parallel.transformer import TransformerLayer
from torch.sagemaker.utils import utils as tsm_utils
from torch.sagemaker.utils.process_group_utils import get_global_ranks
from transformers import LlamaForCausalLM

CONFIG = {"tensor_parallel_degree": 2, "hybrid_shard_degree": 2}


def build(args):
    """The model as the fine-tuning path of shared-scripts builds it: rank 0 holds the
    (here: seeded) pretrained weights, the others build on the meta device."""
    rank = dist.get_rank()
    with tsm_utils.timeit(True, "Model creation", rank):
        if rank == 0:
            torch.manual_seed(0)
            model = LlamaForCausalLM(llama_config())
        else:
            with init_empty_weights():
                model = LlamaForCausalLM(llama_config())
        model = transform(model, load_state_dict_from_rank0=True)
        initer = DelayedParamIniter(model) if rank != 0 else None
    assert {p.dtype for p in model.parameters()} == {torch.float32}
    policy = functools.partial(transformer_auto_wrap_policy,
                               transformer_layer_cls={TransformerLayer})
    with tsm_utils.timeit(True, "FSDP constructor", rank):
        model = FSDP(model, auto_wrap_policy=policy,
                     sharding_strategy=ShardingStrategy.HYBRID_SHARD,
                     device_id=torch.cuda.current_device() if torch.cuda.is_available()
                     else None,
                     use_orig_params=True,
                     param_init_fn=initer.get_param_init_fn() if initer else None,
                     post_param_init_fn=initer.get_post_param_init_fn() if initer else None,
                     sync_module_states=True)
    optimizer = make_optimizer(args, model.parameters())
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: 1.0 / (1 + s))
    return model, optimizer, scheduler


def checkpoint_dir(root, step):
    """One directory per tensor-parallel rank, as shared-scripts' sharded checkpoints."""
    return os.path.join(root, f"ckpt_{step}steps", f"tp{tsm.state.tp_rank}")


def save_checkpoint(model, optimizer, scheduler, root, step):
    with FSDP.state_dict_type(model, StateDictType.SHARDED_STATE_DICT):
        state = {"model": model.state_dict(),
                 "optimizer": FSDP.optim_state_dict(model, optimizer),
                 "scheduler": scheduler.state_dict(), "total_steps": step}
    coordinator = min(get_global_ranks(model.process_group))
    save(state, checkpoint_id=checkpoint_dir(root, step), process_group=model.process_group,
         coordinator_rank=coordinator)
    dist.barrier()
    if dist.get_rank() == 0:  # keep the newest only
        tsm_checkpoint.limit_num_subdirs(root, 1, sort_fn=tsm_checkpoint.SORT_BY_LAST_INT,
                                         regex=r"^.*\d+steps$")


def load_checkpoint(model, optimizer, scheduler, root, step):
    path = checkpoint_dir(root, step)
    with FSDP.state_dict_type(model, StateDictType.SHARDED_STATE_DICT):
        state = {"model": model.state_dict(), "scheduler": scheduler.state_dict(),
                 "total_steps": 0}
        load(state, storage_reader=DistributedFileSystemReader(path),
             process_group=model.process_group,
             coordinator_rank=min(get_global_ranks(model.process_group)))
        model.load_state_dict(state["model"])
        optim = load_sharded_optimizer_state_dict(
            model_state_dict=state["model"], optimizer_key="optimizer",
            storage_reader=DistributedFileSystemReader(path))
        optimizer.load_state_dict(FSDP.optim_state_dict_to_load(model, optimizer,
                                                                optim["optimizer"]))
    scheduler.load_state_dict(state["scheduler"])
    return state["total_steps"]


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--restart_at", type=int, default=2)
    parser.add_argument("--lr", type=float, default=2e-3)
    parser.add_argument("--optimizer", choices=["adamw", "sgd"], default="adamw")
    parser.add_argument("--checkpoint_dir", default="/tmp/smp_v2_fsdp_ckpt")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()

    dist.init_process_group("nccl" if torch.cuda.is_available() else "gloo")
    tsm.init(CONFIG)
    model, optimizer, scheduler = build(args)
    # the data-parallel rank: the ranks of a tensor-parallel group share a batch
    dp_rank = dist.get_rank() // tsm.state.tensor_parallel_degree
    dp_size = dist.get_world_size() // tsm.state.tensor_parallel_degree
    losses = []
    for step, batch in enumerate(token_batches(args.steps)):
        if step == args.restart_at:  # save, then start again as a restarted job would
            save_checkpoint(model, optimizer, scheduler, args.checkpoint_dir, step)
            model, optimizer, scheduler = build(args)
            assert load_checkpoint(model, optimizer, scheduler, args.checkpoint_dir,
                                   step) == step
        ids = rows(batch, dp_rank, dp_size)
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        clip_grad_norm_(model, 1.0)
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad(set_to_none=True)
        value = loss.detach().double()
        dist.all_reduce(value)
        losses.append(value.item() / dist.get_world_size())
        if dist.get_rank() == 0:
            print(json.dumps({"step": step, "loss": losses[-1]}), flush=True)
    with FSDP.state_dict_type(model, StateDictType.FULL_STATE_DICT):
        state = model.state_dict()
    if dist.get_rank() == 0 and args.out:
        write_results(args.out, losses, state)


if __name__ == "__main__":
    main()
