"""Under FSDP, a parameter no data-parallel rank used keeps no gradient, as in one process.

FSDP reduces each unit's gradients in backward. A parameter a rank did not use (a branch
its batch did not take) must still join that reduction with zeros, or the ranks' calls
differ (FSDP2 then aborts the process: :func:`track_fsdp2` turns on its zero filling;
FSDP1 always reduces whole flat parameters). The zeros are right where another rank
used the parameter (one process averages its gradient over the global batch the same
way), but where no rank did, the optimizer would step a zero gradient (weight decay,
momentum, optimizer state) that one process never has: a parameter without a gradient
is skipped.

:class:`UnusedGradients` records, with a hook on the tensor each unit's forward reads,
which parameters got a gradient on this rank, and at the next optimizer step (torch's
global step pre-hook, for an optimizer holding them) all-reduces one flag per parameter
(and one whether it had a gradient before) over the data-parallel group: one small
collective per step. Under FSDP2 a gradient made since the parameter last had none,
from zeros alone, is taken away again (a gradient a script keeps across steps stays:
zeros added to it change nothing). FSDP1
cannot follow: it hands the optimizer flat gradients (``use_orig_params=False``), and
its optimizer state dicts need a state for every parameter of a unit
(``use_orig_params=True``); there the step is refused, naming the parameters and the
ways out.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist
import torch.utils._pytree as pytree
from torch import nn
from torch.distributed.fsdp import FSDPModule, FullyShardedDataParallel
from torch.distributed.fsdp._common_utils import clean_tensor_name  # FSDP1's own names
from torch.optim.optimizer import register_optimizer_step_pre_hook

from modelparallel.module_state import own_state, state_of

Site = tuple[nn.Module, str]  # a module attribute a forward reads a parameter through


class UnusedGradients:
    """One flag per parameter: whether this rank's backward passes since the last
    optimizer step gave it a gradient; settled at the step (see the module)."""

    def __init__(self, group: dist.ProcessGroup, device: torch.device):
        self.group = group
        self.device = device
        self.names: list[str] = []
        self.stepped: list[torch.Tensor] = []  # what the optimizer holds, per parameter
        self.cleared: list[list[torch.Tensor]] = []  # whose .grad goes when unused
        self.refusal = ""  # what is said instead of clearing (FSDP1)
        self.used: list[bool] = []
        self.fresh: list[bool] = []  # had no gradient at some backward since the step
        self.backward = False  # a backward reached the units since the last step
        self._hooked: weakref.WeakValueDictionary[int, torch.Tensor] = \
            weakref.WeakValueDictionary()
        self._handles: list[Any] = []  # the module hooks, removed by close()
        # optimizers seen -> whether they hold these parameters (asked once each)
        self._holders: weakref.WeakKeyDictionary[torch.optim.Optimizer, bool] = \
            weakref.WeakKeyDictionary()

    def add(self, name: str, stepped: torch.Tensor, cleared: list[torch.Tensor]) -> int:
        """A parameter: ``stepped`` is what the optimizer holds, ``cleared`` the tensors
        whose gradients are this parameter's (taken away when no rank used it)."""
        self.names.append(name)
        self.stepped.append(stepped)
        self.cleared.append(cleared)
        self.used.append(False)
        self.fresh.append(True)
        return len(self.names) - 1

    def watch(self, unit: nn.Module, sites: dict[int, list[Site]]) -> None:
        """Before ``unit``'s forward (after FSDP gathered its parameters) hook the tensors
        its ``sites`` hold, each tensor once (FSDP2 reuses its unsharded parameters;
        FSDP1 makes new views: a checkpointed forward run again in backward feeds its
        gradients back through the first ones). After ``unit``'s forward, a hook on its
        outputs notes, when backward reaches them, which parameters have no gradient
        yet."""
        self._handles.append(unit.register_forward_pre_hook(self._hooker(sites)))

        def after(module: nn.Module, args: Any, output: Any) -> None:
            if not torch.is_grad_enabled():
                return
            for t in pytree.tree_leaves(output):
                if isinstance(t, torch.Tensor) and t.requires_grad:
                    t.register_hook(self._noter(list(sites)))

        self._handles.append(unit.register_forward_hook(after))

    def _hooker(self, sites: dict[int, list[Site]]) -> Callable[[nn.Module, Any], None]:
        def before(module: nn.Module, args: Any) -> None:
            if not torch.is_grad_enabled():
                return
            for i, places in sites.items():
                for owner, name in places:
                    t = getattr(owner, name, None)
                    if not isinstance(t, torch.Tensor) or not t.requires_grad or \
                            self._hooked.get(id(t)) is t:
                        continue
                    self._hooked[id(t)] = t
                    t.register_hook(self._marker(i))
        return before

    def close(self) -> None:
        """Stop watching (another tracker covers these units now)."""
        for handle in self._handles:
            handle.remove()
        self._handles = []

    def _marker(self, i: int) -> Callable[[torch.Tensor], None]:
        def mark(grad: torch.Tensor) -> None:
            self.used[i] = True
        return mark

    def _noter(self, indices: list[int]) -> Callable[[torch.Tensor], None]:
        def note(grad: torch.Tensor) -> None:
            self.backward = True
            for i in indices:
                if all(t.grad is None for t in self.cleared[i]):
                    self.fresh[i] = True
        return note

    def settle(self, optimizer: torch.optim.Optimizer) -> None:
        """Before ``optimizer`` steps: if it holds these parameters, take the gradient
        away from those no rank used (see the module). Collective over the group."""
        holds = self._holders.get(optimizer)
        if holds is None:
            held = {id(p) for group in optimizer.param_groups for p in group["params"]}
            holds = self._holders[optimizer] = any(id(p) in held for p in self.stepped)
        if not holds or not self.backward:  # e.g. torch's zero step making optimizer
            return  # state before a checkpoint loads: no reduction made those zeros
        self.backward = False
        # per parameter: ranks that used it, ranks where it had a gradient already when a
        # backward started (a rank whose shard holds none of it never has one)
        n = len(self.used)
        flags = torch.tensor([*self.used, *(not f for f in self.fresh)], dtype=torch.int32,
                             device=self.device)
        if dist.get_world_size(self.group) > 1:
            dist.all_reduce(flags, group=self.group)
        counts = flags.tolist()
        idle = [i for i in range(n) if counts[i] == 0 and counts[n + i] == 0
                and self.stepped[i].requires_grad]
        self.used = [False] * len(self.used)
        self.fresh = [False] * len(self.fresh)
        if self.refusal and idle:
            names = ", ".join(self.names[i] for i in idle[:3]) + (" ..." if len(idle) > 3
                                                                  else "")
            raise RuntimeError(f"no data-parallel rank used {names} in this step: "
                               f"{self.refusal}")
        for i in idle:
            for t in self.cleared[i]:
                t.grad = None


