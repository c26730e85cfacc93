"""SMP v1's ``DistributedModel`` and ``smp.partition``: the facade over the PipelineEngine."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor, Shard, distribute_tensor

from modelparallel.errors import ConfigError
from modelparallel.module_state import state_of
from modelparallel.observe.run_output import write_schedule
from modelparallel.parallel.pipeline.engine import PipelineEngine
from modelparallel.parallel.pipeline.record import ScheduleRecording, gather_events
from modelparallel.parallel.pipeline.runtime import current_microbatch
from modelparallel.smp import registry
from modelparallel.smp.state import state
from modelparallel.smp.v1 import tensor_parallelism, tp_register
from modelparallel.smp.v1.distributed_model_options import ModelOptions, broadcast_buffers
from modelparallel.topology import CommGroup

_placement: list[int] = []  # stack of mp.partition(i) contexts


@contextlib.contextmanager
def partition(index: int) -> Iterator[None]:
    """Modules created inside go to pipeline stage ``index`` (SMP v1's ``smp.partition``)."""
    _placement.append(index)
    original = nn.Module.__init__

    def init(self: nn.Module, *args: Any, **kwargs: Any) -> None:
        original(self, *args, **kwargs)
        state_of(self).partition = _placement[-1]

    nn.Module.__init__ = init  # type: ignore[method-assign]
    try:
        yield
    finally:
        nn.Module.__init__ = original  # type: ignore[method-assign]
        _placement.pop()


def set_partition(module: nn.Module, index: int) -> None:
    """Put ``module`` on pipeline stage ``index``; call before the first step."""
    state_of(module).partition = index


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
    optimizer after it. The other arguments of SMP v1's signature:
    ``average_grads_across_microbatches=False`` sums the microbatches' gradients;
    ``broadcast_buffers`` (default True) gives the replicas data-parallel rank 0's
    buffers at every training step, as DDP; the rest log one line saying why they have
    no effect here (:mod:`~modelparallel.smp.v1.distributed_model_options`).
    """

    def __init__(self, module: nn.Module, trace_device: str = "gpu",
                 trace_execution_times: bool = False, trace_memory_usage: bool = False,
                 overlapping_allreduce: bool = True, backward_passes_per_step: int = 1,
                 average_grads_across_microbatches: bool = True, bucket_cap_mb: float = 25,
                 find_unused_parameters: bool = False, broadcast_buffers: bool = True,
                 gradient_as_bucket_view: bool = False):
        super().__init__()
        ctx = state.require("mp.DistributedModel").context
        if ctx.topology.cp > 1:
            raise ConfigError([("context_parallel_degree", (
                f"{ctx.topology.cp}: context parallelism is SMP v2's (tsm.transform, then "
                "FSDP or mp.shard); mp.DistributedModel (SMP v1) does not split sequences. "
                "Set context_parallel_degree to 1"))])
        if ctx.topology.ep > 1:
            raise ConfigError([("expert_parallel_degree", (
                f"{ctx.topology.ep}: expert parallelism is SMP v2's (tsm.transform with a "
                "MoEConfig, then mp.shard); mp.DistributedModel (SMP v1) does not split "
                "experts. Set expert_parallel_degree to 1"))])
        self.options = ModelOptions(
            trace_device, trace_execution_times, trace_memory_usage, overlapping_allreduce,
            backward_passes_per_step, average_grads_across_microbatches, bucket_cap_mb,
            find_unused_parameters, broadcast_buffers, gradient_as_bucket_view)
        self.options.check(ctx)
        if registry.model() is not None:  # one per mp.init()
            raise RuntimeError("only one mp.DistributedModel may exist per process; wrap the "
                               "whole model once")
        module = tp_register.replace_marked(module)  # SMP's distributed modules (GPT-2, ...)
        tensor_parallelism.in_place(tp_register.unreplaced_with_options(module))
        self.module = module
        self.engine = PipelineEngine(module, ctx, passes_per_sync=backward_passes_per_step,
                                     loss_scale=self._loss_scale,
                                     on_partitioned=self._finish_partition)
        self._hooks: list[Callable[[DistributedModel, Any], None]] = []
        self._post_step_hooks: list[Callable[[Any, Any], None]] = []
        # mp.resume_from_checkpoint before the split: loads once the rank knows its part
        self._load_after_partition: Callable[[], None] | None = None
        registry.set_model(self)

    # -- SMP v1 methods ------------------------------------------------------------
    def forward(self, *args: Any, **kwargs: Any) -> Any:
        mb = current_microbatch("calling the DistributedModel")
        if self.options.broadcast_buffers and mb.index == 0 and self.partitioned \
                and torch.is_grad_enabled() and self.module.training:
            broadcast_buffers(self.module, self.engine.ctx)  # every rank calls the model
        return mb.call_model(args, kwargs)

    def get_module(self) -> nn.Module:
        """The wrapped model (SMP v1), parameters under their own names."""
        return self.module

    def backward(self, loss: torch.Tensor) -> None:
        """Backward of this microbatch's loss (``loss.backward()`` is not pipelined)."""
        current_microbatch("model.backward()").backward(loss)

    @property
    def partitioned(self) -> bool:
        """Whether the model has been split (at the first step)."""
        return self.engine.partitioned

    def register_post_partition_hook(self,
                                     hook: Callable[[DistributedModel, Any], None]) -> None:
        """``hook(model, optimizer)`` runs once the model is partitioned."""
        self._hooks.append(hook)

    def local_named_parameters(self) -> Iterator[tuple[str, nn.Parameter]]:
        yield from self.engine.local.items()

    def local_parameters(self) -> Iterator[nn.Parameter]:
        yield from self.engine.local_parameters()

    def grad_norm_parts(self) -> tuple[list[nn.Parameter], list[nn.Parameter], Any]:
        """For a global gradient norm (``mp.clip_grad_norm_``): the parameters whose
        gradients this rank counts (a parameter several pipeline stages hold counts on
        the first of them), those it holds, and the group adding up the stages (None
        without a pipeline)."""
        return self.engine.grad_norm_parts()

    def local_modules(self) -> Iterator[nn.Module]:
        yield from self.engine.local_modules()

    def local_state_dict(self) -> dict[str, torch.Tensor]:
        """This rank's parameters and buffers under the model's own names."""
        return self.engine.local_state_dict()

    # -- what this rank holds, and what tensor parallelism split ---------------------
    def local_named_modules(self) -> Iterator[tuple[str, nn.Module]]:
        """The modules of this rank's pipeline stage, by their names in the model."""
        held = {id(m) for m in self.local_modules()}
        for name, module in self.module.named_modules():
            if id(module) in held:
                yield name, module

    def local_named_buffers(self) -> Iterator[tuple[str, torch.Tensor]]:
        for name, module in self.local_named_modules():
            for own, buffer in module.named_buffers(recurse=False):
                yield f"{name}.{own}" if name else own, buffer

    def local_buffers(self) -> Iterator[torch.Tensor]:
        for _, buffer in self.local_named_buffers():
            yield buffer

    def distributed_modules(self) -> Iterator[nn.Module]:
        """The modules whose own parameters tensor parallelism split."""
        for module in self.module.modules():
            if any(_split_by_tp(p) for p in module.parameters(recurse=False)):
                yield module

    def is_distributed_parameter(self, param: torch.Tensor) -> bool:
        """Whether tensor parallelism split ``param`` over the tensor-parallel ranks."""
        return _split_by_tp(param)

    def is_distributed_buffer(self, buffer: torch.Tensor) -> bool:
        return _split_by_tp(buffer)

    def state_dict(self, destination: dict[str, Any] | None = None,  # type: ignore[override]
                   prefix: str = "", keep_vars: bool = False, cast_to_cpu: bool = True,
                   gather_to_rank0: bool = False) -> dict[str, torch.Tensor]:
        """The full model (every stage's parameters) under the model's own names
        (SMP v1's arguments: ``gather_to_rank0`` keeps it on rank 0 only, the others
        get an empty dict; ``cast_to_cpu=False`` leaves it on this rank's device).
        Collective over the pipeline stage and the tensor-parallel group."""
        if keep_vars:
            raise ValueError("DistributedModel.state_dict(keep_vars=True) is not supported: "
                             "the full state dict holds gathered copies, not the parameters")
        local = {k: (v.full_tensor() if isinstance(v, DTensor) else v).detach().cpu()
                 for k, v in self.local_state_dict().items()}  # collective in the stage
        full = local
        if self.pipeline_degree > 1:
            parts: list[Any] = [None] * self.pipeline_degree
            dist.all_gather_object(parts, local, group=self.pipeline_group())
            full = {}
            for part in parts:
                full.update(part)
        if gather_to_rank0 and dist.get_rank() != 0:
            full = {}
        if not cast_to_cpu:
            device = self.engine.ctx.device
            full = {k: v.to(device) for k, v in full.items()}
        out = destination if destination is not None else {}
        out.update({prefix + k: v for k, v in full.items()})
        return out

    def load_state_dict(self, state_dict: Mapping[str, Any],  # type: ignore[override]
                        strict: bool = True,
                        translate_function: Callable[[Any], Mapping[str, Any]] | None = None,
                        same_partition_load: bool = True) -> None:
        """Load a full (or this rank's) state dict; this rank takes what it holds.
        Before the split (the first step) it loads right after it, as SMP v1.
        ``translate_function`` maps the state dict's names first (SMP's Hugging Face
        translators); ``same_partition_load`` is SMP's shortcut for an unchanged split,
        which this load does not need (each rank takes its part by name either way)."""
        if translate_function is not None:
            state_dict = translate_function(state_dict)
        if not self.partitioned:
            self.load_after_partition(lambda: self.load_state_dict(state_dict, strict))
            return
        state_dict = {k: v for k, v in state_dict.items() if k != "_smp_is_partial"}
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
                _local(target).copy_(_local(v))

    @contextlib.contextmanager
    def record_schedule(self) -> Iterator[ScheduleRecording]:
        """Record what every pipeline rank runs in the steps inside (one is best).

        ``with model.record_schedule() as rec: train_step(...)``; afterwards
        ``rec.events`` (forward/backward of which stage and microbatch, start and end),
        ``rec.grid()`` (the rank x time grid as text), ``rec.bubble`` (measured idle
        share) and ``rec.theoretical`` hold every pipeline rank's record. Enter it on
        every rank of the pipeline: leaving it gathers the records. Under
        ``modelparallel run``, rank 0 also appends it to ``schedule.json`` in the run
        directory, and the run's report.html draws the last one recorded.
        """
        c = self.engine.ctx.config
        recording = ScheduleRecording(self.pipeline_degree, c.microbatches, c.stages_per_rank)
        self.engine.events = []
        try:
            yield recording
            events = self.engine.events
        finally:
            self.engine.events = None
        recording.events = gather_events(events, group=self.pipeline_group())
        # under modelparallel run, rank 0 keeps it for the run's report (schedule.json)
        write_schedule(recording, self.engine.ctx.rank)

    def display_partition(self) -> str:
        """The stages, their layers and cost shares, as text (also printed by rank 0)."""
        return self.engine.display_partition()

    # -- what checkpoints use (checkpoint.protocol.PartitionedModel) -------------------
    @property
    def pipeline_degree(self) -> int:
        return self.engine.pp

    def pipeline_group(self) -> dist.ProcessGroup:
        return self.engine.ctx.process_group(CommGroup.PP_GROUP)

    def load_after_partition(self, load: Callable[[], None]) -> None:
        """Run ``load`` once this rank knows what it holds (now, if it does); loads
        asked for before the split run in the order they were asked for."""
        if self.partitioned:
            load()
        elif self._load_after_partition is None:
            self._load_after_partition = load
        else:
            earlier = self._load_after_partition

            def both() -> None:
                earlier()
                load()

            self._load_after_partition = both

    # -- the engine's callbacks -----------------------------------------------------
    def _loss_scale(self) -> float:
        """The factor ``model.backward`` multiplies the loss by: the loss scale of the
        DistributedOptimizer's scaler under fp16, else 1 (times the microbatches when
        their gradients are summed, ``average_grads_across_microbatches=False``)."""
        if not torch.is_grad_enabled():
            return 1.0
        factor = self.options.loss_factor(self.engine.ctx)
        if not self.engine.ctx.precision.loss_scaling:
            return factor
        optimizer = registry.optimizer()
        if optimizer is None or optimizer.loss_scaler is None:
            raise RuntimeError("fp16=True needs loss scaling, which mp.DistributedOptimizer "
                               "does: create optimizer = mp.DistributedOptimizer(torch_optimizer) "
                               "after mp.DistributedModel and before the first step")
        return optimizer.loss_scaler.scale_value * factor

    def _finish_partition(self) -> None:
        if self._load_after_partition is not None:
            load, self._load_after_partition = self._load_after_partition, None
            load()
        for hook in self._hooks:
            hook(self, registry.optimizer())

    # -- post-step hooks, and the DDP hooks it refuses --------------------------------
    def register_post_step_hook(self, hook: Callable[[Any, Any], None]) -> None:
        """``hook(model, optimizer)`` runs once, after the first ``@smp.step`` call."""
        self._post_step_hooks.append(hook)

    def run_post_step_hooks(self, optimizer: Any) -> None:
        hooks, self._post_step_hooks = self._post_step_hooks, []
        for hook in hooks:
            hook(self, optimizer)

    @contextlib.contextmanager
    def join(self, divide_by_initial_world_size: bool = True,
             enable: bool = True) -> Iterator[None]:
        """Refused: uneven inputs across data-parallel ranks are not supported."""
        raise NotImplementedError(
            "DistributedModel.join() (uneven inputs) is not supported by modelparallel: "
            "give every data-parallel rank the same number of batches (mp.data's "
            "DataLoader with drop_last=True does)")
        yield  # unreachable; makes this a generator

    def register_comm_hook(self, state: Any, hook: Callable[..., Any]) -> None:
        """Refused: modelparallel reduces the gradients itself, not through DDP."""
        raise NotImplementedError(
            "DistributedModel.register_comm_hook() is not supported by modelparallel: its "
            "gradients are reduced over the data-parallel group by the pipeline engine, "
            "not by a DDP module; compress or reduce gradients after backward instead")


def _split_by_tp(t: torch.Tensor) -> bool:
    """Sharded on the ``tp`` dimension (FSDP2 also puts a replicated parameter of a split
    model there, ``Replicate()``)."""
    return isinstance(t, DTensor) and any(
        name == "tp" and isinstance(p, Shard)
        for name, p in zip(t.device_mesh.mesh_dim_names or (), t.placements, strict=True))


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if isinstance(t, DTensor) else t
