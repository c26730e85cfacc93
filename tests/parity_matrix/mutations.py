"""Bugs injected into a case's run (never its reference), to show the judge fails them.

``Case.mutation`` names one; tests/distributed/test_matrix_judge.py runs each in every
precision and expects ``FAIL``:

- ``zero_grad``: one tensor's gradient (the first attention query weight) zeroed before
  the optimizer step, on every rank;
- ``skip_allreduce``: DDP's first gradient bucket kept as each rank computed it (its
  all-reduce dropped);
- ``double_loss``: the loss gradient doubled (in fp16: the loss scale is not undone);
- ``unused_grad``: a parameter the forward never uses given a zero gradient (one
  process leaves it ``None``: no optimizer state, no weight decay);
- ``expert_grads_over_holders``: expert parallelism's expert gradients divided by the
  ranks holding each expert (``dp / ep``) instead of every data-parallel rank (``dp``):
  multiplied by ``ep``, as without the all-reduce hook that divides by ``ep`` more
  (fp64 only: tests/distributed/test_matrix_judge.py).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from parity_matrix.space import Case

MUTATIONS = ("zero_grad", "skip_allreduce", "double_loss", "unused_grad",
             "expert_grads_over_holders")


def before_step(case: Case, model: nn.Module) -> None:
    """What the mutation does between the backward passes and the optimizer step."""
    if case.mutation == "zero_grad":
        p = next(p for n, p in model.named_parameters() if n.endswith("0.attn.q_proj.weight"))
        assert p.grad is not None, "the mutated gradient exists"
        p.grad.zero_()
    elif case.mutation == "unused_grad":
        p = next(p for n, p in model.named_parameters() if n.endswith("unused"))
        assert p.grad is None, "one process gives the unused parameter no gradient"
        p.grad = torch.zeros_like(p)
    elif case.mutation == "expert_grads_over_holders":
        from modelparallel.parallel import expert_parallel

        experts = expert_parallel.expert_parameters(model)
        assert experts, "the model's experts are split"
        for p in experts:
            assert p.grad is not None
            p.grad.mul_(case.layout.ep)


def skip_first_bucket(model: nn.Module) -> None:
    """Average every DDP bucket over the ranks but the first, which keeps this rank's
    own gradients."""
    from torch.nn.parallel import DistributedDataParallel

    if not isinstance(model, DistributedDataParallel):
        raise ValueError("skip_allreduce mutates DDP (the ddp and smddp paths)")

    def hook(state, bucket):  # (DDP reads the annotations: no postponed ones here)
        buffer = bucket.buffer()
        if bucket.index() == 0:
            done: torch.futures.Future[torch.Tensor] = torch.futures.Future()
            done.set_result(buffer)
            return done
        buffer.div_(dist.get_world_size())
        return dist.all_reduce(buffer, async_op=True).get_future().then(
            lambda fut: fut.value()[0])

    hook.__annotations__ = {"bucket": dist.GradBucket,
                            "return": torch.futures.Future[torch.Tensor]}
    model.register_comm_hook(None, hook)
