"""Every private name of torch (and of Python and other libraries) the package reaches is
listed here, with where it lives and the test that fails if it moves.

- a private name the package uses that is not listed fails (found by
  ``private_names.private_uses``: imports, and attributes reached);
- a listed name the package no longer uses fails (the list stays true);
- each name's test exists and names it; most are checked right here, by importing the
  name or finding it on its owner; FSDP1's per-instance state is checked on a real
  FSDP1 model in ``tests/distributed/test_fsdp1.py``.

Reaching past torch's public API is a last resort: docs/architecture.md#rules.
"""

from __future__ import annotations

import argparse
import atexit
import importlib
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from private_names import private_uses

HERE = "tests/unit/test_private_names.py::test_torch_still_has_what_we_reach"
FSDP1 = "tests/distributed/test_fsdp1.py::test_fsdp1_internals_we_rely_on"
PLAN = ("tests/unit/test_plan_internals.py::"
        "test_meshes_build_under_fake_tensors_and_dtensor_caches_clear")


@dataclass(frozen=True)
class Private:
    owner: str  # what holds it: an importable dotted path, or "<class> instances"
    why: str
    test: str = HERE  # the test that fails if torch changes it


# Imports: a private module, or a private name of a public one (checked by importing).
IMPORTS = {name: "imported" for name in (
    "torch._guards.active_fake_mode",  # the planner: is a fake mode on
    "torch._subclasses.fake_tensor.FakeTensorMode",  # the planner's fake tensors
    "torch._subclasses.fake_tensor.FakeTensor",  # the constants a fake tensor carries
    # what fake tensors raise for a shape that depends on values: one line, not a traceback
    "torch._subclasses.fake_tensor.DataDependentOutputException",
    "torch._subclasses.fake_tensor.DynamicOutputShapeException",
    "torch._subclasses.fake_tensor.is_fake",
    "torch._subclasses.fake_tensor.unset_fake_temporarily",  # meshes built for real
    "torch.distributed._composable.replicate_with_fsdp.replicate",  # replicas (DDP on FSDP2)
    "torch.distributed.algorithms._checkpoint.checkpoint_wrapper",  # activation wrappers
    "torch.distributed.algorithms._checkpoint.checkpoint_wrapper.apply_activation_checkpointing",
    "torch.distributed.checkpoint._fsspec_filesystem.FileSystem",  # DCP on fsspec (S3)
    "torch.distributed.checkpoint._fsspec_filesystem.FsspecReader",
    "torch.distributed.checkpoint._fsspec_filesystem.FsspecWriter",
    "torch.distributed.checkpoint._nested_dict.set_element",  # DCP's nested keys
    "torch.distributed.distributed_c10d._resolve_process_group",  # group of a collective op
    "torch.distributed.fsdp._common_utils",  # FSDP1 internals (fsdp1_torch.py)
    "torch.distributed.fsdp._common_utils.clean_tensor_name",
    "torch.distributed.fsdp._flat_param.FlatParamHandle",
    "torch.distributed.fsdp._init_utils",
    "torch.distributed.fsdp._optim_utils",
    "torch.distributed.pipelining.schedules._ComputationType",  # the schedule's actions
    "torch.distributed.pipelining.stage._PipelineStageBase",  # recording a schedule
    "torch.distributed.tensor._redistribute._gen_transform_infos",  # planner's fake world
    "torch.distributed.tensor._sharding_prop.ShardingPropagator",  # the same
    "torch.distributed._tools.mem_tracker.MemTracker",  # the plan's check (testing/)
    "torch.utils._python_dispatch.TorchDispatchMode",  # counting collectives, the planner
    "torch.utils._pytree",  # nested inputs (no public pytree in torch 2.13)
)}

