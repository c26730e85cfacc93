"""``torch.sagemaker.utils``: the helpers SMP v2 scripts import (``utils.timeit``,
``process_group_utils.get_global_ranks``, ``module_utils``), and the checkpoint
directory helpers of ``torch.sagemaker.checkpoint.utils``."""

from modelparallel.smp.utils import process_group_utils, utils
from modelparallel.smp.utils.utils import timeit

__all__ = ["process_group_utils", "timeit", "utils"]
