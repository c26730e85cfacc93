"""SMP v2's checkpoint modules (``torch.sagemaker.distributed.checkpoint.*``) on 2 ranks.

Each resume case trains 2 steps, saves through the v2 API, trains 2 more steps (the
uninterrupted run: an ``async_save`` must have copied the state before returning), then
loads the checkpoint into a fresh model (other initial values) and optimizer, trains
the same 2 steps and must match the uninterrupted run exactly: the loss of every step,
every parameter and every optimizer-state tensor, gathered whole.
"""

from __future__ import annotations

import os
import time

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_optimizer_state_dict,
    get_state_dict,
    set_state_dict,
)

import modelparallel as mp
from modelparallel.checkpoint import CheckpointError
from modelparallel.smp.v2.checkpoint import fsdp_checkpoint as tsm_fsdp_checkpoint
from modelparallel.smp.v2.checkpoint import state_dict_loader as loader
from modelparallel.smp.v2.checkpoint import state_dict_saver as saver
from modelparallel.smp.v2.checkpoint.async_utils import AsyncCallsQueue
from modelparallel.smp.v2.checkpoint.filesystem import (
    DistributedFileSystemReader,
    DistributedFileSystemWriter,
)
from modelparallel.smp.v2.checkpoint.state_dict_utils import (
    SMStateDictType,
    compute_auto_checkpoint_interval,
    init_optim_state,
    sm_state_dict_type,
)
from modelparallel.testing import full_parameters, local_rows

STEPS = 4  # saved after 2


def build(seed: int) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 16), nn.Tanh(),
                         nn.Linear(16, 4))


def batches() -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(7)
    return [(torch.randn(8, 8, generator=g), torch.randn(8, 4, generator=g))
            for _ in range(STEPS)]


def fsdp1(seed: int) -> nn.Module:
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
    from torch.distributed.fsdp.wrap import ModuleWrapPolicy

    # after mp.init the FSDP1 hook lays it out by hybrid_shard_degree
    return FSDP(build(seed), use_orig_params=True, auto_wrap_policy=ModuleWrapPolicy({nn.Linear}))


def optimizer_for(model: nn.Module):
    opt = torch.optim.AdamW(model.parameters(), lr=0.05, weight_decay=0.1)
    return opt, torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.8)


def train(model, opt, sched, steps) -> list[float]:
    losses = []
    for batch in steps:
        x, y = local_rows(batch, dist.get_rank(), dist.get_world_size())
        opt.zero_grad(set_to_none=True)
        loss = nn.functional.mse_loss(model(x), y)
        loss.backward()
        opt.step()
        sched.step()
        value = loss.detach().double()
        dist.all_reduce(value)
        losses.append(float(value) / dist.get_world_size())
    return losses


def snapshot(model, opt) -> dict[str, torch.Tensor]:
    """Every parameter and optimizer-state tensor, whole (collective)."""
    optim = get_optimizer_state_dict(model, opt, options=StateDictOptions(
        full_state_dict=True, flatten_optimizer_state_dict=True))
    out = {f"param.{k}": v for k, v in full_parameters(model).items()}
    out.update({f"optim.{k}": v.detach().clone() if isinstance(v, torch.Tensor)
                else torch.tensor(v) for k, v in optim.items() if k.startswith("state.")})
    return out


def differences(a: dict, b: dict) -> list[str]:
    if set(a) != set(b):
        return [f"keys differ: {sorted(set(a) ^ set(b))[:6]}"]
    return [k for k in a if not torch.equal(a[k], b[k])]


