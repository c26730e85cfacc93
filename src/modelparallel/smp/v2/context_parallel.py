"""``torch.sagemaker.context_parallel.utils``: SMP's setup of Transformer Engine's
context-parallel groups. Context parallelism here is built into ``tsm.transform``
(ring attention over ``tsm.state.cp_process_group``, docs/context-parallel.md) and uses
no Transformer Engine modules, so there are no such groups to set up."""

from __future__ import annotations

from typing import Any, NoReturn

NOT_SUPPORTED = ("setup_transformer_engine_cp_groups sets up Transformer Engine's context-"
                 "parallel groups, and modelparallel uses no Transformer Engine modules: its "
                 "context parallelism is built into tsm.transform (context_parallel_degree "
                 "and cp_comm_type; docs/context-parallel.md). Remove the call")


def setup_transformer_engine_cp_groups(*args: Any, **kwargs: Any) -> NoReturn:
    """Refused: raises NotImplementedError (see the module's docstring)."""
    raise NotImplementedError(NOT_SUPPORTED)
