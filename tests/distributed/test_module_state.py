"""The library sets no attributes of its own on a user's modules: what it keeps about a
module is one typed record (``modelparallel.module_state``), beside what torch's own
wrappers set.

Each case trains two steps of a parity-matrix case on 2 gloo ranks, through every API
path (SMP v1 with a pipeline and activation checkpointing, ``transform`` + ``mp.shard``
with tensor parallelism, FSDP1 as SMP v2 scripts wrap it, ``mp.replicate``, SMDDP's DDP),
and compares every module of the user's model before and after. The attributes torch's
own wrappers add are found the same way, by wrapping a twin model with them
(``fully_shard``, FSDP1, ``parallelize_module``, ``checkpoint_wrapper``, DDP).
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from parity_matrix import zoo
from parity_matrix.space import Case, Layout

# the bound forward of a module apply_activation_checkpointing recomputes (torch's
# checkpoint_wrapper would wrap it instead and change every name under it: SMP keeps them)
# and of a fused GPT-2 projection split by tensor parallelism
REPLACED_FORWARD = "forward"
CASES = {
    "v1-pipeline-ckpt": Case(Layout(2, 2, 1, 0, schedule="interleaved"), "v1",
                             checkpointing=True, microbatches=2),
    "shard-tp-ckpt": Case(Layout(2, 1, 2, 0), "shard", checkpointing=True, model="gpt2"),
    "fsdp1-tp-bf16": Case(Layout(2, 1, 2, 0), "fsdp1", precision="bf16", model="llama"),
    "ddp-fp16": Case(Layout(2, 1, 1, 0), "ddp", precision="fp16"),
    "smddp": Case(Layout(2, 1, 1, 0), "smddp", dropout=True),
}
KEEPS_NO_RECORD = {"smddp"}  # torch's DDP as SMDDP scripts use it: nothing to record


def _keys(modules: dict[str, nn.Module]) -> dict[str, set[str]]:
    return {name: set(m.__dict__) for name, m in modules.items()}


def _added(before: dict[str, set[str]], modules: dict[str, nn.Module]) -> set[str]:
    return {key for name, m in modules.items() for key in set(m.__dict__) - before[name]}


def added_by_the_library(case_dict: dict) -> set[str]:
    """Every attribute name added to a module of the user's model by a case's run."""
    from parity_matrix import train

    built: list[tuple[dict[str, nn.Module], dict[str, set[str]]]] = []
    original_build = zoo.build

    def build(*args, **kwargs):  # the user's model as the script builds it
        model = original_build(*args, **kwargs)
        modules = dict(model.named_modules(remove_duplicate=False))
        built.append((modules, _keys(modules)))
        return model

    zoo.build = build
    try:
        with train.quiet():
            case = Case.from_dict(case_dict)
            run = train.PathRun(case)
            for x, y in zoo.batches(case.model, 2, case.rows, padded=case.padded):
                run.step(x, y)
    finally:
        zoo.build = original_build
    modules, before = built[0]
    return _added(before, modules)


def added_by_torch() -> set[str]:
    """Every attribute name torch's own wrappers add to the modules they wrap."""
    import torch.distributed as dist
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import (
        apply_activation_checkpointing,
    )
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import FullyShardedDataParallel, fully_shard
    from torch.distributed.tensor import Replicate
    from torch.distributed.tensor.parallel import ColwiseParallel, parallelize_module

    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    found: set[str] = set()
    for wrap in ("fully_shard", "fsdp1", "parallelize", "checkpoint", "ddp"):
        model = zoo.build("gpt", 2, False, 0)
        modules = dict(model.named_modules(remove_duplicate=False))
        before = _keys(modules)
        if wrap == "fully_shard":
            for block in zoo.blocks_of(model):
                fully_shard(block, mesh=mesh)
            fully_shard(model, mesh=mesh)
        elif wrap == "fsdp1":
            model = FullyShardedDataParallel(model, use_orig_params=True,
                                             device_id=torch.device("cpu"))
        elif wrap == "parallelize":
            linear = next(n for n, m in modules.items() if isinstance(m, nn.Linear))
            parallelize_module(model, mesh, {linear: ColwiseParallel(output_layouts=Replicate())})
        elif wrap == "checkpoint":
            blocks = zoo.blocks_of(model)
            apply_activation_checkpointing(model, check_fn=lambda m, b=blocks: m in b)
        else:
            model = nn.parallel.DistributedDataParallel(model)
        x, _ = zoo.batches("gpt", 1, 2)[0]
        model(x).float().sum().backward()
        found |= _added(before, modules)
    return found


@pytest.fixture(scope="module")
def torch_keys(workers) -> set[str]:
    return set.union(*workers(2).run(added_by_torch))


@pytest.mark.parametrize("name", list(CASES))
def test_the_library_adds_no_attribute_beyond_its_record_and_torchs(workers, torch_keys, name):
    from modelparallel.module_state import KEY

    for rank, added in enumerate(workers(2).run(added_by_the_library,
                                                case_dict=CASES[name].as_dict())):
        # the snapshot is taken before the library touches the model
        assert (KEY in added) == (name not in KEEPS_NO_RECORD), f"rank {rank}: {added}"
        assert added - torch_keys - {KEY, REPLACED_FORWARD} == set(), f"rank {rank}"


def test_the_check_sees_an_attribute_set_on_a_module():
    model = nn.Sequential(nn.Linear(2, 2))
    modules = dict(model.named_modules())
    before = _keys(modules)
    model[0]._mp_extra = 1
    assert _added(before, modules) == {"_mp_extra"}