# Attributes reached on torch objects (and a few of Python's and transformers').
ATTRIBUTES = {
    "_C": Private("torch", "the planner clears DTensor's C++ sharding cache"),
    "_clear_DTensor_sharding_propagator_cache": Private("torch._C", "the same", PLAN),
    "_op_dispatcher": Private("torch.distributed.tensor.DTensor", "the sharding cache", PLAN),
    "_propagate_tensor_meta_non_cached": Private(
        "torch.distributed.tensor._sharding_prop.ShardingPropagator",
        "the planner: DTensor's shape propagation in a fake mode of its own"),
    "_propagate_tensor_meta_cached": Private(
        "torch.distributed.tensor.DTensor._op_dispatcher.sharding_propagator", "the same", PLAN),
    "_make_wrapper_subclass": Private("torch.Tensor", "pipeline stand-ins: another stage's "
                                      "tensor's metadata on this rank's device, no storage"),
    "_disabled_torch_function_impl": Private("torch._C", "the same: metadata reads stay "
                                             "plain attribute reads"),
    "_HYBRID_SHARD_ZERO2": Private("torch.distributed.fsdp.ShardingStrategy",
                                   "hybrid_shard_degree with SHARD_GRAD_OP"),
    "_allgather_orig_param_states": Private("torch.distributed.fsdp._optim_utils",
                                            "optimizer state of one-rank shard groups"),
    "_allgather_state_info": Private("torch.distributed.fsdp._optim_utils", "the same"),
    "_gather_all_orig_param_state": Private("torch.distributed.fsdp._optim_utils", "the same"),
    "_map_param_key_to_optim_keys": Private("torch.distributed.fsdp._optim_utils",
                                            "optimizer keys of hybrid units"),
    "_init_core_state": Private("torch.distributed.fsdp.fully_sharded_data_parallel",
                                "one-rank shard groups keep a sharded strategy"),
    "_unflatten_optim_state_dict": Private("torch.distributed.checkpoint.state_dict",
                                           "DCP's optimizer state of split parameters"),
    "_get_state_dict_2d_layout": Private("torch.distributed.checkpoint.optimizer", "the same"),
    "_create_chunk_sharded_tensor": Private("torch.distributed.checkpoint.optimizer", "the same"),
    "_materialize_with_param_init_fn": Private("torch.distributed.fsdp._init_utils",
                                               "delayed parameter initialisation"),
    "_check_module_states_for_sync_module_states": Private(
        "torch.distributed.fsdp._init_utils", "sync_module_states on gloo"),
    "_use_unsharded_grad_views": Private("torch.distributed.fsdp._flat_param.FlatParamHandle",
                                         "gradient views on one-rank shards"),
    "_handle": Private("FSDP1 module instances", "FSDP1's flat parameter", FSDP1),
    "_use_orig_params": Private("FSDP1 module instances", "flat or original parameters", FSDP1),
    "_fsdp_extension": Private("FSDP1 module instances", "our state-dict extension", FSDP1),
    "_device_mesh": Private("FSDP1 module instances", "the unit's mesh", FSDP1),
    "_fqns": Private("FlatParameter instances", "what a flat parameter holds", FSDP1),
    "_shapes": Private("FlatParameter instances", "the same", FSDP1),
    "_param_infos": Private("FlatParameter instances", "the same", FSDP1),
    "_shard_param_infos": Private("FlatParameter instances", "the same", FSDP1),
    "_shared_param_infos": Private("FlatParameter instances", "the same", FSDP1),
    "_param_extensions": Private("FlatParameter instances", "the same", FSDP1),
    "_saved_grad_shard": Private("FlatParameter instances", "a gradient gathered on purpose",
                                 FSDP1),
    "_set_params_and_buffers_to_ignore_for_model": Private(
        "torch.nn.parallel.DistributedDataParallel",
        "mp.replicate: DDP leaves the split experts to their FSDP2 units"),
    "_process_group": Private(
        "ShardedTensor instances", "the group torch's sharded optimizer loader chunks an "
        "expert's state over", "tests/distributed/test_expert_parallel_fsdp1_checkpoint.py::"
        "test_fsdp1_sharded_checkpoint_with_expert_parallelism_resumes"),
    "_get_default_group": Private("torch.distributed.distributed_c10d",
                                  "FSDP1's default group vs ours"),
    "_get_default_store": Private("torch.distributed.distributed_c10d",
                                  "the checkpoint guard's store"),
    "_get_metadata_path": Private("torch.distributed.checkpoint.FileSystemReader",
                                  "reading a checkpoint's metadata file safely"),
    "_get_backend": Private("torch.distributed.ProcessGroup", "the default group's timeout"),
    "_flatten": Private("torch.distributed.device_mesh.DeviceMesh",
                        "one mesh dimension for several (no public way in torch 2.13)"),
    "_local_tensor": Private("torch.distributed.tensor.DTensor", "a DTensor's local bytes"),
    "_prepare_input_fn": Private("torch.distributed.tensor.parallel.ColwiseParallel",
                                 "Conv1D under torch's parallel styles"),
    "_prepare_output_fn": Private("torch.distributed.tensor.parallel.ColwiseParallel",
                                  "the same"),
    "_step_microbatches": Private("torch.distributed.pipelining.ScheduleGPipe",
                                  "a schedule's step without its input splitting"),
    "_checkpoint_wrapped_module": Private("CheckpointWrapper instances",
                                          "the module inside torch's activation wrappers"),
    "_amp_foreach_non_finite_check_and_unscale_": Private("torch", "SMP's GradScaler"),
    "_lazy_init_scale_growth_tracker": Private("torch.amp.GradScaler", "the same"),
    "_enabled": Private("torch.amp.GradScaler instances", "the same"),
    "_base": Private("torch.Tensor", "the tensor a view is of (delayed initialisation)"),
    "_parameters": Private("torch.nn.Module instances", "placing parameters in place"),
    "_buffers": Private("torch.nn.Module instances", "the same, buffers"),
    "_forward_hooks": Private("torch.nn.Module instances", "pipeline stubs drop hooks"),
    "_forward_pre_hooks": Private("torch.nn.Module instances", "the same"),
    "_backward_hooks": Private("torch.nn.Module instances", "the same"),
    "_c10d_functional": Private("torch.ops", "functional collectives' ops"),
    "_local_scalar_dense": Private("torch.ops.aten", "the planner answers .item()"),
    "_to_copy": Private("torch.ops.aten", "pipeline stand-ins: a cast or move of another "
                        "stage's tensor (.to(), model.half()) is a stand-in again"),
    "_unsafe_view": Private("torch.ops.aten", "pipeline stand-ins: what reshape of another "
                            "stage's tensor dispatches to is a stand-in again"),
    "_scaled_dot_product_flash_attention": Private("torch.ops.aten", "planner: attention"),
    "_scaled_dot_product_flash_attention_backward": Private("torch.ops.aten", "the same"),
    "_scaled_dot_product_flash_attention_for_cpu": Private("torch.ops.aten", "the same"),
    "_scaled_dot_product_flash_attention_for_cpu_backward": Private("torch.ops.aten",
                                                                    "the same"),
    "_opname": Private("torch._ops.OpOverload", "counting collectives by op"),
    "_overloadpacket": Private("torch._ops.OpOverload", "the planner's op table"),
    # not torch's
    "_getframe": Private("sys", "the doctor records call sites (CPython)"),
    "_current_frames": Private("sys", "the doctor's stack of a stalled rank (CPython)"),
    "_run_exitfuncs": Private("atexit", "a worker ends with its exit handlers run"),
    "_fields": Private("tuple subclasses made by namedtuple", "namedtuple's protocol"),
    "_SubParsersAction": Private("argparse", "the type of add_subparsers()"),
    "_no_split_modules": Private("transformers.PreTrainedModel", "a model's block classes"),
    # the launcher announces torchrun's restarts (launch/restarts.py): overrides, calling
    # torch's own through super()
    "_monitor_workers": Private(
        "torch.distributed.elastic.agent.server.local_elastic_agent.LocalElasticAgent",
        "the result of each check of the workers, kept for the restart's announcement"),
    "_restart_workers": Private(
        "torch.distributed.elastic.agent.server.local_elastic_agent.LocalElasticAgent",
        "a restart of the worker group, announced before torch's own runs"),
    "_grouped_mm": Private("torch.ops.aten", "the planner: mixture-of-experts grouped "
                           "matmuls shaped in any dtype, and their FLOPs"),
    "_experts_implementation": Private("transformers.PretrainedConfig",
                                       "the planner: whether an experts module loops over "
                                       "the experts chosen (no public getter per module)"),
    "_attn_implementation": Private("transformers.PretrainedConfig",
                                    "context parallelism: which attention a model runs "
                                    "(transformers has no public getter)"),
    "_can_record_outputs": Private("transformers.PreTrainedModel",
                                   "the router modules an MoE model records router logits "
                                   "from (the load-balancing loss over ranks; no public "
                                   "declaration)"),
}


