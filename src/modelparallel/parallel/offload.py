"""Activation offloading with prefetch (SMP v1 ``offload_activations``, SMP v2
``sm_activation_offloading`` with ``offload_wrapper``; ``activation_loading_horizon``).

A checkpointed layer keeps only its inputs for backward (the rest is recomputed). An
:class:`ActivationOffloader` copies them to CPU memory as the forward saves them
(``torch.autograd.graph.saved_tensors_hooks``; on CUDA the copies run on a side stream)
and brings them back before backward needs them, as SMP does: when a forward pass (a
call of the root module) completes, the inputs of its last layers are fetched, and
each time backward has taken a layer's inputs the layer before it is fetched, so that
at most ``horizon`` layers' inputs are on the device awaiting backward. A layer whose
inputs are not back when backward reaches it is fetched then (making room if
another pass's prefetched layers fill the horizon). On the CPU the device is the CPU:
offloading is a copy, and the same bookkeeping runs.

Where it is applied (``offload_roots``): SMP v1's ``offload_activations`` offloads the
inputs of the modules marked with ``set_activation_checkpointing``, nothing else; SMP
v2's ``offload_wrapper`` on the root offloads everything its forward saves, as torch's
does, and prefetches its checkpointed layers' inputs within the horizon.

Parameters, tensors on another device and tensor subclasses (DTensor) are left as they
are: offloading them would free no memory or change their meaning.
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.autograd.graph import saved_tensors_hooks
from torch.utils.hooks import RemovableHandle

from modelparallel.parallel.activation import is_recomputed
from modelparallel.parallel.offload_torch import CheckpointWrapper

SMP_V1_HORIZON = 4  # SMP v1's default activation_loading_horizon
SMP_V2_HORIZON = 2  # SMP v2's


def loading_horizon(configured: int | None, *, v2: bool) -> int:
    """``activation_loading_horizon`` as configured, else SMP's default for the API in use
    (4 for SMP v1's ``offload_activations``, 2 for SMP v2's ``offload_wrapper``)."""
    if configured is not None:
        return configured
    return SMP_V2_HORIZON if v2 else SMP_V1_HORIZON


@dataclass
class OffloadStats:
    """What an offloader did, counted by its hooks."""

    layers_offloaded: int = 0   # layer calls whose inputs went to CPU
    tensors_offloaded: int = 0  # every tensor copied to CPU (layers' and, for v2, the rest)
    bytes_offloaded: int = 0
    prefetched: int = 0         # layers fetched ahead of backward
    fetched_on_demand: int = 0  # layers fetched only when backward needed them
    evicted: int = 0            # prefetched layers sent back to make room
    max_resident: int = 0       # most layers on the device awaiting backward at once


class _Pass:
    """One forward pass of the root: its layers, in forward order."""

    __slots__ = ("groups",)

    def __init__(self) -> None:
        self.groups: list[_Group] = []


class _Group:
    """The tensors one checkpointed layer call saved."""

    __slots__ = ("alive", "count", "handles", "index", "pass_", "state", "unpacked")

    def __init__(self, pass_: _Pass, index: int) -> None:
        self.pass_, self.index = pass_, index
        self.handles: list[weakref.ref[_Saved]] = []
        self.count = 0       # tensors saved
        self.alive = 0       # of those, still held by the autograd graph
        self.unpacked: set[int] = set()
        self.state = "offloaded"  # -> "resident" (back on the device) -> "consumed"

    def saved(self) -> Iterator[_Saved]:
        return (s for s in (r() for r in self.handles) if s is not None)

    def forget_one(self, _ref: object) -> None:  # a saved tensor's graph was freed
        self.alive -= 1


class _Saved:
    """What autograd holds instead of a tensor: its CPU copy and, while fetched, its
    copy on the device (with the CUDA event that says the copy is done)."""

    __slots__ = ("__weakref__", "cpu", "group", "on_device", "ready")

    def __init__(self, cpu: torch.Tensor, group: _Group | None) -> None:
        self.cpu, self.group = cpu, group
        self.on_device: torch.Tensor | None = None
        self.ready: Any = None


class ActivationOffloader:
    """Offloads what checkpointed layers save to CPU and prefetches it for backward.

    ``begin_pass`` / ``end_pass`` bracket a forward of the root module (the end starts
    the prefetch); ``begin_layer`` / ``end_layer`` bracket a checkpointed layer's call.
    With ``offload_outside_layers`` (SMP v2's ``offload_wrapper``) the saved-tensor hooks
    are on for the whole pass and tensors saved outside layers are offloaded too;
    otherwise (SMP v1) they are on inside layers only.
    """

    def __init__(self, device: torch.device | str, horizon: int, *,
                 offload_outside_layers: bool = False) -> None:
        if horizon < 1:
            raise ValueError(f"activation_loading_horizon must be >= 1, got {horizon}")
        self.device, self.horizon = normalise(device), horizon
        self.offload_outside_layers = offload_outside_layers
        self.stats = OffloadStats()
        self._stream = torch.cuda.Stream(self.device) if self.device.type == "cuda" else None
        self._lock = threading.RLock()  # unpack runs on autograd's threads on CUDA
        self._pass: _Pass | None = None     # the forward pass running now
        self._pass_depth = 0
        self._group: _Group | None = None   # the layer whose forward runs now
        self._layer_depth = 0
        self._resident: list[_Group] = []   # prefetched / fetched, awaiting backward
        self._live: weakref.WeakSet[_Saved] = weakref.WeakSet()
        self._hooks = saved_tensors_hooks(self._pack, self._unpack)
        self._handles: list[RemovableHandle] = []

    # -- what is on the device -------------------------------------------------------
    def resident_layers(self) -> int:
        """How many layers' saved inputs are on the device now, awaiting backward:
        counted from the device copies the saved tensors hold."""
        return len({id(s.group) for s in list(self._live)
                    if s.on_device is not None and s.group is not None})

    # -- brackets --------------------------------------------------------------------
    def attach(self, root: nn.Module | None, layers: list[nn.Module]) -> None:
        """Bracket each call of ``root`` as a pass (None: the caller does) and each call of
        the ``layers`` as a layer, with forward hooks."""
        for layer in layers:
            self._handles.append(layer.register_forward_pre_hook(
                lambda m, a: self.begin_layer()))
            self._handles.append(layer.register_forward_hook(
                lambda m, a, o: self.end_layer(), always_call=True))
        if root is not None:
            self._handles.append(root.register_forward_pre_hook(lambda m, a: self.begin_pass()))
            self._handles.append(root.register_forward_hook(
                lambda m, a, o: self.end_pass(), always_call=True))

    def detach(self) -> None:
        """Remove the hooks :meth:`attach` added."""
        for handle in self._handles:
            handle.remove()
        self._handles.clear()

    @contextmanager
    def forward_pass(self) -> Iterator[None]:
        """One forward of the root (SMP v2's offload_wrapper)."""
        self.begin_pass()
        try:
            if self.offload_outside_layers and self._pass is not None:
                with self._hooks:
                    yield
            else:
                yield
        finally:
            self.end_pass()

    def begin_pass(self) -> None:
        with self._lock:
            self._pass_depth += 1
            if self._pass_depth == 1 and torch.is_grad_enabled():  # else nothing is saved
                self._pass = _Pass()  # kept alive by its layers' saved tensors

    def end_pass(self) -> None:
        with self._lock:
            self._pass_depth -= 1
            if self._pass_depth > 0 or self._pass is None:
                return
            done, self._pass = self._pass, None
            self._top_up(done, len(done.groups))  # SMP starts the prefetch here

    def begin_layer(self) -> None:
        with self._lock:
            if self._pass is None:  # recomputation in backward, or no pass running
                return
            self._layer_depth += 1
            if self._layer_depth > 1:
                return  # a checkpointed module inside one: the outer one's inputs count
            self._group = _Group(self._pass, len(self._pass.groups))
        if not self.offload_outside_layers:
            self._hooks.__enter__()

    def end_layer(self) -> None:
        with self._lock:
            if self._pass is None or self._layer_depth == 0:
                return
            self._layer_depth -= 1
            if self._layer_depth > 0:
                return
            group, self._group = self._group, None
            if group is not None and group.count:  # nothing saved: run without grad
                self._pass.groups.append(group)
                self.stats.layers_offloaded += 1
        if not self.offload_outside_layers:
            self._hooks.__exit__(None, None, None)

    # -- the saved-tensor hooks --------------------------------------------------------
    def _pack(self, tensor: torch.Tensor) -> Any:
        if (type(tensor) is not torch.Tensor or tensor.device != self.device
                or tensor.layout != torch.strided):
            return tensor  # a parameter (alive anyway), another device, a DTensor
        with self._lock:
            group = self._group
            saved = _Saved(self._to_cpu(tensor), group)
            self._live.add(saved)
            self.stats.tensors_offloaded += 1
            self.stats.bytes_offloaded += tensor.numel() * tensor.element_size()
            if group is not None:
                group.handles.append(weakref.ref(saved, group.forget_one))
                group.count += 1
                group.alive += 1
        return saved

    def _unpack(self, saved: Any) -> torch.Tensor:
        if isinstance(saved, torch.Tensor):
            return saved
        with self._lock:
            group = saved.group
            if group is None or group.state == "consumed":
                # not a layer's (v2), or used again (a second backward): fetch just it
                self._fetch(saved)
                tensor, ready = saved.on_device, saved.ready
                saved.on_device = saved.ready = None
            else:
                if saved.on_device is None:  # backward got here before the prefetch
                    self._make_room(group)
                    self._bring(group)
                    self.stats.fetched_on_demand += 1
                tensor, ready = saved.on_device, saved.ready
                group.unpacked.add(id(saved))
                if len(group.unpacked) >= group.count:  # backward has all it keeps
                    self._release(group)
                    group.state = "consumed"
                    self._top_up(group.pass_, group.index)
        assert tensor is not None
        if ready is not None:  # the copy ran on the side stream
            current = torch.cuda.current_stream(self.device)
            current.wait_event(ready)
            tensor.record_stream(current)
        return tensor

    # -- copies ----------------------------------------------------------------------
    def _to_cpu(self, tensor: torch.Tensor) -> torch.Tensor:
        if self._stream is None:
            return tensor.detach().clone()
        stream = self._stream
        stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(stream):
            cpu = torch.empty(tensor.size(), dtype=tensor.dtype, pin_memory=True)
            cpu.copy_(tensor.detach(), non_blocking=True)
        tensor.record_stream(stream)  # its memory is not reused before the copy is done
        return cpu

    def _fetch(self, saved: _Saved) -> None:
        if self._stream is None:
            saved.on_device = saved.cpu.clone()
            return
        with torch.cuda.stream(self._stream):  # after this tensor's own offload copy
            saved.on_device = saved.cpu.to(self.device, non_blocking=True)
            saved.ready = torch.cuda.Event()
            saved.ready.record(self._stream)

    # -- the horizon -----------------------------------------------------------------
    def _bring(self, group: _Group) -> None:
        for saved in group.saved():
            if saved.on_device is None:
                self._fetch(saved)
        group.state = "resident"
        self._resident.append(group)
        self.stats.max_resident = max(self.stats.max_resident, self.resident_layers())

    def _release(self, group: _Group) -> None:
        for saved in group.saved():
            saved.on_device = saved.ready = None
        if group in self._resident:
            self._resident.remove(group)

    def _make_room(self, needed: _Group) -> None:
        """Send back prefetched layers until ``needed`` fits in the horizon: another
        pass's first, else this pass's earliest (needed last)."""
        self._resident = [g for g in self._resident if g.alive]
        while len(self._resident) >= self.horizon:
            others = [g for g in self._resident if g.pass_ is not needed.pass_]
            victim = others[0] if others else min(self._resident, key=lambda g: g.index)
            self._release(victim)
            victim.state = "offloaded"
            self.stats.evicted += 1

    def _top_up(self, pass_: _Pass, below: int) -> None:
        """Prefetch the layers before index ``below`` of ``pass_``, latest first, while
        fewer than ``horizon`` layers are resident."""
        self._resident = [g for g in self._resident if g.alive]
        for group in reversed(pass_.groups[:below]):
            if len(self._resident) >= self.horizon:
                return
            if group.state == "offloaded" and group.alive:
                self._bring(group)
                self.stats.prefetched += 1


def normalise(device: torch.device | str) -> torch.device:
    """``device``, with the current CUDA device's index when it names none."""
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        return torch.device("cuda", torch.cuda.current_device())
    return device


# -- finding layers and applying ---------------------------------------------------------
def checkpointed_layers(root: nn.Module) -> list[nn.Module]:
    """The outermost checkpointed modules under ``root``: those
    ``apply_activation_checkpointing`` recomputes (SMP v1 marks) and torch's
    ``checkpoint_wrapper`` modules (SMP v2 scripts)."""
    found = [(name, m) for name, m in root.named_modules()
             if is_recomputed(m) or isinstance(m, CheckpointWrapper)]
    names = [name for name, _ in found]
    return [m for name, m in found
            if not any(o != name and (o == "" or name.startswith(o + ".")) for o in names)]