_TRACKERS: list[weakref.ref[UnusedGradients]] = []
_installed: list[Any] = []


def _before_step(optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
    _TRACKERS[:] = [ref for ref in _TRACKERS if ref() is not None]
    for ref in list(_TRACKERS):
        tracker = ref()
        if tracker is not None:
            tracker.settle(optimizer)


def _register(tracker: UnusedGradients, model: nn.Module,
              units: Sequence[nn.Module]) -> None:
    """Keep ``tracker`` with ``model`` (it lives as long as the model); trackers of the
    ``units`` it covers (wrapped on their own before, e.g. FSDP1's auto-wrapped units)
    stop."""
    if not _installed:
        _installed.append(register_optimizer_step_pre_hook(_before_step))
    replaced = {id(old): old for m in [model, *units]
                if (state := own_state(m)) is not None
                and (old := state.unused_gradients) is not None}
    for old in replaced.values():
        old.close()
    _TRACKERS[:] = [ref for ref in _TRACKERS if id(ref()) not in replaced]
    for m in [model, *units]:
        state_of(m).unused_gradients = tracker
    _TRACKERS.append(weakref.ref(tracker))


def track_fsdp2(model: nn.Module, group: dist.ProcessGroup, device: torch.device) -> None:
    """The FSDP2 units in ``model``: zeros for the parameters a rank did not use (the
    ranks' reduce-scatters agree), none where no rank of ``group`` did."""
    units = [m for m in model.modules() if isinstance(m, FSDPModule)]
    if not units:
        return
    tracker = UnusedGradients(group, device)
    index: dict[int, int] = {}
    names = {id(p): n for n, p in model.named_parameters()}
    for unit in units:
        unit.set_reduce_scatter_unused_params(True, recurse=False)
        sites: dict[int, list[Site]] = {}
        for module in _own_modules(unit, lambda m: isinstance(m, FSDPModule)):
            for name, p in module._parameters.items():
                if p is None or not p.requires_grad:
                    continue
                if id(p) not in index:
                    index[id(p)] = tracker.add(names.get(id(p), name), p, [p])
                sites.setdefault(index[id(p)], []).append((module, name))
        if sites:
            tracker.watch(unit, sites)
    _register(tracker, model, units)


def track_fsdp1(root: FullyShardedDataParallel, group: dist.ProcessGroup,
                device: torch.device) -> None:
    """The FSDP1 units of ``root`` (built by our policy): a step after which a parameter
    no rank of ``group`` used would hold a zero gradient is refused (see the module)."""
    tracker = UnusedGradients(group, device)
    tracker.refusal = (
        "one process leaves them without a gradient, but torch's FSDP1 gives every "
        "parameter of a unit one (zeros: weight decay, momentum, optimizer state) and its "
        "optimizer state dicts need a state for each; freeze them (requires_grad_(False); "
        "with use_orig_params=False in an FSDP unit of their own), or use mp.shard() "
        "(FSDP2), which leaves them alone")
    units = FullyShardedDataParallel.fsdp_modules(root)
    prefixes = {id(m): name for name, m in root.named_modules()}
    for unit in units:
        handle = unit._handle  # private: the unit's FlatParamHandle (None: no parameters)
        if handle is None:
            continue
        flat: Any = handle.flat_param  # private FlatParameter metadata below
        orig = handle._use_orig_params
        sites: dict[int, list[Site]] = {}
        for k, info in enumerate(flat._param_infos):
            param = flat._params[k] if orig else flat
            if not param.requires_grad:
                continue
            aliases = [(shared.module, shared.param_name)
                       for shared in flat._shared_param_infos
                       if shared.prim_module is info.module
                       and shared.prim_param_name == info.param_name]
            # whether it has a gradient now: the parameter's own (the flat one's)
            name = ".".join(n for n in (prefixes[id(unit)], info.module_name,
                                        info.param_name) if n)
            i = tracker.add(clean_tensor_name(name), param, [param])
            sites[i] = [(info.module, info.param_name), *aliases]
        if sites:
            tracker.watch(unit.module, sites)
    _register(tracker, root, units)


def _own_modules(unit: nn.Module, is_unit: Callable[[nn.Module], bool]) -> list[nn.Module]:
    """``unit`` and its submodules, without the subtrees of nested units."""
    found, todo = [], [unit]
    while todo:
        m = todo.pop()
        found.append(m)
        todo += [c for c in m.children() if not is_unit(c)]
    return found
