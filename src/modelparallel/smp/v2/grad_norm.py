"""``torch.sagemaker.grad_norm``: clipping by the global norm of a sharded or
tensor-parallel model (the same function as ``mp.clip_grad_norm_``)."""

from modelparallel.parallel.clip import clip_grad_norm_

__all__ = ["clip_grad_norm_"]
