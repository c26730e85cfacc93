"""SMP v1's programming model: DistributedModel, DistributedOptimizer, @step, partition."""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Collection, Iterator, Mapping
from typing import Any

import torch
import torch.distributed as dist
import torch.utils._pytree as pytree
from torch import nn
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor, distribute_tensor

from modelparallel.comm import get_process_group
from modelparallel.parallel import replicas
from modelparallel.parallel.blocks import find_blocks
from modelparallel.parallel.clip import clip_grad_norm_
from modelparallel.parallel.pipeline import compose, cut, schedules
from modelparallel.parallel.pipeline import partition as balancing
from modelparallel.parallel.pipeline.microbatch import collect_step_outputs, split_step_inputs
from modelparallel.parallel.pipeline.record import (
    Event,
    ScheduleRecorder,
    ScheduleRecording,
    gather_events,
)
from modelparallel.parallel.pipeline.runtime import (
    Microbatch,
    OutsideStepError,
    StageRunner,
    current_microbatch,
    running_microbatch,
)
from modelparallel.parallel.placement import is_meta
from modelparallel.parallel.precision import HALF, LossScaler
from modelparallel.state import state
from modelparallel.topology import CommGroup

_placement: list[int] = []  # stack of mp.partition(i) contexts
_PARTITION_ATTR = "_mp_partition"


@contextlib.contextmanager
def partition(index: int) -> Iterator[None]:
    """Modules created inside go to pipeline stage ``index`` (SMP v1's ``smp.partition``)."""
    _placement.append(index)
    original = nn.Module.__init__

    def init(self, *args, **kwargs):
        original(self, *args, **kwargs)
        object.__setattr__(self, _PARTITION_ATTR, _placement[-1])

    nn.Module.__init__ = init
    try:
        yield
    finally:
        nn.Module.__init__ = original
        _placement.pop()


def set_partition(module: nn.Module, index: int) -> None:
    """Put ``module`` on pipeline stage ``index``; call before the first step."""
    object.__setattr__(module, _PARTITION_ATTR, index)


