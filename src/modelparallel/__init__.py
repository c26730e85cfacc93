"""modelparallel: hybrid sharded, tensor and pipeline parallel training from one config.

Scripts written for the SageMaker model parallel library port by changing the import::

    import modelparallel as smp   # was: import smdistributed.modelparallel.torch as smp
    import modelparallel as tsm   # was: import torch.sagemaker as tsm

Every SMP submodule path resolves under ``modelparallel`` too
(``modelparallel.delayed_param``, ``modelparallel.distributed.checkpoint...``), and
``modelparallel run --compat sagemaker`` runs a script with its SageMaker imports
unchanged: ``modelparallel_compat`` holds the one table of module paths.
"""
# ruff: noqa: F401  (_load's imports are the package's names, set by globals().update)

import importlib
import sys
import types
from typing import Any

import modelparallel_compat
from modelparallel.version import __version__ as __version__

# SMP's modules that take the names of this package's own subpackages: mp.checkpoint is
# SMP's checkpoint API (modelparallel.smp.checkpoints), mp.observe SMP's observe module.
_SMP_FACES = {"checkpoint": "modelparallel.smp.checkpoints",
              "observe": "modelparallel.smp.observe"}
_loaded = False


def _load() -> None:
    """Import the public API (torch and its distributed parts: seconds) at the first
    look at a name, so the ``modelparallel`` command's --help and ``import modelparallel``
    stay quick. The imports also register the built-in TP plans (models) and route
    torch's offload_wrapper (smp.offload)."""
    global _loaded
    if _loaded:
        return
    _loaded = True
    from modelparallel import data, models  # models: registers the built-in TP plans
    from modelparallel.checkpoint import CheckpointError
    from modelparallel.config import Config, ConfigError
    from modelparallel.data.sequences import split_for_context_parallel
    from modelparallel.data.tokens import global_token_count
    from modelparallel.parallel.activation import set_activation_checkpointing
    from modelparallel.parallel.blocks import find_blocks
    from modelparallel.parallel.clip import clip_grad_norm_
    from modelparallel.parallel.pipeline.microbatch import StepOutput
    from modelparallel.parallel.pipeline.runtime import OutsideStepError
    from modelparallel.parallel.precision import LossScaler
    from modelparallel.parallel.state_dict import full_state_dict, load_full_state_dict
    from modelparallel.parallel.tensor import (
        TPPlan,
        loss_parallel,
    )
    from modelparallel.smp import checkpoints as checkpoint
    from modelparallel.smp import nn, observe
    from modelparallel.smp.appliers import replicate, shard, transform
    from modelparallel.smp.checkpoints import resume_from_checkpoint, save_checkpoint
    from modelparallel.smp.delayed_param import delay_param_initialization, model_creation
    from modelparallel.smp.state import (
        NotInitializedError,
        init,
        is_initialized,
        reset,
        state,
    )
    from modelparallel.smp.v1 import amp
    from modelparallel.smp.v1 import fused_optimizers as optimizers
    from modelparallel.smp.v1.barriers_and_queries import (
        gather,
        is_tracing,
        num_microbatches,
        pp_barrier,
        rdp_barrier,
        shutdown,
        tp_barrier,
    )
    from modelparallel.smp.v1.distributed_model import (
        DistributedModel,
        partition,
        set_partition,
    )
    from modelparallel.smp.v1.distributed_optimizer import DistributedOptimizer
    from modelparallel.smp.v1.ranks import (
        DP_GROUP,
        MP_GROUP,
        PP_GROUP,
        RDP_GROUP,
        TP_GROUP,
        WORLD,
        allgather,
        barrier,
        broadcast,
        dp_barrier,
        dp_rank,
        dp_size,
        get_dp_group,
        get_dp_process_group,
        get_mp_group,
        get_mp_process_group,
        get_pp_group,
        get_pp_process_group,
        get_process_group,
        get_rdp_group,
        get_rdp_process_group,
        get_tp_group,
        get_tp_process_group,
        get_world_process_group,
        local_rank,
        local_size,
        mp_barrier,
        mp_rank,
        mp_size,
        pp_rank,
        pp_size,
        rank,
        rdp_rank,
        rdp_size,
        recv_from,
        send,
        size,
        tp_rank,
        tp_size,
    )
    from modelparallel.smp.v1.save_load import load, save
    from modelparallel.smp.v1.step import step
    from modelparallel.smp.v1.tensor_parallelism import (
        set_tensor_parallelism,
        tensor_parallelism,
    )
    from modelparallel.smp.v1.tp_register import tp_register, tp_register_with_module
    from modelparallel.smp.v2 import (
        activation_offload,  # routes torch's offload_wrapper
        ranker,
    )
    from modelparallel.smp.v2.logger import get_logger
    from modelparallel.topology import CommGroup, RankType, Topology
    globals().update({k: v for k, v in locals().items() if k in __all__})


