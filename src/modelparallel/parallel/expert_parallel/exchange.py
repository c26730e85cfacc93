"""All-to-all with uneven splits, differentiable: what tokens travel by.

``torch.distributed.all_to_all_single`` moves the rows; its backward is the same
exchange with the split sizes swapped (each rank sends the gradient of what it received
back to where it came from). torch's differentiable wrapper
(``torch.distributed.nn.functional.all_to_all_single``) is deprecated in favour of a
private module, so this small Function uses the public collective.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist


class _AllToAll(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, rows: torch.Tensor, send: list[int], receive: list[int],
                group: dist.ProcessGroup) -> torch.Tensor:
        ctx.send, ctx.receive, ctx.group = send, receive, group
        return _exchange(rows, send, receive, group)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        return _exchange(grad, ctx.receive, ctx.send, ctx.group), None, None, None


def _exchange(rows: torch.Tensor, send: list[int], receive: list[int],
              group: dist.ProcessGroup) -> torch.Tensor:
    out = rows.new_empty((sum(receive), *rows.shape[1:]))
    dist.all_to_all_single(out, rows.contiguous(), output_split_sizes=receive,
                           input_split_sizes=send, group=group)
    return out


def all_to_all(rows: torch.Tensor, send: list[int], receive: list[int],
               group: dist.ProcessGroup) -> torch.Tensor:
    """Send ``rows[sum(send[:r]):sum(send[:r + 1])]`` to rank ``r`` of ``group`` and
    return what every rank sent here, in rank order (``receive[r]`` rows from rank
    ``r``). Differentiable in ``rows``."""
    return _AllToAll.apply(rows, send, receive, group)


def exchange_counts(send: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    """Each rank's ``send[r]`` (how many rows it sends to rank ``r``) in, how many rows
    each rank sends here out: one small all-to-all before the rows travel."""
    receive = torch.empty_like(send)
    dist.all_to_all_single(receive, send, group=group)
    return receive
