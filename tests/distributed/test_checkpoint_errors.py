"""Checkpoint misuse and damage: a clear CheckpointError on every rank, never a hang."""

import os

import pytest
import torch
from torch import nn

import modelparallel as mp
from modelparallel.checkpoint import CheckpointError


def small(width: int = 8) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, width), nn.ReLU(), nn.Linear(width, 2))


def setup(width: int = 8, config: dict | None = None):
    mp.init(config or {"hybrid_shard_degree": 0})
    model = mp.shard(small(width))
    return model, torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)


def train_one(model, optimizer) -> None:
    torch.manual_seed(mp.rank())
    model(torch.randn(4, 4)).pow(2).mean().backward()
    optimizer.step()
    optimizer.zero_grad()


def error_of(fn) -> str:
    try:
        fn()
    except CheckpointError as e:
        return str(e)
    return "no error"


def bad_inputs_case(root: str) -> dict[str, str]:
    model, optimizer = setup()
    train_one(model, optimizer)
    good = os.path.join(root, "good")
    mp.save_checkpoint(good, "a", model=model, optimizer=optimizer)
    errors = {"missing": error_of(lambda: mp.resume_from_checkpoint(
        os.path.join(root, "nothing"), model=model, optimizer=optimizer))}
    errors["missing_tag"] = error_of(lambda: mp.resume_from_checkpoint(
        good, tag="b", model=model, optimizer=optimizer))
    mp.barrier()
    if mp.rank() == 0:  # newest names a checkpoint that is gone
        with open(os.path.join(good, "newest"), "w") as f:
            f.write("gone")
    mp.barrier()
    errors["dangling_newest"] = error_of(lambda: mp.resume_from_checkpoint(
        good, model=model, optimizer=optimizer))
    # a model of another shape
    mp.reset()
    other, other_opt = setup(width=16)
    errors["incompatible"] = error_of(lambda: mp.resume_from_checkpoint(
        good, tag="a", model=other, optimizer=other_opt))
    # truncated shard files
    mp.barrier()
    if mp.rank() == 0:
        for name in os.listdir(os.path.join(good, "a", "sharded")):
            if name.endswith(".distcp"):
                path = os.path.join(good, "a", "sharded", name)
                with open(path, "r+b") as f:
                    f.truncate(os.path.getsize(path) // 2)
    mp.barrier()
    mp.reset()
    model, optimizer = setup()
    errors["truncated"] = error_of(lambda: mp.resume_from_checkpoint(
        good, tag="a", model=model, optimizer=optimizer))
    # a path under a regular file cannot be written (as root, permissions are no obstacle)
    blocker = os.path.join(root, "a-file")
    if mp.rank() == 0:
        open(blocker, "w").close()
    mp.barrier()
    errors["unwritable"] = error_of(lambda: mp.save_checkpoint(
        os.path.join(blocker, "ckpt"), "a", model=model, optimizer=optimizer))
    errors["unsafe_content"] = error_of(lambda: mp.save_checkpoint(
        good, "c", model=model, user_content={"fn": print}))
    errors["bad_tag"] = error_of(lambda: mp.save_checkpoint(good, "../x", model=model))
    errors["plain_loader"] = error_of(lambda: mp.save_checkpoint(
        good, "d", model=model, data_loader=torch.utils.data.DataLoader(range(4))))
    mp.save_checkpoint(good, "model_only", model=model)
    errors["no_optimizer"] = error_of(lambda: mp.resume_from_checkpoint(
        good, model=model, optimizer=optimizer))
    if mp.rank() == 0:  # a directory that was never committed
        os.makedirs(os.path.join(good, "half"))
    mp.barrier()
    errors["incomplete"] = error_of(lambda: mp.resume_from_checkpoint(
        good, tag="half", model=model))
    errors["disagree"] = error_of(lambda: mp.save_checkpoint(
        good, f"rank{mp.rank()}", model=model))
    return errors


def test_bad_checkpoints_give_clear_errors_on_every_rank(workers, tmp_path):
    results = workers(2).run(bad_inputs_case, root=str(tmp_path))
    for errors in results:
        assert "no checkpoint to resume from" in errors["missing"]
        assert "'newest' file" in errors["missing"]
        assert "good/b does not exist; complete checkpoints there: ['a']" in errors["missing_tag"]
        assert errors["dangling_newest"] == "no error", "newest() falls back to 'a'"
        assert "does not fit" in errors["incompatible"]
        assert "0.weight (checkpoint [8, 4], model [16, 4])" in errors["incompatible"]
        assert "good/a is damaged: its file sharded/__" in errors["truncated"]
        assert "no complete checkpoint is left there: remove it" in errors["truncated"]
        assert "cannot write checkpoints to" in errors["unwritable"]
        assert "user_content must be made of tensors" in errors["unsafe_content"]
        assert "it holds print." in errors["unsafe_content"]
        assert "must be a non-empty name without '/'" in errors["bad_tag"]
        assert "data_loader=DataLoader has no state_dict(); use mp.data.DataLoader" in \
            errors["plain_loader"]
        assert "model_only was saved without an optimizer; pass load_optimizer=False" in \
            errors["no_optimizer"]
        assert "good/half is not a complete checkpoint (no checkpoint.json)" in \
            errors["incomplete"]
        assert "ranks disagree on the checkpoint call: rank 0: save_checkpoint(" in \
            errors["disagree"]
        assert "tag='rank0'); rank 1: save_checkpoint(" in errors["disagree"]
    assert not os.path.exists(tmp_path / "good" / "c")  # refused before writing


def subset_case(root: str) -> str:
    mp.init({"hybrid_shard_degree": 0, "collective_timeout": 3})
    model = mp.shard(small())
    if mp.rank() == 0:  # the classic mistake
        return error_of(lambda: mp.save_checkpoint(root, "a", model=model))
    return "did not call"


def test_save_on_some_ranks_is_an_error_not_a_hang(workers, tmp_path):
    results = workers(2).run(subset_case, root=str(tmp_path / "ckpt"))
    assert "is collective, but only rank(s) 0 called it; rank(s) 1 did not within 1.5s" in \
        results[0]
    assert "not under `if mp.rank() == 0`" in results[0]
    assert results[1] == "did not call"
    # the group is still usable afterwards: every rank saves and loads
    assert workers(2).run(roundtrip_case, root=str(tmp_path / "after")) == [True, True]


def uninitialized_case(root: str) -> dict[str, str]:
    mp.reset()  # torch.distributed is up (the worker group's), modelparallel is not
    model = small()
    messages = {}
    for name, call in [
            ("smp", lambda: mp.save_checkpoint(root, "a", model=model)),
            ("dcp", lambda: mp.checkpoint.save({"model": model.state_dict()}, checkpoint_id=root))]:
        try:
            call()
            messages[name] = "no error"
        except RuntimeError as e:
            messages[name] = str(e)
    return messages


def test_checkpoint_before_init_names_the_missing_call(workers, tmp_path):
    for messages in workers(2).run(uninitialized_case, root=str(tmp_path / "ckpt")):
        assert messages["smp"] == ("modelparallel is not initialized: call mp.init(config) "
                                   "before using mp.save_checkpoint")
        assert messages["dcp"] == ("modelparallel is not initialized: call mp.init(config) "
                                   f"before mp.checkpoint.save('{tmp_path / 'ckpt'}') on 2 ranks")
    assert not os.path.exists(tmp_path / "ckpt")


def roundtrip_case(root: str) -> bool:
    model, optimizer = setup()
    train_one(model, optimizer)
    before = {k: v.full_tensor().clone() for k, v in model.state_dict().items()}
    mp.save_checkpoint(root, "a", model=model, optimizer=optimizer)
    train_one(model, optimizer)
    mp.resume_from_checkpoint(root, model=model, optimizer=optimizer)
    return all(torch.equal(before[k], v.full_tensor()) for k, v in model.state_dict().items())


def atomic_case(root: str, url: bool) -> dict:
    model, optimizer = setup()
    path = f"file://{root}" if url else root
    tags = []
    for step in range(4):
        train_one(model, optimizer)
        mp.save_checkpoint(path, f"step{step}", model=model, optimizer=optimizer,
                           num_kept_partial_checkpoints=2, step=step)
        tags.append(sorted(n for n in os.listdir(root) if not n.startswith(".")))
    mp.barrier()
    if mp.rank() == 0:  # what a save killed half-way leaves behind
        os.makedirs(os.path.join(root, ".tmp-step4-dead", "sharded"))
        with open(os.path.join(root, ".tmp-step4-dead", "sharded", "__0_0.distcp"), "wb") as f:
            f.write(b"partial")
    mp.barrier()
    newest = mp.checkpoint.newest(path)
    info = mp.checkpoint.info(path)
    mp.resume_from_checkpoint(path, model=model, optimizer=optimizer)
    leftover_before = os.path.exists(os.path.join(root, ".tmp-step4-dead"))
    mp.save_checkpoint(path, "step5", model=model, optimizer=optimizer)
    return {"tags": tags, "newest": newest, "step": info["step"],
            "leftover_before": leftover_before,
            "leftover_after": os.path.exists(os.path.join(root, ".tmp-step4-dead")),
            "final": sorted(os.listdir(root))}


@pytest.mark.parametrize("url", [False, True], ids=["path", "file-url"])
def test_rotation_and_leftovers_of_interrupted_saves(workers, tmp_path, url):
    for r in workers(2).run(atomic_case, root=str(tmp_path / "ckpt"), url=url):
        assert r["tags"] == [["newest", "step0"], ["newest", "step0", "step1"],
                             ["newest", "step1", "step2"], ["newest", "step2", "step3"]]
        assert (r["newest"], r["step"]) == ("step3", 3)
        assert r["leftover_before"] and not r["leftover_after"]
        assert r["final"] == ["newest", "step2", "step3", "step5"]


def memory_url_case() -> list[bool]:
    """fsspec's memory:// lives in one process: a world of one."""
    model, optimizer = setup()
    train_one(model, optimizer)
    results = []
    for partial in (True, False):
        mp.save_checkpoint("memory://ckpts", f"p{partial}", partial=partial, model=model,
                           optimizer=optimizer, user_content={"partial": partial})
        expected = {k: v.full_tensor().clone() for k, v in model.state_dict().items()}
        train_one(model, optimizer)
        content = mp.resume_from_checkpoint("memory://ckpts", model=model, optimizer=optimizer)
        results.append(content == {"partial": partial} and all(
            torch.equal(expected[k], v.full_tensor()) for k, v in model.state_dict().items()))
    return results


def test_memory_url_round_trips(workers):
    assert workers(1).run(memory_url_case) == [[True, True]]