def _resolve(dotted: str) -> object:
    parts = dotted.split(".")
    for i in range(len(parts), 0, -1):
        try:
            obj: object = importlib.import_module(".".join(parts[:i]))
        except ImportError:
            continue
        for part in parts[i:]:
            obj = getattr(obj, part)
        return obj
    raise ImportError(dotted)


def _instances() -> dict[str, Callable[[], object]]:
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

    point = type("Point", (tuple,), {"_fields": ()})
    return {
        "torch.nn.Module instances": lambda: torch.nn.Linear(1, 1),
        "torch.amp.GradScaler instances": lambda: torch.amp.GradScaler("cpu"),
        "CheckpointWrapper instances": lambda: checkpoint_wrapper(torch.nn.Linear(1, 1)),
        "torch._ops.OpOverload": lambda: torch.ops.aten.add.Tensor,
        "tuple subclasses made by namedtuple": point,
    }


def test_every_private_name_reached_is_listed_and_every_listed_one_reached():
    used = private_uses()
    listed = set(IMPORTS) | {f".{n}" for n in ATTRIBUTES}
    assert {n: used[n] for n in sorted(set(used) - listed)} == {}, \
        "a private name not in the allow-list (tests/unit/test_private_names.py)"
    assert sorted(listed - set(used)) == [], "listed, no longer used: remove from the list"


