"""scikit-learn's handwritten digits (1797 images of 8x8 pixels) as PNG files, one per image.

    python examples/jobs/digits_data.py OUTDIR

writes OUTDIR/train/<label>/<index>.png and OUTDIR/val/<label>/<index>.png: grayscale,
pixel values 0..16 scaled to 0..255, <index> the image's position in
``sklearn.datasets.load_digits`` (zero-padded to 4 digits). The split is a seeded
permutation, the same on every machine. The data ships with scikit-learn: nothing is
downloaded. Many small files on purpose: a training job's ``ShardedByKey`` channel
splits them over instances.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import numpy as np
from PIL import Image
from sklearn.datasets import load_digits


def write_digits(root: Path, val_fraction: float = 0.2, seed: int = 0) -> dict[str, Path]:
    """Write the digits under ``root`` as ``{train,val}/<label>/<index>.png``; returns
    ``{"train": root/"train", "val": root/"val"}``. Deterministic for a given seed."""
    if not 0 < val_fraction < 1:
        raise ValueError(f"val_fraction={val_fraction} must lie strictly between 0 and 1")
    root = Path(root)
    digits = load_digits()
    images = np.rint(digits.images * (255 / 16)).astype(np.uint8)  # (1797, 8, 8), 0..16
    order = np.random.default_rng(seed).permutation(len(images))
    n_val = round(len(images) * val_fraction)
    splits = {"val": np.sort(order[:n_val]), "train": np.sort(order[n_val:])}
    dirs = {}
    for split, indices in splits.items():
        dirs[split] = root / split
        for index in indices:
            folder = dirs[split] / str(int(digits.target[index]))
            folder.mkdir(parents=True, exist_ok=True)
            Image.fromarray(images[index]).save(folder / f"{index:04d}.png")
    return {"train": dirs["train"], "val": dirs["val"]}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("outdir", type=Path)
    p.add_argument("--val-fraction", type=float, default=0.2)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args()
    dirs = write_digits(args.outdir, args.val_fraction, args.seed)
    for split, path in dirs.items():
        print(f"{split}: {sum(1 for _ in path.glob('*/*.png'))} images in {path}")


if __name__ == "__main__":
    main()
