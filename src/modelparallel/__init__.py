"""modelparallel: hybrid sharded, tensor and pipeline parallel training from one config.

Scripts written for the SageMaker model parallel library port by changing the import::

    import modelparallel as smp   # was: import smdistributed.modelparallel.torch as smp
    import modelparallel as tsm   # was: import torch.sagemaker as tsm
"""

from modelparallel import data, observe
from modelparallel.comm import (
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
from modelparallel.config import Config, ConfigError
from modelparallel.parallel import (
    TPPlan,
    clip_grad_norm_,
    find_blocks,
    full_state_dict,
    load_full_state_dict,
    loss_parallel,
    replicate,
    set_tensor_parallelism,
    shard,
    tensor_parallelism,
    tp_register_with_module,
    transform,
)
from modelparallel.state import NotInitializedError, init, reset, state
from modelparallel.topology import CommGroup, RankType, Topology

__version__ = "0.1.0"


__all__ = [
    "DP_GROUP", "MP_GROUP", "PP_GROUP", "RDP_GROUP", "TP_GROUP", "WORLD",
    "CommGroup", "Config", "ConfigError", "NotInitializedError", "RankType", "TPPlan", "Topology",
    "allgather", "barrier", "broadcast", "clip_grad_norm_", "data", "dp_barrier", "dp_rank",
    "dp_size",
    "find_blocks", "full_state_dict", "get_dp_group", "get_dp_process_group", "get_mp_group",
    "get_mp_process_group", "get_pp_group", "get_pp_process_group", "get_process_group",
    "get_rdp_group", "get_rdp_process_group", "get_tp_group", "get_tp_process_group",
    "get_world_process_group", "init", "load_full_state_dict", "local_rank", "local_size",
    "loss_parallel", "mp_barrier", "mp_rank",
    "mp_size", "observe", "pp_rank", "pp_size", "rank", "rdp_rank", "rdp_size", "recv_from",
    "replicate", "reset", "send", "set_tensor_parallelism", "shard", "size", "state",
    "tensor_parallelism", "tp_rank", "tp_register_with_module", "tp_size", "transform",
]
