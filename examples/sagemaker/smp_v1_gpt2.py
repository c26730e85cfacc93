"""An SMP v1 script in the style of SageMaker's train_gpt_simple.py: a Hugging Face
GPT-2 wrapped in smp.DistributedModel (pipeline x tensor parallel), smp.step with
microbatches, smp.DistributedOptimizer with an LR scheduler, gradient clipping, and a
checkpoint saved with smp.save_checkpoint and resumed with smp.resume_from_checkpoint.

As in train_gpt_simple.py, --use_distributed_transformer 1 (the default) builds the model
inside smp.model_creation(tensor_parallelism=True): smp.DistributedModel then replaces
the GPT-2 by smp.nn.DistributedTransformerLMHead, its weights carried over, as SMP does
(SMP_USE_HF_GELU=1 keeps GPT-2's tanh GeLU there, as in SMP). With 0 the Hugging Face
model is split in place by modelparallel's built-in GPT-2 plan.

It needs transformers (`pip install -e ".[hf]"`). It keeps SageMaker's import lines;
run it unchanged with

    modelparallel run --compat sagemaker --nproc-per-node 4 examples/sagemaker/smp_v1_gpt2.py

or change its import to `import modelparallel as smp` and drop `--compat sagemaker`.
"""

import argparse
import json
import os

import numpy as np
import smdistributed.modelparallel.torch as smp
import torch
from common import gpt2_config, make_optimizer, rows, token_batches, write_results
from smdistributed.modelparallel.torch.nn.huggingface.gpt2 import translate_state_dict_to_hf_gpt2
from transformers import GPT2LMHeadModel

os.environ.setdefault("SMP_USE_HF_GELU", "1")  # GPT-2's own GeLU in SMP's modules

CONFIG = {"pipeline_parallel_degree": 2, "tensor_parallel_degree": 2, "microbatches": 2,
          "ddp": True, "pipeline": "interleaved"}


def build(args):
    """The model, optimizer and scheduler, as the script builds them at start."""
    torch.manual_seed(0)  # every rank builds the same model (SMP syncs them anyway)
    with smp.model_creation(tensor_parallelism=args.use_distributed_transformer > 0):
        model = GPT2LMHeadModel(gpt2_config())
    model = smp.DistributedModel(model, trace_device="gpu")
    module = model.get_module()
    layers = module.transformer.seq_layers if args.use_distributed_transformer \
        else module.transformer.h
    assert len(layers) == 2, layers
    optimizer = smp.DistributedOptimizer(
        make_optimizer(args, model.parameters()),
        static_loss_scale=None, dynamic_loss_scale=True,
        dynamic_loss_args={"scale_window": 1000, "min_scale": 1, "delayed_shift": 2})
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0 / (1 + step))
    return model, optimizer, scheduler


@smp.step
def train_step(model, input_ids):
    loss = model(input_ids=input_ids, labels=input_ids)["loss"]
    model.backward(loss)
    return loss


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--restart_at", type=int, default=2)
    parser.add_argument("--lr", type=float, default=2e-3)
    parser.add_argument("--optimizer", choices=["adamw", "sgd"], default="adamw")
    parser.add_argument("--use_distributed_transformer", type=int, default=1)
    parser.add_argument("--checkpoint_dir", default="/tmp/smp_v1_gpt2_ckpt")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()

    smp.init(CONFIG)
    model, optimizer, scheduler = build(args)
    losses = []
    for step, batch in enumerate(token_batches(args.steps)):
        if step == args.restart_at:  # save, then start over as a restarted job would
            smp.save_checkpoint(args.checkpoint_dir, tag=f"step{step}", partial=True,
                                user_content={"step": np.int64(step),
                                              "config": gpt2_config(),
                                              "scheduler": scheduler.state_dict()})
            smp.reset()
            smp.init(CONFIG)
            model, optimizer, scheduler = build(args)
            user = smp.resume_from_checkpoint(args.checkpoint_dir, partial=True)
            assert user["step"] == step and isinstance(user["step"], np.int64)
            assert user["config"].n_layer == 2
            scheduler.load_state_dict(user["scheduler"])
        model.train()
        loss = train_step(model, rows(batch, smp.dp_rank(), smp.dp_size())).reduce_mean()
        optimizer.clip_master_grads(1.0)
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad()
        loss = loss.detach().double()
        torch.distributed.all_reduce(loss, group=smp.get_dp_process_group())
        losses.append(loss.item() / smp.dp_size())
        if smp.rank() == 0:
            print(json.dumps({"step": step, "loss": losses[-1]}), flush=True)
    state = model.state_dict()  # the full model, every stage's part (collective)
    if args.use_distributed_transformer:
        state = translate_state_dict_to_hf_gpt2(state)  # Hugging Face's names
    if smp.rank() == 0 and args.out:
        write_results(args.out, losses, state)


if __name__ == "__main__":
    main()
