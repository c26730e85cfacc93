"""Silence Python warnings and named loggers for a block; both come back afterwards."""

from __future__ import annotations

import contextlib
import logging
import warnings
from collections.abc import Iterator


@contextlib.contextmanager
def quiet_logs(*names: str, level: int = logging.CRITICAL) -> Iterator[None]:
    """Ignore warnings and raise the loggers ``names`` to ``level`` while inside
    (errors still raise); their levels and the warning filters are restored after."""
    loggers = [logging.getLogger(name) for name in names]
    levels = [logger.level for logger in loggers]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for logger in loggers:
            logger.setLevel(level)
        try:
            yield
        finally:
            for logger, old in zip(loggers, levels, strict=True):
                logger.setLevel(old)
