"""``modelparallel plan --memory-per-device``: every layout of a world size, planned,
those that fit ranked by estimated time per sequence trained.

A layout is a pipeline, tensor-parallel and hybrid-shard degree whose product of the
first two divides the world (the rest is data parallelism, sharded over
``hybrid_shard_degree`` ranks and replicated over the others), and, for a model context
parallelism splits (a Hugging Face causal LM of ``MODEL_TYPES``) without a pipeline, a
context-parallel degree dividing the shard degree; for a model whose experts expert
parallelism splits, without a pipeline (with or without tensor parallelism), an
expert-parallel degree dividing the data-parallel size and the experts (both planned
with ``transform`` + ``shard``, the API that has them); the configuration's other keys
are kept. Layouts train different numbers of sequences per step (the ranks of a pipeline or a
context-parallel group read the same ones), so they are ranked by step time per
sequence. To keep the search quick, each layout simulates one rank per pipeline
stage (the first of its tensor-, context- and data-parallel groups: their ranks hold
equal shares, up to FSDP's padding of the last shard); planning the chosen layout
alone simulates every rank.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

from modelparallel.config import Config, ConfigError
from modelparallel.data import BatchSizeError
from modelparallel.parallel.context_parallel.hugging_face import find_causal_lm
from modelparallel.parallel.expert_parallel.hugging_face import expert_count, find_experts
from modelparallel.plan import JobPlan, PlanError, plan_job
from modelparallel.plan.device_model import DeviceModel
from modelparallel.plan.estimate import StepEstimate, estimate_step
from modelparallel.plan.fake_world import fake_tensors
from modelparallel.plan.workload import Workload
from modelparallel.topology import CommGroup, Topology


@dataclass
class Candidate:
    config: dict[str, Any]
    plan: JobPlan | None = None
    estimate: StepEstimate | None = None
    refused: str | None = None  # why the layout is not a candidate
    rows_per_step: int = 0  # sequences the whole job trains per step

    @property
    def peak_bytes(self) -> int:
        return max(r.peak_bytes for r in self.plan.ranks) if self.plan else 0

    @property
    def seconds_per_row(self) -> float:
        """The estimated step time per sequence trained (what the ranking compares)."""
        return self.estimate.step_s / self.rows_per_step if self.estimate else 0.0


def layouts(world_size: int, base: dict[str, Any], context_parallel: bool = False,
            experts: tuple[int, ...] = ()) -> list[dict[str, Any]]:
    """Every (pp, tp, hybrid_shard_degree) of ``world_size`` over the ``base`` keys, and
    with ``context_parallel`` every context-parallel degree > 1 of those without a
    pipeline (a divisor of the shard degree); for a model whose layers hold ``experts``
    experts (each layer's count), every expert-parallel degree > 1 dividing the
    data-parallel size and every count, of the layouts without a pipeline (expert
    parallelism combines with tensor parallelism and hybrid sharding, not with a
    pipeline)."""
    out = []
    for pp in _divisors(world_size):
        for tp in _divisors(world_size // pp):
            dp = world_size // (pp * tp)
            for shard in _divisors(dp):
                config = {**base, "pipeline_parallel_degree": pp, "tensor_parallel_degree": tp,
                          "hybrid_shard_degree": shard, "context_parallel_degree": 1,
                          "expert_parallel_degree": 1}
                if pp > 1:
                    config["microbatches"] = max(base.get("microbatches", 1), pp)
                out.append(config)
                if context_parallel and pp == 1:
                    out += [{**config, "context_parallel_degree": cp}
                            for cp in _divisors(shard) if cp > 1]
                if experts and pp == 1:
                    out += [{**config, "expert_parallel_degree": ep} for ep in _divisors(dp)
                            if ep > 1 and all(count % ep == 0 for count in experts)]
    return out


def search(work: Workload, device: DeviceModel, memory_per_device: int) -> list[Candidate]:
    """Every layout, planned: those that fit first, the least time per sequence first;
    then the others."""
    found = []
    for config in layouts(work.world_size, work.config, *_model_traits(work)):
        candidate = Candidate(config)
        found.append(candidate)
        candidate.refused = _unsplittable(work, config)
        if candidate.refused:  # not simulated: a step that raises leaves collectives behind
            continue
        try:
            loaded = Config.load(config, environ={})
            topology = Topology.from_config(loaded, work.world_size)
            firsts = [r for r in range(work.world_size)
                      if all(v == 0 for d, v in topology.coordinate(r).items() if d != "pp")]
            readers = CommGroup.RDP_GROUP if loaded.prescaled_batch else CommGroup.DP_GROUP
            candidate.rows_per_step = work.batch_size * topology.reading_rank(0, readers)[1]
            # context and expert parallelism are SMP v2's: their layouts run transform +
            # shard
            api = "v2" if topology.cp > 1 or topology.ep > 1 else work.api
            candidate.plan = plan_job(replace(work, config=config, api=api), firsts)
            candidate.estimate = estimate_step(candidate.plan.ranks, device, topology.pp,
                                               config.get("microbatches", 1))
            if candidate.peak_bytes > memory_per_device:
                candidate.refused = (f"peak {human_bytes(candidate.peak_bytes)} > "
                                     f"{human_bytes(memory_per_device)} per device")
        except (ConfigError, PlanError) as error:
            candidate.refused = str(error).splitlines()[0]
        except BatchSizeError as error:  # e.g. more microbatches than the batch has rows
            candidate.refused = f"not possible: {str(error).split(';')[0]}"
    return sorted(found, key=lambda c: (c.refused is not None, c.seconds_per_row))


def _model_traits(work: Workload) -> tuple[bool, tuple[int, ...]]:
    """Whether context parallelism knows the model, and the number of experts of each
    experts module expert parallelism knows (the model built on fake tensors to see
    them, as ``transform`` finds them). Whether this one's settings allow them
    (attention implementation, sliding window, dropout, router loss) its layouts' plans
    say."""
    with fake_tensors():
        model = work.build()
    counts = tuple(expert_count(m) or 0 for _, m in find_experts(model))
    return find_causal_lm(model) is not None, counts


def _unsplittable(work: Workload, config: dict[str, Any]) -> str | None:
    """Why the batch cannot be split into the layout's microbatches, or the sequence
    into its context-parallel chunks (None: both can). A tensor-parallel group may
    concatenate its ranks' batches: a batch that does not split even then does not
    split at all."""
    microbatches = config.get("microbatches", 1)
    if work.batch_size * config.get("tensor_parallel_degree", 1) % microbatches:
        return (f"not possible: a batch of {work.batch_size} rows per rank does not split "
                f"into microbatches={microbatches} equal parts")
    chunks = 2 * config.get("context_parallel_degree", 1)
    if chunks > 2 and work.seq_len % chunks:
        return (f"not possible: a sequence of {work.seq_len} tokens does not split into "
                f"2 x context_parallel_degree = {chunks} equal chunks")
    return None


def human_bytes(n: float) -> str:
    for unit, size in (("TiB", 2**40), ("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= size:
            return f"{n / size:.2f} {unit}"
    return f"{n:.0f} B"


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]
