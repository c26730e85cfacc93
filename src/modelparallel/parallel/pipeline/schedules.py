"""Pipeline schedule names (SMP's and PyTorch's) and the torch classes behind them."""

from __future__ import annotations

from torch.distributed.pipelining import schedules as torch_schedules

from modelparallel.config import ConfigError

# SMP v1's names first: "simple" is GPipe, "interleaved" is SMP's 1F1B.
SINGLE_STAGE = {
    "simple": torch_schedules.ScheduleGPipe,
    "gpipe": torch_schedules.ScheduleGPipe,
    "interleaved": torch_schedules.Schedule1F1B,
    "1f1b": torch_schedules.Schedule1F1B,
}


def schedule_class(name: str) -> type:
    """The torch schedule class for the config's ``pipeline`` value."""
    try:
        return SINGLE_STAGE[name]
    except KeyError:
        raise ConfigError([("pipeline", f"{name!r} is not a pipeline schedule; choose one of "
                            f"{sorted(SINGLE_STAGE)}")]) from None
