"""The estimator workflow end to end: digits as PNG files in ``train``/``val`` channels,
a ViT trained as a job, first data parallel, then hybrid sharded + tensor parallel,
and the model artifact loaded and scored in one plain process at the end.

    python examples/jobs/run_jobs.py [--epochs 3] [--backend local]

Jobs are recorded under ``$MODELPARALLEL_JOBS_DIR`` (default
~/.local/share/modelparallel/jobs); ``modelparallel jobs list`` shows them afterwards.
The same jobs as YAML: examples/jobs/job_dp.yaml and job_hybrid.yaml.
"""

from __future__ import annotations

import argparse
import sys
import tarfile
import tempfile
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from digits_data import write_digits  # noqa: E402
from evaluate import evaluate, load_model  # noqa: E402

from modelparallel.jobs import Estimator, TrainingInput  # noqa: E402

METRICS = [{"Name": "val:accuracy", "Regex": r"val_accuracy=([0-9.]+)"},
           {"Name": "train:loss", "Regex": r"train_loss=([0-9.]+)"}]
LAYOUTS: dict[str, dict[str, Any]] = {
    # 2 instances x 2 processes: plain data parallel (torch_distributed), then
    # hybrid sharding over 2 ranks x tensor parallel over 2 (the modelparallel form)
    "dp": {"torch_distributed": {"enabled": True}},
    "hybrid-tp": {"modelparallel": {"hybrid_shard_degree": 2, "tensor_parallel_degree": 2}},
}


def vit_estimator(layout: str, *, epochs: int, backend: str = "local",
                  **kwargs: Any) -> Estimator:
    """The ViT job on 2 instances x 2 processes with the ``layout``'s distribution."""
    return Estimator(entry_point="train_vit.py", source_dir=str(HERE), instance_count=2,
                     processes_per_host=2, distribution=LAYOUTS[layout],
                     hyperparameters={"epochs": epochs, "batch-size": 32, "lr": 3e-3},
                     metric_definitions=METRICS, backend=backend, **kwargs)


def digits_channels(root: Path) -> dict[str, TrainingInput]:
    """Write the digits PNGs under ``root`` (once) and describe them as channels."""
    if not (root / "train").is_dir():
        write_digits(root)
    return {"train": TrainingInput(str(root / "train")),
            "val": TrainingInput(str(root / "val"), input_mode="FastFile")}


def score(model_tar: str, val_dir: Path) -> dict[str, float]:
    """Unpack model.tar.gz and score it on ``val_dir`` in this process."""
    with tempfile.TemporaryDirectory() as tmp:
        with tarfile.open(model_tar) as tar:
            tar.extractall(tmp, filter="data")
        return evaluate(load_model(tmp), val_dir)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--epochs", type=int, default=3)
    p.add_argument("--backend", default="local")
    p.add_argument("--data", default=None, help="where the PNGs go (default: a temp dir)")
    args = p.parse_args()
    root = Path(args.data or tempfile.mkdtemp(prefix="digits-"))
    channels = digits_channels(root)
    for layout in LAYOUTS:
        est = vit_estimator(layout, epochs=args.epochs, backend=args.backend)
        est.fit(channels)
        job = est.latest_job
        result = score(est.model_data, root / "val")
        print(f"\n{layout}: job {job.name} {job.status}; model {est.model_data}")
        print(f"{layout}: val_accuracy logged {job.metrics['val:accuracy'][-1]:.4f}, "
              f"reloaded model {result['accuracy']:.4f}\n")


if __name__ == "__main__":
    main()