def resume_case(root: str, how: str) -> dict:
    mp.init({"hybrid_shard_degree": 0})
    data = batches()
    model = mp.shard(build(0)) if how == "shard-async" else fsdp1(0)
    opt, sched = optimizer_for(model)
    losses = train(model, opt, sched, data[:2])
    path = os.path.join(root, how)
    queue = AsyncCallsQueue()
    if how == "fsdp1-sharded":  # as the SMP v2 example scripts save
        from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
        from torch.distributed.fsdp import StateDictType

        with FSDP.state_dict_type(model, StateDictType.SHARDED_STATE_DICT):
            state = {"model": model.state_dict(), "optimizer": FSDP.optim_state_dict(model, opt),
                     "scheduler": sched.state_dict(), "total_steps": 2}
        saver.save(state, checkpoint_id=path, coordinator_rank=0)
    elif how == "fsdp1-util":  # the older SMP v2 scripts' one call
        from torch.distributed.fsdp import StateDictType

        tsm_fsdp_checkpoint.save_model_checkpoint(
            model, StateDictType.SHARDED_STATE_DICT, path, None, (None, 0, True),
            optimizer=opt, scheduler=sched, extra_exports={"total_steps": 2})
    else:
        model_sd, optim_sd = get_state_dict(model, opt)
        state = {"model": model_sd, "optimizer": optim_sd, "scheduler": sched.state_dict(),
                 "total_steps": 2}
        saver.async_save(state, checkpoint_id=path, queue=queue)
        pending = queue.get_num_unfinalized_calls()
    losses += train(model, opt, sched, data[2:])  # while the checkpoint is written
    expected = snapshot(model, opt)
    finalized: list[int] = []
    if how == "shard-async":
        while not finalized:  # non-blocking: every rank finalizes the same calls
            finalized = queue.maybe_finalize_async_calls(blocking=False)
            time.sleep(0.02)
        finalized.append(pending)

    fresh = mp.shard(build(1)) if how == "shard-async" else fsdp1(1)
    opt2, sched2 = optimizer_for(fresh)
    if how == "fsdp1-util":
        from torch.distributed.fsdp import StateDictType

        loaded = tsm_fsdp_checkpoint.load_model_checkpoint(
            fresh, StateDictType.SHARDED_STATE_DICT, path, None, (None, 0, True),
            optimizer=opt2, scheduler=sched2, extra_imports={"total_steps": 0})
        target = loaded[tsm_fsdp_checkpoint.EXPORT_KEY_IDENTITY]
        assert loaded[tsm_fsdp_checkpoint.EXPORT_KEY_MODEL] is fresh
    elif how == "fsdp1-sharded":
        from torch.distributed.checkpoint.optimizer import load_sharded_optimizer_state_dict
        from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
        from torch.distributed.fsdp import StateDictType

        with FSDP.state_dict_type(fresh, StateDictType.SHARDED_STATE_DICT):
            target = {"model": fresh.state_dict(), "scheduler": sched2.state_dict(),
                      "total_steps": 0}
            loader.load(target, storage_reader=DistributedFileSystemReader(path))
            fresh.load_state_dict(target["model"])
            optim = load_sharded_optimizer_state_dict(
                model_state_dict=target["model"], optimizer_key="optimizer",
                storage_reader=DistributedFileSystemReader(path))
            opt2.load_state_dict(FSDP.optim_state_dict_to_load(fresh, opt2, optim["optimizer"]))
    else:
        model_sd, optim_sd = get_state_dict(fresh, opt2)
        target = {"model": model_sd, "optimizer": optim_sd, "scheduler": sched2.state_dict(),
                  "total_steps": 0}
        loader.load(target, checkpoint_id=path)
        set_state_dict(fresh, opt2, model_state_dict=target["model"],
                       optim_state_dict=target["optimizer"])
    if how != "fsdp1-util":
        sched2.load_state_dict(target["scheduler"])
    resumed = train(fresh, opt2, sched2, data[2:])
    return {"losses": losses[2:], "resumed": resumed, "total_steps": target["total_steps"],
            "differ": differences(snapshot(fresh, opt2), expected), "finalized": finalized,
            "listing": sorted(os.listdir(root))}


@pytest.mark.parametrize("how", ["fsdp1-sharded", "shard-async", "fsdp1-util"])
def test_resume_through_the_v2_api_matches_an_uninterrupted_run(workers, tmp_path, how):
    for got in workers(2).run(resume_case, root=str(tmp_path), how=how):
        assert got["resumed"] == got["losses"]
        assert got["differ"] == []
        assert got["total_steps"] == 2
        assert got["listing"] == [how]  # committed under its name, nothing hidden left
        if how == "shard-async":
            assert got["finalized"] == [0, 1]  # index 0, and 1 call was pending


