"""One pipeline stage of a whole model, in the form torch's ``PipelineStage`` runs."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator

import torch
from torch import nn

from modelparallel.parallel.dataflow import DataFlow
from modelparallel.parallel.pipeline.cut import Split, Stub, swap_module


class LeakedActivationError(RuntimeError):
    """A stage's output depends on a value computed on another stage."""


class _Captured(Exception):
    """Ends a stage's model forward once the next stage's input is known.

    An ``Exception`` (not a ``BaseException``): modules run their ``always_call`` forward
    hooks on an ``Exception`` only, and hooks that restore state (parameter views,
    data-flow tracking) must run when the forward stops here."""


class StageModule(nn.Module):
    """Runs ``model``'s forward for stage ``stage`` of ``split``.

    ``forward(x, mb=marker)``: ``x`` is the hidden state from the previous stage (on
    the first stage, the marker itself) and ``inputs(mb)`` gives the model's own
    arguments for that microbatch, and False for torch's metadata-inference run (on
    uninitialised tensors). Returns the hidden state for the next stage; on the
    last stage ``on_output(mb, output)`` receives the model's output and a 0-dim
    marker is returned in its place (the loss is computed by the step function).

    The model's parameters are not registered here, so torch's stage neither moves nor
    syncs them (the caller syncs once per parameter); ``parameters()`` lists the
    stage's own for the zero-bubble schedules' weight-gradient pass.
    """

    def __init__(self, model: nn.Module, split: Split, stage: int,
                 stubs: dict[str, Stub],
                 inputs: Callable[[torch.Tensor], tuple[tuple, dict, bool]],
                 on_output: Callable[[torch.Tensor, object], torch.Tensor]):
        super().__init__()
        self.__dict__["model"] = model  # not a child: parameters() stay empty
        self.model: nn.Module  # (the attribute set above, for the type checker)
        self.stage = stage
        self.is_last = stage == split.stages - 1
        held = set(split.modules_of(stage))
        self._stubs = {path: stub for path, stub in stubs.items() if path not in held}
        layers = split.layer_range(stage)
        self._first_layer = split.layers[layers.start]
        self._next_layer = None if self.is_last else split.layers[layers.stop]
        self._inputs = inputs
        self._on_output = on_output
        self._held = sorted(held)
        self.checked = False  # the first real forward checks that no stand-in output leaks
        self._stand_ins_run: list[str] = []

    def parameters(self, recurse: bool = True) -> Iterator[nn.Parameter]:
        seen: set[int] = set()
        for path in self._held:
            for p in self.model.get_submodule(path).parameters():
                if id(p) not in seen and p.requires_grad:
                    seen.add(id(p))
                    yield p

    def forward(self, x: torch.Tensor, mb: torch.Tensor) -> torch.Tensor:
        args, kwargs, real = self._inputs(mb)
        flow = DataFlow() if real and not self.checked else None
        captured: list[torch.Tensor] = []
        originals = {}
        handles = []
        try:
            def capture(a, k):  # the rest of the forward belongs to later stages
                captured.append(a[0])
                raise _Captured

            for path, stub in self._stubs.items():
                stub.__dict__["_on_call"] = capture if path == self._next_layer else None
                originals[path] = swap_module(self.model, path, stub)
                if flow is not None:  # what a stand-in returns must not reach the output
                    handles.append(stub.register_forward_hook(
                        lambda m, a, out, path=path: self._stood_in(flow, path, out)))
            if self.stage > 0:
                layer = self.model.get_submodule(self._first_layer)
                handles.append(layer.register_forward_pre_hook(
                    lambda module, a, k: ((x, *a[1:]), k), with_kwargs=True,
                    prepend=True))  # before hooks that keep the inputs (recomputation)
            with flow if flow is not None else contextlib.nullcontext():
                out = self.model(*args, **kwargs)
        except _Captured:
            out = None
        finally:
            for handle in handles:
                handle.remove()
            for path, original in originals.items():
                swap_module(self.model, path, original)
        result = out if self.is_last else (captured[0] if captured else None)
        if not self.is_last and not isinstance(result, torch.Tensor):
            raise RuntimeError(f"pipeline stage {self.stage}: the model never called "
                               f"{self._next_layer} with a tensor as its first argument")
        if flow is not None:
            self.checked = True
            self._check_no_leak(flow, result)
        if self.is_last:
            return self._on_output(mb, out)
        assert isinstance(result, torch.Tensor)  # checked above
        return result

    def _stood_in(self, flow: DataFlow, path: str, out: object) -> None:
        flow.mark(out)
        self._stand_ins_run.append(path)

    def _check_no_leak(self, flow: DataFlow, result: object) -> None:
        """Raise if what this stage passes on was computed from a stand-in's output."""
        ran, self._stand_ins_run = self._stand_ins_run, []
        if not flow.any_marked(result):
            return
        what = "its output" if self.is_last else f"the input of {self._next_layer}"
        raise LeakedActivationError(
            f"pipeline stage {self.stage}: {what} is computed from the output of a module "
            f"another stage holds (stand-ins that ran here: {', '.join(ran) or 'none'}). The "
            "model passes a value other than the hidden state from one layer (or embedding) "
            "to a later one, which a cut at layer boundaries cannot carry. Place the cut "
            "with mp.partition() so that the value stays within one stage, or keep the "
            "model on one stage.")
