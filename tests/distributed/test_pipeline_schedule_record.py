"""Recording real torch.distributed.pipelining schedules on 2 gloo ranks."""

import torch
from torch import nn
from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe

import modelparallel as mp
from modelparallel.parallel.pipeline.record import (
    ScheduleRecorder,
    bubble_fraction,
    gather_events,
    render_grid,
)

MICROBATCHES = 4


def record_case(schedule_name: str):
    mp.init({"pipeline_parallel_degree": 2})
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(256, 256) for _ in range(4)])
    rank = mp.pp_rank()
    stage = PipelineStage(model[2 * rank:2 * rank + 2], stage_index=rank, num_stages=2,
                          device=torch.device("cpu"), group=mp.get_pp_process_group())
    schedule_cls = {"gpipe": ScheduleGPipe, "1f1b": Schedule1F1B}[schedule_name]
    schedule = schedule_cls(stage, n_microbatches=MICROBATCHES,
                            loss_fn=lambda out, y: out.pow(2).mean())
    x, y = torch.randn(64, 256), torch.randn(64, 256)

    def step():
        # the first stage feeds the input, the last one the target for the loss
        if stage.is_first:
            schedule.step(x)
        else:
            schedule.step(target=y)

    step()  # warm-up: shape inference and first-call costs stay out of the recording
    with ScheduleRecorder([stage], rank=rank) as recorder:
        step()
    events = gather_events(recorder.events, group=mp.get_pp_process_group())
    return events, render_grid(events, width=60), bubble_fraction(events)


def by_rank(events, rank):
    return [e for e in events if e.rank == rank]


def test_gpipe_recording(workers):
    results = workers(2).run(record_case, schedule_name="gpipe")
    events, grid, bubble = results[0]
    assert results[1][0] == events  # every rank got the same gathered events
    print(grid)
    for rank in (0, 1):
        mine = by_rank(events, rank)
        assert all(e.stage == rank for e in mine)
        for kind in "FB":
            assert sorted(e.microbatch for e in mine if e.kind == kind) == [0, 1, 2, 3]
        assert len(mine) == 2 * MICROBATCHES
    first = {e.microbatch: e for e in by_rank(events, 0) if e.kind == "F"}
    for e in by_rank(events, 1):
        if e.kind == "F":
            assert e.start >= first[e.microbatch].end
    assert min(e.start for e in events) == 0.0
    rows = [line for line in grid.splitlines() if line.startswith("rank ")]
    assert len(rows) == 2
    assert grid.splitlines()[-1].endswith("% measured")
    assert 0 < bubble < 1


def test_1f1b_order(workers):
    results = workers(2).run(record_case, schedule_name="1f1b")
    events = results[0][0]
    order = {r: [f"{e.kind}{e.microbatch}" for e in by_rank(events, r)] for r in (0, 1)}
    # stage 0 warms up with num_stages forwards, the last stage with one
    assert order[0] == ["F0", "F1", "B0", "F2", "B1", "F3", "B2", "B3"]
    assert order[1] == ["F0", "B0", "F1", "B1", "F2", "B2", "F3", "B3"]
    # rank 0 backpropagates a microbatch only after rank 1 sent its input gradient
    last = {e.microbatch: e for e in by_rank(events, 1) if e.kind == "B"}
    for e in by_rank(events, 0):
        if e.kind == "B":
            assert e.start >= last[e.microbatch].end


def distributed_model_case(schedule: str):
    from modelparallel.models import GPT, GPTConfig
    from modelparallel.models.gpt import lm_loss

    mp.init({"pipeline_parallel_degree": 2, "microbatches": MICROBATCHES,
             "pipeline": schedule})
    torch.manual_seed(0)
    model = mp.DistributedModel(GPT(GPTConfig(vocab_size=64, max_seq_len=8, d_model=32,
                                              n_layers=4, n_heads=4)))

    @mp.step
    def train_step(model, x):
        loss = lm_loss(model(x), x)
        model.backward(loss)
        return loss

    x = torch.randint(64, (8, 8))
    train_step(model, x)  # the split and warm-up stay out of the recording
    with model.record_schedule() as recording:
        train_step(model, x)
    return recording.events, recording.grid(width=60), recording.bubble, recording.theoretical


def test_distributed_model_records_its_schedule(workers):
    results = workers(2).run(distributed_model_case, schedule="simple")
    events, grid, bubble, theoretical = results[0]
    assert results[1][0] == events
    print(grid)
    for rank in (0, 1):
        mine = by_rank(events, rank)
        assert {e.stage for e in mine} == {rank}
        for kind in "FB":
            assert sorted(e.microbatch for e in mine if e.kind == kind) == [0, 1, 2, 3]
    assert theoretical == 1 / 5  # (p-1) / (m+p-1)
    assert 0 < bubble < 1


def test_virtual_stages_show_in_the_recording(workers):
    events, _, _, theoretical = workers(2).run(distributed_model_case,
                                               schedule="interleaved_1f1b")[0]
    assert {e.stage for e in by_rank(events, 0)} == {0, 2}
    assert {e.stage for e in by_rank(events, 1)} == {1, 3}
    assert len(events) == 2 * 2 * 2 * MICROBATCHES  # F and B, 2 ranks x 2 stages
    assert theoretical == 1 / 9  # (p-1) / (v m + p-1)
