"""One pipeline stage of a whole model, in the form torch's ``PipelineStage`` runs."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.utils._pytree as pytree
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

    ``forward(*xs, mb=marker)``: on the first stage ``xs`` is the marker itself; on the
    others it is what the previous stage sent: the arguments of this stage's first
    unit that cross the cut (``split.crossing``), then the tensors of the model's
    inputs. ``inputs(mb, passed)`` gives the model's arguments for that microbatch
    (built around ``passed``, the received input tensors, on later stages), whether it
    is a real run (False for torch's metadata inference, on uninitialised tensors), and
    the input tensors to pass on. Returns what the next stage needs (the same kinds of
    tensors); on the last stage ``on_output(mb, output)`` receives the model's output
    and a 0-dim marker is returned in its place (the loss is computed by the step
    function).

    The model's parameters are not registered here, so torch's stage neither moves nor
    syncs them (the caller syncs once per parameter); ``parameters()`` lists the
    stage's own for the zero-bubble schedules' weight-gradient pass.
    """

    def __init__(self, model: nn.Module, split: Split, stage: int,
                 stubs: dict[str, Stub],
                 inputs: Callable[[torch.Tensor, tuple | None],
                                  tuple[tuple, dict, bool, tuple]],
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
        # argument leaves (by position) received at the start / sent at the end
        self._received = split.crossing.get(self._first_layer, []) if stage > 0 else []
        self._sent = [] if self.is_last else split.crossing.get(self._next_layer or "", [])
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

    def forward(self, *xs: torch.Tensor, mb: torch.Tensor) -> Any:
        cut, passed = (xs[:len(self._received)], xs[len(self._received):]) \
            if self.stage > 0 else ((), None)
        args, kwargs, real, inputs = self._inputs(mb, passed)
        flow = DataFlow() if real and not self.checked else None
        captured: list[torch.Tensor] = []
        originals = {}
        handles = []
        try:
            def capture(a, k):  # the rest of the forward belongs to later stages
                leaves = pytree.tree_leaves((a, k))
                captured.extend(_tensor(leaves, i, self._next_layer) for i in self._sent)
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
                    self._take(cut, flow), with_kwargs=True,
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
        if not self.is_last and len(captured) != len(self._sent):
            raise RuntimeError(f"pipeline stage {self.stage}: the model never called "
                               f"{self._next_layer}, where the next stage starts")
        result = out if self.is_last else captured
        if flow is not None:
            self.checked = True
            self._check_no_leak(flow, result)
        if self.is_last:
            return self._on_output(mb, out)
        # sent as they are: contiguous, on this stage's device (the marker's)
        return tuple(t.to(mb.device).contiguous() for t in (*captured, *inputs))

    def _take(self, received: tuple, flow: DataFlow | None) -> Callable:
        """A pre-hook giving this stage's first unit, at its first call, the arguments
        the previous stage computed. The stand-in values in their place are overwritten
        too, so the model's own forward sees the received values wherever it uses them
        again (``x = x + unit(x)``)."""
        done = [False]

        def hook(module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict] | None:
            if done[0]:
                return None
            done[0] = True
            leaves, spec = pytree.tree_flatten((args, kwargs))
            swap: dict[int, torch.Tensor] = {}
            for i, value in zip(self._received, received, strict=True):
                local = _tensor(leaves, i, self._first_layer)
                swap[id(local)] = value
                with contextlib.suppress(RuntimeError):  # e.g. an expanded view
                    local.copy_(value)
                if flow is not None:
                    flow.unmark(local)
            leaves = [swap.get(id(t), t) if isinstance(t, torch.Tensor) else t for t in leaves]
            return pytree.tree_unflatten(leaves, spec)

        return hook

    def _stood_in(self, flow: DataFlow, path: str, out: object) -> None:
        flow.mark(out)
        self._stand_ins_run.append(path)

    def _check_no_leak(self, flow: DataFlow, result: object) -> None:
        """Raise if what this stage passes on was computed from a stand-in's output."""
        ran, self._stand_ins_run = self._stand_ins_run, []
        if not flow.any_marked(result):
            return
        what = "its output" if self.is_last else f"the arguments of {self._next_layer}"
        raise LeakedActivationError(
            f"pipeline stage {self.stage}: {what} is computed from the output of a module "
            f"another stage holds (stand-ins that ran here: {', '.join(ran) or 'none'}). The "
            "model passes a value other than the hidden state from one layer (or embedding) "
            "to a later one without passing it to the module where the stage starts, "
            "which a cut cannot carry (the automatic split avoids such cuts; its trace may "
            "have taken another path through the model). Place the cut with "
            "mp.partition() so that the value stays within one stage.")


def _tensor(leaves: list, index: int, unit: str | None) -> torch.Tensor:
    """Leaf ``index`` of a unit's arguments, which the trace found to be a tensor."""
    leaf = leaves[index] if index < len(leaves) else None
    if not isinstance(leaf, torch.Tensor):
        raise RuntimeError(f"the call of {unit} differs from the traced one: its argument "
                           f"{index} (counting every tensor and value in its positional and "
                           f"keyword arguments) is {type(leaf).__name__}, not a tensor")
    return leaf
