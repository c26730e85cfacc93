"""SMP v1's remaining surface on 2 ranks, each against one process: optimizer state
sharding (``shard_optimizer_state``) with its checkpoints, ``smp.save`` / ``smp.load``
and the manual checkpoint pattern, ``smp.amp.GradScaler`` with ``smp.optimizers.FusedLAMB``
over a pipeline, ``backward_passes_per_step`` with ``clip_master_grads`` and an LR
scheduler on the ``DistributedOptimizer``. What ``DistributedModel``'s other arguments
do: test_smp_v1_model_arguments.py."""

import os

import pytest
import torch
from torch import nn

import modelparallel as mp
from modelparallel.models import GPT, GPTConfig
from modelparallel.models.gpt import lm_loss
from modelparallel.smp.v1.amp import GradScaler
from modelparallel.smp.v1.fused_optimizers import FusedLAMB
from modelparallel.smp.v1.save_load import load, save
from modelparallel.smp.v2.checkpoint.constants import SMP_IS_PARTIAL_KEY
from modelparallel.testing import assert_parity, token_batches
from modelparallel.testing.parity import TrainResult

SEQ, VOCAB, BATCH = 8, 64, 8
BATCHES = token_batches(3, BATCH, SEQ, VOCAB, seed=3)


def gpt(seed: int = 0) -> GPT:
    torch.manual_seed(seed)
    return GPT(GPTConfig(vocab_size=VOCAB, max_seq_len=SEQ, d_model=64, n_layers=2, n_heads=4))


@mp.step
def train_step(model, x, y):
    loss = lm_loss(model(x), y)
    model.backward(loss)
    return loss


def _rows(t: torch.Tensor) -> torch.Tensor:
    n = t.shape[0] // mp.dp_size()
    return t[mp.dp_rank() * n:(mp.dp_rank() + 1) * n]


def _global_loss(loss: torch.Tensor) -> float:
    loss = loss.detach().double()
    torch.distributed.all_reduce(loss, group=mp.get_dp_process_group())
    return float(loss) / mp.dp_size()


def _v1_step(model, optimizer, x, y) -> float:
    optimizer.zero_grad()
    loss = _global_loss(train_step(model, _rows(x), _rows(y)).reduce_mean())
    optimizer.step()
    return loss


# -- shard_optimizer_state -------------------------------------------------------------
ZERO = {"ddp": True, "shard_optimizer_state": True}


def sgd(params):
    # stateful (momentum); not Adam, which turns an attention key bias's round-off
    # gradient (its exact gradient is zero) into lr-sized steps that parity cannot judge
    return torch.optim.SGD(params, lr=0.2, momentum=0.9, weight_decay=0.01)


def _reference_sgd(steps: int):
    model = gpt()
    opt = sgd(model.parameters())
    losses = []
    for x, y in BATCHES[:steps]:
        opt.zero_grad()
        loss = lm_loss(model(x), y)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    names = [n for n, _ in model.named_parameters()]
    state = {names[i]: s for i, s in opt.state_dict()["state"].items()}
    return TrainResult(losses, {k: v.detach() for k, v in model.state_dict().items()}), state


def zero_train_case(path: str) -> dict:
    mp.init(ZERO)
    model = mp.DistributedModel(gpt(seed=mp.rank()))  # replicas start from rank 0's values
    optimizer = mp.DistributedOptimizer(sgd(model.parameters()))
    losses = [_v1_step(model, optimizer, x, y) for x, y in BATCHES[:2]]
    mp.save_checkpoint(path, "step2", model=model, optimizer=optimizer)
    losses += [_v1_step(model, optimizer, x, y) for x, y in BATCHES[2:]]
    names = {id(p): n for n, p in model.module.named_parameters()}
    kept = sorted(names[id(p)] for p in optimizer.optimizer.state)
    full = optimizer.state_dict()[0]  # gathered over the replicas
    held = [names[id(p)] for p in optimizer.param_groups[0]["params"]]
    share = len(optimizer.local_state_dict()["state"])
    whole = len(optimizer.local_state_dict(gather_if_shard=True)["state"])
    return {"losses": losses, "params": model.state_dict(), "kept": kept,
            "local": (share, whole), "kept_after_gather": len(optimizer.optimizer.state),
            "state": {held[i]: s for i, s in full["state"].items()}}