def test_the_scanner_finds_private_imports_and_attributes(tmp_path: Path):
    pkg = tmp_path / "pkg"
    pkg.mkdir()
    (pkg / "a.py").write_text(
        "import torch\nimport torch.distributed.fsdp._init_utils as iu\n"
        "from torch.utils._pytree import tree_map\nfrom torch.nn import _reduction\n"
        "class A:\n    def __init__(self):\n        self._own = 1\n"
        "    def f(self, m):\n        m._mp_state = 1\n        return self._own, m._parameters, "
        "torch._C, iu._own, getattr(m, '_handle', None)\n"
        "class B(torch.nn.Module):\n    def _apply(self, fn):\n"
        "        return super()._apply(fn)\n")  # an override of a private method
    assert sorted(private_uses(tmp_path)) == [
        "._C", "._apply", "._handle", "._own", "._parameters",
        "torch.distributed.fsdp._init_utils", "torch.nn._reduction",
        "torch.utils._pytree.tree_map"]


def test_torch_still_has_what_we_reach():
    for name in IMPORTS:
        assert _resolve(name) is not None, name
    instances = _instances()
    missing = []
    for name, private in ATTRIBUTES.items():
        if private.test != HERE:
            continue
        owner = instances[private.owner]() if private.owner in instances \
            else _resolve(private.owner)
        if not (hasattr(owner, name) or name in getattr(owner, "__annotations__", {})):
            missing.append(f"{private.owner}.{name}")
    assert missing == []


@pytest.mark.parametrize("name", sorted(n for n, p in ATTRIBUTES.items() if p.test != HERE))
def test_each_name_checked_elsewhere_is_named_by_its_test(name: str):
    path, _, function = ATTRIBUTES[name].test.partition("::")
    source = (Path(__file__).resolve().parents[2] / path).read_text()
    assert f"def {function}(" in source and name in source


def test_python_and_transformers_privates_are_where_we_reach_them():
    import transformers

    assert callable(sys._getframe) and callable(sys._current_frames)
    assert callable(atexit._run_exitfuncs)
    assert isinstance(argparse.ArgumentParser().add_subparsers(), argparse._SubParsersAction)
    assert hasattr(transformers.PreTrainedModel, "_no_split_modules")
    assert transformers.LlamaConfig(attn_implementation="sdpa")._attn_implementation == "sdpa"
    recorder = transformers.MixtralForCausalLM._can_record_outputs["router_logits"]
    assert recorder.target_class.__name__ == "MixtralTopKRouter" and recorder.index == 0
