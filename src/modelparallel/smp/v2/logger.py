"""``torch.sagemaker.logger``: the logger SMP v2 scripts write their progress to."""

from __future__ import annotations

import logging
import os

_FORMAT = "%(asctime)s %(levelname)s [rank {rank}] %(name)s: %(message)s"


def get_logger(name: str = "modelparallel.script") -> logging.Logger:
    """A logger that prints INFO and above to stderr with this rank's number (the
    handler is added once per logger; set its level to change what is shown)."""
    logger = logging.getLogger(name)
    if not any(getattr(h, "_mp_owned", False) for h in logger.handlers):
        handler = logging.StreamHandler()
        handler.setFormatter(logging.Formatter(_FORMAT.format(
            rank=os.environ.get("RANK", "0"))))
        handler._mp_owned = True  # type: ignore[attr-defined]
        logger.addHandler(handler)
        logger.setLevel(logging.INFO)
        logger.propagate = False  # printed once, not again by the root logger
    return logger
