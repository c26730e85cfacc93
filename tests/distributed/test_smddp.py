"""SMDDP: ``init_process_group(backend="smddp")`` after importing the mapped
``torch_smddp`` module, collectives, ``new_group``, DDP / FSDP1 / ``mp.shard`` parity on
it, ``mp.init()`` reusing it, and the deprecated 1.x API (``ReduceOp.AVERAGE``,
``DistributedDataParallel``'s arguments). One torchrun job of 2 processes runs
``smddp_script.py``; each check's outcome is read here."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).with_name("smddp_script.py")


@pytest.fixture(scope="module")
def ranks(tmp_path_factory) -> list[dict]:
    out = tmp_path_factory.mktemp("smddp")
    ran = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
         str(SCRIPT), str(out)], capture_output=True, text=True, timeout=240)
    assert ran.returncode == 0, ran.stdout[-4000:] + ran.stderr[-8000:]
    return [json.loads((out / f"rank{r}.json").read_text()) for r in range(2)]


def outcome(ranks: list[dict], name: str) -> list:
    values = [r[name] for r in ranks]
    for rank, value in enumerate(values):
        assert not (isinstance(value, dict) and "error" in value), \
            f"{name} failed on rank {rank}:\n{value['error']}"
    return values


def test_init_process_group_with_the_smddp_backend(ranks):
    assert [r["backend"] for r in ranks] == ["smddp", "smddp"]
    assert [r["cpu_backend"] for r in ranks] == ["ProcessGroupGloo"] * 2  # gloo without CUDA
    for rank, got in enumerate(outcome(ranks, "collectives")):
        assert got == [3.0, [0.0, 1.0], 1.0, [2.0, 4.0][rank], [{"rank": 0}, {"rank": 1}]]


def test_new_group_on_smddp(ranks):
    for rank, got in enumerate(outcome(ranks, "new_group")):
        assert got == ["smddp", 2.0, float(rank)]


@pytest.mark.parametrize("case", ["ddp_parity", "fsdp1_parity", "mp_shard_parity",
                                  "legacy_ddp_parity"])
def test_training_on_smddp_matches_one_process(ranks, case):
    for problems in outcome(ranks, case):
        assert problems == []


def test_mp_init_reuses_the_smddp_group(ranks):
    for got in outcome(ranks, "mp_init_reuses_group"):
        assert got == [True, "smddp", 2, 2]


def test_deprecated_api(ranks):
    for rank, got in enumerate(outcome(ranks, "legacy_api")):
        assert got[:3] == [0.5, 1.0, 1.0]  # AVERAGE (sync and async), MAX
        assert "floating-point" in got[3]  # AVERAGE of integers is refused
        assert got[4:] == [rank, True, 2, 2, True, [0.0 + rank, 10.0 + rank]]
