"""``modelparallel plan --memory-per-device``: every layout of a world size, planned,
those that fit ranked by estimated step time.

A layout is a pipeline, tensor-parallel and hybrid-shard degree whose product of the
first two divides the world (the rest is data parallelism, sharded over
``hybrid_shard_degree`` ranks and replicated over the others); the configuration's
other keys are kept. To keep the search quick, each layout simulates one rank per
pipeline stage (the first of its tensor- and data-parallel groups: their ranks hold
equal shares, up to FSDP's padding of the last shard); planning the chosen layout
alone simulates every rank.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

from modelparallel.config import Config, ConfigError
from modelparallel.data import BatchSizeError
from modelparallel.plan import JobPlan, PlanError, plan_job
from modelparallel.plan.device_model import DeviceModel
from modelparallel.plan.estimate import StepEstimate, estimate_step
from modelparallel.plan.workload import Workload
from modelparallel.topology import Topology


@dataclass
class Candidate:
    config: dict[str, Any]
    plan: JobPlan | None = None
    estimate: StepEstimate | None = None
    refused: str | None = None  # why the layout is not a candidate

    @property
    def peak_bytes(self) -> int:
        return max(r.peak_bytes for r in self.plan.ranks) if self.plan else 0


def layouts(world_size: int, base: dict[str, Any]) -> list[dict[str, Any]]:
    """Every (pp, tp, hybrid_shard_degree) of ``world_size`` over the ``base`` keys."""
    out = []
    for pp in _divisors(world_size):
        for tp in _divisors(world_size // pp):
            dp = world_size // (pp * tp)
            for shard in _divisors(dp):
                config = {**base, "pipeline_parallel_degree": pp, "tensor_parallel_degree": tp,
                          "hybrid_shard_degree": shard}
                if pp > 1:
                    config["microbatches"] = max(base.get("microbatches", 1), pp)
                out.append(config)
    return out


def search(work: Workload, device: DeviceModel, memory_per_device: int) -> list[Candidate]:
    """Every layout, planned: those that fit first, fastest first; then the others."""
    found = []
    for config in layouts(work.world_size, work.config):
        candidate = Candidate(config)
        found.append(candidate)
        candidate.refused = _unsplittable(work, config)
        if candidate.refused:  # not simulated: a step that raises leaves collectives behind
            continue
        try:
            topology = Topology.from_config(Config.load(config, environ={}), work.world_size)
            firsts = [r for r in range(work.world_size)
                      if all(v == 0 for d, v in topology.coordinate(r).items() if d != "pp")]
            candidate.plan = plan_job(replace(work, config=config), firsts)
            candidate.estimate = estimate_step(candidate.plan.ranks, device, topology.pp,
                                               config.get("microbatches", 1))
            if candidate.peak_bytes > memory_per_device:
                candidate.refused = (f"peak {human_bytes(candidate.peak_bytes)} > "
                                     f"{human_bytes(memory_per_device)} per device")
        except (ConfigError, PlanError) as error:
            candidate.refused = str(error).splitlines()[0]
        except BatchSizeError as error:  # e.g. more microbatches than the batch has rows
            candidate.refused = f"not possible: {str(error).split(';')[0]}"
    return sorted(found, key=lambda c: (c.refused is not None,
                                        c.estimate.step_s if c.estimate else 0.0))


def _unsplittable(work: Workload, config: dict[str, Any]) -> str | None:
    """Why the batch cannot be split into the layout's microbatches (None: it can).
    A tensor-parallel group may concatenate its ranks' batches: a batch that does not
    split even then does not split at all."""
    microbatches = config.get("microbatches", 1)
    if work.batch_size * config.get("tensor_parallel_degree", 1) % microbatches:
        return (f"not possible: a batch of {work.batch_size} rows per rank does not split "
                f"into microbatches={microbatches} equal parts")
    return None


def human_bytes(n: float) -> str:
    for unit, size in (("TiB", 2**40), ("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= size:
            return f"{n / size:.2f} {unit}"
    return f"{n:.0f} B"


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]
