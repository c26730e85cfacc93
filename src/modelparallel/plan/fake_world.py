"""One rank of a job, simulated in this process: a fake process group (torch's ``fake``
backend: collectives return at once and move nothing) and fake tensors (shapes, dtypes
and storages without memory). Everything that reaches into torch beyond its public API
for the planner is here, each piece with the reason:

- ``DeviceMesh`` computes a rank's coordinates with ``nonzero`` on its rank tensor; FSDP2
  makes new meshes while it shards (``_init_sharding_spec_tp``), which under fake
  tensors has no answer. Mesh construction runs with the fake mode unset
  (``unset_fake_temporarily``). A mesh keeps real CPU tensors of its ranks (16 bytes
  for 2 ranks), which a CPU run holds with its other tensors: ``StepTracker`` counts
  what is made while ``building_mesh()``.
- Values a real step reads back (``.item()``: an optimizer's step count, a loss
  scaler's overflow flag) do not exist under fake tensors. ``ScalarPolicy`` answers
  with the value of a healthy step (no overflow, a count of 1), answers the integers
  of ``KNOWN_INTEGERS`` (torch's pipeline warm-up vote: every stage knows its shapes,
  our engine's stages leave it to torch) and the flags of ``KNOWN_FLAGS`` (no parameter
  on the meta device), and refuses other integers, naming the line that asked.
- Object collectives are carried between the simulated ranks (``plan/mailbox.py``).
- A fake tensor of one element made from a value (``torch.tensor([rows])``) carries
  that value as a constant, and the fake mode runs an operation whose inputs are all
  constants for real: a functional collective would run on the fake backend and leave
  its work in torch's registry (its output, more than one element, is no constant: no
  wait reaches the real one), which torch reports at exit as "unwaited collective
  calls". ``ScalarPolicy`` hides the constants from functional collectives: their
  outputs depend on other ranks' values, which a simulated rank does not have.
- DTensor caches sharding decisions by mesh, and meshes compare equal by layout: the
  next simulated rank's identical mesh would find the previous rank's (with its
  destroyed groups). ``fake_process_group`` clears those caches when a rank ends.
- DTensor works out an operation's output shape by running it on fake tensors of the
  global shapes, in the fake mode it finds active (``detect_fake_mode``): the planner's,
  whose ``StepTracker`` would count those global-shape tensors as the step's memory
  (on each operation's first run, before DTensor caches the answer). In training that
  propagation runs in a fake mode of its own and allocates nothing;
  ``_propagation_outside_fake_mode`` runs it with the planner's mode unset, so it gets
  one of its own here too.
- torch's shape function for ``_grouped_mm`` (transformers 5's default experts
  computation) checks the CUDA kernel's rule, bfloat16 only; the CPU kernel, which a CPU
  run calls, computes float32 too. ``GroupedMatmulShapes`` asks it for the shape in
  bfloat16 and makes the output in the run's dtype.
- ``StepTracker`` (``plan/tracker.py``) wraps ``UntypedStorage.resize_``, which no
  dispatch mode sees and FSDP2 frees and refills parameter storage with.

``tests/unit/test_plan_internals.py`` fails if torch changes any of these.
"""

from __future__ import annotations

import contextlib
import contextvars
import traceback
from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist
import torch.utils._pytree as pytree
from torch._subclasses.fake_tensor import (
    DataDependentOutputException,
    DynamicOutputShapeException,
    FakeTensor,
    FakeTensorMode,
    is_fake,
    unset_fake_temporarily,
)
from torch.distributed.device_mesh import DeviceMesh
from torch.utils._python_dispatch import TorchDispatchMode

__all__ = [
    "GROUPED_MM",
    "VALUE_DEPENDENT_SHAPES",
    "GroupedMatmulShapes",
    "NotYetSent",
    "PlanError",
    "ScalarPolicy",
    "building_mesh",
    "fake_process_group",
    "fake_tensors",
    "forget_sharding_caches",
    "group_or_world",
    "is_fake",
    "unset_fake_temporarily",
    "user_line",
]


