"""``torch.sagemaker.checkpoint.constants``: the keys SMP puts into the state dicts it
makes (``_smp_is_partial``: a partial, per-rank state dict; ``_smp_load_info``: the layout
it was saved under). modelparallel's SMP v1 ``DistributedModel.load_state_dict`` accepts
and drops ``_smp_is_partial``."""

SMP_IS_PARTIAL_KEY = "_smp_is_partial"
SMP_IS_LOAD_INFO_KEY = "_smp_load_info"

__all__ = ["SMP_IS_LOAD_INFO_KEY", "SMP_IS_PARTIAL_KEY"]