def zero_resume_case(path: str) -> dict:
    mp.init(ZERO)
    model = mp.DistributedModel(gpt(seed=7))
    optimizer = mp.DistributedOptimizer(sgd(model.parameters()))
    mp.resume_from_checkpoint(path)
    losses = [_v1_step(model, optimizer, x, y) for x, y in BATCHES[2:]]
    return {"losses": losses, "params": model.state_dict()}


def test_shard_optimizer_state_trains_as_one_process_and_resumes(workers, tmp_path):
    reference, ref_state = _reference_sgd(3)
    runs = workers(2).run(zero_train_case, path=str(tmp_path))
    for run in runs:
        assert_parity(TrainResult(run["losses"], run["params"]), reference)
        assert set(run["state"]) == set(ref_state)  # every parameter's state, reassembled
        for name, want in ref_state.items():
            for key, value in want.items():
                torch.testing.assert_close(run["state"][name][key], value, rtol=1e-5,
                                           atol=1e-7)
    kept = [set(run["kept"]) for run in runs]
    assert kept[0] and kept[1] and not kept[0] & kept[1]  # each replica keeps its share
    assert kept[0] | kept[1] == set(ref_state)
    assert all(run["kept_after_gather"] == len(run["kept"]) for run in runs)  # dropped again
    # local_state_dict(): this replica's share; gather_if_shard=True: every parameter's
    assert [run["local"] for run in runs] == [(len(k), len(ref_state)) for k in kept]
    resumed = workers(2).run(zero_resume_case, path=str(tmp_path))
    for run, before in zip(resumed, runs, strict=True):
        assert run["losses"] == pytest.approx(before["losses"][2:], rel=1e-6)
        for name, value in before["params"].items():
            torch.testing.assert_close(run["params"][name], value, rtol=1e-6, atol=1e-7)


# -- smp.save / smp.load: the manual checkpoint pattern on a pipeline -------------------
PP = {"pipeline_parallel_degree": 2, "microbatches": 2}


def manual_save_case(path: str) -> dict:
    mp.init(PP)
    model = mp.DistributedModel(gpt())
    optimizer = mp.DistributedOptimizer(torch.optim.Adam(model.parameters(), lr=1e-2))
    for x, y in BATCHES[:2]:
        _v1_step(model, optimizer, x, y)
    if mp.rdp_rank() == 0:
        save({"model": model.local_state_dict(), "optimizer": optimizer.local_state_dict()},
             os.path.join(path, "ckpt.pt"), partial=True)
    full = model.state_dict()
    on_rank0 = model.state_dict(gather_to_rank0=True)  # SMP's default: rank 0 only
    gathered = (sorted(on_rank0) == sorted(full)
                and all(torch.equal(v, full[k]) for k, v in on_rank0.items()))
    if mp.rank() == 0:
        save(full, os.path.join(path, "full.pt"), partial=False)
    mp.barrier()
    saved = {k: v.clone() for k, v in model.local_state_dict().items()}
    step3 = _v1_step(model, optimizer, *BATCHES[2])
    part = load(os.path.join(path, "ckpt.pt"))
    assert SMP_IS_PARTIAL_KEY not in part["model"]
    model.load_state_dict({**part["model"], SMP_IS_PARTIAL_KEY: True})  # SMP's marker: dropped
    optimizer.load_state_dict(part["optimizer"])
    restored = all(torch.equal(v, saved[k]) for k, v in model.local_state_dict().items())
    again = _v1_step(model, optimizer, *BATCHES[2])
    _v1_step(model, optimizer, *BATCHES[2])
    renamed = {f"module.{k}": v for k, v in load(os.path.join(path, "full.pt"),
                                                  partial=False).items()}
    model.load_state_dict(renamed, translate_function=lambda sd: {
        k.removeprefix("module."): v for k, v in sd.items()})
    from_full = all(torch.equal(v, saved[k]) for k, v in model.local_state_dict().items())
    return {"files": sorted(os.listdir(path)), "step3": step3, "again": again,
            "restored": restored, "from_full": from_full, "held": sorted(saved),
            "gathered": gathered if mp.rank() == 0 else on_rank0}


