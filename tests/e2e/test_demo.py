"""The quick-start demo: a GPT learns Python source with hybrid sharding on 4 ranks."""

import json
import re

import pytest


def test_gpt_demo_learns(modelparallel, tmp_path):
    metrics = tmp_path / "metrics.jsonl"
    ran = modelparallel("run", "--nproc-per-node", 4, "examples/gpt/train.py",
                        "--steps", 30, "--log-every", 10, "--metrics", metrics, timeout=600)
    assert ran.code == 0, ran.all
    assert "dp_replicate=2 x dp_shard=2" in ran.out
    progress = re.findall(r"\[rank(\d)\]: step +(\d+) \| loss ([\d.]+)", ran.out)
    assert [int(s) for _, s, _ in progress] == [1, 10, 20, 30]
    assert {r for r, _, _ in progress} == {"0"}, "only rank 0 prints progress"
    done = re.search(r"training loss ([\d.]+) -> ([\d.]+); held-out loss ([\d.]+) -> ([\d.]+)",
                     ran.out)
    first, last, before, after = map(float, done.groups())
    assert first > 5.0 and last < first - 1.0, "byte-level loss starts near ln 256 and falls"
    assert after < before - 1.0
    lines = [json.loads(line) for line in metrics.read_text().splitlines()]
    assert len(lines) == 30
    # (and FSDP's per-step flags of parameters used, a few bytes over all of them)
    assert {k for k, v in lines[-1]["comm_bytes"].items() if v > 4096} == \
        {"dp_shard", "dp_replicate"}


@pytest.mark.extended  # the README's demo stays in the default tier
def test_gpt_demo_learns_with_tensor_parallelism(modelparallel, tmp_path):
    ran = modelparallel("run", "--nproc-per-node", 4, "examples/gpt/train.py",
                        "--tensor-parallel-degree", 2, "--steps", 20, "--log-every", 10,
                        "--metrics", tmp_path / "metrics.jsonl", timeout=600)
    assert ran.code == 0, ran.all
    assert "dp_replicate=1 x dp_shard=2 x pp=1 x tp=2" in ran.out
    assert re.search(r"comm dp_shard [\d.]+ MiB, tp [\d.]+ MiB", ran.out), "TP collectives ran"
    done = re.search(r"training loss ([\d.]+) -> ([\d.]+)", ran.out)
    first, last = map(float, done.groups())
    assert first > 5.0 and last < first - 1.0