def local_case(root: str, hybrid: int) -> dict:
    """SM_LOCAL_STATE_DICT saved per replication group, as SMP's resilience checkpoints."""
    mp.init({"hybrid_shard_degree": hybrid})
    rank, world = dist.get_rank(), dist.get_world_size()
    shard = world if hybrid == 0 else hybrid  # FSDP1 shard degree
    groups = [list(range(r, world, shard)) for r in range(shard)]  # same shard: replicas
    group = [dist.new_group(g) for g in groups][rank % shard]
    coordinator = min(groups[rank % shard])
    subdir = os.path.join(root, "step2", f"tp0_ep0_fsdp{rank % shard}")
    data = batches()
    model = fsdp1(0)
    opt, sched = optimizer_for(model)
    losses = train(model, opt, sched, data[:2])
    started = []

    def mark(writer):
        if writer.is_coordinator:
            with writer.fs.create_stream(writer.fs.concat_path(writer.path, ".local.metadata"),
                                         "wb") as f:
                torch.save({"step": 2}, f)

    with sm_state_dict_type(model, SMStateDictType.SM_LOCAL_STATE_DICT):
        state = {"model": model.state_dict(), "optimizer": opt.state_dict(),
                 "scheduler": sched.state_dict(), "step": 2}
    writer = DistributedFileSystemWriter(subdir, pre_write_hooks=[started.append],
                                         post_write_hooks=[mark])
    queue = AsyncCallsQueue() if hybrid == 0 else None  # None: the module's default queue
    saver.async_save(state, storage_writer=writer, process_group=group,
                     coordinator_rank=coordinator, queue=queue, force_check_all_plans=False,
                     wait_error_handling=False)
    losses += train(model, opt, sched, data[2:])
    expected = snapshot(model, opt)
    default_queue = [saver.DEFAULT_ASYNC_REQUEST_QUEUE.get_num_unfinalized_calls()]
    (queue or saver.DEFAULT_ASYNC_REQUEST_QUEUE).maybe_finalize_async_calls(blocking=True,
                                                                           skip_sync=True)
    default_queue.append(saver.DEFAULT_ASYNC_REQUEST_QUEUE.get_num_unfinalized_calls())
    with open(os.path.join(subdir, ".local.metadata"), "rb") as f:
        marker = torch.load(f, weights_only=True)

    fresh = fsdp1(1)
    opt2, sched2 = optimizer_for(fresh)
    init_optim_state(opt2, skip_empty_param=True)
    with sm_state_dict_type(fresh, SMStateDictType.SM_LOCAL_STATE_DICT):
        target = {"model": fresh.state_dict(), "optimizer": opt2.state_dict(),
                  "scheduler": sched2.state_dict(), "step": 0}
        loader.load(target, storage_reader=DistributedFileSystemReader(subdir),
                    process_group=group, coordinator_rank=coordinator)
    # tensors were loaded in place; the param groups are plain values
    for group_state, saved in zip(opt2.param_groups, target["optimizer"]["param_groups"],
                                  strict=True):
        group_state.update({k: v for k, v in saved.items() if k != "params"})
    sched2.load_state_dict(target["scheduler"])
    resumed = train(fresh, opt2, sched2, data[2:])
    return {"losses": losses[2:], "resumed": resumed, "step": target["step"],
            "differ": differences(snapshot(fresh, opt2), expected), "started": len(started),
            "marker": marker, "default_queue": default_queue,
            "dirs": sorted(os.listdir(os.path.join(root, "step2")))}


@pytest.mark.parametrize("hybrid", [0, 1])  # 2 shards, no replicas; 2 replicas of 1 shard
def test_sm_local_state_dict_round_trip(workers, tmp_path, hybrid):
    for got in workers(2).run(local_case, root=str(tmp_path), hybrid=hybrid):
        assert got["resumed"] == got["losses"]
        assert got["differ"] == []
        assert got["step"] == 2 and got["started"] == 1 and got["marker"] == {"step": 2}
        assert got["default_queue"] == ([1, 0] if hybrid else [0, 0])  # queue=None's
        assert got["dirs"] == (["tp0_ep0_fsdp0", "tp0_ep0_fsdp1"] if hybrid == 0
                               else ["tp0_ep0_fsdp0"])


def errors_case(root: str) -> list[str]:
    mp.init({})
    rank = dist.get_rank()
    seen = []
    saver.save({"a": torch.ones(2), "b": torch.zeros(3)}, checkpoint_id=root)
    for target, kwargs in (
            ({"a": torch.zeros(2), f"only{rank}": torch.zeros(1)}, {}),  # ranks disagree
            ({"a": torch.zeros(2), "c": torch.zeros(1)}, {}),  # not in the checkpoint
            ({"a": torch.zeros(2)}, {"coordinator_rank": 1})):  # not the group's first
        try:
            loader.load(target, checkpoint_id=root, **kwargs)
            seen.append("loaded")
        except (CheckpointError, ValueError) as e:
            seen.append(f"{type(e).__name__}|{isinstance(e, KeyError)}|{e}")
    return seen


def test_load_errors_are_clear_and_on_every_rank(workers, tmp_path):
    for keys, missing, coordinator in workers(2).run(errors_case, root=str(tmp_path / "ckpt")):
        assert keys.startswith("CheckpointError|False|load: the ranks ask for different keys")
        assert "rank 1 lacks 1 key(s) ('only0') and has 1 key(s) ('only1')" in keys
        # a loader.CheckpointKeyError, which is a KeyError (scripts catch KeyError)
        assert missing.startswith(f"{loader.CheckpointKeyError.__name__}|True|")
        assert "Missing key in checkpoint state_dict: c" in missing
        assert coordinator.startswith("ValueError|False|load: coordinator_rank=1: the "
                                      "checkpoint is coordinated from the group's first rank, 0")


def interval_case() -> list:
    rank = dist.get_rank()
    interval = compute_auto_checkpoint_interval([1.0 + rank] * 3, [1.5] * 3, [0.1] * 3,
                                                [2.5, 2.5 + 2 * rank, 3.0])
    return [interval.interval, interval.step_duration, interval.ckpt_io_duration]


