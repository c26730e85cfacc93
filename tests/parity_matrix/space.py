"""The configuration space of the parity matrix, and the cases generated from it.

Layout axes — world size (1, 2, 4, 8 processes on one node, and 2 nodes x 2), pipeline,
tensor-parallel, hybrid-shard and context-parallel degrees (cp where SMP allows it: a
divisor of the shard degree, no pipeline), placement strategy (when two or more
degrees exceed 1), pipeline schedule and its virtual stages (when pp > 1) — and the
API path are crossed exhaustively. The other axes (model, precision, microbatches,
prescaled batch, activation checkpointing, ddp, gradient accumulation, dropout, padded
targets) are assigned to those cases so that every triple of their values that some
case can hold appears at least once (a greedy covering array, seeded, so the list is the same on
every run). :func:`ci_cases` picks a subset in which every pair of values of all axes
appears, plus a fixed list of regression cases.

Each case knows what it expects: parity with one process, or a refusal (the key and
a fragment of the message) derived from the rules in ``refusals.py``.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
import random
from collections.abc import Iterable, Iterator
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
LOAD_BALANCING = ("none", "aux_loss")
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
        if axis == "dropout" and _has_twins(layout, path):  # dropout twins (full_cases)
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


# -- generating ----------------------------------------------------------------------

def base_cases() -> list[tuple[Layout, str]]:
    """Layout x API path, exhaustively (paths other than SMP v1 have no pipeline)."""
    return [(lay, path) for lay in layouts() for path in PATHS if lay.pp == 1 or path == "v1"]


def expert_base_cases() -> list[tuple[Layout, str]]:
    """Expert-parallel layout x API path, exhaustively."""
    return [(lay, path) for lay in expert_layouts() for path in PATHS]


def _triples(assignment: dict[str, Any]) -> Iterator[tuple]:
    items = sorted(assignment.items())
    return itertools.combinations(items, 3)


def full_cases(seed: int = 0) -> list[Case]:
    """Every layout x API path, the other axes covering every achievable triple of their
    values (values a layout is forced to, such as 16 microbatches for DualPipeV on 8
    stages, are not axis values and need no triple). The expert-parallel cases are a
    covering of their own (their models and float64), made after the others, so that
    those stay the cases earlier runs judged."""
    cases = _covering(base_cases(), OTHER_AXES, random.Random(seed))
    # every case context parallelism splits again with dropout: its ring attention and
    # hidden states drop by global position. Added after the search, so that the other
    # cases stay the ones earlier runs judged.
    cases += [dataclasses.replace(c, dropout=True) for c in cases
              if c.layout.cp > 1 and c.path in CONTEXT_PARALLEL_PATHS]
    expert_axes = {**OTHER_AXES, "model": MOE_MODELS, "precision": ("fp64",)}
    expert = _covering(expert_base_cases(), expert_axes, random.Random(seed + 1))
    # the cases that train, or will (refusals.py), again with dropout (the attention's,
    # keyed by sample: each rank attends over its own samples) and, where each step is
    # one pass (the load-balancing loss of a part of a step is not a share of the
    # step's), with the routers' load-balancing loss
    trained = [c for c in expert if _has_twins(c.layout, c.path)]
    dropout = [dataclasses.replace(c, dropout=True) for c in trained]
    aux = [dataclasses.replace(c, load_balancing="aux_loss") for c in trained + dropout
           if c.accumulation == "none"]
    return cases + expert + dropout + aux


def _has_twins(layout: Layout, path: str) -> bool:
    """Whether an expert-parallel case gets dropout and load-balancing twins: the paths
    that train expert parallelism (tensor parallelism with it: its covering's dropout)."""
    return layout.ep > 1 and layout.tp == 1 and path in EXPERT_PARALLEL_PATHS


def _covering(bases: list[tuple[Layout, str]], axis_values: dict[str, tuple[Any, ...]],
              rng: random.Random) -> list[Case]:
    """One case per base, then more until every achievable triple of ``axis_values``
    appears (a seeded greedy covering array)."""
    axes = sorted(axis_values)  # the order _triples gives
    options = {(lay, path): {a: allowed(lay, path, a) for a in axes} for lay, path in bases}
    achievable = set()
    for opts in options.values():
        for combo in itertools.combinations(axes, 3):
            values = [[v for v in opts[a] if v in axis_values[a]] for a in combo]
            for triple in itertools.product(*values):
                achievable.add(tuple(zip(combo, triple, strict=True)))
    covered: set[tuple] = set()
    cases = []

    def assign(base: tuple[Layout, str], fixed: dict[str, Any]) -> dict[str, Any]:
        opts = {**options[base], **{a: (v,) for a, v in fixed.items()}}
        best, best_gain = {}, -1
        for _ in range(4):
            pick = {a: rng.choice(opts[a]) for a in axes}
            for _ in range(2):  # coordinate ascent: each axis to its best value (ties at
                for a in rng.sample(axes, len(axes)):  # random, so values keep varying)
                    def score(v: Any, a: str = a, pick: dict[str, Any] = pick) -> tuple[int, float]:
                        return _gain({**pick, a: v}, covered), rng.random()
                    pick[a] = max(opts[a], key=score)
            gain = _gain(pick, covered)
            if gain > best_gain:
                best, best_gain = dict(pick), gain
        return best

    def add(base: tuple[Layout, str], pick: dict[str, Any]) -> None:
        covered.update(_triples(pick))
        cases.append(Case(base[0], base[1], **pick))

    for base in bases:
        add(base, assign(base, {}))
    cheapest = sorted(bases, key=lambda b: (b[0].processes, b[0].stages, b[0].label()))
    for triple in sorted(achievable - covered, key=repr):
        if triple in covered:
            continue
        fixed = dict(triple)
        base = next(b for b in cheapest
                    if all(v in options[b][a] for a, v in fixed.items()))
        add(base, assign(base, fixed))
    return cases


def _gain(assignment: dict[str, Any], covered: set[tuple]) -> int:
    return sum(1 for t in _triples(assignment) if t not in covered)


def _pairs(case: Case) -> set[tuple]:
    lay = case.layout
    values = {"world": lay.world, "pp": lay.pp, "tp": lay.tp, "hsd": lay.hsd, "cp": lay.cp,
              "placement": lay.placement, "schedule": (lay.schedule, lay.virtual_stages),
              "path": case.path, **{a: getattr(case, a) for a in OTHER_AXES}}
    if lay.ep > 1:  # (not on the other cases: their subset stays the one measured)
        values.update(ep=lay.ep, load_balancing=case.load_balancing)
    return set(itertools.combinations(sorted(values.items(), key=lambda kv: kv[0]), 2))


def cost(case: Case) -> float:
    """Rough seconds a case takes in CI on a 2-core machine: its ranks' run and its
    one-process references (the whole batch, the batch cut in slices, float64).

    Fitted to the per-case times of a full run (2026-11-26) and to timed references: a
    half-precision reference is the dear part where the batch is cut in many slices (CPU
    bf16/fp16 kernels are slow on small pieces: one 8-rank Mistral bf16 case's references
    took 43 s, its ranks 8 s)."""
    lay = case.layout
    ranks = math.exp(-1.56 + 0.84 * math.log(lay.processes) - 0.27 * math.log(lay.pp)
                     + 0.78 * math.log(lay.tp) + 0.45 * math.log(case.microbatches)
                     + 0.25 * case.checkpointing + 0.34 * (case.accumulation != "none")
                     + 0.14 * case.layers)
    half = case.precision != "fp32"
    references = STEPS * case.layers * (case.slices * (0.05 if half else 0.005)
                                        + case.rows * (0.01 if half else 0.003))
    return 0.5 + ranks + references


def pairwise_subset(cases: Iterable[Case]) -> list[Case]:
    """Cases of ``cases`` in which every pair of values of any two axes (layout axes,
    path and the others) appears at least once, favouring cheap cases."""
    pool = list(cases)
    need = set().union(*(_pairs(c) for c in pool))
    chosen = []
    while need:
        case = max(pool, key=lambda c: (len(_pairs(c) & need) / cost(c), c.id))
        chosen.append(case)
        need -= _pairs(case)
    return chosen


def regression_cases() -> list[Case]:
    """The layouts and models that trained silently wrong or crashed before (issue 14)."""
    L = Layout
    return [
        Case(L(4, 1, 2, 0), "v1", "noplan", note="no TP plan: TP ranks are replicas"),
        Case(L(8, 2, 2, 0, schedule="interleaved"), "v1", "noplan", microbatches=2,
             note="no TP plan under pp2 x tp2 x dp2"),
        Case(L(4, 1, 2, 2), "shard", "noplan", note="no TP plan under FSDP2"),
        Case(L(4, 1, 2, 1), "ddp", "noplan", note="no TP plan under DDP"),
        Case(L(4, 1, 2, 0), "fsdp1", "noplan", note="no TP plan under FSDP1"),
        Case(L(2, 1, 2, 0), "shard", "partial", note="only some blocks have a plan"),
        Case(L(2, 1, 2, 0), "v1", "qwen3", note="q_norm/k_norm on split heads"),
        Case(L(4, 1, 2, 2), "shard", "qwen3", prescaled_batch=True,
             note="q_norm/k_norm on split heads, FSDP2"),
        Case(L(2, 1, 2, 0), "fsdp1", "gpt", note="FSDP1 with tp2 and one data-parallel rank"),
        Case(L(4, 1, 2, 0), "fsdp1", "llama", accumulation="no_sync",
             note="FSDP1 no_sync() on a tensor-parallel model"),
        Case(L(8, 2, 1, 1, "DTP", "looped_bfs", 3), "v1", "qwen3", ddp=True,
             accumulation="no_sync", note="fp32 round-off of cancelling gradients"),
        Case(L(4, 1, 1, 1), "v1", "gpt", ddp=True, note="ddp replicas start equal"),
        Case(L(4, 1, 1, 1), "ddp", "gpt", precision="bf16", note="bf16 under mp.replicate"),
        Case(L(2, 1, 2, 0), "ddp", "gpt", precision="bf16", note="bf16 under transform"),
        Case(L(4, 1, 2, 0), "fsdp1", "gpt", precision="bf16", note="bf16 with FSDP1"),
        Case(L(4, 2, 1, 1, schedule="interleaved"), "v1", "gpt", precision="bf16", ddp=True,
             microbatches=2, note="bf16 with ddp=True replicas"),
        Case(L(2, 1, 1, 0), "v1", "gpt", precision="fp16", note="fp16 loss scaling"),
        Case(L(4, 1, 1, 2), "shard", "gpt", precision="fp16", note="fp16 with mp.shard"),
        Case(L(2, 1, 1, 0, cp=2), "shard", "gpt", note="cp: a model it cannot split"),
        Case(L(2, 1, 1, 0, cp=2), "fsdp1", "llama", dropout=True,
             note="cp: attention dropout, judged"),
        Case(L(4, 1, 1, 1, cp=2), "shard", "llama",
             note="cp: hybrid_shard_degree not a multiple of it"),
        Case(L(4, 2, 1, 0, schedule="simple", ep=2), "v1", "mixtral", precision="fp64",
             note="ep: with a pipeline (SMP refuses it)"),
        Case(L(4, 1, 1, 0, cp=2, ep=2), "shard", "mixtral", precision="fp64",
             note="ep: with context parallelism (SMP refuses it)"),
        Case(L(2, 1, 1, 0, ep=4), "shard", "qwen3moe", precision="fp64",
             note="ep: not a divisor of the data-parallel size"),
        Case(L(2, 1, 1, 0), "shard", "mixtral", precision="fp64", load_balancing="aux_loss",
             note="ep 1: the load-balancing loss over the whole batch, mp.shard"),
        Case(L(2, 1, 1, 1), "ddp", "qwen2moe", precision="fp64", load_balancing="aux_loss",
             note="ep 1: the load-balancing loss over the whole batch, mp.replicate"),
        Case(L(2, 1, 1, 0), "fsdp1", "qwen3moe", precision="fp64", load_balancing="aux_loss",
             dropout=True, note="ep 1: the load-balancing loss over the whole batch, FSDP1"),
    ]


def ci_cases() -> list[Case]:
    """What CI runs: the pairwise subset of the full matrix (of the expert-parallel cases
    apart: the other cases' subset stays the one measured) and the regression cases."""
    everything = full_cases()
    chosen = pairwise_subset(c for c in everything if c.layout.ep == 1)
    chosen += pairwise_subset(c for c in everything if c.layout.ep > 1)
    seen = {c.id for c in chosen}
    return chosen + [c for c in regression_cases() if c.id not in seen]