# what fake tensors raise for an operation whose output depends on values (nonzero,
# a boolean mask's index): no shape without running it
VALUE_DEPENDENT_SHAPES = (DynamicOutputShapeException, DataDependentOutputException)


class PlanError(RuntimeError):
    """The planner cannot simulate this model or layout (the message says where)."""


class NotYetSent(PlanError):
    """A rank needs an object from a rank the planner has not simulated yet."""


@contextlib.contextmanager
def fake_process_group(rank: int, world_size: int) -> Iterator[None]:
    """The default process group of ``rank`` in a job of ``world_size`` processes."""
    if dist.is_initialized():
        raise PlanError("the planner runs outside a job: a process group already exists")
    dist.init_process_group("fake", rank=rank, world_size=world_size)
    try:
        yield
    finally:
        dist.destroy_process_group()
        forget_sharding_caches()


def forget_sharding_caches() -> None:
    """Forget DTensor's sharding decisions (they hold the meshes they were made on)."""
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor._redistribute import _gen_transform_infos

    torch._C._clear_DTensor_sharding_propagator_cache()  # the C++ dispatch's cache
    propagator = DTensor._op_dispatcher.sharding_propagator
    propagator.propagate_op_sharding.cache_clear()
    propagator._propagate_tensor_meta_cached.cache_clear()
    _gen_transform_infos.cache_clear()


# (file suffix, function) reading an integer -> the value a healthy step reads there
KNOWN_INTEGERS = {
    # our stages are built without example shapes: torch infers them (DYNAMIC, 0)
    ("torch/distributed/pipelining/schedules.py", "_warmup_p2p"): 0,
    # FSDP's per-step flags of parameters used: every rank used every one
    ("modelparallel/parallel/unused_grads.py", "settle"): 1,
}
# (file suffix, function) reading a floating flag -> what the planner's model gives there
KNOWN_FLAGS = {
    # whether a rank holds parameters on the meta device: the planner builds every one
    # as a fake tensor of its shape, on the run's device
    ("modelparallel/parallel/delayed_init.py", "held_anywhere"): 0.0,
}


class ScalarPolicy(TorchDispatchMode):
    """Answer a fake tensor's ``.item()`` as a healthy training step would, and run
    functional collectives on fake tensors only (never on their constants)."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.namespace == "_c10d_functional":
            with _constants_hidden(pytree.tree_leaves((args, kwargs))):
                return func(*args, **(kwargs or {}))
        if func is torch.ops.aten._local_scalar_dense.default and is_fake(args[0]):
            dtype = args[0].dtype
            if dtype == torch.bool:
                return False  # no overflow, no non-finite gradient
            stack = traceback.extract_stack()
            if dtype.is_floating_point:
                return _known(stack, KNOWN_FLAGS, default=1.0)
            value = _known(stack, KNOWN_INTEGERS)
            if value is not None:
                return value
            raise PlanError("the step reads an integer from a tensor, which the planner "
                            f"cannot know without running it, at {user_line(stack)}")
        return func(*args, **(kwargs or {}))


def _known(stack: traceback.StackSummary, known: dict[tuple[str, str], Any],
           default: Any = None) -> Any:
    """The value ``known`` gives the innermost frame of ``stack`` it names, else ``default``."""
    for frame in reversed(stack):
        for (suffix, function), value in known.items():
            if frame.filename.endswith(suffix) and frame.name == function:
                return value
    return default


# the grouped matmul of mixture-of-experts layers (transformers 5's default experts kernel)
GROUPED_MM = torch.ops.aten._grouped_mm


class GroupedMatmulShapes(TorchDispatchMode):
    """``_grouped_mm`` on fake tensors of any floating dtype: the output torch's shape
    function gives for bfloat16 inputs of the same shapes and strides, in the inputs'
    dtype (or the ``out_dtype`` asked for)."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = dict(kwargs or {})
        if func is not GROUPED_MM.default or not is_fake(args[0]) \
                or args[0].dtype == torch.bfloat16:
            return func(*args, **kwargs)
        a, b, *rest = args
        named = dict(zip(("offs", "bias", "out_dtype"), rest, strict=False)) | kwargs
        out_dtype = named.pop("out_dtype", None)
        like = {k: torch.empty_strided(t.shape, t.stride(), dtype=torch.bfloat16,
                                       device=t.device) if isinstance(t, torch.Tensor)
                and t.is_floating_point() else t for k, t in (("a", a), ("b", b), *named.items())}
        shape = func(like.pop("a"), like.pop("b"), **like).shape
        return torch.empty(shape, dtype=out_dtype or a.dtype, device=a.device)


