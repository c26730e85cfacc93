"""``torch.sagemaker.utils``: the helpers SMP v2 scripts import (``utils.timeit``,
``process_group_utils.get_global_ranks``, ``module_utils``), and the checkpoint
directory helpers of ``torch.sagemaker.checkpoint.utils``. SMP v1's
``smdistributed.modelparallel.torch.utils`` maps here too: its structure and size
helpers are re-exported."""

from modelparallel.smp.v1.nested_structures import (
    convert_args_to_device,
    dtype_size,
    flatten_structure,
    get_distribution_axis,
    get_tensor_size,
    is_instance_namedtuple,
    map_structure,
    product,
    rmsg,
    unflatten_structure,
)
from modelparallel.smp.v2.utils import process_group_utils, utils
from modelparallel.smp.v2.utils.utils import timeit

__all__ = ["convert_args_to_device", "dtype_size", "flatten_structure", "get_distribution_axis",
           "get_tensor_size",
           "is_instance_namedtuple", "map_structure", "process_group_utils", "product", "rmsg",
           "timeit", "unflatten_structure", "utils"]