class DistributedModel(nn.Module):
    """A model split over the pipeline stages and wrapped for data parallelism.

    At the first ``@mp.step`` call (as SMP v1): with ``pipeline_parallel_degree`` > 1
    one microbatch is traced, the repeated layers are balanced over the stages (or
    placed by ``mp.partition`` / ``mp.set_partition``), and every rank keeps only its
    stage's parameters; every rank takes the values of the first data-parallel rank
    of its stage (scripts may seed each rank differently); then tensor parallelism,
    activation checkpointing (``set_activation_checkpointing``), the precision policy
    (``bf16``/``fp16``) and data parallelism apply to what the rank holds. Call the
    model and ``backward`` only inside a step function.

    ``backward_passes_per_step`` (SMP v1): gradients are accumulated over that many
    step calls and reduced over the data-parallel ranks at the last of them; call the
    optimizer after it.
    """

    _instance: DistributedModel | None = None

    def __init__(self, module: nn.Module, *, backward_passes_per_step: int = 1):
        super().__init__()
        s = state.require("mp.DistributedModel")
        if not (isinstance(backward_passes_per_step, int) and backward_passes_per_step >= 1):
            raise ValueError(f"backward_passes_per_step must be an integer >= 1, got "
                             f"{backward_passes_per_step!r}")
        previous = DistributedModel._instance
        if previous is not None and previous._config is s.config:  # same mp.init()
            raise RuntimeError("only one mp.DistributedModel may exist per process; wrap the "
                               "whole model once")
        self.module = module
        self._config = s.config
        self.partitioned = False
        self._hooks: list[Callable[[DistributedModel, Any], None]] = []
        self._pp = s.topology.pp
        self._split: cut.Split | None = None
        self._trace: cut.Trace | None = None
        self._runners: dict[tuple, StageRunner] = {}
        self._stubs: dict[str, cut.Stub] = {}
        # parameters used on several pipeline ranks: (group of those ranks, names), their
        # gradients are summed over it
        self._shared: list[tuple[dist.ProcessGroup, list[str]]] = []
        # this rank's parameters by name, as wrapped (FSDP's sharded ones, which the
        # optimizer updates, even while FSDP has swapped in gathered ones)
        self._local: dict[str, nn.Parameter] = {}
        self._fsdp: set[int] = set()   # ids of parameters FSDP manages
        self._tp_replicas = False  # the TP ranks hold the model whole: data-parallel replicas
        # gradient accumulation: data-parallel reduction after every n-th training step
        self._passes_per_sync = backward_passes_per_step
        self._passes = 0
        self._shared_before: dict[str, torch.Tensor] = {}  # summed gradients set aside
        self._replaced: dict[int, nn.Parameter] = {}  # old parameter id -> its DTensor
        self._events: list[Event] | None = None  # recorded by record_schedule()
        # mp.resume_from_checkpoint before the split: loads once the rank knows its part
        self._load_after_partition: Callable[[], None] | None = None
        DistributedModel._instance = self

    # -- SMP v1 methods ------------------------------------------------------------
    def forward(self, *args, **kwargs):
        mb = current_microbatch("calling the DistributedModel")
        return mb.call_model(args, kwargs)

    def backward(self, loss: torch.Tensor) -> None:
        """Backward of this microbatch's loss (``loss.backward()`` is not pipelined)."""
        current_microbatch("model.backward()").backward(loss)

    def register_post_partition_hook(self, hook: Callable[[DistributedModel, Any], None]):
        """``hook(model, optimizer)`` runs once the model is partitioned."""
        self._hooks.append(hook)

    def local_named_parameters(self) -> Iterator[tuple[str, nn.Parameter]]:
        yield from self._local.items()

    def local_parameters(self) -> Iterator[nn.Parameter]:
        seen = set()
        for _, p in self.local_named_parameters():
            if id(p) not in seen:
                seen.add(id(p))
                yield p

    def grad_norm_parts(self) -> tuple[list[nn.Parameter], list[nn.Parameter], Any]:
        """For a global gradient norm (``mp.clip_grad_norm_``): the parameters whose
        gradients this rank counts (a parameter several pipeline stages hold counts on
        the first of them), those it holds, and the group adding up the stages (None
        without a pipeline)."""
        held = list(self.local_parameters())
        if self._pp == 1:
            return held, held, None
        s = state.require("mp.clip_grad_norm_")
        params = dict(self.module.named_parameters(remove_duplicate=False))
        elsewhere = {id(params[n]) for group, names in self._shared
                     if dist.get_global_rank(group, 0) != s.rank for n in names}
        counted = [p for p in held if id(p) not in elsewhere]
        return counted, held, get_process_group(CommGroup.PP_GROUP)

    def local_modules(self) -> Iterator[nn.Module]:
        held = self._held_modules()
        for name, m in self.module.named_modules():
            if any(name == h or name.startswith(h + ".") for h in held):
                yield m

    def local_state_dict(self) -> dict[str, torch.Tensor]:
        """This rank's parameters and buffers under the model's own names."""
        params = {n for n, _ in self.module.named_parameters(remove_duplicate=False)}
        return {k: v for k, v in self.module.state_dict().items()
                if k in self._local or (k not in params and not is_meta(v))}

    def state_dict(self, *args, **kwargs) -> dict[str, torch.Tensor]:
        """The full model (every stage's parameters), on every rank, on CPU."""
        local = {k: (v.full_tensor() if isinstance(v, DTensor) else v).detach().cpu()
                 for k, v in self.local_state_dict().items()}  # collective in the stage
        if self._pp == 1:
            return local
        parts: list[Any] = [None] * self._pp
        dist.all_gather_object(parts, local, group=get_process_group(CommGroup.PP_GROUP))
        full = {}
        for part in parts:
            full.update(part)
        return full

    def load_state_dict(self, state_dict: Mapping[str, Any], strict: bool = True):
        """Load a full (or this rank's) state dict; this rank takes what it holds."""
        held = self.local_state_dict()
        mine = {k: v for k, v in state_dict.items() if k in held}
        missing = set(held) - set(mine)
        if strict and missing:
            raise KeyError(f"state dict lacks {sorted(missing)} held by this rank")
        with torch.no_grad():
            current = self.module.state_dict(keep_vars=True)
            for k, v in mine.items():
                target = current[k]
                if isinstance(target, DTensor):  # this rank's shard of the full value
                    v = distribute_tensor(v.to(target.device), target.device_mesh,
                                          target.placements, src_data_rank=None)
                compose.local(target).copy_(compose.local(v))

    @contextlib.contextmanager
    def record_schedule(self) -> Iterator[ScheduleRecording]:
        """Record what every pipeline rank runs in the steps inside (one is best).

        ``with model.record_schedule() as rec: train_step(...)``; afterwards
        ``rec.events`` (forward/backward of which stage and microbatch, start and end),
        ``rec.grid()`` (the rank x time grid as text), ``rec.bubble`` (measured idle
        share) and ``rec.theoretical`` hold every pipeline rank's record. Enter it on
        every rank of the pipeline: leaving it gathers the records.
        """
        s = state.require("model.record_schedule")
        recording = ScheduleRecording(self._pp, s.config.microbatches,
                                      s.config.stages_per_rank)
        self._events = []
        try:
            yield recording
            events = self._events
        finally:
            self._events = None
        recording.events = gather_events(events, group=get_process_group(CommGroup.PP_GROUP))

    def display_partition(self) -> str:
        """The stages, their layers and cost shares, as text (also printed by rank 0)."""
        if self._split is None:
            return "not partitioned yet: the split happens at the first step"
        t = self._trace
        return balancing.describe(self._split.starts, self._split.layers, t.compute, t.memory,
                                  self._split.before, self._split.after,
                                  before=_sum_costs(t.before), after=_sum_costs(t.after))

    # -- the step --------------------------------------------------------------------
    def _run_step(self, microbatches: list[Microbatch]) -> list[Any]:
        s = state.require("mp.step")
        if self._pp == 1:
            if not self.partitioned:  # as SMP v1: wrapping happens at the first step
                found = {id(b) for b in find_blocks(self.module)}
                self._parallelize([n for n, m in self.module.named_modules() if id(m) in found]
                                  + [""])
                self._finish_partition()
            self._before_step()
            results = [self._run_direct(mb, len(microbatches)) for mb in microbatches]
            self._after_step()
            return results
        for mb in microbatches:
            kind, _ = mb.start()
            if kind != "call":
                raise RuntimeError("the step function returned without calling the model")
        if not self.partitioned:
            self._partition(microbatches[0].model_inputs)
        self._before_step()
        train = torch.is_grad_enabled()
        for mb in microbatches:
            mb.scale = self._loss_scale() / len(microbatches)
        key = (train, _signature(microbatches[0].model_inputs), len(microbatches))
        if key not in self._runners:
            c = s.config
            self._runners[key] = StageRunner(
                self.module, self._split, self._stage_ids(), self._stubs,
                get_process_group(CommGroup.PP_GROUP), s.device, c.pipeline,
                schedules.round_size(c.pipeline, len(microbatches), self._pp,
                                     c.active_microbatches), train)
        runner = self._runners[key]
        if self._events is None:
            results = runner.run(microbatches)
        else:
            pp_rank = s.topology.coordinate(s.rank)["pp"]
            with ScheduleRecorder(runner.stages, rank=pp_rank) as recorder:
                results = runner.run(microbatches)
            self._events += recorder.events
        self._after_step()
        return self._from_last_stage(results)

    def _run_direct(self, mb: Microbatch, count: int) -> Any:
        """No pipeline: the step function runs here; backward of loss / microbatches."""
        mb.scale = self._loss_scale() / count
        kind, value = mb.start()
        while kind != "done":
            if kind == "call":
                args, kwargs = mb.model_inputs
                kind, value = mb.resume(("output", self.module(*args, **kwargs)))
            elif kind == "backward":
                (mb.loss.float() * mb.scale).backward()
                kind, value = mb.resume(("continue", None))
        return value

    def _loss_scale(self) -> float:
        """The factor ``model.backward`` multiplies the loss by: the loss scale of the
        DistributedOptimizer's scaler under fp16, else 1."""
        if not torch.is_grad_enabled() or self._config.half_precision != "fp16":
            return 1.0
        optimizer = DistributedOptimizer._instance
        if optimizer is None or optimizer.loss_scaler is None:
            raise RuntimeError("fp16=True needs loss scaling, which mp.DistributedOptimizer "
                               "does: create optimizer = mp.DistributedOptimizer(torch_optimizer) "
                               "after mp.DistributedModel and before the first step")
        return optimizer.loss_scaler.scale_value

    def _from_last_stage(self, results: list[Any] | None) -> list[Any]:
        """SMP: the step's return values are on every rank of the pipeline."""
        s = state.require("mp.step")
        group = get_process_group(CommGroup.PP_GROUP)
        c = s.config
        last_stage = self._pp * c.stages_per_rank - 1
        last = s.topology.group_ranks(s.rank, CommGroup.PP_GROUP)[schedules.rank_of_stage(
            c.pipeline, last_stage, self._pp, c.stages_per_rank)]
        box = [None if results is None else pytree.tree_map(
            lambda t: t.detach().cpu() if isinstance(t, torch.Tensor) else t, results)]
        dist.broadcast_object_list(box, src=last, group=group)
        device = s.device
        return pytree.tree_map(lambda t: t.to(device) if isinstance(t, torch.Tensor) else t,
                               box[0])

    # -- partitioning ----------------------------------------------------------------
    def _partition(self, model_inputs: tuple[tuple, dict]) -> None:
        s = state.require("mp.DistributedModel")
        args, kwargs = model_inputs
        trace = cut.trace(self.module, args, kwargs)
        box = [trace]  # one rank's timings for all: every rank must choose the same split
        dist.broadcast_object_list(box, src=0)
        self._trace = trace = box[0]
        self._split = self._choose_split(trace, s.config)
        held = self._held_modules()
        everything = [*self._split.layers, *self._split.before,
                      *[m for m in self._split.after if m not in self._split.before]]
        half = HALF.get(s.config.half_precision or "")
        self._stubs = {path: cut.Stub(self.module.get_submodule(path), None, half)
                       for path in everything}
        self._shared = self._shared_parameters()
        self._free_other_stages(everything, held)
        # FSDP units: this rank's layers, then its outer modules (root parameters stay)
        layers = [m for m in held if m in self._split.layers]
        self._parallelize([*layers, *[m for m in held if m not in layers]])
        if s.rank == 0:
            print(f"modelparallel: pipeline partition ({s.config.pipeline} schedule)\n"
                  f"{self.display_partition()}", flush=True)
        self._finish_partition()

    def _choose_split(self, trace: cut.Trace, config) -> cut.Split:
        stages = self._pp * config.stages_per_rank
        placed = {path: getattr(self.module.get_submodule(path), _PARTITION_ATTR, None)
                  for path in trace.layers}
        before, after = list(trace.before), list(trace.after)
        outer_placed = lambda names: {  # noqa: E731
            n: getattr(self.module.get_submodule(n), _PARTITION_ATTR)
            for n in names if getattr(self.module.get_submodule(n), _PARTITION_ATTR, None)
            is not None}
        if any(v is not None for v in placed.values()) or not config.auto_partition:
            starts = balancing.manual_starts(list(placed.values()), stages,
                                             config.default_partition, trace.layers)
            balancing.check_outer("before", outer_placed(set(before) - set(trace.shared)), 0)
            balancing.check_outer("after", outer_placed(set(after) - set(trace.shared)),
                                  stages - 1)
        else:
            starts = balancing.balance(trace.compute, trace.memory, stages,
                                       memory_weight=config.effective_memory_weight,
                                       before=_sum_costs(trace.before),
                                       after=_sum_costs(trace.after))
        return cut.Split(trace.layers, starts, before, after)

    def _parallelize(self, units: list[str]) -> None:
        """Tensor parallelism, then FSDP on ``units``; remember replaced parameters."""
        s = state.require("mp.DistributedModel")
        before = dict(self.module.named_parameters(remove_duplicate=False))
        done = compose.parallelize(self.module, units, s)
        self._fsdp, self._tp_replicas = done.fsdp, done.tp_replicas
        after = dict(self.module.named_parameters(remove_duplicate=False))
        self._replaced = {id(before[n]): p for n, p in after.items() if p is not before[n]}
        self._local = {n: p for n, p in after.items() if not is_meta(p)}

    def _free_other_stages(self, everything: list[str], held: list[str]) -> None:
        """Swap the parameters of modules this rank does not hold for meta tensors."""
        held_params = {id(p) for path in held
                       for p in self.module.get_submodule(path).parameters()}
        for path in everything:
            if path in held:
                continue
            for module in self.module.get_submodule(path).modules():
                for name, p in list(module._parameters.items()):
                    if p is not None and id(p) not in held_params:
                        module._parameters[name] = nn.Parameter(
                            torch.empty_like(p, device="meta"), p.requires_grad)
                for name, b in list(module._buffers.items()):
                    if b is not None:
                        module._buffers[name] = torch.empty_like(b, device="meta")

    def _shared_parameters(self) -> list[tuple[dist.ProcessGroup, list[str]]]:
        """Parameters used on more than one pipeline rank (tied across a cut, or the
        model's own, used in its forward), one name per tensor, grouped by the pipeline
        ranks using them, with a process group of those ranks here. The split alone
        decides it, so every rank creates the same groups. Call before freeing."""
        s = state.require("mp.DistributedModel")
        ranks_of: dict[int, set[int]] = {}
        for rank in range(self._pp):
            for path in self._held_modules(rank):
                for p in self.module.get_submodule(path).parameters():
                    ranks_of.setdefault(id(p), set()).add(rank)
        by_ranks: dict[tuple[int, ...], list[str]] = {}
        for name, p in self.module.named_parameters():  # tied: first name only
            holders = tuple(sorted(ranks_of.get(id(p), range(self._pp))))
            if len(holders) > 1:
                by_ranks.setdefault(holders, []).append(name)
        shared = []
        for holders, names in by_ranks.items():
            for ranks in s.topology.all_groups(CommGroup.PP_GROUP):  # every rank, same order
                group = dist.new_group([ranks[i] for i in holders], timeout=s.collective_timeout)
                if s.rank in ranks and s.topology.coordinate(s.rank)["pp"] in holders:
                    shared.append((group, names))
        return shared

    def _sync_gradients(self) -> None:
        """Sum the gradients of parameters several pipeline ranks use over those ranks;
        average the rest over the data-parallel replicas (with the tensor-parallel ranks
        when they hold the model whole) unless FSDP did."""
        s = state.require("mp.step")
        params = dict(self.module.named_parameters(remove_duplicate=False))
        for group, names in self._shared:
            _all_reduce_grads([params[n] for n in names], group)
        for name, before in self._shared_before.items():  # what earlier steps summed
            params[name].grad = before if params[name].grad is None else \
                params[name].grad + before
        self._shared_before = {}
        group = replicas.data_parallel_group(s, self._tp_replicas)
        size = dist.get_world_size(group)
        if size > 1:
            held = [p for p in self.local_parameters() if id(p) not in self._fsdp]
            _all_reduce_grads(held, group, 1 / size)

    def _syncs_this_step(self) -> bool:
        """Whether this training step ends a run of ``backward_passes_per_step``."""
        return (self._passes + 1) % self._passes_per_sync == 0

    def _before_step(self) -> None:
        """Set gradients that already hold a sum over pipeline ranks aside, so that a step
        that accumulates onto them sums only its own part. FSDP reduces gradients in
        backward: only on the steps that synchronize."""
        if not torch.is_grad_enabled():
            return
        if self._passes % self._passes_per_sync == 0:  # a run of passes starts
            params = dict(self.module.named_parameters(remove_duplicate=False))
            for _, names in self._shared:
                for name in names:
                    if params[name].grad is not None:
                        self._shared_before[name] = params[name].grad
                        params[name].grad = None
        if self._passes_per_sync > 1:
            sync = self._syncs_this_step()
            for module in self.module.modules():
                if isinstance(module, FSDPModule):
                    module.set_requires_gradient_sync(sync, recurse=False)

    def _after_step(self) -> None:
        """Training: synchronize gradients (every ``backward_passes_per_step`` steps).
        Evaluation: FSDP keeps a root unit's parameters gathered after forward, for a
        backward that never comes; free them."""
        if torch.is_grad_enabled():
            if self._syncs_this_step():
                self._sync_gradients()
            self._passes += 1
            return
        for module in self.module.modules():
            if isinstance(module, FSDPModule):
                module.reshard()

    def _finish_partition(self) -> None:
        self.partitioned = True
        if self._load_after_partition is not None:
            load, self._load_after_partition = self._load_after_partition, None
            load()
        for hook in self._hooks:
            hook(self, DistributedOptimizer._instance)

    def _stage_ids(self, pp_rank: int | None = None) -> list[int]:
        """The pipeline stages a pipeline rank (default: this one) holds."""
        s = state.require("mp.DistributedModel")
        rank = s.topology.coordinate(s.rank)["pp"] if pp_rank is None else pp_rank
        return schedules.stages_of_rank(s.config.pipeline, rank, self._pp,
                                        s.config.stages_per_rank)

    def _held_modules(self, pp_rank: int | None = None) -> list[str]:
        if self._split is None:
            return [""]
        held: list[str] = []
        for stage in self._stage_ids(pp_rank):
            held += [m for m in self._split.modules_of(stage) if m not in held]
        return held