@contextlib.contextmanager
def _constants_hidden(leaves: list[Any]) -> Iterator[None]:
    """The fake tensors among ``leaves`` without the constants they carry, while inside."""
    held = [(t, t.constant) for t in leaves
            if isinstance(t, FakeTensor) and t.constant is not None]
    for t, _ in held:
        t.constant = None
    try:
        yield
    finally:
        for t, constant in held:
            t.constant = constant


def user_line(stack: traceback.StackSummary) -> str:
    """The innermost frame of ``stack`` outside torch and the planner, as file:line: code."""
    frames = [f for f in stack if "/torch/" not in f.filename and "/plan/" not in f.filename
              and not f.filename.endswith("parallel/dataflow.py")]
    if not frames:
        return "an unknown line"
    return f"{frames[-1].filename}:{frames[-1].lineno}: {frames[-1].line}"


_BUILDING_MESH = contextvars.ContextVar("building_mesh", default=False)


def building_mesh() -> bool:
    """Whether a device mesh is being built (outside the fake mode) right now."""
    return _BUILDING_MESH.get()


@contextlib.contextmanager
def _meshes_outside_fake_mode() -> Iterator[None]:
    original = DeviceMesh.__init__

    def init(self: DeviceMesh, *args: Any, **kwargs: Any) -> None:
        building = _BUILDING_MESH.set(True)
        try:
            with unset_fake_temporarily():
                original(self, *args, **kwargs)
        finally:
            _BUILDING_MESH.reset(building)

    DeviceMesh.__init__ = init  # type: ignore[method-assign]
    try:
        yield
    finally:
        DeviceMesh.__init__ = original  # type: ignore[method-assign]


@contextlib.contextmanager
def _propagation_outside_fake_mode() -> Iterator[None]:
    from torch.distributed.tensor._sharding_prop import ShardingPropagator

    original = ShardingPropagator._propagate_tensor_meta_non_cached

    def propagate(self: ShardingPropagator, op_schema: Any) -> Any:
        with unset_fake_temporarily():  # it makes a fake mode of its own, as in training
            return original(self, op_schema)

    ShardingPropagator._propagate_tensor_meta_non_cached = propagate  # type: ignore[method-assign]
    try:
        yield
    finally:
        ShardingPropagator._propagate_tensor_meta_non_cached = original  # type: ignore[method-assign]


@contextlib.contextmanager
def fake_tensors() -> Iterator[FakeTensorMode]:
    """Fake tensors for everything created inside (real tensors passed in are
    converted), device meshes built as usual, DTensor's shape propagation in a fake
    mode of its own, ``.item()`` answered and ``_grouped_mm`` shaped in any dtype."""
    mode = FakeTensorMode(allow_non_fake_inputs=True)
    with _meshes_outside_fake_mode(), _propagation_outside_fake_mode(), mode, ScalarPolicy(), \
            GroupedMatmulShapes():
        yield mode


def group_or_world(group: Any) -> dist.ProcessGroup:
    """``group``, or the default group for None."""
    found = group or dist.group.WORLD
    assert found is not None, "the fake process group is gone"
    return found
