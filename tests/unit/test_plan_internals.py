"""What the planner takes from torch beyond its public API (``plan/fake_world.py``):
each test fails if torch changes the piece the planner relies on."""

import inspect

import pytest
import torch
import torch.distributed as dist
from torch._subclasses.fake_tensor import FakeTensorMode

from modelparallel.plan.fake_world import (
    KNOWN_INTEGERS,
    PlanError,
    ScalarPolicy,
    fake_process_group,
    fake_tensors,
)
from modelparallel.plan.tracker import StepTracker


def test_peak_tracker_counts_storages_until_freed_and_storage_resizes():
    with FakeTensorMode(), StepTracker() as tracker:
        a = torch.empty(1000)          # 4000 bytes
        b = torch.empty(2000)          # 8000: 12000 live
        view = a[10:]                  # a view allocates nothing
        del a, view                    # 8000 live
        c = torch.empty(500)           # 10000 live
        b.untyped_storage().resize_(0)  # FSDP2's free: 2000 live (no operation is dispatched)
        b.untyped_storage().resize_(800)  # 2800
        meta = torch.empty(10**6, device="meta")  # meta tensors take no memory
    assert tracker.peak == 12000 and tracker.live == 2800
    del b, c, meta


def test_tracker_restarts_its_peak_from_what_is_live():
    with FakeTensorMode():
        tracker = StepTracker()
        with tracker:
            kept = torch.empty(250)    # 1000 bytes
            gone = torch.empty(1000)
            del gone
        with tracker:
            torch.empty(100)           # 400 more, freed at once
        assert tracker.peak == 1400 and kept.numel() == 250


def test_scalar_policy_answers_a_healthy_step_and_refuses_other_integers():
    with FakeTensorMode(), ScalarPolicy():
        assert torch.isinf(torch.ones(2)).any().item() is False  # no overflow
        assert torch.ones(()).item() == 1.0
        with pytest.raises(PlanError, match="cannot know"):
            torch.ones((), dtype=torch.int64).item()
    assert torch.tensor(7).item() == 7  # real tensors are untouched outside


def test_pipeline_warmup_vote_is_where_the_planner_answers_it():
    from torch.distributed.pipelining import schedules

    (suffix, function), = (k for k in KNOWN_INTEGERS if k[0].startswith("torch/"))
    assert schedules.__file__.endswith(suffix)
    source = inspect.getsource(getattr(schedules.PipelineScheduleSingle, function))
    assert "result.item() == 1" in source and "InferenceMode.STATIC" in source


def test_meshes_build_under_fake_tensors_and_dtensor_caches_clear():
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor._redistribute import _gen_transform_infos

    assert hasattr(torch._C, "_clear_DTensor_sharding_propagator_cache")
    propagator = DTensor._op_dispatcher.sharding_propagator
    assert callable(propagator.propagate_op_sharding.cache_clear)
    assert callable(propagator._propagate_tensor_meta_cached.cache_clear)
    assert callable(_gen_transform_infos.cache_clear)
    with fake_process_group(1, 4):
        assert dist.get_rank() == 1 and dist.get_world_size() == 4
        mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("a", "b"))
        with fake_tensors():
            sub = mesh["a", "b"]["b"]  # slicing builds meshes, which reads rank tensors
            assert sub.get_local_rank() == 1
    assert not dist.is_initialized()


def test_cpu_attention_is_counted_with_the_gpu_kernels_formula():
    import torch.nn.functional as F
    from torch.utils.flop_counter import FlopCounterMode

    def attention() -> None:
        q, k, v = (torch.randn(2, 4, 64, 32, requires_grad=True) for _ in range(3))
        F.scaled_dot_product_attention(q, k, v, is_causal=True).sum().backward()

    with FlopCounterMode(display=False) as torch_counter:
        attention()
    assert torch_counter.get_total_flops() == 0, "torch counts CPU attention now: use it"
    with FakeTensorMode(), StepTracker() as tracker:
        attention()
    forward = 4 * 2 * 4 * 64 * 64 * 32  # two matmuls of (s x d) by (d x s), 2 FLOPs each
    assert tracker.flops == forward * 7 // 2  # backward: 2.5 times the forward


def test_gloo_runs_a_groups_work_on_the_threads_the_tracker_assumes():
    from modelparallel.plan.tracker import GLOO_THREADS

    assert dist.ProcessGroupGloo._Options()._threads == GLOO_THREADS


def test_the_unused_parameter_flags_are_where_the_planner_answers_them():
    from modelparallel.parallel import unused_grads

    (suffix, function), = (k for k in KNOWN_INTEGERS if k[0].startswith("modelparallel/"))
    assert unused_grads.__file__.endswith(suffix)
    assert ".tolist()" in inspect.getsource(getattr(unused_grads.UnusedGradients, function))


def test_a_functional_collective_on_a_value_made_fake_runs_on_fake_tensors_only():
    # torch's fake tensors run an operation on constants for real when every input
    # carries one: a collective would leave its work in torch's registry of unwaited work
    functional = torch.ops._c10d_functional
    registered = torch._C._distributed_c10d._get_work_registry_size
    with fake_process_group(0, 2):
        before = registered()
        with fake_tensors():
            rows = torch.tensor([4])  # a value made fake: torch keeps it as a constant
            gathered = functional.wait_tensor(functional.all_gather_into_tensor(
                rows, 2, dist.group.WORLD.group_name))  # as DTensor gathers
        assert gathered.shape == (2,) and rows.constant is not None
        assert registered() == before, "a collective ran on the fake backend for real"
