"""The calls of SMP v1's ``FP16_Optimizer`` (Apex's, modified) that fp16 scripts make on
``smp.DistributedOptimizer``. Parameters stay float32 here (``fp16: True`` computes in
half precision with float32 parameters), so there are no separate master weights:
``backward`` scales the loss through the model, and the master-weight calls have
nothing to do."""

from __future__ import annotations

import logging
from typing import Any

import torch

from modelparallel.smp import registry

logger = logging.getLogger("modelparallel")


class FP16OptimizerCalls:
    """Mixed into ``DistributedOptimizer`` (which has ``clip_master_grads``)."""

    clip_master_grads: Any

    def backward(self, loss: torch.Tensor, update_master_grads: bool = True,
                 retain_graph: bool = False) -> None:
        """``FP16_Optimizer.backward(loss)``: the microbatch's backward, with the loss
        scaled (inside an ``@smp.step`` function, like ``model.backward``)."""
        if retain_graph:
            raise ValueError("optimizer.backward(retain_graph=True) is not supported: "
                             "the pipeline frees each microbatch's graph after backward")
        model = registry.model()
        if model is None:
            raise RuntimeError("optimizer.backward(loss) needs mp.DistributedModel: create it "
                               "before the optimizer and call backward in an @mp.step "
                               "function")
        model.backward(loss)

    def update_master_grads(self) -> None:
        """Nothing to do: the float32 parameters already hold the gradients (the loss
        scale is removed at ``step()``/``clip_master_grads``)."""

    def init_master_params(self) -> None:
        """Nothing to do: there are no separate master weights."""

    def clip_grad_norm(self, max_norm: float, norm_type: float = 2.0) -> Any:
        """Apex's name for :meth:`clip_master_grads`."""
        return self.clip_master_grads(max_norm, norm_type)
