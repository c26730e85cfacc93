"""Load the model examples/jobs/train_vit.py saved and score it, in one plain process.

    python examples/jobs/evaluate.py MODEL_DIR VAL_DIR

MODEL_DIR holds ``model.safetensors`` and ``config.json`` (a training job's model
directory, or its unpacked model.tar.gz); VAL_DIR holds ``<label>/*.png``. No process
group, no modelparallel runtime: the reference ViT class and safetensors only.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors.torch import load_file

from modelparallel.models.vit import ViT, ViTConfig

sys.path.insert(0, str(Path(__file__).resolve().parent))
from train_vit import load_images  # the same preprocessing as in training


def load_model(model_dir: str | os.PathLike) -> ViT:
    """The ViT of ``model_dir/config.json`` with the weights of ``model.safetensors``
    (every name and shape must match: strict), in eval mode."""
    model_dir = Path(model_dir)
    cfg = ViTConfig(**json.loads((model_dir / "config.json").read_text()))
    model = ViT(cfg)
    model.load_state_dict(load_file(model_dir / "model.safetensors"), strict=True)
    return model.eval()


@torch.no_grad()
def evaluate(model: ViT, directory: str | os.PathLike) -> dict[str, float]:
    """Mean cross-entropy, accuracy and count of the images under ``directory``."""
    images, labels = load_images(directory, model.cfg.image_size)
    logits = model(images)
    return {"loss": F.cross_entropy(logits, labels).item(),
            "accuracy": (logits.argmax(-1) == labels).double().mean().item(),
            "images": len(labels)}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("model_dir")
    p.add_argument("val_dir")
    args = p.parse_args()
    result = evaluate(load_model(args.model_dir), args.val_dir)
    print(f"val_loss={result['loss']:.4f} val_accuracy={result['accuracy']:.4f} "
          f"({result['images']} images)")


if __name__ == "__main__":
    main()
