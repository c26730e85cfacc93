"""PipelineEngine: runs one training or evaluation step of a model split into stages.

At the first step (as SMP v1): without a pipeline the model is parallelized whole
(its repeated blocks and the root as FSDP units); with ``pipeline_parallel_degree`` > 1
one microbatch is traced, a :class:`PipelineLayout` places the layers on the stages
(balanced, or as ``mp.partition`` / ``mp.set_partition`` say), every rank keeps only
its stages' parameters, and :func:`parallelize.parallelize` applies tensor parallelism,
activation checkpointing, the precision policy and data parallelism to what it holds.
Then every step runs its microbatches through a :class:`StageRunner` on the configured
schedule, and :class:`GradientSync` reduces the gradients.

The SMP facade's ``DistributedModel`` adapts this engine to SMP's names; the engine
knows nothing of process state: it is given the :class:`ParallelContext`.
"""

from __future__ import annotations

import pickle
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.distributed as dist
import torch.utils._pytree as pytree
from torch import nn

from modelparallel.context import ParallelContext
from modelparallel.observe.fit_check import warn_if_state_cannot_fit
from modelparallel.parallel import deferred, parallelize, stale_params, unused_grads
from modelparallel.parallel.blocks import find_blocks
from modelparallel.parallel.pipeline import cut, schedules
from modelparallel.parallel.pipeline import trace as tracing
from modelparallel.parallel.pipeline.absent import Holder, stand_in
from modelparallel.parallel.pipeline.gradients import GradientSync, shared_parameters
from modelparallel.parallel.pipeline.layout import PipelineLayout
from modelparallel.parallel.pipeline.record import Event, ScheduleRecorder
from modelparallel.parallel.pipeline.runtime import Microbatch, StageRunner
from modelparallel.parallel.placement import is_meta
from modelparallel.topology import CommGroup