def _all_reduce_grads(params: list[nn.Parameter], group, scale: float = 1.0) -> None:
    """Sum (times ``scale``) this rank's part of the parameters' gradients over ``group``,
    as one flat tensor. A parameter this rank's step did not use (a model parameter read
    before the first layer, on a later pipeline stage) joins with a zero gradient: every
    rank must pass the same sizes, and the others' gradients are its too."""
    params = [p for p in params if p.requires_grad]
    for p in params:  # e.g. a vocab-parallel embedding's gradient comes back replicated
        if p.grad is None:
            p.grad = torch.zeros_like(p)
        elif isinstance(p.grad, DTensor) and p.grad.placements != p.placements:
            p.grad = p.grad.redistribute(p.device_mesh, p.placements)
    grads = [compose.local(p.grad) for p in params]
    if not grads:
        return
    flat = torch.cat([g.reshape(-1) for g in grads])
    dist.all_reduce(flat, group=group)
    if scale != 1.0:
        flat *= scale
    offset = 0
    for g in grads:
        g.copy_(flat[offset:offset + g.numel()].view_as(g))
        offset += g.numel()


def _sum_costs(costs: dict[str, tuple[float, float]]) -> tuple[float, float]:
    return (sum(c for c, _ in costs.values()), sum(m for _, m in costs.values()))


