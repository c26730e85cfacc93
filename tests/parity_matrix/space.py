"""The configuration space of the parity matrix (its cases are generated in ``cases.py``).

Layout axes — world size (1, 2, 4, 8 processes on one node, and 2 nodes x 2), pipeline,
tensor-parallel, hybrid-shard, context-parallel and expert-parallel degrees (cp where SMP
allows it: a divisor of the shard degree, no pipeline; ep a divisor of the data-parallel
size and of the experts, no pipeline or cp), placement strategy (when two or more
degrees exceed 1), pipeline schedule and its virtual stages (when pp > 1) — and the
API path are crossed exhaustively. The other axes (model, precision, microbatches,
prescaled batch, activation checkpointing, ddp, gradient accumulation, dropout, padded
targets) are assigned to those cases so that every triple of their values that some
case can hold appears at least once. Expert-parallel cases train the mixture-of-experts
models in float64, with and without the routers' load-balancing loss.

Each case knows what it expects: parity with one process, or a refusal (the key and
a fragment of the message) derived from the rules in ``refusals.py``.
"""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from modelparallel.schedule_rules import MULTI_STAGE_SCHEDULES, check_schedule
from parity_matrix.zoo import EXPERTS, MODELS, MOE_MODELS

WORLDS: tuple[int | str, ...] = (1, 2, 4, 8, "2x2")
PATHS = ("v1", "shard", "fsdp1", "ddp", "smddp")
PATH_DOC = {
    "v1": "SMP v1: mp.DistributedModel + @mp.step + mp.DistributedOptimizer",
    "shard": "mp.transform + mp.shard (FSDP2)",
    "fsdp1": "mp.transform + torch FSDP1 as SMP v2 scripts write it",
    "ddp": "mp.transform + mp.replicate (DDP)",
    "smddp": "modelparallel.dataparallel (SMDDP's DistributedDataParallel)",
}
PLACEMENTS = ("cluster", "spread", "PDT", "PTD", "DTP", "TDP")
# SMP's schedule names (gpipe and 1f1b are aliases of the first two), then the multi-stage
SCHEDULES = ("simple", "interleaved", *MULTI_STAGE_SCHEDULES)
LOOP_SCHEDULES = tuple(n for n, style in MULTI_STAGE_SCHEDULES.items() if style == "loop")
V_SCHEDULES = tuple(n for n, style in MULTI_STAGE_SCHEDULES.items() if style == "v")

OTHER_AXES: dict[str, tuple[Any, ...]] = {
    "model": MODELS,
    "precision": ("fp32", "bf16", "fp16"),
    "microbatches": (1, 2, 4),
    "prescaled_batch": (False, True),
    "checkpointing": (False, True),
    "ddp": (False, True),
    "accumulation": ("none", "steps", "no_sync"),
    "dropout": (False, True),
    # uneven padded targets, the loss summed over the others and divided by
    # mp.global_token_count (a plain mean averages the ranks' means)
    "padded": (False, True),
}
# the zoo's models context parallelism splits (Hugging Face causal LMs it knows), and the
# paths that train them (tsm.transform, then a data-parallel wrapper)
CONTEXT_PARALLEL_MODELS = ("llama", "mistral", "qwen2", "qwen3", "neox")
CONTEXT_PARALLEL_PATHS = ("shard", "fsdp1", "ddp")
# expert parallelism: the degrees (dividing the data-parallel size and the experts), the
# paths SMP v2 trains it with (refusals.py says which are built), the load balancing
EXPERT_DEGREES = (2, 4)
EXPERT_PARALLEL_PATHS = ("shard", "fsdp1", "ddp")
STEPS = 3  # optimizer steps per case
ACCUMULATION = 2  # backward passes per optimizer step when accumulating


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