class PipelineEngine:
    """Partitions ``module`` at the first step and runs every step after it.

    ``loss_scale()`` gives the factor a microbatch's loss is multiplied by before its
    backward (fp16's loss scale, else 1); ``on_partitioned()`` runs once this rank
    knows what it holds.
    """

    def __init__(self, module: nn.Module, ctx: ParallelContext, *, passes_per_sync: int,
                 loss_scale: Callable[[], float], on_partitioned: Callable[[], None]):
        self.module = module
        self.ctx = ctx
        self.pp = ctx.topology.pp
        self.partitioned = False
        self.layout: PipelineLayout | None = None  # chosen at the first step
        self.gradients = GradientSync(module, ctx, passes_per_sync)
        # this rank's parameters by name, as wrapped (FSDP's sharded ones, which the
        # optimizer updates, even while FSDP has swapped in gathered ones)
        self.local: dict[str, nn.Parameter] = {}
        self.replaced: dict[int, nn.Parameter] = {}  # old parameter id -> its DTensor
        self.events: list[Event] | None = None  # recorded while a schedule is recorded
        self._loss_scale = loss_scale
        self._on_partitioned = on_partitioned
        self._runners: dict[tuple, StageRunner] = {}
        self._stubs: dict[str, cut.Stub] = {}

    # -- what this rank holds --------------------------------------------------------
    def local_parameters(self) -> list[nn.Parameter]:
        """This rank's parameters, each tensor once."""
        return list({id(p): p for p in self.local.values()}.values())

    def grad_norm_parts(self) -> tuple[list[nn.Parameter], list[nn.Parameter], Any]:
        """For a global gradient norm: the parameters whose gradients this rank counts (a
        parameter several pipeline stages hold counts on the first of them), those it
        holds, and the group adding up the stages (None without a pipeline)."""
        held = self.local_parameters()
        if self.pp == 1:
            return held, held, None
        params = dict(self.module.named_parameters(remove_duplicate=False))
        elsewhere = {id(params[n]) for group, names in self.gradients.shared
                     if dist.get_global_rank(group, 0) != self.ctx.rank for n in names}
        counted = [p for p in held if id(p) not in elsewhere]
        return counted, held, self.ctx.process_group(CommGroup.PP_GROUP)

    def held_modules(self, pp_rank: int | None = None) -> list[str]:
        """Paths of the modules a pipeline rank (default: this one) holds."""
        if self.layout is None:
            return [""]
        return self.layout.held_modules(self.ctx.coordinate("pp") if pp_rank is None
                                        else pp_rank)

    def local_modules(self) -> Iterator[nn.Module]:
        held = self.held_modules()
        for name, m in self.module.named_modules():
            if any(name == h or name.startswith(h + ".") for h in held):
                yield m

    def local_state_dict(self) -> dict[str, torch.Tensor]:
        """This rank's parameters and buffers under the model's own names."""
        params = {n for n, _ in self.module.named_parameters(remove_duplicate=False)}
        return {k: v for k, v in self.module.state_dict().items()
                if k in self.local or (k not in params and not is_meta(v))}

    def display_partition(self) -> str:
        """The stages, their layers and cost shares, as text."""
        if self.layout is None:
            return "not partitioned yet: the split happens at the first step"
        return self.layout.describe()

    # -- the step --------------------------------------------------------------------
    def run_step(self, microbatches: list[Microbatch]) -> list[Any]:
        """Run a step function's microbatches; their return values, on every rank."""
        if self.pp == 1:
            if not self.partitioned:  # as SMP v1: wrapping happens at the first step
                found = {id(b) for b in find_blocks(self.module)}
                self._parallelize([n for n, m in self.module.named_modules() if id(m) in found]
                                  + [""])
                self._finish_partition()
            self.gradients.before_step()
            direct = [self._run_direct(mb, len(microbatches)) for mb in microbatches]
            self.gradients.after_step(self.local_parameters())
            return direct
        for mb in microbatches:
            kind, _ = mb.start()
            if kind != "call":
                raise RuntimeError("the step function returned without calling the model")
        if not self.partitioned:
            self._partition(_inputs(microbatches[0]))
        first = self._first_stage_signature(microbatches[0])
        self.gradients.before_step()
        for mb in microbatches:
            mb.scale = self._loss_scale() / len(microbatches)
        runner = self._runner(microbatches, first)
        results: list[Any] | None
        if self.events is None:
            results = runner.run(microbatches)
        else:
            with ScheduleRecorder(runner.stages, rank=self.ctx.coordinate("pp")) as recorder:
                results = runner.run(microbatches)
            self.events += recorder.events
        self.gradients.after_step(self.local_parameters())
        return self._from_last_stage(results)

    def _first_stage_signature(self, mb: Microbatch) -> tuple:
        """The form of the first stage's model inputs, agreed by the pipeline. Later
        stages run on the first stage's input tensors and ignore theirs (as SMP: a data
        loader may give them placeholders), but their call must have the same form."""
        ctx = self.ctx
        forms: list[Any] = [None] * self.pp
        dist.all_gather_object(forms, _signature(_inputs(mb)),
                               group=ctx.process_group(CommGroup.PP_GROUP))
        odd = [r for r, form in enumerate(forms) if _structure(form) != _structure(forms[0])]
        if odd:
            raise ValueError(
                f"pipeline rank(s) {odd} called the model with arguments of another form "
                f"than the first stage: {_describe(forms[odd[0]])} instead of "
                f"{_describe(forms[0])}. Stages after the first take the first stage's "
                f"input tensors and ignore their own, but must call the model alike: pass "
                f"a placeholder tensor wherever the first stage passes a tensor")
        return forms[0]

    def _runner(self, microbatches: list[Microbatch], first: tuple) -> StageRunner:
        train = torch.is_grad_enabled()
        key = (train, first, len(microbatches))
        if key not in self._runners:
            c, layout = self.ctx.config, self.layout
            assert layout is not None
            self._runners[key] = StageRunner(
                self.module, layout.split, layout.stage_ids(self.ctx.coordinate("pp")),
                self._stubs,
                self.ctx.process_group(CommGroup.PP_GROUP), self.ctx.device, c.pipeline,
                schedules.round_size(c.pipeline, len(microbatches), self.pp,
                                     c.active_microbatches), train)
        return self._runners[key]

    def _run_direct(self, mb: Microbatch, count: int) -> Any:
        """No pipeline: the step function runs here; backward of loss / microbatches."""
        mb.scale = self._loss_scale() / count
        kind, value = mb.start()
        while kind != "done":
            if kind == "call":
                args, kwargs = _inputs(mb)
                kind, value = mb.resume(("output", self.module(*args, **kwargs)))
            elif kind == "backward":
                assert mb.loss is not None  # the step function called model.backward
                (mb.loss.float() * mb.scale).backward()
                kind, value = mb.resume(("continue", None))
        return value

    def _from_last_stage(self, results: list[Any] | None) -> list[Any]:
        """SMP: the step's return values are on every rank of the pipeline."""
        ctx = self.ctx
        assert self.layout is not None
        last = ctx.topology.group_ranks(ctx.rank, CommGroup.PP_GROUP)[
            self.layout.last_stage_rank()]
        box = [None if results is None else pytree.tree_map(
            lambda t: t.detach().cpu() if isinstance(t, torch.Tensor) else t, results)]
        dist.broadcast_object_list(box, src=last, group=ctx.process_group(CommGroup.PP_GROUP))
        device = ctx.device
        return pytree.tree_map(lambda t: t.to(device) if isinstance(t, torch.Tensor) else t,
                               box[0])

    # -- partitioning ----------------------------------------------------------------
    def _partition(self, model_inputs: tuple[tuple, dict]) -> None:
        ctx = self.ctx
        args, kwargs = model_inputs
        trace, error = None, None
        if ctx.rank == 0:  # one rank's timings for all: every rank must choose the same split
            try:
                # the traced forwards' dropout must not move this rank's generators alone
                devices = [device] if (device := ctx.device).type == "cuda" else []
                with deferred.stand_ins(self.module), torch.random.fork_rng(devices):
                    trace = tracing.trace(self.module, args, kwargs)
            except Exception as e:  # raised on every rank, not only here
                error = e
        box: list[Any] = [(trace, _portable(error))]
        dist.broadcast_object_list(box, src=0)
        if error is not None:
            raise error
        trace, error = box[0]
        if error is not None:
            raise error
        self.layout = layout = PipelineLayout.choose(self.module, trace, ctx.config, self.pp)
        held = self.held_modules()
        everything = layout.all_modules()
        self._stubs = {path: cut.Stub(self.module.get_submodule(path), None,
                                      ctx.precision.param_dtype, path=path,
                                      holder=layout.holder(path), device=ctx.device)
                       for path in everything}
        self.gradients.shared = shared_parameters(self.module, ctx, self.held_modules)
        self._free_other_stages(everything, held)
        self._parallelize(held)  # FSDP units: this rank's units (root parameters stay)
        self._stand_in_for_other_stages(everything, held)
        if ctx.rank == 0:
            print(f"modelparallel: pipeline partition ({ctx.config.pipeline} schedule)\n"
                  f"{self.display_partition()}", flush=True)
        self._finish_partition()

    def _parallelize(self, units: list[str]) -> None:
        """Tensor parallelism, then FSDP on ``units``; remember replaced parameters."""
        before = dict(self.module.named_parameters(remove_duplicate=False))
        done = parallelize.parallelize(self.module, units, self.ctx)
        self.gradients.fsdp, self.gradients.tp_replicas = done.fsdp, done.tp_replicas
        if done.fsdp:  # parameters no replica used keep no gradient (as GradientSync's)
            unused_grads.track_fsdp2(self.module, self.ctx.gradient_group(done.tp_replicas),
                                     self.ctx.device)
        after = dict(self.module.named_parameters(remove_duplicate=False))
        self.replaced = {id(before[n]): p for n, p in after.items() if p is not before[n]}
        stale_params.record_replaced(
            before, self.module, "mp.DistributedModel's first step",
            "wrap the optimizer in mp.DistributedOptimizer, which follows the split, or "
            "build it after the first step from model.local_parameters()")
        self.local = {n: p for n, p in after.items() if not is_meta(p)}
        warn_if_state_cannot_fit(self.module, self.ctx.rank, self.ctx.device,
                                 "DistributedModel")

    def _free_other_stages(self, everything: list[str], held: list[str]) -> None:
        """Swap the parameters of modules this rank does not hold for meta tensors."""
        held_params = {id(p) for path in held
                       for p in self.module.get_submodule(path).parameters()}
        # one placeholder per tensor: ties stay ties
        params: dict[int, nn.Parameter] = {}
        buffers: dict[int, torch.Tensor] = {}
        for path in everything:
            if path in held:
                continue
            for module in self.module.get_submodule(path).modules():
                for name, p in list(module._parameters.items()):
                    if p is not None and id(p) not in held_params:
                        module._parameters[name] = params.setdefault(id(p), nn.Parameter(
                            torch.empty_like(p, device="meta"), p.requires_grad))
                for name, b in list(module._buffers.items()):
                    if b is not None:
                        module._buffers[name] = buffers.setdefault(
                            id(b), torch.empty_like(b, device="meta"))

    def _stand_in_for_other_stages(self, everything: list[str], held: list[str]) -> None:
        """Swap the meta placeholders left in modules other stages hold for stand-ins
        that report the real dtype, shape and device (what a script reads of the model
        after the split: ``model.dtype``, ``model.device``) and refuse their values."""
        assert self.layout is not None
        made: dict[int, torch.Tensor] = {}  # one stand-in per tensor: ties stay ties

        def stand_in_for(t: torch.Tensor, name: str, holder: Holder) -> torch.Tensor:
            if id(t) not in made:
                made[id(t)] = absent = stand_in(t, name, holder, self.ctx.device, None)
                if isinstance(t, nn.Parameter):
                    made[id(t)] = nn.Parameter(absent, t.requires_grad)
            return made[id(t)]

        for path in everything:
            if path in held:
                continue
            holder = self.layout.holder(path)
            for prefix, module in self.module.get_submodule(path).named_modules(prefix=path):
                for name, p in list(module._parameters.items()):
                    if p is not None and is_meta(p):
                        module._parameters[name] = stand_in_for(p, f"{prefix}.{name}", holder)
                for name, b in list(module._buffers.items()):
                    if b is not None and is_meta(b):
                        module._buffers[name] = stand_in_for(b, f"{prefix}.{name}", holder)

    def _finish_partition(self) -> None:
        self.partitioned = True
        self._on_partitioned()


