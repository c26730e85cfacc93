"""Train a small GPT with checkpoints, and pick up where it stopped after a crash.

    modelparallel run --nproc-per-node 2 --max-restarts 1 examples/checkpoint/train_resume.py \\
        --checkpoint-dir runs/ckpt --steps 60 --save-every 10

Every --save-every steps all ranks save one sharded checkpoint, DIR/stepN: model,
optimizer, LR scheduler, data loader position and random generators (only the newest
--keep stay). At start the script resumes from the newest checkpoint in DIR, so a
run the launcher restarts (--max-restarts) or that is started again by hand goes on
from there; on CPU the result is bit-identical to a run that never stopped.
"""

from __future__ import annotations

import argparse
import os
import signal

import torch

import modelparallel as mp
from modelparallel.checkpoint import manager
from modelparallel.data.datasets import ByteChunks, python_source_bytes
from modelparallel.models import GPT, GPTConfig
from modelparallel.models.gpt import lm_loss


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--config", help="modelparallel config (JSON/YAML); default: "
                                    "hybrid_shard_degree 2 (1 on an odd number of ranks)")
    p.add_argument("--steps", type=int, default=60)
    p.add_argument("--batch-size", type=int, default=8, help="sequences per replica per step")
    p.add_argument("--seq-len", type=int, default=32)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--text-bytes", type=int, default=200_000, help="of Python source to train on")
    p.add_argument("--checkpoint-dir", default="runs/checkpoints")
    p.add_argument("--save-every", type=int, default=10)
    p.add_argument("--keep", type=int, default=2, help="checkpoints to keep")
    p.add_argument("--out", help="rank 0 saves the final parameters here (torch.save)")
    # fault injection for the tests (tests/e2e/test_checkpoint_faults.py)
    p.add_argument("--die-at-step", type=int, help="SIGKILL --die-rank in this step "
                                                   "(on the first attempt only)")
    p.add_argument("--die-rank", type=int, default=1)
    p.add_argument("--die-during-save", action="store_true", help="die inside that step's "
                   "save: after this rank's shards are written, before the commit")
    return p.parse_args()


def die(during_save: bool) -> None:
    """SIGKILL this rank now, or once its shards of the next checkpoint are written."""
    if not during_save:
        os.kill(os.getpid(), signal.SIGKILL)
    write_shards = manager.run_dcp

    def write_shards_then_die(*args, **kwargs):
        write_shards(*args, **kwargs)
        os.kill(os.getpid(), signal.SIGKILL)

    manager.run_dcp = write_shards_then_die


def batches(loader: mp.data.DataLoader):
    """Batches epoch after epoch; a resumed loader first finishes its saved epoch."""
    while True:
        yield from loader
        loader.set_epoch(loader.epoch + 1)


def main() -> None:
    args = parse_args()
    world = int(os.environ.get("WORLD_SIZE", "1"))
    first_attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0"
    mp.init(args.config or {"hybrid_shard_degree": 2 if world % 2 == 0 else 1})
    torch.manual_seed(0)  # the same initial weights on every rank
    data = ByteChunks(python_source_bytes(args.text_bytes), args.seq_len)
    model = mp.shard(GPT(GPTConfig(vocab_size=ByteChunks.vocab_size, max_seq_len=args.seq_len,
                                   d_model=32, n_layers=2, n_heads=2)))
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.01)
    scheduler = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=args.steps)
    loader = mp.data.DataLoader(data, batch_size=args.batch_size, seed=0, drop_last=True)
    training = {"model": model, "optimizer": optimizer, "lr_scheduler": scheduler,
                "data_loader": loader}

    start = 0
    tag = mp.checkpoint.newest(args.checkpoint_dir)
    if tag is not None:  # go on from the newest complete checkpoint
        start = mp.resume_from_checkpoint(args.checkpoint_dir, tag, **training)["step"]
        if mp.rank() == 0:
            print(f"resumed from {os.path.join(args.checkpoint_dir, tag)} at step {start} "
                  f"(restart {os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')})", flush=True)

    steps = range(start + 1, args.steps + 1)
    for step, (inputs, targets) in zip(steps, batches(loader), strict=False):
        if step == args.die_at_step and mp.rank() == args.die_rank and first_attempt:
            die(args.die_during_save)
        optimizer.zero_grad(set_to_none=True)
        loss = lm_loss(model(inputs), targets)
        loss.backward()
        optimizer.step()
        scheduler.step()
        if mp.rank() == 0:
            print(f"step {step:4d} | loss {loss.item():.4f}", flush=True)
        if step % args.save_every == 0 or step == args.steps:
            mp.save_checkpoint(args.checkpoint_dir, f"step{step}", user_content={"step": step},
                               num_kept_partial_checkpoints=args.keep, step=step, **training)

    params = mp.full_state_dict(model)  # collective; the whole model on rank 0
    if mp.rank() == 0 and args.out:
        torch.save(params, args.out)
        print(f"done: {args.steps} steps; parameters saved to {args.out}", flush=True)


if __name__ == "__main__":
    main()
