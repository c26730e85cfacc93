"""Schedule names, their constraints (checked up front), stage placement and rounds."""

import pytest
from torch.distributed.pipelining import schedules as torch_schedules

from modelparallel.config import Config, ConfigError
from modelparallel.parallel.pipeline.schedules import (
    CLASSES,
    rank_of_stage,
    round_size,
    schedule_class,
    stages_of_rank,
)
from modelparallel.schedule_rules import PIPELINE_SCHEDULES


def problems(**config) -> dict[str, str]:
    try:
        Config.load(config)
    except ConfigError as e:
        return dict(e.problems)
    return {}


def test_every_configurable_schedule_has_a_torch_class():
    assert set(CLASSES) == set(PIPELINE_SCHEDULES)
    assert CLASSES["simple"] is torch_schedules.ScheduleGPipe
    assert CLASSES["interleaved"] is torch_schedules.Schedule1F1B  # SMP v1's default


@pytest.mark.parametrize("name", sorted(PIPELINE_SCHEDULES))
def test_each_schedule_is_valid_with_its_defaults(name):
    assert problems(pipeline=name, pipeline_parallel_degree=2, microbatches=4) == {}


def test_unknown_schedule_lists_the_choices():
    msg = problems(pipeline="zero_bubble")["pipeline"]
    assert "interleaved_1f1b" in msg and "simple" in msg


def test_virtual_stages_need_a_multi_stage_schedule():
    msg = problems(pipeline="interleaved", virtual_stages=2)["virtual_stages"]
    assert "runs one stage per rank" in msg and "interleaved_1f1b" in msg


@pytest.mark.parametrize("name", ["zbv_zero_bubble", "dualpipe_v"])
def test_v_schedules_hold_exactly_two_stages_per_rank(name):
    msg = problems(pipeline=name, pipeline_parallel_degree=2, microbatches=8,
                   virtual_stages=3)["virtual_stages"]
    assert "exactly 2 stages" in msg


def test_dualpipe_needs_as_many_microbatches_as_stages():
    msg = problems(pipeline="dualpipe_v", pipeline_parallel_degree=4, microbatches=6)
    assert "at least as many microbatches as stages (8); got 6" in msg["microbatches"]


@pytest.mark.parametrize("name", ["interleaved_1f1b", "interleaved_zero_bubble"])
def test_interleaved_rounds_must_divide_the_microbatches(name):
    # 10 microbatches on 4 ranks: 2 rounds of 5 (valid); 9 on 4: 2 rounds (invalid)
    assert problems(pipeline=name, pipeline_parallel_degree=4, microbatches=10) == {}
    assert problems(pipeline=name, pipeline_parallel_degree=4, microbatches=3) == {}
    msg = problems(pipeline=name, pipeline_parallel_degree=4, microbatches=9)["microbatches"]
    assert "does not split into 2 equal rounds; use a multiple of 4" in msg


def test_active_microbatches_is_rejected_by_multi_stage_schedules():
    msg = problems(pipeline="looped_bfs", active_microbatches=2)["active_microbatches"]
    assert "honoured by 'simple' and 'interleaved' only" in msg
    assert problems(pipeline="simple", active_microbatches=2) == {}


def test_default_partition_counts_virtual_stages():
    assert problems(pipeline="interleaved_1f1b", pipeline_parallel_degree=2,
                    microbatches=2, default_partition=3) == {}
    msg = problems(pipeline_parallel_degree=2, default_partition=2)["default_partition"]
    assert "valid stages are 0..1" in msg


def test_loop_schedules_deal_stages_round_robin():
    assert [stages_of_rank("interleaved_1f1b", r, 2, 2) for r in (0, 1)] == [[0, 2], [1, 3]]
    assert stages_of_rank("looped_bfs", 1, 4, 3) == [1, 5, 9]
    assert stages_of_rank("interleaved", 3, 4, 1) == [3]


def test_v_schedules_fold_the_stages():
    assert [stages_of_rank("zbv_zero_bubble", r, 4, 2) for r in range(4)] == \
        [[0, 7], [1, 6], [2, 5], [3, 4]]
    assert rank_of_stage("dualpipe_v", 7, 4, 2) == 0
    assert rank_of_stage("interleaved_1f1b", 7, 4, 2) == 3


def test_rounds_honour_active_microbatches():
    assert round_size("simple", 8, 2, None) == 8
    assert round_size("simple", 8, 2, 3) == 2       # largest divisor of 8 within 3
    assert round_size("simple", 8, 2, 8) == 8
    assert round_size("interleaved", 8, 4, 4) == 8  # 1F1B keeps 4 in flight anyway
    assert round_size("interleaved", 8, 4, 2) == 2
    assert round_size("interleaved_1f1b", 8, 4, None) == 8


def test_1f1b_with_fewer_microbatches_than_ranks_runs_as_gpipe():
    assert schedule_class("interleaved", 1, 2) is torch_schedules.ScheduleGPipe
    assert schedule_class("interleaved", 2, 2) is torch_schedules.Schedule1F1B
    assert schedule_class("interleaved_1f1b", 1, 2) is torch_schedules.ScheduleInterleaved1F1B
