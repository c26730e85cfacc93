"""Step-time comparison shared by the benchmarks: ours vs the same work done by hand.

Two rounds with fresh models, built in opposite order, each alternating the two
variants step by step; the ratio is the median of adjacent-pair ratios, averaged
(geometrically) over the rounds, so drift and build order cancel out.
"""

from __future__ import annotations

import math
import statistics
import time
from collections.abc import Callable

import torch
import torch.distributed as dist
from torch import nn

from modelparallel.models.gpt import lm_loss


def lm_batch(vocab_size: int, seq_len: int, batch: int) -> tuple[torch.Tensor, torch.Tensor]:
    """One fixed next-token batch, the same on every rank."""
    g = torch.Generator().manual_seed(0)
    seq = torch.randint(vocab_size, (batch, seq_len + 1), generator=g)
    return seq[:, :-1], seq[:, 1:]


def lm_step(model: nn.Module, opt: torch.optim.Optimizer, inputs: torch.Tensor,
            targets: torch.Tensor) -> None:
    opt.zero_grad(set_to_none=True)
    lm_loss(model(inputs), targets).backward()
    opt.step()


def compare_step_times(ours: Callable[[], nn.Module], hand: Callable[[], nn.Module],
                       optimizer: Callable[[nn.Module], torch.optim.Optimizer],
                       batch: tuple[torch.Tensor, torch.Tensor], steps: int) -> dict:
    """``ratio`` (ours / hand), per-round ``rounds`` ratios and each variant's mean of
    per-round median step times in seconds (``ours``, ``hand``)."""

    def stepper(build: Callable[[], nn.Module]) -> Callable[[], Callable[[], None]]:
        def make() -> Callable[[], None]:
            model = build()
            opt = optimizer(model)
            return lambda: lm_step(model, opt, *batch)
        return make

    return compare_steps(stepper(ours), stepper(hand), steps)


def compare_steps(ours: Callable[[], Callable[[], None]], hand: Callable[[], Callable[[], None]],
                  steps: int) -> dict:
    """As :func:`compare_step_times`, for variants whose builder returns their whole
    training step as a function of no arguments (model, optimizer and batch bound in).

    Every rank runs the same steps in the same order, so variants that are collective
    (a pipeline, a sharded model) stay in step across ranks.
    """
    ratios, medians = [], {"ours": [], "hand": []}
    for round_ in range(2):
        builders = [("ours", ours), ("hand", hand)]
        order = builders if round_ == 0 else builders[::-1]
        step_fns = {}  # the previous round's variants are freed before building anew
        for name, build in order:
            step_fns[name] = build()
        times: dict[str, list[float]] = {"ours": [], "hand": []}
        for i in range(steps + 2):  # two warm-up steps each
            for name in ("ours", "hand") if i % 2 else ("hand", "ours"):
                dist.barrier()
                start = time.perf_counter()
                step_fns[name]()
                dist.barrier()
                if i >= 2:
                    times[name].append(time.perf_counter() - start)
        ratios.append(statistics.median(a / b for a, b in zip(times["ours"], times["hand"],
                                                               strict=True)))
        for name in medians:
            medians[name].append(statistics.median(times[name]))
    return {"ratio": math.prod(ratios) ** (1 / len(ratios)), "rounds": ratios,
            **{name: statistics.mean(v) for name, v in medians.items()}}
