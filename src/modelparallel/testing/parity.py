"""Train the same model in one process and in many, and compare every step.

The single-process reference sees the whole global batch; a data-parallel rank sees
its slice. Losses are compared at every step and all parameters at the end.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
from torch.distributed.tensor import DTensor

Batch = tuple[torch.Tensor, torch.Tensor]


@dataclass
class TrainResult:
    losses: list[float]  # the global-batch mean loss of every step
    params: dict[str, torch.Tensor]  # every parameter at the end, full and on CPU


def token_batches(steps: int, global_batch: int, seq_len: int, vocab: int,
                  seed: int = 0) -> list[Batch]:
    """Random next-token batches: (inputs, targets) of shape (global_batch, seq_len)."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(steps):
        seq = torch.randint(vocab, (global_batch, seq_len + 1), generator=g)
        out.append((seq[:, :-1], seq[:, 1:]))
    return out


def local_rows(batch: Batch, index: int, count: int) -> Batch:
    """Rows of ``batch`` that replica ``index`` of ``count`` trains on."""
    rows = batch[0].shape[0]
    if rows % count:
        raise ValueError(f"global batch of {rows} rows does not split over {count} replicas")
    n = rows // count
    return batch[0][index * n:(index + 1) * n], batch[1][index * n:(index + 1) * n]


def train(model: nn.Module, batches: Sequence[Batch], *,
          optimizer: Callable[[nn.Module], torch.optim.Optimizer],
          loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
          replica: tuple[int, int] = (0, 1),
          group: dist.ProcessGroup | None = None,
          loss_context: Callable[[], AbstractContextManager] = contextlib.nullcontext,
          before_step: Callable[[nn.Module], object] | None = None) -> TrainResult:
    """Train on this replica's rows of every batch; losses are averaged over ``group``.

    The loss and its backward run inside ``loss_context()`` (``mp.loss_parallel`` for
    vocabulary-sharded logits); ``before_step(model)`` runs between backward and the
    optimizer step (gradient clipping).
    """
    opt = optimizer(model)
    losses = []
    for batch in batches:
        inputs, targets = local_rows(batch, *replica)
        opt.zero_grad(set_to_none=True)
        with loss_context():
            loss = loss_fn(model(inputs), targets)
            loss.backward()
        if before_step is not None:
            before_step(model)
        opt.step()
        if isinstance(loss, DTensor):
            loss = loss.full_tensor()
        value = loss.detach().double()
        if group is not None and dist.get_world_size(group) > 1:
            dist.all_reduce(value, group=group)
            value /= dist.get_world_size(group)
        losses.append(float(value))
    return TrainResult(losses, full_parameters(model))


def full_parameters(model: nn.Module) -> dict[str, torch.Tensor]:
    """Every parameter, unsharded and on CPU, under its original name (any wrapper)."""
    if not dist.is_initialized():
        return {k: v.detach().cpu().clone() for k, v in model.state_dict().items()}
    sd: dict[str, Any] = get_model_state_dict(model,
                                              options=StateDictOptions(full_state_dict=True))
    return {k: v.detach().cpu().clone() for k, v in sd.items()}


def parity_problems(result: TrainResult, reference: TrainResult, rtol: float = 1e-5,
                    atol: float = 1e-8) -> list[str]:
    """Every loss with relative error above ``rtol``, and every parameter tensor whose
    largest difference exceeds ``rtol`` times its largest absolute value plus ``atol``.

    ``atol`` is a round-off floor for parameters whose exact gradient is zero (an
    attention key bias: softmax ignores a constant added to every logit of a row);
    they hold only float noise of ~1e-11, which no relative test can compare.
    """
    problems = []
    if len(result.losses) != len(reference.losses):
        problems.append(f"{len(result.losses)} losses vs {len(reference.losses)} reference")
    for step, (a, b) in enumerate(zip(result.losses, reference.losses, strict=False)):
        if not abs(a - b) <= rtol * abs(b):  # written so that NaN fails too
            problems.append(f"step {step}: loss {a:.8f} vs reference {b:.8f} "
                            f"(relative error {abs(a - b) / abs(b):.2e})")
    if set(result.params) != set(reference.params):
        differ = sorted(set(result.params) ^ set(reference.params))
        problems.append(f"parameter names differ: {differ}")
    for name in sorted(set(result.params) & set(reference.params)):
        a_t, b_t = result.params[name].float(), reference.params[name].float()
        if a_t.shape != b_t.shape:
            problems.append(f"{name}: shape {tuple(a_t.shape)} vs {tuple(b_t.shape)}")
            continue
        diff, scale = (a_t - b_t).abs().max().item(), b_t.abs().max().item()
        if not diff <= rtol * scale + atol:  # NaN fails
            problems.append(f"{name}: max difference {diff:.3e} > {rtol} x max |value| "
                            f"{scale:.3e} + {atol}")
    return problems


def assert_parity(result: TrainResult, reference: TrainResult, rtol: float = 1e-5,
                  atol: float = 1e-8) -> None:
    problems = parity_problems(result, reference, rtol, atol)
    if problems:
        raise AssertionError("parallel run differs from the single-process reference:\n  "
                             + "\n  ".join(problems))
