"""The pipeline schedules a configuration may name, and their rules.

Which schedules exist (SMP v1's and torch's names), how many stages each places on a
rank, and what each needs of ``virtual_stages`` / ``microbatches``, said up front in
the configuration's terms (what torch's schedule classes would otherwise reject late).
This module imports nothing heavy: ``Config`` checks a configuration with it.
"""

from __future__ import annotations

# SMP v1's names ("simple" = GPipe, "interleaved" = 1F1B), torch's single-stage names,
# then the multi-stage schedules (several stages per rank): "loop" or "v" placement.
SINGLE_STAGE_SCHEDULES = ("simple", "interleaved", "gpipe", "1f1b")
MULTI_STAGE_SCHEDULES = {"interleaved_1f1b": "loop", "looped_bfs": "loop",
                         "interleaved_zero_bubble": "loop", "zbv_zero_bubble": "v",
                         "dualpipe_v": "v"}
PIPELINE_SCHEDULES = (*SINGLE_STAGE_SCHEDULES, *MULTI_STAGE_SCHEDULES)
# schedules that run a backward for the inputs and a later one for the weights
SPLIT_BACKWARD_SCHEDULES = ("interleaved_zero_bubble", "zbv_zero_bubble", "dualpipe_v")


def default_stages_per_rank(name: str) -> int:
    """Stages a rank holds under schedule ``name`` unless ``virtual_stages`` says."""
    return 2 if name in MULTI_STAGE_SCHEDULES else 1


def check_schedule(name: str, v: int, m: int, pp: int,
                   active_microbatches: int | None) -> list[tuple[str, str]]:
    """Problems, as ``(key, message)``, of schedule ``name`` with ``v`` stages per rank,
    ``m`` microbatches and ``pp`` pipeline ranks."""
    style = MULTI_STAGE_SCHEDULES.get(name)
    if style is None:
        if v != 1:
            return [("virtual_stages", f"{v} stages per rank needs a multi-stage schedule; "
                     f"pipeline={name!r} runs one stage per rank. Use one of "
                     f"{sorted(MULTI_STAGE_SCHEDULES)}, or drop virtual_stages")]
        return []
    problems = []
    if active_microbatches is not None:
        problems.append(("active_microbatches", f"pipeline={name!r} fixes how many "
                         "microbatches are in flight itself; active_microbatches is "
                         "honoured by 'simple' and 'interleaved' only, remove it"))
    if style == "v" and v != 2:
        problems.append(("virtual_stages", f"pipeline={name!r} places exactly 2 stages on "
                         f"each rank (a V: rank r holds stages r and {2 * pp - 1}-r); got "
                         f"{v}"))
    if name == "dualpipe_v" and m < pp * v:
        problems.append(("microbatches", f"pipeline='dualpipe_v' needs at least as many "
                         f"microbatches as stages ({pp * v}); got {m}"))
    if name in ("interleaved_1f1b", "interleaved_zero_bubble"):
        rounds = max(1, m // pp)
        if m % rounds:
            problems.append(("microbatches", f"pipeline={name!r} runs the microbatches in "
                             f"rounds of pipeline_parallel_degree ({pp}): {m} does not "
                             f"split into {rounds} equal rounds; use a multiple of {pp}, "
                             f"or fewer than {2 * pp}"))
    return problems


def check_sharded_stages(name: str, shard_ranks: int) -> list[tuple[str, str]]:
    """Problems of schedule ``name`` when FSDP shards each stage over ``shard_ranks``."""
    if name not in SPLIT_BACKWARD_SCHEDULES:
        return []
    return [("pipeline", f"{name!r} computes weight gradients in a separate pass after the "
                         f"input gradients, which FSDP's sharded data parallelism (here over "
                         f"{shard_ranks} ranks) cannot follow; use 'interleaved_1f1b' or "
                         f"'interleaved', or replicas (ddp=True, or hybrid_shard_degree=1)")]
