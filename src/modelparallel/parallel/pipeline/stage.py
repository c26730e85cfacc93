"""One pipeline stage of a whole model, in the form torch's ``PipelineStage`` runs."""

from __future__ import annotations

from collections.abc import Callable, Iterator

import torch
from torch import nn

from modelparallel.parallel.pipeline.cut import Split, Stub, swap_module


class LeakedActivationError(RuntimeError):
    """A stage's output depends on a value computed on another stage."""


class _Captured(BaseException):
    """Ends a stage's model forward once the next stage's input is known."""


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
        self.checked = False  # first real forward checks no NaN stub output leaked in

    def parameters(self, recurse: bool = True) -> Iterator[nn.Parameter]:
        seen: set[int] = set()
        for path in self._held:
            for p in self.model.get_submodule(path).parameters():
                if id(p) not in seen and p.requires_grad:
                    seen.add(id(p))
                    yield p

    def forward(self, x: torch.Tensor, mb: torch.Tensor) -> torch.Tensor:
        args, kwargs, real = self._inputs(mb)
        captured: list[torch.Tensor] = []
        originals = {}
        handle = None
        try:
            def capture(a, k):  # the rest of the forward belongs to later stages
                captured.append(a[0])
                raise _Captured

            for path, stub in self._stubs.items():
                stub.__dict__["_on_call"] = capture if path == self._next_layer else None
                originals[path] = swap_module(self.model, path, stub)
            if self.stage > 0:
                layer = self.model.get_submodule(self._first_layer)
                handle = layer.register_forward_pre_hook(
                    lambda module, a, k: ((x, *a[1:]), k), with_kwargs=True,
                    prepend=True)  # before hooks that keep the inputs (recomputation)
            out = self.model(*args, **kwargs)
        except _Captured:
            out = None
        finally:
            if handle is not None:
                handle.remove()
            for path, original in originals.items():
                swap_module(self.model, path, original)
        if self.is_last:
            if real:
                self._check_finite(out, x)
            return self._on_output(mb, out)
        if not captured or not isinstance(captured[0], torch.Tensor):
            raise RuntimeError(f"pipeline stage {self.stage}: the model never called "
                               f"{self._next_layer} with a tensor as its first argument")
        if real:
            self._check_finite(captured[0], x)
        return captured[0]

    def _check_finite(self, out, x: torch.Tensor) -> None:
        if self.checked or not torch.is_grad_enabled():
            return
        self.checked = True
        tensors = [t for t in torch.utils._pytree.tree_leaves(out)
                   if isinstance(t, torch.Tensor) and t.is_floating_point()]
        x_finite = not x.is_floating_point() or bool(torch.isfinite(x).all())
        if x_finite and any(not bool(torch.isfinite(t).all()) for t in tensors):
            raise LeakedActivationError(
                f"pipeline stage {self.stage} computed NaN/inf from finite inputs. Either "
                "training diverged, or the model passes a value other than the hidden state "
                "from one layer (or embedding) to a later one, which a cut at layer "
                "boundaries cannot carry. Check the first step with "
                "pipeline_parallel_degree=1; otherwise place the cut with mp.partition().")
