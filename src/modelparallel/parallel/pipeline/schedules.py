"""Pipeline schedule names (SMP's and PyTorch's), the torch classes behind them, and
which stages each rank holds."""

from __future__ import annotations

from torch.distributed.pipelining import schedules as torch_schedules

from modelparallel.schedule_rules import MULTI_STAGE_SCHEDULES

CLASSES = {
    "simple": torch_schedules.ScheduleGPipe,
    "gpipe": torch_schedules.ScheduleGPipe,
    "interleaved": torch_schedules.Schedule1F1B,  # SMP v1's "interleaved" is 1F1B
    "1f1b": torch_schedules.Schedule1F1B,
    "interleaved_1f1b": torch_schedules.ScheduleInterleaved1F1B,
    "looped_bfs": torch_schedules.ScheduleLoopedBFS,
    "interleaved_zero_bubble": torch_schedules.ScheduleInterleavedZeroBubble,
    "zbv_zero_bubble": torch_schedules.ScheduleZBVZeroBubble,
    "dualpipe_v": torch_schedules.ScheduleDualPipeV,
}


def schedule_class(name: str, microbatches: int, ranks: int) -> type:
    """The torch class that runs ``microbatches`` per run under schedule ``name``.

    1F1B with fewer microbatches than ranks never reaches its steady state: it is GPipe
    (all forwards, then all backwards), which torch's ``Schedule1F1B`` refuses to run.
    """
    cls = CLASSES[name]
    if cls is torch_schedules.Schedule1F1B and microbatches < ranks:
        return torch_schedules.ScheduleGPipe
    return cls


def is_multi_stage(name: str) -> bool:
    return name in MULTI_STAGE_SCHEDULES


def stages_of_rank(name: str, rank: int, ranks: int, per_rank: int) -> list[int]:
    """The stage indices pipeline rank ``rank`` holds, in order.

    One stage per rank: its rank. Multi-stage "loop" schedules deal stages round-robin
    (rank r holds r, r + p, ...); "v" schedules fold them (rank r holds r and 2p-1-r),
    so the first and the last stage share rank 0.
    """
    if MULTI_STAGE_SCHEDULES.get(name) == "v":
        return sorted({rank, 2 * ranks - 1 - rank})
    return [rank + k * ranks for k in range(per_rank)]


def rank_of_stage(name: str, stage: int, ranks: int, per_rank: int) -> int:
    for rank in range(ranks):
        if stage in stages_of_rank(name, rank, ranks, per_rank):
            return rank
    raise ValueError(f"stage {stage} is on no rank of {ranks} x {per_rank}")


def round_size(name: str, microbatches: int, stages: int, active: int | None) -> int:
    """Microbatches per schedule run so that at most ``active`` are in flight at once.

    GPipe keeps all of a run's microbatches in flight and 1F1B up to ``stages``; a step
    with more runs the schedule several times over equal rounds (gradients accumulate),
    which is how ``active_microbatches`` is honoured.
    """
    if active is None or is_multi_stage(name):  # config rejects active for multi-stage
        return microbatches
    peak = microbatches if CLASSES[name] is torch_schedules.ScheduleGPipe else \
        min(microbatches, stages)
    if peak <= active:
        return microbatches
    return max(k for k in range(1, active + 1) if microbatches % k == 0)
