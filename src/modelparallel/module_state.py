"""What the library keeps about a module: one typed record per module.

The library sets no attributes of its own on a user's module. A module it marks or
transforms gets one :class:`ModuleState`, kept in the module's ``__dict__`` under
:data:`KEY` (as torch's composable APIs keep theirs), and each part of the library
reads and writes its own fields of it. Torch's wrappers (FSDP1, the activation
checkpoint and offload wrappers) forward the attribute lookups they miss to the module
they wrap; :func:`lookup` follows them the same way, so what was set on a model is
still found through the wrapper a script puts around it.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from torch import nn

KEY = "_modelparallel_state"

# torch's wrappers that pass a missed attribute lookup on to the module they hold: FSDP1,
# the activation checkpoint/offload wrappers, torch.compile's OptimizedModule
_FORWARDING_CHILDREN = ("_fsdp_wrapped_module", "_checkpoint_wrapped_module", "_orig_mod")


@dataclass
class ModuleState:
    """One module's record. ``None`` is "not set": :func:`lookup` then asks the module a
    torch wrapper holds."""

    # tensor parallelism
    tensor_parallel: bool | None = None  # mp.set_tensor_parallelism / tensor_parallelism()
    tensor_parallel_split: bool | None = None  # transform(): whether a plan split the model
    split_regions: Any = None  # transform()'s SplitRegions (parallel/tensor/regions.py)
    stored_shapes: dict[str, tuple[int, ...]] | None = None  # Conv1D: the full shapes
    init_args: tuple[tuple, dict] | None = None  # SMP: a registered class's arguments
    tp_options: dict[str, Any] | None = None  # SMP: tensor_parallelism(**options) at creation
    # context parallelism: its SequenceSplit (parallel/context_parallel/hugging_face.py),
    # on the model and on each attention module
    context_parallel: Any = None
    # expert parallelism: on the model, its split experts modules; on each of those, its
    # ExpertParallelExperts (parallel/expert_parallel/hugging_face.py)
    expert_parallel: Any = None
    # a MoE model's load-balancing loss over the batch (parallel/expert_parallel/router_loss.py)
    router_loss: Any = None
    # pipeline parallelism
    partition: int | None = None  # the stage mp.partition / set_partition gave it
    # activations
    activation_checkpointing: bool | None = None  # marked: preserve_rng_state
    recomputed: bool | None = None  # apply_activation_checkpointing checkpointed it
    activation_offloader: Any = None  # its ActivationOffloader (parallel/offload_roots.py)
    # precision
    compute_dtype: Any = None  # the half type compute_in gave it (a torch.dtype)
    # data parallelism
    unused_gradients: Any = None  # its UnusedGradients tracker (parallel/unused_grads.py)
    fsdp1_policy: bool | None = None  # an FSDP1 unit wrapped under the library's policy
    fsdp1_root_mesh: Any = None  # that unit's root DeviceMesh
    no_sync_noted: bool | None = None  # the FSDP1 no_sync notice was given for it
    # parameters read through views (parallel/param_views.py)
    param_views: dict[str, list] | None = None
    param_views_pinned: dict[str, int] | None = None
    param_views_saved: list[list[tuple[str, Any]]] | None = None  # per forward in flight


FIELDS = frozenset(f.name for f in dataclasses.fields(ModuleState))


def own_state(module: nn.Module) -> ModuleState | None:
    """``module``'s own record, if it has one (never a wrapped module's)."""
    return module.__dict__.get(KEY)


def state_of(module: nn.Module) -> ModuleState:
    """``module``'s own record, made on first use."""
    state = module.__dict__.get(KEY)
    if state is None:
        state = module.__dict__[KEY] = ModuleState()
    return state


def lookup(module: nn.Module, field: str, default: Any = None) -> Any:
    """The value of ``field`` for ``module``: its own record's, else (through torch's
    wrappers, as their attribute lookup goes) the wrapped module's; ``default`` if none
    sets it."""
    if field not in FIELDS:
        raise AttributeError(f"ModuleState has no field {field!r}")
    seen: nn.Module | None = module
    while seen is not None:
        state = seen.__dict__.get(KEY)
        if state is not None and (value := getattr(state, field)) is not None:
            return value
        children = seen.__dict__.get("_modules", {})
        seen = next((children[n] for n in _FORWARDING_CHILDREN if n in children), None)
    return default
