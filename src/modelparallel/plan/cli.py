"""``modelparallel plan``: the command line of the planner (and ``check-config --model``)."""

from __future__ import annotations

import argparse
import importlib.util
import json
import sys
from pathlib import Path
from typing import Any

from torch import nn

from modelparallel.config import ConfigError
from modelparallel.plan import JobPlan, PlanError, plan_job
from modelparallel.plan.device_model import PROFILES, DeviceModel, measure_here
from modelparallel.plan.estimate import StepEstimate, estimate_step
from modelparallel.plan.workload import ModelFactory, Workload


def load_factory(spec: str) -> ModelFactory:
    """``FILE.py:FUNCTION`` -> FUNCTION, FILE imported as a script's module would be."""
    file, _, function = spec.rpartition(":")
    if not file or not function:
        raise PlanError(f"--model {spec!r}: give FILE.py:FUNCTION")
    path = Path(file).resolve()
    if not path.is_file():
        raise PlanError(f"--model {spec!r}: no file {path}")
    sys.path.insert(0, str(path.parent))
    module_spec = importlib.util.spec_from_file_location(path.stem, path)
    assert module_spec is not None and module_spec.loader is not None
    module = importlib.util.module_from_spec(module_spec)
    sys.modules[path.stem] = module
    module_spec.loader.exec_module(module)
    factory = getattr(module, function, None)
    if not callable(factory):
        raise PlanError(f"--model {spec!r}: {path.name} has no function {function}")

    def build() -> nn.Module:
        model = factory()
        if not isinstance(model, nn.Module):
            raise PlanError(f"{function}() returned {type(model).__name__}, not an nn.Module")
        return model

    return build


def parse_bytes(text: str) -> int:
    """``80G``, ``1.5M``, ``512KiB``, ``1073741824`` -> bytes; a PlanError naming the
    option otherwise."""
    units = {"K": 2**10, "M": 2**20, "G": 2**30, "T": 2**40}
    number = text.strip().upper().removesuffix("IB").removesuffix("B")
    scale = units.get(number[-1:], 1)
    try:
        value = int(float(number[:-1] if scale > 1 else number) * scale)
    except ValueError:
        value = 0
    if value <= 0:
        raise PlanError(f"--memory-per-device {text!r} is not a size; give a positive number "
                        f"of bytes, with an optional suffix K, M, G or T (powers of 1024), "
                        f"e.g. 80G")
    return value


def main(args: argparse.Namespace) -> int:
    try:
        memory = parse_bytes(args.memory_per_device) if args.memory_per_device is not None \
            else None
        config = _read_config(args.config)
        work = workload_from(args, config, args.world_size)
        device = PROFILES[args.device_profile] if args.device_profile else measure_here()
        if memory is not None:
            from modelparallel.plan.search import search
            from modelparallel.plan.table import ranking

            found = search(work, device, memory)
            print(json.dumps([c.__dict__ | {"plan": c.plan.as_dict() if c.plan else None,
                                            "estimate": c.estimate.as_dict() if c.estimate
                                            else None} for c in found], indent=1)
                  if args.json else ranking(found, device))
            return 0 if any(c.refused is None for c in found) else 1
        plan = plan_job(work)
        estimate = estimate_step(plan.ranks, device, config.get("pipeline_parallel_degree", 1),
                                 config.get("microbatches", 1))
        print(json.dumps(as_json(plan, estimate), indent=1) if args.json
              else describe(plan, estimate))
        return 0
    except (PlanError, ConfigError) as error:
        print(f"modelparallel plan: {error}", file=sys.stderr)
        return 2


def plan_for_check_config(args: argparse.Namespace) -> str | None:
    """``check-config FILE --model ... --world-size N``: the plan of FILE's layout, or
    None after printing why there is none."""
    try:
        if args.world_size is None or args.file is None:
            raise PlanError("--model needs a configuration FILE and --world-size")
        config = _read_config(args.file)
        plan = plan_job(workload_from(args, config, args.world_size))
        estimate = estimate_step(plan.ranks, measure_here(),
                                 config.get("pipeline_parallel_degree", 1),
                                 config.get("microbatches", 1))
        return describe(plan, estimate)
    except (PlanError, ConfigError) as error:
        print(f"modelparallel check-config: {error}", file=sys.stderr)
        return None


def workload_from(args: argparse.Namespace, config: dict[str, Any], world_size: int) -> Workload:
    """What ``args`` say is trained on ``world_size`` processes (PlanError: bad input)."""
    for option, value in (("--world-size", world_size), ("--batch-size", args.batch_size),
                          ("--seq-len", args.seq_len)):
        if value is not None and value < 1:
            raise PlanError(f"{option} {value} is not possible; give a whole number >= 1")
    missing = [f"--{n.replace('_', '-')}" for n in ("batch_size", "seq_len")
               if getattr(args, n) is None]
    if missing:
        raise PlanError(f"the planner needs {' and '.join(missing)}")
    return Workload(load_factory(args.model), config, world_size, args.batch_size,
                    args.seq_len, args.optimizer, args.activation_checkpointing, args.api)


def as_json(plan: JobPlan, estimate: StepEstimate) -> dict[str, Any]:
    out = plan.as_dict()
    out["comm_bytes_per_step"] = _comm_per_group(plan)
    out["estimate"] = estimate.as_dict()
    return out


def describe(plan: JobPlan, estimate: StepEstimate) -> str:
    from modelparallel.plan.table import rank_table

    lines = [rank_table(plan), "", "collectives per step (bytes each rank sends, ring "
             "algorithms): " + (", ".join(f"{g} {b / 2**20:.2f} MiB" for g, b in
                                          sorted(_comm_per_group(plan).items())) or "none"),
             f"estimated step: {estimate.step_s * 1e3:.1f} ms on rank {estimate.slowest_rank} "
             f"(compute {estimate.compute_s * 1e3:.1f} ms, communication "
             f"{estimate.comm_s * 1e3:.1f} ms) with {estimate.device}"]
    return "\n".join(lines)


def _comm_per_group(plan: JobPlan) -> dict[str, float]:
    """Per group: the most bytes any of its ranks moves in a step."""
    out: dict[str, float] = {}
    for r in plan.ranks:
        for group, b in r.comm_bytes.items():
            out[group] = max(out.get(group, 0.0), b)
    return out


def _read_config(path: str | None) -> dict[str, Any]:
    if path is None:
        return {}
    from modelparallel.launch.run import load_config_file

    explicit, _ = load_config_file(path)
    return dict(explicit)


__all__ = ["DeviceModel", "load_factory", "main",
           "plan_for_check_config"]
