"""Per-step metrics: loss, throughput, step time, peak memory and collective bytes."""

from __future__ import annotations

import os
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from modelparallel.context import ParallelContext
from modelparallel.observe import run_output
from modelparallel.observe.collectives import CollectiveCounter
from modelparallel.observe.tensor_memory import PeakTensorMemory
from modelparallel.topology import CommGroup


@dataclass
class StepRecord:
    """One training step as seen by this rank (loss averaged over data-parallel ranks)."""

    step: int
    samples: int
    tokens: int | None = None
    loss: float | None = None
    step_time_s: float = 0.0
    samples_per_s: float = 0.0
    tokens_per_s: float | None = None
    peak_memory_bytes: int = 0
    # "cuda": CUDA max allocated this step; "tensors": peak CPU tensor bytes this step
    # (PeakTensorMemory); "tensors, max of steps 1-3": the largest of those measured
    memory_kind: str = "tensors"
    comm_bytes: dict[str, float] = field(default_factory=dict)  # per group, this rank
    comm_calls: dict[str, int] = field(default_factory=dict)

    def format(self) -> str:
        parts = [f"step {self.step:>5}"]
        if self.loss is not None:
            parts.append(f"loss {self.loss:.4f}")
        parts.append(f"{self.step_time_s * 1e3:7.1f} ms")
        parts.append(f"{self.samples_per_s:8.1f} samples/s")
        if self.tokens_per_s is not None:
            parts.append(f"{self.tokens_per_s:9.0f} tokens/s")
        parts.append(f"mem {self.peak_memory_bytes / 2**20:.0f} MiB ({self.memory_kind})")
        # groups that moved under 0.005 MiB (bookkeeping: usage flags, loss averages)
        # would print as 0.00; metrics.jsonl keeps them
        shown = {k: v for k, v in self.comm_bytes.items() if v >= 0.005 * 2**20}
        if shown:
            comm = ", ".join(f"{k} {v / 2**20:.2f} MiB" for k, v in sorted(shown.items()))
            parts.append(f"comm {comm}")
        return " | ".join(parts)