@dataclass(frozen=True, order=True)
class Layout:
    """How the processes are laid out: degrees, placement, pipeline schedule."""

    world: int | str  # a process count on one node, or "2x2" (2 nodes x 2 processes)
    pp: int
    tp: int
    hsd: int  # hybrid_shard_degree
    placement: str = "cluster"
    schedule: str | None = None  # pipeline schedule when pp > 1
    virtual_stages: int = 1
    cp: int = 1  # context_parallel_degree: ranks of dp_shard that split each sequence
    ep: int = 1  # expert_parallel_degree: data-parallel ranks that split the experts

    @property
    def nodes(self) -> int:
        return 2 if self.world == "2x2" else 1

    @property
    def processes(self) -> int:
        return 4 if self.world == "2x2" else int(self.world)

    @property
    def dp(self) -> int:
        """Reduced data-parallel size (ranks holding the same part of the model)."""
        return self.processes // (self.pp * self.tp)

    @property
    def dp_shard(self) -> int:
        return self.dp if self.hsd == 0 else self.hsd

    @property
    def stages(self) -> int:
        return self.pp * self.virtual_stages

    def config(self) -> dict[str, Any]:
        c: dict[str, Any] = {"pipeline_parallel_degree": self.pp,
                             "tensor_parallel_degree": self.tp, "hybrid_shard_degree": self.hsd,
                             "placement_strategy": self.placement}
        if self.schedule is not None:
            c["pipeline"] = self.schedule
            if self.virtual_stages > 1:
                c["virtual_stages"] = self.virtual_stages
        if self.cp > 1:
            c["context_parallel_degree"] = self.cp
        if self.ep > 1:
            c["expert_parallel_degree"] = self.ep
        return c

    def label(self) -> str:
        parts = [f"w{self.world}", f"pp{self.pp}", f"tp{self.tp}", f"hsd{self.hsd}"]
        if self.cp > 1:
            parts.append(f"cp{self.cp}")
        if self.ep > 1:
            parts.append(f"ep{self.ep}")
        if sum(d > 1 for d in (self.pp, self.tp, self.dp)) >= 2:
            parts.append(self.placement)
        if self.schedule:
            parts.append(self.schedule + (f"v{self.virtual_stages}"
                                          if self.virtual_stages > 1 else ""))
        return "-".join(parts)


