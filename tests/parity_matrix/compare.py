"""Judge a case: every rank's result against the one-process reference and each other.

Losses (relative): fp32 1e-5, as every parity test of the suite; bf16 (unit round-off
u = 2^-8: 8 significant bits) and fp16 (u = 2^-11; loss scaling is by powers of two,
exact) 3x the difference between one process on the whole global batch and one process
on the same batch cut the way the parallel run cuts it (data replicas x accumulation
passes x microbatches, one backward per slice), and at least 10 u (3.9e-2 bf16, 4.9e-3
fp16); the fp16 loss scale must be the same, step for step.

Parameters and optimizer state, every precision: as accurate as one process. Each
tensor's distance from the float64 answer (the same model and data in float64, no
precision policy) may be 3x the larger distance of those two one-process runs from it, and
at least the loss tolerance (each relative to the tensor's largest value). Every op
rounds, so runs that only sum in a different order differ, and by much more than u where a
gradient is a difference of nearly equal terms: Qwen3 applies RMSNorm (q_norm, k_norm) to
each head of q_proj's and k_proj's outputs, and the norm's backward removes the component
along its input. Such runs can err alike or apart: the two one-process fp16 runs of a Qwen3
case were 6e-3 apart while each was 2e-2 to 3e-2 from the answer and the parallel run 2e-2
from it (4e-2 from them), so their distance from each other is no measure of the noise
(the spread-of-two bound once used for half precision failed that case); the distance
from the answer is.

A case summing in many more pieces than one process (tensor parallel x pipeline
microbatches x data replicas) can still land past that bound: Qwen3 on 8 ranks (pp 2, tp
2, 2 replicas, 4 microbatches) is, over all its tensors, a median 2.2x and at most 6.5x
one process's distance in fp32, and 2.0x and 4.3x in bf16 (3.8x on Llama's embedding
momentum at tp 4, bf16) — the layout's order of summation, in either type, not the
precision policy; in bf16 tensor parallelism alone measured at most 2.4x (2 and 4 ranks).
Those tensors are set apart (``roundoff``) and the case is rerun in float64, its precision
policy dropped: the library runs the same code for every type, so if every rank then
matches the float64 answer within :data:`EXACT_TOLERANCE` (1.2e-15 measured), what the case
computes is right and the distance is round-off (:func:`exact_problems`). The rerun cannot
see the precision policy itself (casts, the fp16 loss scale), which errs by a share of the
tensor: a bf16 or fp16 tensor is set apart only up to :data:`HALF_CAP` x one process's
distance, and past it the case fails.

Every bound is per tensor and relative to what training changed in it: a parameter minus
its initial value (a parameter's value is mostly its initialisation, which no layout
changes, so a bound relative to the value hid whole wrong gradients in half precision),
the optimizer state as it is. Below one float32 unit of the tensor's largest value (the
precision it is stored in, whatever the compute type) a difference is noise. A tensor
whose exact gradient is zero (an attention key bias: softmax ignores a constant added to
every logit of a row) changes by round-off only; the float64 answer tells that apart
(compared without one, two runs may differ there by one float32 unit of the largest
value of the tensor's kind).
Optimizer state that one process does not have (momentum for a parameter it never
stepped) is a problem too.

Dropout cases are judged like the rest: the matrix's models key every mask by sample
and position (``keyed.py``), so one process draws the masks every layout draws.

On every case, whatever the precision: all ranks report the same losses, and the full
parameters and optimizer state each rank gathered are bitwise equal across ranks. A
rank gathers a replicated value from its own copy, so this is the test that replicas
(data-parallel, tensor-parallel, pipeline-stage copies) never drift apart.
"""

from __future__ import annotations

import math

import torch

from parity_matrix.space import Case
from parity_matrix.train import RunResult

UNIT_ROUNDOFF = {"fp32": 2.0 ** -24, "bf16": 2.0 ** -8, "fp16": 2.0 ** -11, "fp64": 2.0 ** -53}
FLOAT32_UNIT = UNIT_ROUNDOFF["fp32"]  # parameters and optimizer state are stored in float32


