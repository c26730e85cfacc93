"""Checkpoints under failure: a rank killed in training or in the middle of a save, a
save that raises, a save only some ranks call. Each run is a real `modelparallel run`
of examples/checkpoint/train_resume.py (or a small script) on 2 gloo processes."""

import re
import textwrap

import pytest
import torch

import modelparallel as mp
from modelparallel.config import Config

EXAMPLE = "examples/checkpoint/train_resume.py"
STEPS, SAVE_EVERY = 12, 3
TEXT_BYTES = 2600  # 81 windows of 32 bytes: 5 batches of 8 per rank and epoch


def train(modelparallel, ckpt, out, *args, restarts=0):
    return modelparallel("run", "--nproc-per-node", 2, "--max-restarts", restarts, EXAMPLE,
                         "--steps", STEPS, "--save-every", SAVE_EVERY, "--keep", 2,
                         "--text-bytes", TEXT_BYTES, "--checkpoint-dir", ckpt, "--out", out, *args,
                         timeout=150)


def losses(out: str) -> dict[int, str]:
    """Rank 0's printed loss of each step (a step printed twice would show as a clash)."""
    found = re.findall(r"\[rank0\]: step +(\d+) \| loss ([\d.]+)", out)
    steps = [int(s) for s, _ in found]
    assert len(steps) == len(set(steps)), f"a step ran twice: {steps}"
    return {int(s): loss for s, loss in found}


def assert_same_parameters(a, b):
    first, second = torch.load(a), torch.load(b)
    assert first.keys() == second.keys() and first
    for name in first:
        assert torch.equal(first[name], second[name]), name


def summary(err: str) -> str:
    return err[err.index("modelparallel run: rank"):]


@pytest.mark.extended  # long fault test
@pytest.mark.timeout(240)
def test_rank_killed_in_training_restarts_and_ends_bit_identical(modelparallel, tmp_path):
    plain = train(modelparallel, tmp_path / "plain", tmp_path / "plain.pt")
    assert plain.code == 0, plain.all
    assert sorted(losses(plain.out)) == list(range(1, STEPS + 1))

    # step 6 is the first of the second epoch: the resumed loader goes on mid-epoch
    ckpt = tmp_path / "ckpt"
    ran = train(modelparallel, ckpt, tmp_path / "resumed.pt", "--die-at-step", 7,
                "--die-rank", 1, restarts=1)
    assert ran.code == 0, ran.all
    assert f"[rank0]: resumed from {ckpt}/step6 at step 6 (restart 1)" in ran.out, ran.all
    assert losses(ran.out) == losses(plain.out), "same loss at every step, each step once"
    assert_same_parameters(tmp_path / "plain.pt", tmp_path / "resumed.pt")
    assert mp.checkpoint.newest(ckpt) == "step12"
    assert mp.checkpoint.info(ckpt)["step"] == STEPS
    assert sorted(p.name for p in ckpt.iterdir()) == ["newest", "step12", "step9"], "--keep 2"
    print(f"uninterrupted {plain.seconds:.1f}s, killed + restarted {ran.seconds:.1f}s")


@pytest.mark.extended  # long fault test
@pytest.mark.timeout(240)
def test_rank_killed_while_saving_leaves_the_previous_checkpoint(modelparallel, tmp_path):
    ckpt = tmp_path / "ckpt"
    # rank 0 dies in step 6's save, after its shards are written, before the commit
    ran = train(modelparallel, ckpt, tmp_path / "never.pt", "--die-at-step", 6,
                "--die-rank", 0, "--die-during-save")
    assert ran.code == 137, ran.all
    assert "rank 0 (local rank 0) failed first with signal SIGKILL" in summary(ran.err)
    assert (ckpt / "newest").read_text().strip() == "step3"
    leftovers = [p.name for p in ckpt.iterdir() if p.name.startswith(".tmp-step6-")]
    assert len(leftovers) == 1 and (ckpt / leftovers[0] / "sharded").is_dir(), \
        sorted(p.name for p in ckpt.iterdir())
    assert not (ckpt / "step6").exists()
    assert mp.checkpoint.newest(ckpt) == "step3"
    assert mp.checkpoint.info(ckpt)["step"] == 3

    again = train(modelparallel, ckpt, tmp_path / "resumed.pt")
    assert again.code == 0, again.all
    assert f"[rank0]: resumed from {ckpt}/step3 at step 3 (restart 0)" in again.out
    assert sorted(losses(again.out)) == list(range(4, STEPS + 1))
    assert not (ckpt / leftovers[0]).exists(), "the next save removed the leftover"
    assert sorted(p.name for p in ckpt.iterdir()) == ["newest", "step12", "step9"]
    print(f"killed in save {ran.seconds:.1f}s, resumed {again.seconds:.1f}s")


@pytest.mark.timeout(120)
@pytest.mark.parametrize("bad_ranks", ["all", "1"])
def test_save_that_raises_ends_the_run_naming_the_rank(modelparallel, tmp_path, bad_ranks):
    script = tmp_path / "train.py"
    script.write_text(textwrap.dedent(f"""
        import sys
        import torch
        import modelparallel as mp
        mp.init({{"hybrid_shard_degree": 1}})
        model = mp.shard(torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 4)))
        bad = {bad_ranks!r} == "all" or str(mp.rank()) == {bad_ranks!r}
        content = {{"step": 1, "loss_fn": (lambda x: x) if bad else None}}
        mp.save_checkpoint(sys.argv[1], "step1", model=model, user_content=content)
        print("saved", flush=True)
    """))
    ckpt = tmp_path / "ckpt"
    ran = modelparallel("run", "--nproc-per-node", 2, script, ckpt, timeout=90)
    assert ran.code == 1, ran.all
    first = summary(ran.err)
    failed = re.search(r"rank (\d) \(local rank \d\) failed first with exit code 1", first)
    assert failed, first
    if bad_ranks != "all":
        assert failed.group(1) == bad_ranks, first
    assert "error: CheckpointError: user_content must be made of tensors" in first
    assert "Can't pickle <function <lambda>" in first
    assert "saved" not in ran.out
    assert not (ckpt / "newest").exists()
    assert not any(p.name.startswith(".tmp-") for p in ckpt.glob(".*")), "nothing written"
    print(f"failed after {ran.seconds:.1f}s")


@pytest.mark.timeout(120)
@pytest.mark.parametrize("rank0_late_s", [0, 1])  # rank 0 reaches the save 1 s late
def test_save_on_rank_0_only_is_an_error_not_a_hang(modelparallel, tmp_path, rank0_late_s):
    if "collective_timeout" not in Config.__dataclass_fields__:
        pytest.skip("the collective_timeout config key does not exist yet")
    script = tmp_path / "train.py"
    script.write_text(textwrap.dedent(f"""
        import sys, time
        import torch
        import modelparallel as mp
        mp.init({{"hybrid_shard_degree": 1, "collective_timeout": 5}})
        model = mp.shard(torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 4)))
        if mp.rank() == 0:
            time.sleep({rank0_late_s})  # e.g. logging first
            mp.save_checkpoint(sys.argv[1], "step1", model=model)
        mp.barrier()
    """))
    ran = modelparallel("run", "--nproc-per-node", 2, script, tmp_path / "ckpt", timeout=100)
    assert ran.code == 1, ran.all
    first = summary(ran.err)
    assert "rank 0 (local rank 0) failed first with exit code 1" in first, first
    assert "is collective, but only rank(s) 0 called it; rank(s) 1 did not within 2.5s" in first
    assert not (tmp_path / "ckpt" / "newest").exists()
    print(f"failed after {ran.seconds:.1f}s")