def _inputs(mb: Microbatch) -> tuple[tuple, dict]:
    """The model inputs of a microbatch whose step function has called the model."""
    assert mb.model_inputs is not None, "the step function has not called the model yet"
    return mb.model_inputs


def _signature(model_inputs: tuple[tuple, dict]) -> tuple:
    leaves, spec = pytree.tree_flatten(model_inputs)
    return (str(spec), tuple((tuple(t.shape), t.dtype) if isinstance(t, torch.Tensor)
                             else type(t).__name__ for t in leaves))


def _structure(signature: tuple) -> tuple:
    """A signature without the tensors' shapes and types: where the tensors are."""
    spec, leaves = signature
    return spec, tuple(isinstance(leaf, tuple) for leaf in leaves)


def _describe(signature: tuple) -> str:
    spec, leaves = signature
    kinds = ", ".join("tensor" if isinstance(x, tuple) else x for x in leaves)
    return f"{len(leaves)} values ({kinds}) arranged as {spec}"


def _portable(error: Exception | None) -> Exception | None:
    """``error`` if it survives pickling (to reach the other ranks), else its text."""
    if error is None:
        return None
    try:
        pickle.loads(pickle.dumps(error))
        return error
    except Exception:
        return RuntimeError(f"on rank 0: {type(error).__name__}: {error}")
