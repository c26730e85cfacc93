"""``torch.sagemaker.utils.utils``: timing a block of a script."""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator

from modelparallel.smp.v2.logger import get_logger


@contextlib.contextmanager
def timeit(enabled: bool = True, name: str = "block", rank: int | None = None,
           ) -> Iterator[None]:
    """Log how long the block took, as ``<name> took <seconds>s`` (only where ``rank``
    is None or 0, so a job prints it once; nothing when not ``enabled``)."""
    start = time.perf_counter()
    yield
    if enabled and rank in (None, 0):
        get_logger().info("%s took %.3fs", name, time.perf_counter() - start)
