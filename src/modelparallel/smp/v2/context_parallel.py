"""``torch.sagemaker.context_parallel.utils``: context parallelism is not built, so its
setup is refused (a configuration with ``context_parallel_degree`` > 1 is refused at
``init()`` already)."""

from __future__ import annotations

from typing import Any, NoReturn

NOT_SUPPORTED = ("context parallelism (sequences split over ranks) is not supported yet by "
                 "modelparallel; leave context_parallel_degree at 1")


def setup_transformer_engine_cp_groups(*args: Any, **kwargs: Any) -> NoReturn:
    """Refused: raises NotImplementedError."""
    raise NotImplementedError(NOT_SUPPORTED)