def test_auto_checkpoint_interval_is_agreed_by_every_rank(workers):
    # medians: step 1.0 / 2.0 and io 2.5 / 3.0; the largest over the ranks: ceil(3 / 2)
    assert workers(2).run(interval_case) == [[2, 2.0, 3.0]] * 2


# -- one process: the helpers and the arguments refused before any collective ----------

def test_s3_paths_survive_pathlib():
    from pathlib import Path

    from modelparallel.smp.v2.checkpoint.s3_filesystem import (
        format_s3_path,
        is_s3_uri,
        parse_s3_uri,
    )

    assert is_s3_uri(Path("s3://bucket/a/b")) and not is_s3_uri("/tmp/s3") and not is_s3_uri(None)
    assert format_s3_path(Path("s3://bucket/a/b")) == "s3://bucket/a/b"
    assert parse_s3_uri("s3://bucket/a/b") == ("bucket", "a/b")
    with pytest.raises(ValueError, match="not an s3:// URI"):
        format_s3_path("/tmp/x")


def test_retry_with_jitter_retries_then_raises():
    from modelparallel.smp.v2.checkpoint.s3_filesystem import retry_with_jitter

    calls = []

    @retry_with_jitter(max_attempts=3, base_delay_s=0.001)
    def flaky(n):
        calls.append(n)
        if len(calls) < 3:
            raise OSError("transient")
        return n

    assert flaky(5) == 5 and calls == [5, 5, 5]

    class Holder:  # SMP scripts stack it over @staticmethod
        @retry_with_jitter
        @staticmethod
        def always():
            calls.append("x")
            raise OSError("down")

    calls.clear()
    with pytest.raises(OSError, match="down"):
        Holder().always()
    assert calls == ["x"] * 3


def test_writer_hooks_and_path_file_systems(tmp_path):
    from torch.distributed.checkpoint.filesystem import FileSystem

    from modelparallel.smp.v2.checkpoint.filesystem import path_to_file_system
    from modelparallel.smp.v2.checkpoint.s3_filesystem import S3FileSystem

    seen = []
    writer = DistributedFileSystemWriter(tmp_path / "ckpt", pre_write_hooks=[
        lambda w: seen.append(("pre", w.is_coordinator))], post_write_hooks=[
        lambda w: seen.append(("post", w.is_coordinator))])
    saver.save({"w": torch.arange(4.0)}, storage_writer=writer)
    assert seen == [("pre", True), ("post", True)]
    target = {"w": torch.zeros(4)}
    loader.load(target, checkpoint_id=tmp_path / "ckpt")
    assert torch.equal(target["w"], torch.arange(4.0))
    assert type(path_to_file_system(tmp_path)) is FileSystem
    assert isinstance(S3FileSystem(), FileSystem.__mro__[1])  # a DCP file system


def test_arguments_that_cannot_work_are_refused(tmp_path):
    sd = {"w": torch.ones(1)}
    with pytest.raises(ValueError, match="s3client_config configures SMP's s3torchconnector"):
        saver.save(sd, checkpoint_id="s3://bucket/ckpt", s3client_config=object())
    with pytest.raises(TypeError, match="sharded_strategy must be None or a PyTorchDist"):
        saver.async_save(sd, checkpoint_id=tmp_path, sharded_strategy="fully_parallel")
    with pytest.raises(ValueError, match="pass checkpoint_id or storage_writer"):
        saver.save(sd)
    with pytest.raises(TypeError, match="applies to FSDP1"):
        from torch.distributed.fsdp import StateDictType

        with sm_state_dict_type(build(0), StateDictType.FULL_STATE_DICT):
            pass


def test_init_optim_state_changes_no_parameter_and_keeps_gradients():
    model = build(0)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    opt = torch.optim.AdamW(model.parameters(), lr=0.1, weight_decay=0.1)
    model[0].weight.grad = torch.ones_like(model[0].weight)
    init_optim_state(opt)
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    assert torch.equal(model[0].weight.grad, torch.ones_like(model[0].weight))
    assert model[2].weight.grad is None and opt.param_groups[0]["lr"] == 0.1
    assert len(opt.state) == len(list(model.parameters()))
    assert all(float(s["step"]) == 1 for s in opt.state.values())


def test_local_state_dict_of_a_plain_model_shares_storage():
    model = build(0)
    with sm_state_dict_type(model, SMStateDictType.SM_LOCAL_STATE_DICT):
        sd = model.state_dict()
        sd["0.bias"].fill_(3.0)
        assert torch.equal(model[0].bias.detach(), torch.full((16,), 3.0))
        model.load_state_dict({k: torch.zeros_like(v) for k, v in sd.items()})
    assert "state_dict" not in model.__dict__  # the method is back
    assert not model[0].weight.detach().any() and set(model.state_dict()) == set(sd)