def _signature(model_inputs: tuple[tuple, dict]) -> tuple:
    return tuple((tuple(t.shape), t.dtype) if isinstance(t, torch.Tensor) else type(t).__name__
                 for t in pytree.tree_leaves(model_inputs))


class DistributedOptimizer:
    """An optimizer over exactly the parameters this rank holds after partitioning.

    Create it after ``DistributedModel`` and before the first step, from an optimizer
    over ``model.parameters()``; parameters other stages hold are dropped at the split.
    With ``fp16`` it scales the loss (``model.backward`` multiplies by the scale) with a
    dynamic :class:`~modelparallel.parallel.precision.LossScaler` (``loss_scaler``, or
    the one passed in):
    ``step()`` unscales, skips a step whose gradients overflowed on any rank
    (``overflow`` says so) and adapts the scale; the scaler's state is part of
    ``state_dict()``. With ``sharded_data_parallel_degree`` > 1 ``step()`` first clips
    the gradients to the global norm ``sdp_gradient_clipping`` (0 disables), as SMP v1's
    sharded data parallelism does.
    """

    _instance: DistributedOptimizer | None = None

    def __init__(self, optimizer: torch.optim.Optimizer, *, loss_scaler: LossScaler | None = None):
        s = state.require("mp.DistributedOptimizer")
        self.optimizer = optimizer
        self._filtered = False
        if loss_scaler is not None and s.config.half_precision != "fp16":
            raise ValueError("a loss_scaler is for fp16=True; the configuration trains in "
                             f"{s.config.half_precision or 'fp32'}, which needs none")
        if s.config.half_precision == "fp16" and loss_scaler is None:
            loss_scaler = LossScaler()
        self.loss_scaler = loss_scaler
        DistributedOptimizer._instance = self

    @property
    def overflow(self) -> bool:
        """Whether the last step's gradients overflowed (and the step was skipped)."""
        return self.loss_scaler is not None and self.loss_scaler.overflow

    def _filter(self) -> None:
        model = DistributedModel._instance
        if self._filtered or model is None or not model.partitioned:
            return
        held = {id(p) for p in model.local_parameters()}
        for group in self.optimizer.param_groups:  # tensor/data parallelism replaced some
            params = [model._replaced.get(id(p), p) for p in group["params"]]
            group["params"] = [p for p in params if id(p) in held]
        self._filtered = True

    def step(self, *args, **kwargs):
        self._filter()
        c = state.require("mp.DistributedOptimizer.step").config
        if self.loss_scaler is not None and self.loss_scaler.unscale_(self.optimizer):
            self.loss_scaler.update()  # skipped: the gradients overflowed somewhere
            return None
        model = DistributedModel._instance
        if c.sharded_data_parallel_degree > 1 and c.sdp_gradient_clipping > 0:
            clip_grad_norm_(model if model is not None else self._params(),
                            c.sdp_gradient_clipping)
        result = self.optimizer.step(*args, **kwargs)
        if self.loss_scaler is not None:
            self.loss_scaler.update()
        return result

    def _params(self) -> list[torch.Tensor]:
        return [p for group in self.optimizer.param_groups for p in group["params"]]

    def zero_grad(self, set_to_none: bool = True) -> None:
        self._filter()
        self.optimizer.zero_grad(set_to_none=set_to_none)

    def local_state_dict(self) -> dict[str, Any]:
        self._filter()
        sd = self.optimizer.state_dict()
        if self.loss_scaler is not None:
            sd["loss_scaler"] = self.loss_scaler.state_dict()
        return sd

    def state_dict(self) -> list[dict[str, Any]]:
        """Every pipeline stage's optimizer state (SMP gathers them), stage order."""
        s = state.require("mp.DistributedOptimizer")
        local = self.local_state_dict()
        if s.topology.pp == 1:
            return [local]
        parts: list[Any] = [None] * s.topology.pp
        dist.all_gather_object(parts, local, group=get_process_group(CommGroup.PP_GROUP))
        return parts

    def load_state_dict(self, state_dict) -> None:
        self._filter()
        if isinstance(state_dict, list):
            s = state.require("mp.DistributedOptimizer")
            state_dict = state_dict[s.topology.coordinate(s.rank)["pp"]]
        state_dict = dict(state_dict)
        scaler = state_dict.pop("loss_scaler", None)
        if scaler is not None and self.loss_scaler is not None:
            self.loss_scaler.load_state_dict(scaler)
        self.optimizer.load_state_dict(state_dict)

    def __getattr__(self, name: str):
        return getattr(self.optimizer, name)


