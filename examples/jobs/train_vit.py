"""Train a small Vision Transformer on handwritten digits: a training job's entry point.

Written like a SageMaker training script: hyperparameters arrive as ``--key value``
arguments, the input channels as directories (``SM_CHANNEL_TRAIN``, ``SM_CHANNEL_VAL``;
``MP_CHANNEL_*`` too) of ``<label>/<name>.png`` files (examples/jobs/digits_data.py
writes them), the layout as ``MP_CONFIG`` (read by ``mp.init()``). By hand:

    python examples/jobs/digits_data.py /tmp/digits
    SM_CHANNEL_TRAIN=/tmp/digits/train SM_CHANNEL_VAL=/tmp/digits/val \\
    SM_MODEL_DIR=/tmp/model MP_CHECKPOINT_DIR=/tmp/ckpt \\
    modelparallel run --nproc-per-node 2 examples/jobs/train_vit.py --epochs 2

(add ``--config FILE`` holding e.g. ``{"hybrid_shard_degree": 2, "tensor_parallel_degree":
2}`` on 4 processes). Every epoch rank 0 prints one line,
``epoch=N train_loss=... val_loss=... val_accuracy=...`` (the whole validation set,
counted once over all data-parallel ranks), and every rank takes part in a sharded
checkpoint in ``MP_CHECKPOINT_DIR``; a job started again resumes after the newest one
(``resumed from epoch N``). At the end rank 0 writes ``model.safetensors`` and
``config.json`` (the ViTConfig) to ``SM_MODEL_DIR``; examples/jobs/evaluate.py loads
them in one plain process.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
import torch.nn.functional as F
from PIL import Image

import modelparallel as mp
from modelparallel.models.vit import ViT, ViTConfig

IMAGE_SIZE = 8  # the digits' own size; other images are resized to it
EVAL_BATCH = 128  # images per rank per evaluation forward


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--epochs", type=int, default=5)
    p.add_argument("--batch-size", type=int, default=32, help="global: images per optimizer "
                   "step over all data-parallel ranks")
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--d-model", type=int, default=32)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--patch-size", type=int, default=4)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--log-every", type=int, default=50, help="rank 0 prints step metrics")
    p.add_argument("--fail-at-epoch", type=int, help="raise a RuntimeError on every rank "
                   "when this epoch starts (failure tests)")
    return p.parse_args()


def env_dir(*names: str) -> str | None:
    """The first of these environment variables that is set (a directory), else None."""
    return next((os.environ[n] for n in names if os.environ.get(n)), None)


def load_images(directory: str | os.PathLike, image_size: int = IMAGE_SIZE,
                ) -> tuple[torch.Tensor, torch.Tensor]:
    """Every ``directory/<label>/*.png`` (sorted paths) as images (n, 1, size, size) in
    [0, 1] and integer labels (n,)."""
    paths = sorted(Path(directory).glob("*/*.png"))
    if not paths:
        raise FileNotFoundError(f"no <label>/*.png images in {directory}")
    images = np.empty((len(paths), 1, image_size, image_size), dtype=np.float32)
    for i, path in enumerate(paths):
        with Image.open(path) as im:
            im = im.convert("L")
            if im.size != (image_size, image_size):
                im = im.resize((image_size, image_size), Image.Resampling.BILINEAR)
            images[i, 0] = np.asarray(im, dtype=np.float32) / 255.0
    labels = torch.tensor([int(p.parent.name) for p in paths])
    return torch.from_numpy(images), labels


def model_config(args: argparse.Namespace) -> ViTConfig:
    return ViTConfig(image_size=IMAGE_SIZE, patch_size=args.patch_size, channels=1,
                     num_classes=10, d_model=args.d_model, n_layers=args.layers,
                     n_heads=args.heads)


def all_sum(values: list[float]) -> list[float]:
    """Element-wise sum over every rank."""
    t = torch.tensor(values, dtype=torch.float64, device=mp.state.device)
    dist.all_reduce(t)
    return t.tolist()


@torch.no_grad()
def evaluate(model: torch.nn.Module, images: torch.Tensor, labels: torch.Tensor,
             ) -> tuple[float, float]:
    """(mean loss, accuracy) over all of ``images``, each image counted once.

    Each data slice (``mp.data.replica_rank_and_size``) takes every n-th image, padded
    with weight-0 copies to the same length on every rank, so every rank runs the same
    number of equally sized forwards (FSDP and tensor parallelism need that). Sums are
    added over all ranks: ranks that read the same slice (a tensor-parallel group with
    prescaled_batch) count every image alike, which the ratio cancels.
    """
    model.eval()
    rank, slices = mp.data.replica_rank_and_size()
    mine = torch.arange(rank, len(images), slices)
    length = math.ceil(len(images) / slices)
    weight = torch.ones(length, dtype=torch.float64)
    weight[len(mine):] = 0
    mine = torch.cat([mine, mine.new_zeros(length - len(mine))])
    loss_sum = correct = 0.0
    for start in range(0, length, EVAL_BATCH):
        idx, w = mine[start:start + EVAL_BATCH], weight[start:start + EVAL_BATCH]
        logits = model(images[idx].to(mp.state.device)).float().cpu()
        loss = F.cross_entropy(logits, labels[idx], reduction="none").double()
        loss_sum += float((loss * w).sum())
        correct += float(((logits.argmax(-1) == labels[idx]).double() * w).sum())
    model.train()
    loss_sum, correct, count = all_sum([loss_sum, correct, float(weight.sum())])
    return loss_sum / count, correct / count


