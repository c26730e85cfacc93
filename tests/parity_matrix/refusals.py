"""Which cases the library must refuse, and with what: rules written here, not asked of it."""

from __future__ import annotations

from dataclasses import dataclass

from modelparallel.schedule_rules import SPLIT_BACKWARD_SCHEDULES
from parity_matrix.space import CONTEXT_PARALLEL_MODELS, Case
from parity_matrix.zoo import TIED_MODELS


@dataclass(frozen=True)
class Refusal:
    """What the library must say instead of training: the key its ConfigError names, a
    fragment of the message, and whether the configuration alone decides it (then
    ``check-config`` refuses it too)."""

    key: str
    fragment: str
    by_config: bool


def expected_refusal(case: Case) -> Refusal | None:
    """The refusal a case must get, from rules written here (not asked of the library)."""
    lay = case.layout
    if lay.ep > 1:
        refusal = _expert_parallel_refusal(case)
        if refusal is not None:
            return refusal
    if lay.cp > 1:
        refusal = _context_parallel_refusal(case)
        if refusal is not None:
            return refusal
    if case.path in ("ddp", "smddp") and lay.hsd >= 2:
        return Refusal("hybrid_shard_degree", "replicates; use mp.shard()", by_config=False)
    shards = lay.dp_shard > 1 and (not case.ddp or lay.hsd >= 2)
    if lay.schedule in SPLIT_BACKWARD_SCHEDULES and shards:
        return Refusal("pipeline", "computes weight gradients in a separate pass",
                       by_config=True)
    if case.path == "fsdp1":  # what torch's FSDP1 cannot follow (parallel/fsdp1_limits.py)
        tied = case.model in TIED_MODELS
        if lay.tp > 1 and tied:
            return Refusal("tensor_parallel_degree", "flattens the tied parameters",
                           by_config=False)
        if (lay.tp == 1 and lay.dp_shard == 1 and tied and case.precision != "fp32"
                and case.accumulation == "no_sync"):
            return Refusal(case.precision, "cannot accumulate gradients in no_sync()",
                           by_config=False)
    return None


# Expert parallelism as built today: the paths whose wrappers average the experts'
# gradients over the ranks holding them, and whether tensor parallelism combines with it
# (what is not built is refused in one message; add a path here when it is built)
EXPERT_PARALLEL_BUILT_PATHS = ("shard", "ddp", "fsdp1")
EXPERT_PARALLEL_WITH_TP = ("shard",)  # the wrappers ep x tp is built under
_WRAPPER_CALLS = {"shard": "mp.shard()", "ddp": "mp.replicate()",
                  "fsdp1": "FullyShardedDataParallel"}


def _expert_parallel_refusal(case: Case) -> Refusal | None:
    """SMP v2's expert parallelism: tsm.transform with a MoEConfig, then a data-parallel
    wrapper that knows the experts; no pipeline or context parallelism (SMP refuses
    them), tensor parallelism our extension (under mp.shard)."""
    key, lay = "expert_parallel_degree", case.layout
    if lay.dp % lay.ep:
        return Refusal(key, "does not divide the data-parallel size", by_config=True)
    if lay.pp > 1:
        return Refusal(key, "cannot be combined with pipeline_parallel_degree", by_config=True)
    if lay.cp > 1:
        return Refusal(key, "combined with context_parallel_degree", by_config=True)
    if case.path == "v1":
        return Refusal(key, "mp.DistributedModel (SMP v1) does not split experts",
                       by_config=False)
    wrapper = "ddp" if case.path == "smddp" else case.path  # SMDDP's DDP: mp.replicate
    if wrapper not in EXPERT_PARALLEL_BUILT_PATHS:
        return Refusal(key, f"with {_WRAPPER_CALLS[wrapper]} is not built yet",
                       by_config=False)
    if lay.tp > 1 and wrapper not in EXPERT_PARALLEL_WITH_TP:
        return Refusal(key, f"under {_WRAPPER_CALLS[wrapper]} is not built yet",
                       by_config=False)
    if case.path == "smddp":  # SMDDP's DDP of a model nobody transformed
        return Refusal(key, "was not split over the expert-parallel ranks", by_config=False)
    return None


def _context_parallel_refusal(case: Case) -> Refusal | None:
    """SMP v2's context parallelism needs tsm.transform on a model it knows how to split."""
    key = "context_parallel_degree"
    if case.layout.dp_shard % case.layout.cp:  # the shard group holds the cp groups
        return Refusal("hybrid_shard_degree", "is not a multiple of context_parallel_degree",
                       by_config=True)
    if case.path == "v1":
        return Refusal(key, "mp.DistributedModel (SMP v1) does not split sequences",
                       by_config=False)
    if case.path == "smddp":  # SMDDP's DDP of a model nobody transformed
        return Refusal(key, "call tsm.transform(model) first", by_config=False)
    if case.model not in CONTEXT_PARALLEL_MODELS:
        return Refusal(key, "is not a model context parallelism knows how to split",
                       by_config=False)
    return None