def _smp_face(name: str) -> property:
    """The package attribute ``name``: SMP's module ``_SMP_FACES[name]`` (the public API
    loaded first); the import system's assignment of the subpackage of that name is
    ignored (``modelparallel.<name>`` stays importable by its path)."""

    def get(package: types.ModuleType) -> types.ModuleType:
        _load()
        return importlib.import_module(_SMP_FACES[name])

    def keep(package: types.ModuleType, subpackage: types.ModuleType) -> None:
        pass

    return property(get, keep)


class _Package(types.ModuleType):
    """This package's module type: ``checkpoint`` and ``observe`` stay SMP's modules
    when the subpackages of those names are imported (the import system sets the
    package's attribute to a subpackage it imports)."""

    checkpoint = _smp_face("checkpoint")
    observe = _smp_face("observe")


def __getattr__(name: str) -> Any:
    # other names are left to the import system: ``from modelparallel import config``
    # looks here first, then imports the submodule
    if name in __all__:
        _load()
        if name in globals():
            return globals()[name]
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))


modelparallel_compat.install()  # SMP's submodule paths under modelparallel
sys.modules[__name__].__class__ = _Package


__all__ = [
    "DP_GROUP",
    "MP_GROUP",
    "PP_GROUP",
    "RDP_GROUP",
    "TP_GROUP",
    "WORLD",
    "CheckpointError",
    "CommGroup",
    "Config",
    "ConfigError",
    "DistributedModel",
    "DistributedOptimizer",
    "LossScaler",
    "NotInitializedError",
    "OutsideStepError",
    "RankType",
    "StepOutput",
    "TPPlan",
    "Topology",
    "allgather",
    "amp",
    "barrier",
    "broadcast",
    "checkpoint",
    "clip_grad_norm_",
    "data",
    "delay_param_initialization",
    "dp_barrier",
    "dp_rank",
    "dp_size",
    "find_blocks",
    "full_state_dict",
    "gather",
    "get_dp_group",
    "get_dp_process_group",
    "get_logger",
    "get_mp_group",
    "get_mp_process_group",
    "get_pp_group",
    "get_pp_process_group",
    "get_process_group",
    "get_rdp_group",
    "get_rdp_process_group",
    "get_tp_group",
    "get_tp_process_group",
    "get_world_process_group",
    "global_token_count",
    "init",
    "is_initialized",
    "is_tracing",
    "load",
    "load_full_state_dict",
    "local_rank",
    "local_size",
    "loss_parallel",
    "model_creation",
    "models",
    "mp_barrier",
    "mp_rank",
    "mp_size",
    "nn",
    "num_microbatches",
    "observe",
    "optimizers",
    "partition",
    "pp_barrier",
    "pp_rank",
    "pp_size",
    "rank",
    "ranker",
    "rdp_barrier",
    "rdp_rank",
    "rdp_size",
    "recv_from",
    "replicate",
    "reset",
    "resume_from_checkpoint",
    "save",
    "save_checkpoint",
    "send",
    "set_activation_checkpointing",
    "set_partition",
    "set_tensor_parallelism",
    "shard",
    "shutdown",
    "size",
    "split_for_context_parallel",
    "state",
    "step",
    "tensor_parallelism",
    "tp_barrier",
    "tp_rank",
    "tp_register",
    "tp_register_with_module",
    "tp_size",
    "transform",
]
