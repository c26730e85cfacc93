"""SMP v1's ``DistributedModel(...)`` arguments: what each does here.

``backward_passes_per_step`` accumulates over step calls (the engine);
``average_grads_across_microbatches=False`` sums the microbatches' gradients;
``broadcast_buffers`` gives every replica the first data-parallel rank's buffers at
each training step (DDP's rule); ``trace_device`` is where tracing would run. The DDP
tuning arguments have no counterpart: each logs one line (rank 0) saying why.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from modelparallel.context import ParallelContext
from modelparallel.parallel import replicas
from modelparallel.parallel.placement import is_meta
from modelparallel.topology import CommGroup

logger = logging.getLogger("modelparallel")


@dataclass(frozen=True)
class ModelOptions:
    """SMP v1's defaults (its documentation's, where its source differs)."""

    trace_device: str = "gpu"
    trace_execution_times: bool = False
    trace_memory_usage: bool = False
    overlapping_allreduce: bool = True
    backward_passes_per_step: int = 1
    average_grads_across_microbatches: bool = True
    bucket_cap_mb: float = 25
    find_unused_parameters: bool = False
    broadcast_buffers: bool = True
    gradient_as_bucket_view: bool = False

    def check(self, ctx: ParallelContext) -> None:
        """Raise on a bad value; say once what has no effect."""
        if not (isinstance(self.backward_passes_per_step, int)
                and self.backward_passes_per_step >= 1):
            raise ValueError(f"backward_passes_per_step must be an integer >= 1, got "
                             f"{self.backward_passes_per_step!r}")
        if self.trace_device not in ("gpu", "cpu"):
            raise ValueError(f"trace_device must be 'gpu' or 'cpu', got {self.trace_device!r}")
        if ctx.rank != 0:
            return
        say = logger.warning
        traced = ctx.topology.pp > 1  # tracing happens only to split a pipeline
        if traced and self.trace_device == "gpu" and not torch.cuda.is_available():
            say("DistributedModel(trace_device='gpu'): this machine has no GPU; the pipeline "
                "split is traced on the cpu")
        elif traced and self.trace_device == "cpu" and ctx.device.type != "cpu":
            say("DistributedModel(trace_device='cpu') has no effect: the pipeline split is "
                "traced where the model's parameters are when the first step runs")
        if traced and self.trace_memory_usage:
            say("DistributedModel(trace_memory_usage=True) has no effect: tracing always "
                "records each layer's parameter and output bytes, which the split balances")
        if not self.overlapping_allreduce:
            say("DistributedModel(overlapping_allreduce=False) has no effect: FSDP reduces "
                "gradients during backward and replicas all-reduce them once after it")
        if self.bucket_cap_mb != 25:
            say("DistributedModel(bucket_cap_mb=%s) has no effect: replicas all-reduce a "
                "stage's gradients as one flat tensor, FSDP per unit", self.bucket_cap_mb)
        if self.find_unused_parameters:
            say("DistributedModel(find_unused_parameters=True) has no effect: unused "
                "parameters are always found (a rank's joins the reduction with zeros; "
                "one no replica used keeps no gradient)")
        if self.gradient_as_bucket_view:
            say("DistributedModel(gradient_as_bucket_view=True) has no effect: there are no "
                "DDP buckets; gradients are reduced in place")
        # trace_execution_times: tracing always times every layer, which is what True asks

    def loss_factor(self, ctx: ParallelContext) -> float:
        """What the engine's per-microbatch average is multiplied by: the number of
        microbatches when their gradients are summed rather than averaged."""
        return 1.0 if self.average_grads_across_microbatches else float(ctx.config.microbatches)


def broadcast_buffers(module: nn.Module, ctx: ParallelContext) -> None:
    """DDP's ``broadcast_buffers``: the buffers this rank holds take the first
    data-parallel rank's values (tensor-parallel shards: over the reduced group).
    Collective over the data-parallel group; nothing under FSDP, which does not."""
    if ctx.shards_pipeline_stages or ctx.topology.size_of(CommGroup.DP_GROUP) == 1:
        return
    held = [b for b in module.buffers() if not is_meta(b)]
    if not held:
        return
    replicas.broadcast_from_first([b for b in held if not isinstance(b, DTensor)],
                                  ctx.process_group(CommGroup.DP_GROUP))
    split = [b for b in held if isinstance(b, DTensor)]
    if split and ctx.topology.tp > 1:
        replicas.broadcast_from_first(split, ctx.process_group(CommGroup.RDP_GROUP))
