"""Run an SMP step function over microbatches through torch's pipeline schedules.

The step function holds the model call and the loss: ``loss = f(model(x), y);
model.backward(loss)``. Each microbatch runs it in its own greenlet, paused at
``model(...)``: the main code collects the model's inputs, drives the schedule, and
when the last stage has a microbatch's output it switches to that greenlet to compute
the loss (the schedule's ``loss_fn``). Greenlets share the thread, so a switch costs
microseconds and no OS scheduling (threads cost ~0.5 ms per hand-off on a busy CPU).
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from typing import Any

import greenlet
import torch
import torch.utils._pytree as pytree
from torch import nn
from torch.distributed.pipelining import PipelineStage
from torch.distributed.pipelining.schedules import _ComputationType

from modelparallel.parallel.pipeline.cut import Split, Stub
from modelparallel.parallel.pipeline.schedules import is_multi_stage, schedule_class
from modelparallel.parallel.pipeline.stage import StageModule


class OutsideStepError(RuntimeError):
    """A DistributedModel was called, or backward() used, outside an @mp.step function."""


class _Stop(BaseException):
    """Ends a microbatch whose model output lives on another stage."""


class _Greenlet(greenlet.greenlet):
    # weak: a strong one would make a reference cycle that keeps the step's inputs,
    # loss and results alive after the step, until Python's cycle collector runs
    microbatch: weakref.ref[Microbatch]


def running_microbatch() -> Microbatch | None:
    """The microbatch whose step function is running here, if any."""
    ref = getattr(greenlet.getcurrent(), "microbatch", None)
    return ref() if ref is not None else None


class Microbatch:
    """One run of the step function, paused at the model call."""

    def __init__(self, index: int, fn: Callable, args: tuple, kwargs: dict):
        self.index = index
        self.model_inputs: tuple[tuple, dict] | None = None
        self.loss: torch.Tensor | None = None
        self.results: tuple[str, Any] | None = None  # the last stage's (kind, value) at the end
        self.scale = 1.0  # of the loss in backward: 1 / microbatches
        self._call = (fn, args, kwargs, torch.is_grad_enabled())
        self._greenlet = _Greenlet(self._run)
        self._greenlet.microbatch = weakref.ref(self)

    def _run(self) -> tuple[str, Any]:
        fn, args, kwargs, grad = self._call
        try:
            with torch.set_grad_enabled(grad):
                return ("done", fn(*args, **kwargs))
        except _Stop:
            return ("stopped", None)
        except BaseException as e:  # raised where the main code resumed it
            return ("error", e)

    def start(self) -> tuple[str, Any]:
        return self.resume()

    def resume(self, *message: tuple[str, Any]) -> tuple[str, Any]:
        grad = torch.is_grad_enabled()  # grad mode is per thread: keep the caller's
        try:
            kind, value = self._greenlet.switch(*message)
        finally:
            torch.set_grad_enabled(grad)
        if kind == "error":
            raise value
        return kind, value

    # called in the microbatch's greenlet
    def _pause(self, message: tuple[str, Any]) -> tuple[str, Any]:
        grad = torch.is_grad_enabled()
        try:
            return self._greenlet.parent.switch(message)
        finally:
            torch.set_grad_enabled(grad)

    def call_model(self, args: tuple, kwargs: dict):
        if self.model_inputs is not None:
            raise RuntimeError("the step function called the model twice; call it once per "
                               "step (one forward over the microbatch)")
        self.model_inputs = (args, kwargs)
        kind, value = self._pause(("call", None))
        if kind == "stop":
            raise _Stop
        return value

    def backward(self, loss: torch.Tensor) -> None:
        if self.loss is not None:
            raise RuntimeError("model.backward() was called twice in one step function")
        self.loss = loss
        self._pause(("backward", None))  # continue: the schedule runs the backward later


_FORWARD_ACTIONS = {_ComputationType.FORWARD, _ComputationType.SEND_F, _ComputationType.RECV_F,
                    _ComputationType.UNSHARD, _ComputationType.RESHARD}


def _forward_only(schedule) -> None:
    """Drop the backward actions of a multi-stage schedule's plan, for evaluation.

    torch runs these plans' backward actions as no-ops without a loss, except that
    a V schedule (two adjacent stages on one rank) still hands gradients between them
    and fails. Forward actions keep their order, so the plan stays deadlock free.
    """
    order = schedule.pipeline_order_with_comms
    for rank, actions in order.items():
        flat = [sub for a in actions for sub in (a.sub_actions or (a,))]  # OVERLAP_F_B
        order[rank] = [a for a in flat if a.computation_type in _FORWARD_ACTIONS]


def current_microbatch(what: str) -> Microbatch:
    mb = running_microbatch()
    if mb is None:
        raise OutsideStepError(
            f"{what} must run inside a function decorated with @mp.step: the pipeline "
            "splits the step's inputs into microbatches and runs them through the stages")
    return mb


class StageRunner:
    """This rank's stages and one schedule, for one shape of microbatch inputs.

    The schedule is built for ``round_size`` microbatches; a step with more runs it
    over consecutive rounds (``active_microbatches``), accumulating gradients.
    """

    def __init__(self, model: nn.Module, split: Split, stage_ids: list[int],
                 stubs: dict[str, Stub], group, device: torch.device, schedule: str,
                 round_size: int, train: bool):
        self.microbatches: list[Microbatch] = []
        self._markers = [torch.full((1,), float(i), device=device) for i in range(round_size)]
        self._inference_output = None
        self._loss_of = -1  # the microbatch whose loss torch computes next
        self.outputs: dict[int, Any] = {}
        self.modules = [StageModule(model, split, s, stubs, self._inputs, self._output)
                        for s in stage_ids]
        self.stages = [PipelineStage(m, s, split.stages, device, group=group)
                       for m, s in zip(self.modules, stage_ids, strict=True)]
        self.holds_first = any(stage.is_first for stage in self.stages)
        self.holds_last = any(stage.is_last for stage in self.stages)
        stages = self.stages if is_multi_stage(schedule) else self.stages[0]
        cls = schedule_class(schedule, round_size, group.size())
        self.schedule = cls(stages, round_size, loss_fn=self._loss if train else None,
                            scale_grads=False)
        if not train and is_multi_stage(schedule):
            _forward_only(self.schedule)
        self.round_size = round_size
        self.train = train

    def _index(self, mb: torch.Tensor) -> int | None:
        """The microbatch of a marker, or None for torch's metadata-inference run."""
        for i, marker in enumerate(self._markers):
            if mb is marker:
                return i
        return None

    def _inputs(self, mb: torch.Tensor, passed: tuple | None,
                ) -> tuple[tuple, dict, bool, tuple]:
        """The model's arguments for a microbatch, whether the run is real, and the
        input tensors to pass on. The first stage (``passed`` None) uses the step
        function's own; later stages the first stage's tensors (``passed``) in the
        structure of their own call: as SMP, they ignore the data they were given."""
        i = self._index(mb)
        inputs = self.microbatches[0 if i is None else i].model_inputs
        assert inputs is not None, "the step function has not called the model yet"
        leaves, spec = pytree.tree_flatten(inputs)
        if passed is None:
            return (*inputs, i is not None,
                    tuple(t for t in leaves if isinstance(t, torch.Tensor)))
        if i is None:  # metadata inference: uninitialised buffers; zeros index safely
            passed = tuple(torch.zeros_like(t) for t in passed)
        given = iter(passed)
        leaves = [next(given) if isinstance(t, torch.Tensor) else t for t in leaves]
        args, kwargs = pytree.tree_unflatten(leaves, spec)
        return args, kwargs, i is not None, passed

    def _output(self, mb: torch.Tensor, output: Any) -> torch.Tensor:
        i = self._index(mb)
        # torch computes a microbatch's loss right after the last stage's forward of it
        self._loss_of = -1 if i is None else i
        if i is None:
            self._inference_output = output
            return torch.full((), -1.0, device=mb.device)
        self.outputs[i] = output
        return torch.full((), float(i), device=mb.device)

    def _loss(self, marker: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        # the index is known without reading the marker's value (none under the planner's
        # fake tensors)
        i = self._loss_of
        if i < 0:  # metadata inference: any loss that depends on the output will do
            leaves = [t for t in pytree.tree_leaves(self._inference_output)
                      if isinstance(t, torch.Tensor) and t.requires_grad]
            zero = torch.zeros((), device=marker.device)
            return sum((t.float().sum() * 0.0 for t in leaves), zero)
        mb = self.microbatches[i]
        kind, _ = mb.resume(("output", self.outputs.pop(i)))
        if kind == "backward":  # the rest of the step function runs after the schedule
            # the mean over microbatches, as one process (times the fp16 loss scale)
            assert mb.loss is not None  # model.backward(loss) was called
            return mb.loss.float() * mb.scale
        raise RuntimeError("the step function returned without calling model.backward(loss) "
                           "while gradients are enabled; call model.backward(loss), or run "
                           "evaluation steps under torch.no_grad()")

    def run(self, microbatches: list[Microbatch]) -> list[Any] | None:
        """Drive the schedule; the step function's results where the last stage is,
        else None."""
        for start in range(0, len(microbatches), self.round_size):
            self._run_round(microbatches[start:start + self.round_size])
        if not self.holds_last:
            for mb in microbatches:
                mb.resume(("stop", None))
            return None
        return [mb.results[1] if mb.results is not None else None for mb in microbatches]

    def _run_round(self, microbatches: list[Microbatch]) -> None:
        self.microbatches = microbatches
        n = len(microbatches)
        args = [(self._markers[i],) for i in range(n)] if self.holds_first else None
        kwargs = [{"mb": self._markers[i]} for i in range(n)]
        targets = list(self._markers) if self.holds_last and self.train else None
        for stage in self.stages:
            stage.has_backward = self.train
            stage.clear_runtime_states()
        self.schedule._step_microbatches(args, kwargs, targets, None, return_outputs=False)
        if self.holds_last:
            for i, mb in enumerate(microbatches):
                mb.results = (mb.resume(("continue", None)) if self.train
                              else mb.resume(("output", self.outputs.pop(i))))