def main() -> None:
    args = parse_args()
    train_dir = env_dir("SM_CHANNEL_TRAIN", "MP_CHANNEL_TRAIN")
    val_dir = env_dir("SM_CHANNEL_VAL", "MP_CHANNEL_VAL")
    model_dir = env_dir("SM_MODEL_DIR", "MP_MODEL_DIR")
    ckpt_dir = env_dir("MP_CHECKPOINT_DIR")
    if train_dir is None:
        raise SystemExit("no training data: set SM_CHANNEL_TRAIN (or MP_CHANNEL_TRAIN)")

    mp.init()  # the layout comes from MP_CONFIG (a training job's config, or --config)
    rank0 = mp.rank() == 0
    train_x, train_y = load_images(train_dir)
    val_x, val_y = load_images(val_dir) if val_dir else (None, None)

    cfg = model_config(args)
    torch.manual_seed(args.seed)  # the same initial weights on every rank
    model = ViT(cfg)
    n_params = sum(p.numel() for p in model.parameters())
    mp.transform(model)  # splits the blocks over tensor-parallel ranks; no-op at degree 1
    mp.shard(model)  # FSDP2 over the data-parallel ranks (hybrid_shard_degree)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.01)

    _, slices = mp.data.replica_rank_and_size()
    if args.batch_size % slices:
        raise SystemExit(f"--batch-size {args.batch_size} does not split over {slices} "
                         f"data-parallel slices")
    train_set = torch.utils.data.TensorDataset(train_x, train_y)
    loader = mp.data.DataLoader(train_set, batch_size=args.batch_size // slices, seed=args.seed,
                                drop_last=True)
    metrics = mp.observe.StepMetrics(print_every=args.log_every)  # MP_METRICS_FILE in a job
    if rank0:
        print(f"{mp.state.topology.describe()}; ViT with {n_params} parameters; "
              f"{len(train_x)} training images, "
              f"{0 if val_x is None else len(val_x)} validation; global batch "
              f"{args.batch_size} ({len(loader)} steps per epoch)", flush=True)

    start_epoch, step = 0, 0
    if ckpt_dir and mp.checkpoint.newest(ckpt_dir) is not None:
        user = mp.resume_from_checkpoint(ckpt_dir, model=model, optimizer=optimizer,
                                         data_loader=loader)
        start_epoch, step = user["epoch"], user["step"]
        if rank0:
            print(f"resumed from epoch {start_epoch}", flush=True)

    for epoch in range(start_epoch + 1, args.epochs + 1):
        if epoch == args.fail_at_epoch:
            raise RuntimeError(f"injected failure at epoch {epoch}")
        loader.set_epoch(epoch)
        losses = []
        for images, labels in loader:
            with metrics.step(samples=args.batch_size) as rec:
                optimizer.zero_grad(set_to_none=True)
                loss = F.cross_entropy(model(images.to(mp.state.device)),
                                       labels.to(mp.state.device))
                loss.backward()
                optimizer.step()
                rec.loss = loss
            losses.append(rec.loss)  # the mean over the data-parallel ranks
            step += 1
        line = f"epoch={epoch} train_loss={sum(losses) / len(losses):.4f}"
        if val_x is not None:
            val_loss, val_acc = evaluate(model, val_x, val_y)
            line += f" val_loss={val_loss:.4f} val_accuracy={val_acc:.4f}"
        if rank0:
            print(line, flush=True)
        if ckpt_dir:
            mp.save_checkpoint(ckpt_dir, f"epoch{epoch}", model=model, optimizer=optimizer,
                               data_loader=loader, user_content={"epoch": epoch, "step": step},
                               step=step, num_kept_partial_checkpoints=2)

    params = mp.full_state_dict(model)  # collective; the whole model on rank 0
    if rank0 and model_dir:
        from safetensors.torch import save_file

        Path(model_dir).mkdir(parents=True, exist_ok=True)
        save_file({k: v.contiguous() for k, v in params.items()},
                  os.path.join(model_dir, "model.safetensors"))
        with open(os.path.join(model_dir, "config.json"), "w") as f:
            json.dump(dataclasses.asdict(cfg), f, indent=2)
        print(f"saved model to {model_dir}", flush=True)


if __name__ == "__main__":
    main()
