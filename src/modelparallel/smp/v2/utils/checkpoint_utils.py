"""``torch.sagemaker.checkpoint.utils``: keeping the newest N checkpoint directories."""

from __future__ import annotations

import os
import re
import shutil
from collections.abc import Callable
from typing import Any

from modelparallel.smp.v2.logger import get_logger


def _last_int(name: str) -> int:
    numbers = re.findall(r"\d+", os.path.basename(name.rstrip("/")))
    return int(numbers[-1]) if numbers else -1


SORT_BY_LAST_INT: Callable[[str], int] = _last_int
"""Sort key: the last integer in a directory's name (``..._120steps`` -> 120)."""


def limit_num_subdirs(path: str, num_to_keep: int | None,
                      sort_fn: Callable[[str], Any] = SORT_BY_LAST_INT,
                      regex: str | None = None, log: bool = True) -> list[str]:
    """Remove all but the ``num_to_keep`` last subdirectories of ``path`` (by
    ``sort_fn``, among those whose name matches ``regex``); returns what was removed.

    ``log`` names the one rank that logs and removes (SMP's scripts call it on every
    rank with ``log=rank == 0``); with ``log=False`` nothing is removed. ``num_to_keep``
    None or below 1 keeps everything.
    """
    if not log or not num_to_keep or num_to_keep < 1 or not os.path.isdir(path):
        return []
    pattern = re.compile(regex) if regex else None
    names = [n for n in os.listdir(path) if os.path.isdir(os.path.join(path, n))
             and (pattern is None or pattern.match(n))]
    names.sort(key=sort_fn)
    removed = names[:-num_to_keep] if len(names) > num_to_keep else []
    for name in removed:
        shutil.rmtree(os.path.join(path, name), ignore_errors=True)
        get_logger().info("removed old checkpoint %s", os.path.join(path, name))
    return removed
