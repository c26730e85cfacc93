"""Records what a job's worker sees: its environment, arguments and channel files."""

import argparse
import json
import os
import sys
import time
from pathlib import Path

parser = argparse.ArgumentParser()
parser.add_argument("--epochs", type=int, required=True)
parser.add_argument("--fail", default="")  # "traceback" or "file": fail on algo-2's rank
parser.add_argument("--sleep", type=float, default=0.0)
parser.add_argument("--name", default="")
args = parser.parse_args()

rank = int(os.environ["RANK"])
env = {k: v for k, v in os.environ.items() if k.startswith(("MP_", "SM_"))}
channels = {}
for name in json.loads(os.environ["SM_CHANNELS"]):
    root = Path(os.environ[f"SM_CHANNEL_{name.upper()}"])
    channels[name] = {"path": str(root), "files": sorted(
        str(p.relative_to(root)) for p in root.rglob("*") if p.is_file())}
record = {"rank": rank, "argv": sys.argv[1:], "env": env, "channels": channels,
          "cwd": os.getcwd(), "group_rank": os.environ["GROUP_RANK"]}
out = Path(os.environ["SM_OUTPUT_DATA_DIR"])
(out / f"rank{rank}.json").write_text(json.dumps(record))

checkpoints = Path(os.environ["MP_CHECKPOINT_DIR"])
previous = sorted(p.name for p in checkpoints.glob("epoch-*"))
if rank == 0:
    print(f"found checkpoints: {previous}", flush=True)
start = len(previous)
for epoch in range(start, args.epochs):
    if rank == 0:
        print(f"epoch={epoch} train_loss={1.0 / (epoch + 1):.4f}", flush=True)
        (checkpoints / f"epoch-{epoch}").write_text(str(epoch))
    time.sleep(args.sleep)
if args.fail and os.environ["SM_CURRENT_HOST"] == "algo-2" and os.environ["LOCAL_RANK"] == "0":
    if args.fail == "file":
        (Path(os.environ["MP_OUTPUT_DIR"]) / "failure").write_text(
            "CustomError: the data was bad\nsecond line\n")
        sys.exit(3)
    raise ValueError("injected failure in the training loop")
if rank == 0:
    (Path(os.environ["SM_MODEL_DIR"]) / "weights.txt").write_text(f"model {args.name}")
    (Path(os.environ["SM_MODEL_DIR"]) / "sub").mkdir()
    (Path(os.environ["SM_MODEL_DIR"]) / "sub" / "extra.txt").write_text("x")