class StepMetrics:
    """Measure training steps; rank 0 prints them and appends them to a JSON-lines file.

    Usage::

        metrics = mp.observe.StepMetrics(jsonl="runs/metrics.jsonl", print_every=10)
        for batch in loader:
            with metrics.step(samples=global_batch, tokens=global_batch * seq_len) as rec:
                loss = train_step(batch)
                rec.loss = loss          # a tensor or a float, this rank's loss

    ``samples``/``tokens`` are the counts the whole job processes in the step.
    Collective bytes are counted while the step body runs (``count_collectives``).

    Under ``modelparallel run`` (or in a training job) rank 0 writes into the run
    directory (``MP_RUN_DIR``): ``metrics.jsonl``, ``layout.json`` and TensorBoard
    events (``tensorboard``: None = when the package is installed, True = required,
    False = none); see ``modelparallel.observe.run_output``. ``run_dir=`` names one
    under plain ``python``, where nothing is written otherwise. ``jsonl=`` (or a job's
    ``MP_METRICS_FILE``) gets the lines too. ``total_steps=N`` shows a progress bar with
    an ETA on a terminal, and adds ``| 25/300 8% ETA 01:52`` to the printed lines
    elsewhere. ``close()`` ends the bar and flushes the events (also done at exit).

    Peak memory: on CUDA ``torch.cuda.max_memory_allocated`` of the step
    (``memory_kind`` "cuda"). On CPU the peak bytes of tensor storage alive during the
    step, measured with ``PeakTensorMemory`` (the profiler's allocator events): the
    first ``memory_steps`` steps (default 3; None = every step) are measured and say
    ``memory_kind`` "tensors"; profiling slows a step, so later steps are not measured
    and report the largest measured peak, with ``memory_kind``
    "tensors, max of steps 1-3".
    """

    def __init__(self, *, jsonl: str | Path | None = None, print_every: int = 1,
                 count_collectives: bool = True, printer: Callable[[str], None] | None = None,
                 context: ParallelContext | None = None, total_steps: int | None = None,
                 run_dir: str | Path | None = None, tensorboard: bool | None = None,
                 memory_steps: int | None = 3):
        # inside a training job, the job records the steps too (MP_METRICS_FILE)
        jsonl = jsonl or os.environ.get(run_output.METRICS_FILE)
        self.jsonl = Path(jsonl) if jsonl else None
        self.run_dir = Path(run_dir) if run_dir else run_output.run_dir_from_env()
        if total_steps is not None and total_steps < 1:
            raise ValueError(f"total_steps must be at least 1, not {total_steps}")
        self.total_steps = total_steps
        if memory_steps is not None and memory_steps < 0:
            raise ValueError(f"memory_steps must be at least 0, not {memory_steps}")
        self.memory_steps = memory_steps
        self._measured_peak: int | None = None  # the largest CPU tensor peak measured
        self.tensorboard = tensorboard
        self.print_every = print_every
        self.count_collectives = count_collectives
        self._printer = printer
        self.printer = printer or (lambda line: print(line, file=sys.stdout, flush=True))
        self.records: list[StepRecord] = []
        self._step = 0
        self.context = context
        self._output: run_output.RunOutput | None = None  # rank 0's, made at the first step

    def _context(self) -> ParallelContext:
        """The layout whose data-parallel ranks the loss is averaged over."""
        if self.context is None:
            raise ValueError("StepMetrics needs the layout: use mp.observe.StepMetrics "
                             "after mp.init(), or pass context=")
        return self.context

    @contextmanager
    def step(self, *, samples: int, tokens: int | None = None) -> Iterator[StepRecord]:
        s = self._context()
        self._step += 1
        rec = StepRecord(step=self._step, samples=samples, tokens=tokens)
        cuda = s.device.type == "cuda"
        if cuda:
            torch.cuda.reset_peak_memory_stats(s.device)
        counter = CollectiveCounter(dict(s.group_labels or {})) if self.count_collectives else None
        measure = not cuda and (self.memory_steps is None or self._step <= self.memory_steps)
        memory = PeakTensorMemory() if measure else None
        start = time.perf_counter()
        with memory if memory is not None else nullcontext(), \
                counter if counter is not None else nullcontext():
            yield rec
        if cuda:
            torch.cuda.synchronize(s.device)
        rec.step_time_s = time.perf_counter() - start
        if memory is not None:
            self._measured_peak = max(self._measured_peak or 0, memory.peak_bytes)
        self._finish(s, rec, counter, cuda, measured=memory)

    def _finish(self, ctx: ParallelContext, rec: StepRecord, counter: CollectiveCounter | None,
                cuda: bool, measured: PeakTensorMemory | None) -> None:
        rec.samples_per_s = rec.samples / rec.step_time_s
        if rec.tokens is not None:
            rec.tokens_per_s = rec.tokens / rec.step_time_s
        if cuda:
            rec.peak_memory_bytes, rec.memory_kind = torch.cuda.max_memory_allocated(ctx.device), \
                "cuda"
        elif measured is not None:
            rec.peak_memory_bytes, rec.memory_kind = measured.peak_bytes, "tensors"
        else:  # steps after the measured ones
            rec.peak_memory_bytes = self._measured_peak or 0
            rec.memory_kind = f"tensors, max of steps 1-{self.memory_steps}" \
                if self._measured_peak is not None else "none"
        if counter is not None:
            rec.comm_bytes, rec.comm_calls = dict(counter.bytes), dict(counter.calls)
        if rec.loss is not None:
            rec.loss = _mean_over_data_parallel(rec.loss, ctx)
        self.records.append(rec)
        if ctx.rank == 0:
            if self._output is None:
                self._output = run_output.RunOutput(
                    ctx, jsonl=self.jsonl, run_dir=self.run_dir, tensorboard=self.tensorboard,
                    total_steps=self.total_steps, print_every=self.print_every,
                    printer=self._printer)
            self._output.write(rec)

    def close(self) -> None:
        """End the progress bar and flush the TensorBoard events (also done at exit)."""
        if self._output is not None:
            self._output.close()


def _mean_over_data_parallel(loss: Any, ctx: ParallelContext) -> float:
    value = torch.as_tensor(loss.detach() if isinstance(loss, torch.Tensor) else loss,
                            dtype=torch.float64, device=ctx.device).reshape(())
    group = ctx.process_group(CommGroup.DP_GROUP)
    if dist.get_world_size(group) > 1:
        dist.all_reduce(value, group=group)
        value /= dist.get_world_size(group)
    return float(value)