def layouts() -> Iterator[Layout]:
    """Every layout of every world size (hybrid_shard_degree equal to the data-parallel
    size is the same layout as 0, so only 0 is listed)."""
    for world in WORLDS:
        n = 4 if world == "2x2" else int(world)
        for pp in _divisors(n):
            for tp in _divisors(n // pp):
                dp = n // (pp * tp)
                hsds = [0, *([1] if dp > 1 else []), *[k for k in _divisors(dp) if 1 < k < dp]]
                several = sum(d > 1 for d in (pp, tp, dp)) >= 2
                for hsd, placement in itertools.product(
                        hsds, PLACEMENTS if several else ("cluster",)):
                    for schedule, v in _schedules(pp):
                        yield Layout(world, pp, tp, hsd, placement, schedule, v)
                    for cp in _context_degrees(pp, dp if hsd == 0 else hsd):
                        yield Layout(world, pp, tp, hsd, placement, cp=cp)


def expert_layouts() -> Iterator[Layout]:
    """Every layout of every world size with an expert-parallel degree: a divisor of the
    data-parallel size and of the experts, without a pipeline or context parallelism
    (SMP refuses both with it: one regression case each)."""
    for lay in layouts():
        if lay.pp == 1 and lay.cp == 1:
            yield from (dataclasses.replace(lay, ep=ep) for ep in EXPERT_DEGREES
                        if lay.dp % ep == 0 and EXPERTS % ep == 0)


def _context_degrees(pp: int, shard: int) -> list[int]:
    """The context-parallel degrees > 1 a layout allows: divisors of the shard degree
    that split the test sequences into ``2 * cp`` chunks (SMP: no pipeline)."""
    from parity_matrix.zoo import SEQ

    return [cp for cp in _divisors(shard)
            if pp == 1 and cp > 1 and SEQ % (2 * cp) == 0]


def _schedules(pp: int) -> Iterator[tuple[str | None, int]]:
    if pp == 1:
        yield None, 1
        return
    for schedule in SCHEDULES:
        if schedule in LOOP_SCHEDULES:
            yield from ((schedule, v) for v in ((2, 3) if pp == 2 else (2,)))
        elif schedule in V_SCHEDULES:
            yield schedule, 2
        else:
            yield schedule, 1


@dataclass(frozen=True, order=True)
class Case:
    """One layout, one API path and one value of every other axis."""

    layout: Layout
    path: str
    model: str = "gpt"
    precision: str = "fp32"
    microbatches: int = 1
    prescaled_batch: bool = False
    checkpointing: bool = False
    ddp: bool = False
    accumulation: str = "none"
    dropout: bool = False
    padded: bool = False
    # SMP's moe_load_balancing with a mixture-of-experts model: "aux_loss" adds the
    # routers' load-balancing loss (over the whole batch), "none" the model as configured
    load_balancing: str = "none"
    unused: bool = False  # the model has a parameter its forward never uses
    note: str = ""  # why a regression case is in the list
    # a bug injected into the run (not the reference) to show the judge fails it:
    # train.MUTATIONS
    mutation: str = ""

    @property
    def id(self) -> str:
        flags = [self.path, self.model, self.precision]
        if self.microbatches > 1:
            flags.append(f"mb{self.microbatches}")
        flags += [name for name, on in (("prescaled", self.prescaled_batch),
                                        ("ckpt", self.checkpointing), ("ddp", self.ddp),
                                        ("dropout", self.dropout),
                                        ("padded", self.padded),
                                        ("unused", self.unused)) if on]
        if self.accumulation != "none":
            flags.append(f"acc-{self.accumulation}")
        if self.load_balancing != "none":
            flags.append(self.load_balancing.replace("_", "-"))
        if self.mutation:
            flags.append(f"mutated-{self.mutation}")
        return f"{self.layout.label()}-{'-'.join(flags)}"

    @property
    def layers(self) -> int:
        """Repeated layers of the model: 2, or one per pipeline stage if more."""
        return max(2, self.layout.stages)

    def config(self) -> dict[str, Any]:
        c = self.layout.config()
        c["microbatches"] = self.microbatches
        if self.prescaled_batch:
            c["prescaled_batch"] = True
        if self.ddp:
            c["ddp"] = True
        if self.precision in ("bf16", "fp16"):  # (fp64: the model and data in float64)
            c[self.precision] = True
        return c

    @property
    def data_replicas(self) -> int:
        """How many different slices of each global batch the ranks read: one per
        data-parallel rank (SMP's dp_size), or per reduced data-parallel rank when the
        ranks of a tensor-parallel group read the same batch."""
        lay = self.layout
        return lay.dp if self.prescaled_batch else lay.dp * lay.tp

    @property
    def rows(self) -> int:
        """Global batch rows per optimizer step: 2 per microbatch per data replica."""
        passes = ACCUMULATION if self.accumulation != "none" else 1
        return self.data_replicas * self.microbatches * passes * 2

    @property
    def slices(self) -> int:
        """Pieces a parallel run cuts each global batch into: data replicas x accumulation
        passes x microbatches (SMP v1's)."""
        passes = ACCUMULATION if self.accumulation != "none" else 1
        return self.data_replicas * passes * (self.microbatches if self.path == "v1" else 1)

    def as_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Case:
        return cls(**{**d, "layout": Layout(**d["layout"])})


# -- which values a case can take ------------------------------------------------------

def allowed(layout: Layout, path: str, axis: str) -> tuple[Any, ...]:
    """The values of ``axis`` that make sense for this layout and path."""
    values = OTHER_AXES[axis]
    if layout.ep > 1:
        if axis == "model":
            return MOE_MODELS
        if axis == "precision":  # round-off cannot flip a router's top-k choice
            return ("fp64",)
        if axis == "dropout" and has_twins(layout, path):  # dropout twins (full_cases)
            return (False,)
    if axis == "microbatches":
        if path != "v1":
            return (1,)
        ok = tuple(m for m in values if schedule_accepts(layout, m))
        return ok or (next(m for m in (8, 16, 32) if schedule_accepts(layout, m)),)
    if axis == "ddp" and path != "v1":
        return (False,)
    if layout.cp > 1 and path in CONTEXT_PARALLEL_PATHS:  # what it splits (refusals.py):
        if axis == "model":  # the rest is refused, once each in regression_cases
            return CONTEXT_PARALLEL_MODELS
        if axis == "dropout":  # dropout twins of these cases are added (full_cases)
            return (False,)
    return values


def schedule_accepts(layout: Layout, m: int) -> bool:
    """Whether the pipeline schedule runs ``m`` microbatches (the configuration's rules)."""
    if layout.schedule is None:
        return True
    problems = check_schedule(layout.schedule, layout.virtual_stages, m, layout.pp, None)
    return not any(key == "microbatches" for key, _ in problems)


def has_twins(layout: Layout, path: str) -> bool:
    """Whether an expert-parallel case gets dropout and load-balancing twins: the paths
    that train expert parallelism (tensor parallelism with it: its covering's dropout)."""
    return layout.ep > 1 and layout.tp == 1 and path in EXPERT_PARALLEL_PATHS