NOISE_MARGIN = 3.0  # times the round-off one process carries (measured, above)
# float64 carries 53 bits: a rerun that computes what one process computes lands within a
# few thousand units (1e-13) of it even through the cancellations above; any difference in
# what is computed is many orders larger
EXACT_TOLERANCE = 1e-10
# a half-precision tensor set apart as round-off may be at most this many times one
# process's distance from the answer: the float64 rerun proves the layout's arithmetic,
# not the precision policy (casts, loss scaling), and a wrong policy errs by a share of
# the tensor itself; round-off measured up to 4.3x in bf16 (above)
HALF_CAP = 10.0
# fp64: the mixture-of-experts cases, the model and data in float64 so that round-off
# cannot flip a router's top-k choice, judged against the float64 answer itself: every
# parameter and optimizer-state tensor within EXACT_TOLERANCE of what training changed in
# it (measured: 6.6e-14), the losses as fp32's (the matrix's loss function computes cross
# entropy in float32, and a mean over each rank's rows rounds otherwise than one over the
# whole batch: 1.1e-7 measured)
TOLERANCE = {"fp32": 1e-5, "bf16": 10 * UNIT_ROUNDOFF["bf16"], "fp16": 10 * UNIT_ROUNDOFF["fp16"],
             "fp64": 1e-5}


def problems(case: Case, results: list[RunResult], ref: RunResult | None,
             sliced: RunResult | None = None,
             exact: RunResult | None = None) -> tuple[list[str], list[str], float]:
    """What is wrong with a case's per-rank results: ``(found, roundoff, worst)``.

    ``roundoff``: the tensors further from the float64 answer than the round-off bound
    allows, which only the case's float64 rerun can clear (:func:`exact_problems`);
    ``found``: everything else; ``worst``: the largest difference from one process as a
    share of what the judge allows it (over the losses and every tensor: 1 is the
    bound; 0 when there is nothing to compare with).
    ``sliced``: the reference cut as the case cuts its batches; ``exact``: the float64
    answer."""
    found: list[str] = []
    roundoff: list[str] = []
    first = results[0]
    for rank, r in enumerate(results[1:], 1):
        if r.losses != first.losses:
            found.append(f"rank {rank} reports losses {r.losses}, rank 0 {first.losses}")
        found += _bitwise("parameter", first.params, r.params, rank)
        found += _bitwise("optimizer state", first.optimizer, r.optimizer, rank)
    if any(not math.isfinite(v) for v in first.losses):
        found.append(f"non-finite loss: {first.losses}")
    if ref is None:
        return found, roundoff, 0.0
    base = TOLERANCE[case.precision]
    worst = 0.0
    for step, (loss, want_loss) in enumerate(zip(first.losses, ref.losses, strict=False)):
        rel = abs(loss - want_loss) / abs(want_loss)
        tol = base if sliced is None or case.precision == "fp32" else max(
            base, NOISE_MARGIN * abs(sliced.losses[step] - want_loss) / abs(want_loss))
        worst = max(worst, rel / tol)
        if not rel <= tol:
            found.append(f"step {step}: loss {loss:.8f} vs reference {want_loss:.8f} "
                         f"(relative {rel:.2e})")
    if len(first.losses) != len(ref.losses):
        found.append(f"{len(first.losses)} losses vs {len(ref.losses)} in the reference")
    for what, got, want, other, answer, start in (
            ("parameter", first.params, ref.params, sliced.params if sliced else None,
             exact.params if exact else None, ref.initial),
            ("optimizer state", first.optimizer, ref.optimizer,
             sliced.optimizer if sliced else None, exact.optimizer if exact else None, {})):
        missing, extra = sorted(set(want) - set(got)), sorted(set(got) - set(want))
        if missing:
            found.append(f"{what}s missing from the run: {missing[:5]}")
        if extra:  # e.g. momentum for a parameter one process never stepped
            found.append(f"{what}s in the run that one process does not have: {extra[:5]}")
        # without the float64 answer a tensor holding only round-off (a zero-gradient
        # bias) cannot be told from a wrong one: below one unit of the largest value of
        # its kind (in the type it is stored in: float32, float64 in fp64 cases), a
        # difference is noise
        float64 = case.precision == "fp64"
        dtype, unit = (torch.float64, UNIT_ROUNDOFF["fp64"]) if float64 else \
            (torch.float32, FLOAT32_UNIT)
        tensor_base = EXACT_TOLERANCE if float64 else base
        noise = unit * max((t.double().abs().max().item() for t in want.values()
                            if t.numel()), default=0.0)
        for name in sorted(set(want) & set(got)):
            a, b = got[name].to(dtype), want[name].to(dtype)
            if a.shape != b.shape:
                found.append(f"{what} {name}: shape {tuple(a.shape)} vs {tuple(b.shape)}")
                continue
            # what training changed (a parameter minus its initial value; optimizer state
            # starts at zero), and the round-off of storing this tensor
            init = start.get(name)
            moved = b - init.to(dtype) if init is not None else b
            scale = moved.abs().max().item()
            floor = unit * b.abs().max().item()
            diff = (a - b).abs().max().item()
            if other is not None and answer is not None and name in other and name in answer:
                # as accurate as one process: the run's distance from the float64 answer
                # against the one-process runs' distances from it
                truth = answer[name].double()
                err = (a.double() - truth).abs().max().item()
                one = max((c.double() - truth).abs().max().item() for c in (b, other[name]))
                allowed = max(base * scale, NOISE_MARGIN * one) + floor
                worst = max(worst, err / allowed)
                if err <= allowed:
                    continue
                text = (f"{what} {name}: {err:.3e} from the float64 answer, one process "
                        f"{one:.3e} (allowed {allowed:.3e})")
                if case.precision == "fp32" or err <= max(base * scale, HALF_CAP * one) + floor:
                    roundoff.append(text)
                else:
                    found.append(f"{text}; past {HALF_CAP:g}x one process, more than "
                                 f"{case.precision} round-off does")
            else:  # no float64 answer (or fp64, which is it): against one process itself
                allowed = tensor_base * scale + max(floor, noise)
                worst = max(worst, diff / allowed if allowed else math.inf)
                if diff <= allowed:
                    continue
                found.append(f"{what} {name}: max difference {diff:.3e} > {tensor_base} x "
                             f"{scale:.3e} (its change in training) + {max(floor, noise):.1e}")
    if case.precision == "fp16" and first.scaler != ref.scaler:
        found.append(f"loss scaler {first.scaler} vs reference {ref.scaler}")
    return found, roundoff, worst


