"""The mixed-precision policy of one ``mp.init()``, decided once from ``bf16`` / ``fp16``.

Every wrapper follows the same policy (FSDP's): parameters stay float32 (the optimizer
updates float32 masters), the forward and backward compute with parameters cast to
``param_dtype``, gradients are reduced in ``reduce_dtype`` (float32), buffers keep their
dtype, and ``fp16`` needs loss scaling. :mod:`modelparallel.parallel.precision` has one
translation per wrapper (FSDP2, FSDP1, the parameter views of DDP, replicas and
``transform``); none decides the policy again.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from modelparallel.config import Config

HALF = {"bf16": torch.bfloat16, "fp16": torch.float16}


@dataclass(frozen=True)
class PrecisionPolicy:
    """What each dtype is while training (``None``: the tensor's own, float32)."""

    param_dtype: torch.dtype | None = None  # parameters as the forward reads them
    reduce_dtype: torch.dtype | None = None  # gradients as they are averaged
    buffer_dtype: torch.dtype | None = None  # buffers (kept as they are on every path)
    loss_scaling: bool = False  # float16 gradients underflow without it

    @classmethod
    def decide(cls, config: Config) -> PrecisionPolicy:
        """Full float32 by default; ``bf16`` / ``fp16``: compute in the half type with
        float32 parameters and float32 gradient reduction (``fp16`` with loss scaling)."""
        half = config.half_precision
        if half is None:
            return cls()
        return cls(param_dtype=HALF[half], reduce_dtype=torch.float32,
                   loss_scaling=half == "fp16")

    @property
    def name(self) -> str:
        """The configuration's name for it: ``fp16``, ``bf16`` or ``fp32``."""
        if self.param_dtype is None:
            return "fp32"
        return {torch.float16: "fp16", torch.bfloat16: "bf16"}[self.param_dtype]

    @property
    def mixed(self) -> bool:
        """Whether the forward computes in a type other than the parameters'."""
        return self.param_dtype is not None