def step(fn: Callable | None = None, *, non_split_inputs: Collection[str] = (),
         input_split_axes: Mapping[str, int] | None = None, detach_outputs: bool = True):
    """Decorate the function holding one forward and backward (SMP v1's ``smp.step``).

    Its tensor arguments are split into ``microbatches`` along the batch axis; the
    function runs once per microbatch; what it returns comes back as ``StepOutput``
    (per position of a returned tuple) on every rank of the pipeline.
    """

    def decorate(fn: Callable) -> Callable:
        @functools.wraps(fn)
        def run(*args, **kwargs):
            model = DistributedModel._instance
            if model is None:
                raise RuntimeError("create mp.DistributedModel(model) before calling a "
                                   "@mp.step function")
            if running_microbatch() is not None:
                raise RuntimeError("@mp.step functions cannot call each other")
            s = state.require("mp.step")
            pieces = split_step_inputs(fn, args, kwargs, s.config.microbatches,
                                       non_split_inputs=non_split_inputs,
                                       input_split_axes=input_split_axes)
            mbs = [Microbatch(i, fn, a, k) for i, (a, k) in enumerate(pieces)]
            results = model._run_step(mbs)
            if detach_outputs:
                results = pytree.tree_map(
                    lambda t: t.detach() if isinstance(t, torch.Tensor) else t, results)
            return collect_step_outputs(results)

        return run

    return decorate(fn) if fn is not None else decorate


__all__ = ["DistributedModel", "DistributedOptimizer", "OutsideStepError", "partition",
           "set_partition", "step"]