def manual_load_case(path: str) -> float:
    """A fresh run loads the parts before its first step: the load waits for the split."""
    mp.init(PP)
    model = mp.DistributedModel(gpt(seed=5))
    optimizer = mp.DistributedOptimizer(torch.optim.Adam(model.parameters(), lr=1e-2))
    part = load(os.path.join(path, "ckpt.pt"))
    model.load_state_dict(part["model"])
    optimizer.load_state_dict(part["optimizer"])
    with pytest.raises(FileNotFoundError, match="no partial checkpoint files"):
        load(os.path.join(path, "missing.pt"))
    return _v1_step(model, optimizer, *BATCHES[2])


def test_manual_save_and_load_round_trip_on_a_pipeline(workers, tmp_path):
    runs = workers(2).run(manual_save_case, path=str(tmp_path))
    assert runs[0]["files"] == ["ckpt.pt_0_0", "ckpt.pt_1_0", "full.pt"]  # SMP's names
    assert runs[0]["held"] != runs[1]["held"]  # each stage saved its own part
    assert runs[0]["gathered"] is True and runs[1]["gathered"] == {}  # gather_to_rank0
    for run in runs:
        assert run["restored"] and run["from_full"]
        assert run["again"] == pytest.approx(run["step3"], rel=1e-6)  # optimizer state too
    fresh = workers(2).run(manual_load_case, path=str(tmp_path))
    assert fresh == pytest.approx([runs[0]["step3"]] * 2, rel=1e-6)


# -- smp.amp.GradScaler and FusedLAMB over a pipeline ------------------------------------
BAD_STEP = 1  # the first stage's embedding gradient overflows at this step


def _lamb(params):
    return FusedLAMB(params, lr=1e-2, weight_decay=0.01, max_grad_norm=0.1)


def _poison(model: nn.Module, step: list[int]) -> None:
    model.tok_emb.weight.register_hook(
        lambda g: torch.full_like(g, float("inf")) if step[0] == BAD_STEP else g)


def _reference_amp():
    model = gpt()
    opt = _lamb(model.parameters())
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 10, growth_interval=2)
    step = [0]
    _poison(model, step)
    losses, scales = [], []
    for step[0], (x, y) in enumerate(BATCHES):
        opt.zero_grad()
        loss = lm_loss(model(x), y)
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()
        losses.append(loss.item())
        scales.append(scaler.get_scale())
    return TrainResult(losses, {k: v.detach() for k, v in model.state_dict().items()}), scales


def amp_case() -> dict:
    mp.init(PP)
    model = mp.DistributedModel(gpt())
    optimizer = mp.DistributedOptimizer(_lamb(model.parameters()))
    scaler = GradScaler(init_scale=2.0 ** 10, growth_interval=2)
    step = [0]
    _poison(model.module, step)  # stage 0 holds the embedding; stage 1 computes the loss

    @mp.step
    def scaled_step(model, x, y):
        loss = lm_loss(model(x), y)
        model.backward(scaler.scale(loss))
        return loss

    losses, scales = [], []
    for step[0], (x, y) in enumerate(BATCHES):
        optimizer.zero_grad()
        losses.append(float(scaled_step(model, x, y).reduce_mean()))
        scaler.step(optimizer)
        scaler.update()
        scales.append(scaler.get_scale())
    return {"losses": losses, "scales": scales, "params": model.state_dict()}


