"""Train one case: on a rank through its API path, or in one process as the reference.

Each path is written the way a user's script would be (SMP v1: DistributedModel and
``@mp.step``; SMP v2: ``transform`` then FSDP2, FSDP1 or DDP; SMDDP's module). Every
rank seeds its model with ``seed + dp_rank`` as SMP scripts commonly do (FSDP1 scripts
alike: torch's FSDP1 starts from each rank's own values unless ``sync_module_states``),
so the library's own synchronisation is part of what is tested. After the last step
every rank gathers the full parameters and optimizer state.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from modelparallel.quiet import quiet_logs
from parity_matrix import keyed, mutations, zoo
from parity_matrix.space import ACCUMULATION, STEPS, Case

SEED = 0
LR, MOMENTUM = 0.1, 0.9
FP16_INIT_SCALE = 2.0 ** 10  # large enough to matter, small enough not to overflow here


@dataclass
class RunResult:
    """What a run produced: the global-batch loss of every step, and after the last step
    the full parameters and flattened optimizer state (``state.<name>.<key>``), on CPU."""

    losses: list[float]
    params: dict[str, torch.Tensor]
    optimizer: dict[str, torch.Tensor]
    scaler: dict[str, Any] | None = None
    notes: list[str] = field(default_factory=list)
    initial: dict[str, torch.Tensor] = field(default_factory=dict)  # (the reference's)


def passes(case: Case) -> int:
    return ACCUMULATION if case.accumulation != "none" else 1


def sgd(params) -> torch.optim.Optimizer:
    return torch.optim.SGD(params, lr=LR, momentum=MOMENTUM)


# -- the one-process reference -------------------------------------------------------------

def slices(case: Case) -> int:
    """Pieces a parallel run cuts each global batch into (:attr:`Case.slices`)."""
    return case.slices


def reference(case: Case, *, sliced: bool = False, exact: bool = False) -> RunResult:
    """One process, the same precision policy: the whole global batch per step, or
    (``sliced``) the batch cut as the parallel run cuts it, one backward per slice.
    ``exact``: the same model and data in float64 with no precision policy, the answer
    that every precision and summation order approximates."""
    from modelparallel.parallel.precision import LossScaler, compute_in
    from modelparallel.precision_policy import HALF

    model = zoo.build(case.model, case.layers, case.dropout, SEED, unused=case.unused)
    if case.load_balancing == "aux_loss":
        zoo.turn_on_router_loss(model)
    initial = {n: p.detach().clone() for n, p in model.named_parameters(remove_duplicate=False)}
    exact = exact or case.precision == "fp64"
    half = case.precision in ("bf16", "fp16") and not exact
    if exact:
        model = model.double()
    if half:
        compute_in(model, HALF[case.precision], zoo.blocks_of(model))
    scaler = LossScaler(FP16_INIT_SCALE) if half and case.precision == "fp16" else None
    optimizer = sgd(model.parameters())
    loss_fn = zoo.loss_fn(case.model, case.padded)
    losses = []
    pieces = slices(case) if sliced else 1
    for x, y in zoo.batches(case.model, STEPS, case.rows, padded=case.padded):
        if exact and x.is_floating_point():
            x = x.double()
        optimizer.zero_grad()
        n = x.shape[0] // pieces
        # padded: the summed loss over the step's valid targets, as one process computes
        # a token mean over the whole batch
        divisor = (y != zoo.IGNORE).sum() if case.padded else pieces
        loss = torch.zeros(())
        for i in range(pieces):
            part = loss_fn(model(x[i * n:(i + 1) * n]), y[i * n:(i + 1) * n]) / divisor
            part = part + _router_loss(model.samples)
            (scaler.scale(part) if scaler else part).backward()
            loss = loss + part.detach()
        if scaler:
            scaler.step(optimizer)
            scaler.update()
        else:
            optimizer.step()
        losses.append(float(loss.detach()))
    state = {}
    for name, p in model.named_parameters():
        buf = optimizer.state.get(p, {}).get("momentum_buffer")
        if buf is not None:
            state[f"state.{name}.momentum_buffer"] = buf.detach().clone()
    params = {n: p.detach().clone() for n, p in model.named_parameters(remove_duplicate=False)}
    return RunResult(losses, params, state, scaler.state_dict() if scaler else None,
                     initial=initial)


# -- one rank of the parallel run -------------------------------------------------------------

def run_rank(case_dict: dict[str, Any], exact: bool = False) -> RunResult:
    """Train ``case`` on this rank (the default process group exists); gather the result.
    ``exact``: the model and data in float64, the case's precision policy dropped (its
    layout, path and every other axis kept)."""
    case = Case.from_dict(case_dict)
    with quiet():
        if exact and case.precision != "fp64":
            case = dataclasses.replace(case, precision="fp32")
        run = PathRun(case, exact=exact or case.precision == "fp64")
        losses = [run.step(x, y) for x, y in zoo.batches(run.case.model, STEPS, run.case.rows,
                                                         padded=run.case.padded)]
        return run.result(losses)


class PathRun:
    """A case's model, optimizer (and fp16 loss scaler) on this rank, built the way a
    script on the case's API path builds them; ``step`` trains on one global batch.
    ``exact`` (an fp32 or fp64 case, or a half-precision case turned fp32): the model
    and data in float64."""

    def __init__(self, case: Case, seed: int = SEED, exact: bool = False):
        assert not exact or case.precision in ("fp32", "fp64"), "float64 replaces fp32 only"
        self.case = case
        self.exact = exact
        self.mp = mp = _init(case)
        self.device = mp.state.context.device  # this rank's GPU, or the CPU
        from modelparallel.parallel.precision import LossScaler

        # SMP scripts often seed each rank apart; FSDP1 scripts start alike (torch's FSDP1
        # takes each rank's own values unless sync_module_states)
        model = zoo.build(case.model, case.layers, case.dropout,
                          seed if case.path == "fsdp1" else seed + mp.dp_rank(),
                          unused=case.unused)
        if case.model == "partial":
            zoo.keep_first_block_whole(model)
        if exact:
            model = model.double()
        self.samples: keyed.Samples = model.samples
        self.scaler = LossScaler(FP16_INIT_SCALE) if case.precision == "fp16" else None
        self.loss_fn = zoo.loss_fn(case.model, case.padded)
        self.passes = passes(case)
        if case.path == "v1":
            self.model = mp.DistributedModel(
                model, backward_passes_per_step=2 if case.accumulation == "no_sync" else 1)
            if case.checkpointing:  # SMP v1 scripts mark modules after wrapping
                for block in zoo.blocks_of(self.model.module):
                    mp.set_activation_checkpointing(block)
            self.optimizer = mp.DistributedOptimizer(sgd(self.model.parameters()),
                                                     loss_scaler=self.scaler)
            self._train_step = _v1_step(mp, self.loss_fn, self.passes, case)
        else:
            self.model = _wrap_v2(case, mp, model, self.device)
            self.optimizer = sgd(self.model.parameters())
        if case.mutation == "skip_allreduce":
            mutations.skip_first_bucket(self.model)

    def step(self, x: torch.Tensor, y: torch.Tensor) -> float:
        """One optimizer step on this rank's rows of the global batch; the global loss.

        Padded targets: each pass's summed loss over ``mp.global_token_count`` of the
        rows of every pass of this step (inside SMP v1's step function when the step is
        one call; otherwise counted before, and passed in)."""
        case, mp = self.case, self.mp
        self.optimizer.zero_grad()
        if self.exact and x.is_floating_point():
            x = x.double()
        x, y = x.to(self.device), y.to(self.device)  # as SMP v1 and v2 scripts do
        every_pass = _rows(case, x, 0, self.passes)
        divisor = None
        if case.padded and (case.path != "v1" or self.passes > 1):  # this rank's targets
            divisor = mp.global_token_count(mp.split_for_context_parallel(y[every_pass]))
        scale = 2.0 if case.mutation == "double_loss" else 1.0
        total = 0.0
        for part in range(self.passes):
            rows = _rows(case, x, part)
            if case.path == "v1":
                out = self._train_step(self.model, x[rows], y[rows], divisor, scale)
                total += float(out.reduce_mean())
                continue
            skip = case.accumulation == "no_sync" and part < self.passes - 1
            # context parallelism: this rank's chunks of every sequence (and its targets)
            xs, ys = mp.split_for_context_parallel(x[rows], y[rows])
            with _no_sync(self.model, skip):
                loss = self.loss_fn(self.model(xs), ys)
                loss = loss / divisor if divisor is not None else loss / self.passes
                loss = loss + _router_loss(self.samples)  # (its cases: one pass a step)
                (self.scaler.scale(loss * scale) if self.scaler else loss * scale).backward()
            total += float(loss.detach())
        mutations.before_step(case, self.model)
        if self.scaler is not None and case.path != "v1":
            self.scaler.step(self.optimizer)
            self.scaler.update()
        else:
            self.optimizer.step()
        # a padded pass's loss is its share of the step's token mean: they add up
        return _global_mean(total if case.padded or case.path != "v1" else total / self.passes)

    def save(self, path: str, tag: str) -> None:
        self.mp.save_checkpoint(path, tag, model=self.model, optimizer=self.optimizer,
                                loss_scaler=self.scaler)

    def resume(self, path: str) -> None:
        self.mp.resume_from_checkpoint(path, model=self.model, optimizer=self.optimizer,
                                       loss_scaler=self.scaler)

    def result(self, losses: list[float]) -> RunResult:
        """Full parameters and optimizer state, gathered on every rank."""
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

        from modelparallel.checkpoint import states

        if self.case.path == "v1":
            params = {k: v.detach().cpu() for k, v in self.model.state_dict().items()}
            optim = _v1_optimizer_state(self.model, self.optimizer)
        else:
            options = StateDictOptions(full_state_dict=True, cpu_offload=False)
            full: dict[str, Any] = get_model_state_dict(self.model, options=options)
            params = {k: v.detach().cpu() for k, v in full.items()}
            optim = {k: v.detach().cpu() for k, v in states.optimizer_state(
                self.model, self.optimizer, full=True, every_rank=True).items()
                if isinstance(v, torch.Tensor)}
        return RunResult(losses, params, optim,
                         self.scaler.state_dict() if self.scaler else None)


@contextlib.contextmanager
def quiet() -> Iterator[None]:
    """Warnings and torch's own error logs would bury the results; errors still raise.
    The levels and filters come back afterwards: a worker runs other tests next."""
    with quiet_logs("torch", "transformers", "modelparallel"):
        yield


def _init(case: Case):
    import modelparallel as mp

    if case.path == "smddp":  # as the launcher passes a job's configuration
        import modelparallel.dataparallel as sdp

        os.environ["MP_CONFIG"] = json.dumps(case.config())
        try:
            sdp.init_process_group(backend="smddp")
        finally:
            del os.environ["MP_CONFIG"]
    else:
        mp.init(case.config())
    return mp


def _rows(case: Case, x: torch.Tensor, part: int, count: int = 1) -> slice:
    """This rank's rows of a global batch for accumulation passes ``part`` to
    ``part + count``."""
    from modelparallel.data import replica_rank_and_size

    index, replicas = replica_rank_and_size()
    per_rank = x.shape[0] // replicas
    per_pass = per_rank // passes(case)
    start = index * per_rank + part * per_pass
    return slice(start, start + count * per_pass)


def _global_mean(value: float) -> float:
    """The mean over the data-parallel group of the losses its ranks computed (ranks that
    read the same rows report the same loss, unless dropout draws differently)."""
    import modelparallel as mp

    t = torch.tensor(value, dtype=torch.float64)
    group = mp.get_dp_process_group()
    dist.all_reduce(t, group=group)
    return float(t) / dist.get_world_size(group)


def _router_loss(samples: keyed.Samples) -> torch.Tensor | float:
    """The weighted load-balancing loss of a mixture-of-experts model's last forward (0
    without one), to add to the loss as the model adds it to its labels' (on each rank
    the whole batch's: the data-parallel average of the gradients is one process's)."""
    return 0.0 if samples.router_loss is None else samples.router_loss


def _v1_step(mp, loss_fn, n: int, case: Case):
    @mp.step
    def train_step(model, x, y, divisor, scale):
        loss = loss_fn(model(x), y)
        if case.padded:  # the step's count, taken here when not passed in
            loss = loss / (divisor if divisor is not None else mp.global_token_count(y))
        model.backward(loss * scale if case.padded else loss * scale / n)
        return loss

    return train_step


def _v1_optimizer_state(model, optimizer) -> dict[str, torch.Tensor]:
    from modelparallel.checkpoint import states
    from modelparallel.smp.v1.ranks import PP_GROUP, get_process_group

    optimizer._filter()
    part = states.optimizer_state(model.module, optimizer.optimizer, full=True, every_rank=True)
    parts: list[Any] = [None] * model.pipeline_degree
    dist.all_gather_object(parts, part, group=get_process_group(PP_GROUP))
    full = {}
    for p in parts:
        full.update(p)
    return {k: v.cpu() for k, v in full.items() if isinstance(v, torch.Tensor)}


def _checkpoint_blocks(model: nn.Module) -> None:
    """Activation checkpointing as SMP v2 scripts apply it (torch's checkpoint wrapper)."""
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import (
        CheckpointImpl,
        apply_activation_checkpointing,
        checkpoint_wrapper,
    )

    blocks = {id(b) for b in zoo.blocks_of(model)}
    apply_activation_checkpointing(
        model, check_fn=lambda m: id(m) in blocks,
        checkpoint_wrapper_fn=lambda m: checkpoint_wrapper(
            m, checkpoint_impl=CheckpointImpl.NO_REENTRANT))


def _wrap_v2(case: Case, mp, model: nn.Module, device: torch.device) -> nn.Module:
    if case.path == "smddp":
        import modelparallel.dataparallel as sdp

        if case.checkpointing:
            _checkpoint_blocks(model)
        return sdp.DistributedDataParallel(model)
    if case.model in zoo.MOE_MODELS:
        model = _transform_experts(mp, model, case.load_balancing)
    else:
        model = keyed.transform(mp, model, case.layout.cp > 1)  # (keeps keyed attention)
    if case.path == "shard":
        if case.checkpointing:
            _checkpoint_blocks(model)
        return mp.shard(model)
    if case.path == "ddp":
        if case.checkpointing:
            _checkpoint_blocks(model)
        return mp.replicate(model)
    from torch.distributed.fsdp import FullyShardedDataParallel
    from torch.distributed.fsdp.wrap import ModuleWrapPolicy

    layer = {type(b) for b in zoo.blocks_of(model)}
    wrapped = FullyShardedDataParallel(  # device_id: SMP v2 scripts give their GPU
        model, auto_wrap_policy=ModuleWrapPolicy(layer), use_orig_params=True,
        device_id=device if device.type == "cuda" else None)
    if case.checkpointing:  # SMP v2's train_lib applies it after FSDP
        _checkpoint_blocks(wrapped)
    return wrapped


def _transform_experts(mp, model: nn.Module, load_balancing: str) -> nn.Module:
    """``tsm.transform(model, config=MoEConfig(smp_moe=False, ...))`` as an SMP v2 script
    calls it on its Hugging Face model (the one inside the matrix's keyed wrapper, which
    then carries the experts it split for the wrappers to find)."""
    from modelparallel.module_state import lookup, state_of
    from modelparallel.smp.v2.moe import MoEConfig

    moe = MoEConfig(smp_moe=False, moe_load_balancing=load_balancing,
                    moe_aux_loss_coeff=zoo.ROUTER_LOSS_COEF)
    model.model = mp.transform(model.model, config=moe)
    state_of(model).expert_parallel = lookup(model.model, "expert_parallel")
    model.decode_inside()  # after its tensor-parallel gathering: the group's numbers
    return model


def _no_sync(model: Any, skip: bool) -> contextlib.AbstractContextManager:
    """A context in which backward accumulates without reducing over data-parallel ranks."""
    if not skip:
        return contextlib.nullcontext()
    if hasattr(model, "no_sync"):  # DDP, FSDP1
        return model.no_sync()
    if hasattr(model, "set_requires_gradient_sync"):  # FSDP2 and its replicate
        model.set_requires_gradient_sync(False)
        return _restore_sync(model)
    raise RuntimeError(f"{type(model).__name__} has no way to skip gradient synchronisation")


@contextlib.contextmanager
def _restore_sync(model):
    try:
        yield
    finally:
        model.set_requires_gradient_sync(True)
