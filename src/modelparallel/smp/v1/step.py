"""SMP v1's ``@smp.step``: one forward and backward, run per microbatch."""

from __future__ import annotations

import functools
from collections.abc import Callable, Collection, Mapping

import torch
import torch.utils._pytree as pytree

from modelparallel.data.tokens import counting_step
from modelparallel.parallel.pipeline.microbatch import collect_step_outputs, split_step_inputs
from modelparallel.parallel.pipeline.runtime import Microbatch, running_microbatch
from modelparallel.smp import registry
from modelparallel.smp.state import state


def step(fn: Callable | None = None, *, non_split_inputs: Collection[str] = (),
         input_split_axes: Mapping[str, int] | None = None, detach_outputs: bool = True):
    """Decorate the function holding one forward and backward (SMP v1's ``smp.step``).

    Its tensor arguments are split into ``microbatches`` along the batch axis; the
    function runs once per microbatch; what it returns comes back as ``StepOutput``
    (per position of a returned tuple) on every rank of the pipeline.
    """

    def decorate(fn: Callable) -> Callable:
        @functools.wraps(fn)
        def run(*args, **kwargs):
            model = registry.model()
            if model is None:
                raise RuntimeError("create mp.DistributedModel(model) before calling a "
                                   "@mp.step function")
            if running_microbatch() is not None:
                raise RuntimeError("@mp.step functions cannot call each other")
            s = state.require("mp.step").context
            pieces = split_step_inputs(fn, args, kwargs, s.config.microbatches,
                                       non_split_inputs=non_split_inputs,
                                       input_split_axes=input_split_axes)
            mbs = [Microbatch(i, fn, a, k) for i, (a, k) in enumerate(pieces)]
            with counting_step(pieces):  # mp.global_token_count counts the whole step
                results = model.engine.run_step(mbs)
            model.run_post_step_hooks(registry.optimizer())
            if detach_outputs:
                results = pytree.tree_map(
                    lambda t: t.detach() if isinstance(t, torch.Tensor) else t, results)
            return collect_step_outputs(results)

        return run

    return decorate(fn) if fn is not None else decorate