def test_grad_scaler_and_fused_lamb_agree_over_pipeline_stages(workers):
    reference, ref_scales = _reference_amp()
    assert ref_scales[BAD_STEP] == ref_scales[0] / 2  # the step was skipped
    for run in workers(2).run(amp_case):
        assert run["scales"] == ref_scales
        assert_parity(TrainResult(run["losses"], run["params"]), reference)


# -- backward_passes_per_step, sums over microbatches, clip_master_grads, LR schedulers --
ACCUMULATE = {"ddp": True, "hybrid_shard_degree": 1, "microbatches": 2}
CLIP = 0.3


def _halves(x):
    return x[:BATCH // 2], x[BATCH // 2:]


def _reference_accumulation():
    model = gpt()
    opt = torch.optim.SGD(model.parameters(), lr=0.2, momentum=0.9)
    sched = torch.optim.lr_scheduler.StepLR(opt, 1, gamma=0.5)
    losses, norms = [], []
    for x, y in BATCHES:
        opt.zero_grad()
        for xs, ys in zip(_halves(x), _halves(y), strict=True):
            loss = lm_loss(model(xs), ys)
            (2 * loss).backward()  # the sum of the two microbatches' mean losses
            losses.append(loss.item())
        norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)))
        opt.step()
        sched.step()
    return TrainResult(losses, {k: v.detach() for k, v in model.state_dict().items()}), norms


def accumulation_case() -> dict:
    mp.init(ACCUMULATE)
    model = mp.DistributedModel(gpt(seed=mp.rank()), backward_passes_per_step=2,
                                average_grads_across_microbatches=False)
    optimizer = mp.DistributedOptimizer(
        torch.optim.SGD(model.parameters(), lr=0.2, momentum=0.9))
    assert isinstance(optimizer, torch.optim.Optimizer)
    sched = torch.optim.lr_scheduler.StepLR(optimizer, 1, gamma=0.5)
    losses, norms, first_pass, cleared = [], [], [], []
    for step, (x, y) in enumerate(BATCHES):
        optimizer.zero_grad(set_grads_to_None=step % 2 == 0)
        grad = model.module.lm_head.weight.grad
        cleared.append(None if grad is None else float(grad.abs().sum()))
        for i, (xs, ys) in enumerate(zip(_halves(x), _halves(y), strict=True)):
            losses.append(_global_loss(train_step(model, _rows(xs), _rows(ys)).reduce_mean()))
            if i == 0:  # not reduced yet: each replica holds its own rows' gradient
                first_pass.append(model.module.lm_head.weight.grad.clone())
        clip = optimizer.clip_master_grads if step % 2 == 0 else optimizer.clip_grad_norm
        norms.append(float(clip(CLIP)))  # clip_grad_norm: Apex's name, the same clipping
        optimizer.step()
        sched.step()
    lr = optimizer.optimizer.param_groups[0]["lr"]
    lambda_lr = torch.optim.lr_scheduler.LambdaLR(optimizer.optimizer, lambda epoch: 0.1)
    return {"losses": losses, "params": model.state_dict(), "norms": norms,
            "first_pass": first_pass, "cleared": cleared, "lr": lr,
            "lambda_lr": lambda_lr.get_last_lr()[0],
            "lambda_in_wrapper": optimizer.param_groups[0]["lr"]}


def test_backward_passes_per_step_accumulates_before_reducing(workers):
    reference, ref_norms = _reference_accumulation()
    runs = workers(2).run(accumulation_case)
    for run in runs:
        assert_parity(TrainResult(run["losses"], run["params"]), reference)
        assert run["norms"] == pytest.approx(ref_norms, rel=1e-5)  # summed microbatches
        # set_grads_to_None=True drops the gradients, False zeroes them in place
        assert run["cleared"] == [None, 0.0, None]
        assert run["lr"] == pytest.approx(0.2 * 0.5 ** 3)  # StepLR drove the wrapped groups
        assert run["lambda_lr"] == run["lambda_in_wrapper"] == pytest.approx(0.02)
    for a, b in zip(runs[0]["first_pass"], runs[1]["first_pass"], strict=True):
        assert not torch.allclose(a, b)