def exact_problems(results: list[RunResult], exact: RunResult) -> list[str]:
    """How a case rerun in float64 differs from the float64 answer beyond
    :data:`EXACT_TOLERANCE` (parameters and optimizer state of every rank; below one
    float64 unit of the largest value of its kind, a value is noise, as above)."""
    found = []
    for rank, r in enumerate(results):
        for what, got, want in (("parameter", r.params, exact.params),
                                ("optimizer state", r.optimizer, exact.optimizer)):
            floor = 2.0 ** -53 * max((t.abs().max().item() for t in want.values() if t.numel()),
                                     default=0.0)
            for name in sorted(want):
                if name not in got or got[name].shape != want[name].shape:
                    found.append(f"float64 rerun, rank {rank}: {what} {name} missing or "
                                 "shaped otherwise")
                    continue
                diff = (got[name] - want[name]).abs().max().item()
                scale = want[name].abs().max().item()
                if not diff <= EXACT_TOLERANCE * scale + floor:
                    found.append(f"float64 rerun, rank {rank}: {what} {name} differs from "
                                 f"the float64 answer by {diff:.3e} (scale {scale:.3e})")
    return found


def _bitwise(what: str, a: dict[str, torch.Tensor], b: dict[str, torch.Tensor],
             rank: int) -> list[str]:
    out = []
    if set(a) != set(b):
        out.append(f"rank {rank} has {what} names {sorted(set(a) ^ set(b))[:5]} rank 0 lacks "
                   "or the other way round")
    for name in sorted(set(a) & set(b)):
        if not torch.equal(a[name], b[name]):
            diff = (a[name].float() - b[name].float()).abs().max().item()
            out.append(f"{what} {name} differs between rank 0 and rank {rank} (max {diff:.3e}):"
                       " replicas drifted apart")
    return out
