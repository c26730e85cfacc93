"""The cases of the parity matrix, generated from its space (``space.py``).

:func:`full_cases`: every layout x API path, the other axes assigned so that every
triple of their values that some case can hold appears at least once (a greedy
covering array, seeded, so the list is the same on every run); the expert-parallel
cases are a covering of their own. :func:`ci_cases` picks a subset in which every pair
of values of all axes appears, plus a fixed list of regression cases.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
import random
from collections.abc import Iterable, Iterator
from typing import Any

from parity_matrix.space import (
    CONTEXT_PARALLEL_PATHS,
    OTHER_AXES,
    PATHS,
    STEPS,
    Case,
    Layout,
    allowed,
    expert_layouts,
    has_twins,
    layouts,
)
from parity_matrix.zoo import MOE_MODELS


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
    # keyed by sample: each rank attends over its own samples), and these again with the
    # routers' load-balancing loss, each step one pass (the loss of a part of a step is
    # not a share of the step's: the loss is not linear in the tokens)
    trained = [c for c in expert if has_twins(c.layout, c.path)]
    dropout = [dataclasses.replace(c, dropout=True) for c in trained]
    aux = [dataclasses.replace(c, load_balancing="aux_loss", accumulation="none")
           for c in trained + dropout]
    return cases + expert + dropout + aux


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
