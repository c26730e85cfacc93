"""The planner's tables for people (``--json`` is for programs)."""

from __future__ import annotations

from modelparallel.plan import JobPlan
from modelparallel.plan.device_model import DeviceModel
from modelparallel.plan.search import Candidate


def mib(n: float) -> str:
    return f"{n / 2**20:,.2f}"


def rank_table(plan: JobPlan) -> str:
    """One line per rank: where it sits, and its memory in MiB."""
    w = plan.work
    head = (f"plan: {w.world_size} ranks, {_degrees(w.config)}, batch {w.batch_size} x "
            f"{w.seq_len} per rank, {w.optimizer}"
            + (", activation checkpointing" if w.activation_checkpointing else "")
            + f" (API {w.api})")
    rows = [head, f"{'rank':>4}  {'pp dr ds tp':11}  {'peak MiB':>10}  {'params':>9}  "
                  f"{'grads':>9}  {'optimizer':>9}  {'activations':>11}"]
    for r in plan.ranks:
        c = r.coordinates
        where = f"{c['pp']:>2} {c['dp_replicate']:>2} {c['dp_shard']:>2} {c['tp']:>2}"
        rows.append(f"{r.rank:>4}  {where:11}  {mib(r.peak_bytes):>10}  {mib(r.param_bytes):>9}  "
                    f"{mib(r.grad_bytes):>9}  {mib(r.optimizer_bytes):>9}  "
                    f"{mib(r.activation_bytes):>11}")
    rows.append("(pp dr ds tp: the rank's pipeline stage, data-parallel replica, shard and "
                "tensor-parallel rank; activations: the rest of the peak)")
    early = [r.peak_bytes_copies_freed_at_once for r in plan.ranks]
    if any(e != r.peak_bytes for e, r in zip(early, plan.ranks, strict=True)):
        rows.append(f"(on gloo the peak is {mib(min(early))}..{mib(max(early))} MiB when its "
                    "collectives' working copies are freed as their calls return; the table "
                    "gives the peak when they are freed late)")
    routed = [r for r in plan.ranks if r.routing]
    if routed:
        balanced = [r.peak_bytes_balanced_routing for r in routed]
        rows.append(f"(experts split over expert-parallel ranks: the peak assumes the worst "
                    f"routing, every token of the group choosing the rank's experts; with a "
                    f"balanced router it is {mib(min(balanced))}..{mib(max(balanced))} MiB, "
                    f"and the collectives below are a balanced router's)")
    return "\n".join(rows)


def ranking(found: list[Candidate], device: DeviceModel) -> str:
    """The layouts that fit, the least time per sequence first, then those that do not,
    with why."""
    rows = [f"{'layout':44}  {'peak MiB':>10}  {'est. step ms':>12}  {'seq/step':>8}  "
            f"{'ms/seq':>8}  note"]
    fitting = [c for c in found if c.refused is None]
    for c in found:
        est = f"{c.estimate.step_s * 1e3:.1f}" if c.estimate else "-"
        per_row = f"{c.seconds_per_row * 1e3:.2f}" if c.estimate else "-"
        sequences = str(c.rows_per_step) if c.estimate else "-"
        note = c.refused or ""
        peak = mib(c.peak_bytes) if c.plan else "-"
        rows.append(f"{_degrees(c.config):44}  {peak:>10}  {est:>12}  {sequences:>8}  "
                    f"{per_row:>8}  {note}".rstrip())
    if fitting:
        best = fitting[0]
        assert best.estimate is not None
        why = (f"best: {_degrees(best.config)}: the least estimated time per sequence among "
               f"the {len(fitting)} layouts that fit ({best.rows_per_step} sequences in a "
               f"step of {best.estimate.step_s * 1e3:.1f} ms: compute "
               f"{best.estimate.compute_s * 1e3:.1f} ms, communication "
               f"{best.estimate.comm_s * 1e3:.1f} ms on its slowest rank)")
        if best.config.get("context_parallel_degree", 1) > 1:
            why += ("; context parallelism is SMP v2's: tsm.transform, then shard, each rank "
                    "given its chunks of every sequence (mp.split_for_context_parallel)")
        if best.config.get("expert_parallel_degree", 1) > 1:
            why += ("; expert parallelism is SMP v2's: tsm.transform(model, config=MoEConfig("
                    "smp_moe=False, moe_load_balancing='none')), then shard; its peak assumes "
                    f"the worst routing ({mib(_balanced_peak(best))} MiB with a balanced "
                    "router)")
        if len(fitting) > 1:
            second = fitting[1]
            why += (f"; next: {_degrees(second.config)} at "
                    f"{second.seconds_per_row * 1e3:.2f} ms per sequence")
        rows += ["", why]
    else:
        rows += ["", "no layout fits: lower --batch-size, add --activation-checkpointing, or "
                     "use more devices"]
    rows.append(f"device model: {device.describe()}")
    return "\n".join(rows)


def _balanced_peak(candidate: Candidate) -> int:
    assert candidate.plan is not None
    return max(r.peak_bytes_balanced_routing for r in candidate.plan.ranks)


def _degrees(config: dict) -> str:
    parts = [f"pp {config.get('pipeline_parallel_degree', 1)}",
             f"tp {config.get('tensor_parallel_degree', 1)}",
             f"hybrid_shard {config.get('hybrid_shard_degree', 0)}"]
    if config.get("context_parallel_degree", 1) > 1:
        parts.append(f"cp {config['context_parallel_degree']}")
    if config.get("expert_parallel_degree", 1) > 1:
        parts.append(f"ep {config['expert_parallel_degree']}")
    if config.get("pipeline_parallel_degree", 1) > 1:
        parts.append(f"mb {config.get('microbatches', 1)}")
    return ", ".join(parts)
