"""SMP v1's remaining surface on 2 ranks, each against one process: optimizer state
sharding (``shard_optimizer_state``) with its checkpoints, ``smp.save`` / ``smp.load``
and the manual checkpoint pattern, ``smp.amp.GradScaler`` with ``smp.optimizers.FusedLAMB``
over a pipeline, ``backward_passes_per_step`` with ``clip_master_grads`` and an LR
scheduler on the ``DistributedOptimizer``, and what ``DistributedModel``'s other
arguments do."""

import logging
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
    return {"losses": losses, "params": model.state_dict(), "kept": kept,
            "kept_after_gather": len(optimizer.optimizer.state),
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
    if mp.rank() == 0:
        save(full, os.path.join(path, "full.pt"), partial=False)
    mp.barrier()
    saved = {k: v.clone() for k, v in model.local_state_dict().items()}
    step3 = _v1_step(model, optimizer, *BATCHES[2])
    part = load(os.path.join(path, "ckpt.pt"))
    model.load_state_dict(part["model"])
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
            "restored": restored, "from_full": from_full, "held": sorted(saved)}


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
    losses, norms, first_pass = [], [], []
    for x, y in BATCHES:
        optimizer.zero_grad()
        for i, (xs, ys) in enumerate(zip(_halves(x), _halves(y), strict=True)):
            losses.append(_global_loss(train_step(model, _rows(xs), _rows(ys)).reduce_mean()))
            if i == 0:  # not reduced yet: each replica holds its own rows' gradient
                first_pass.append(model.module.lm_head.weight.grad.clone())
        norms.append(float(optimizer.clip_master_grads(CLIP)))
        optimizer.step()
        sched.step()
    lr = optimizer.optimizer.param_groups[0]["lr"]
    lambda_lr = torch.optim.lr_scheduler.LambdaLR(optimizer.optimizer, lambda epoch: 0.1)
    return {"losses": losses, "params": model.state_dict(), "norms": norms,
            "first_pass": first_pass, "lr": lr, "lambda_lr": lambda_lr.get_last_lr()[0],
            "lambda_in_wrapper": optimizer.param_groups[0]["lr"]}


def test_backward_passes_per_step_accumulates_before_reducing(workers):
    reference, ref_norms = _reference_accumulation()
    runs = workers(2).run(accumulation_case)
    for run in runs:
        assert_parity(TrainResult(run["losses"], run["params"]), reference)
        assert run["norms"] == pytest.approx(ref_norms, rel=1e-5)  # summed microbatches
        assert run["lr"] == pytest.approx(0.2 * 0.5 ** 3)  # StepLR drove the wrapped groups
        assert run["lambda_lr"] == run["lambda_in_wrapper"] == pytest.approx(0.02)
    for a, b in zip(runs[0]["first_pass"], runs[1]["first_pass"], strict=True):
        assert not torch.allclose(a, b)


# -- DistributedModel's other arguments ---------------------------------------------------
class _Capture(logging.Handler):
    def __init__(self):
        super().__init__(logging.WARNING)
        self.lines: list[str] = []

    def emit(self, record):
        self.lines.append(record.getMessage())


def _bn_model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 8), nn.BatchNorm1d(8), nn.Linear(8, 1))


@mp.step
def bn_step(model, x):
    out = model(x).pow(2).mean()
    model.backward(out)
    return out


def options_case() -> dict:
    capture = _Capture()
    logging.getLogger("modelparallel").addHandler(capture)
    try:
        mp.init({"ddp": True, "hybrid_shard_degree": 1})
        with pytest.raises(ValueError, match="trace_device must be 'gpu' or 'cpu'"):
            mp.DistributedModel(_bn_model(), trace_device="tpu")
        module = _bn_model()
        model = mp.DistributedModel(
            module, trace_device="gpu", trace_memory_usage=True, overlapping_allreduce=False,
            bucket_cap_mb=100, find_unused_parameters=True, gradient_as_bucket_view=True)
        # (no pipeline: nothing is traced, so the trace arguments have nothing to say)
        optimizer = mp.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                            static_loss_scale=None, dynamic_loss_scale=True)
        own = torch.randn(4, 4, generator=torch.Generator().manual_seed(mp.rank()))
        same = torch.randn(4, 4, generator=torch.Generator().manual_seed(99))
        means = []
        for x in (own, own, same):
            optimizer.zero_grad()
            bn_step(model, x)
            optimizer.step()
            means.append(module[1].running_mean.clone())
    finally:
        logging.getLogger("modelparallel").removeHandler(capture)
    return {"lines": capture.lines, "module": model.get_module() is module, "means": means}


def trace_options_case() -> list[str]:
    capture = _Capture()
    logging.getLogger("modelparallel").addHandler(capture)
    try:
        mp.init(PP)
        mp.DistributedModel(gpt(), trace_device="gpu", trace_memory_usage=True)
    finally:
        logging.getLogger("modelparallel").removeHandler(capture)
    return capture.lines


def _said_once(lines: list[str], expected: list[str]) -> None:
    said = "\n".join(lines)
    for text in expected:
        assert said.count(text) == 1, (text, lines)


def test_distributed_model_arguments_work_or_say_why_not(workers):
    r0, r1 = workers(2).run(options_case)
    assert r0["module"] and r1["module"]
    _said_once(r0["lines"], [
        "overlapping_allreduce=False) has no", "bucket_cap_mb=100) has no effect",
        "find_unused_parameters=True) has no", "gradient_as_bucket_view=True) has no",
        "dynamic_loss_args) have no effect"])
    assert "trace" not in "\n".join(r0["lines"])
    assert r1["lines"] == []  # rank 0 says it once
    t0, t1 = workers(2).run(trace_options_case)
    expected = ["trace_memory_usage=True) has no effect"]
    if not torch.cuda.is_available():  # traces on the device it has, and says so
        expected.append("trace_device='gpu'): this machine has no GPU")
    _said_once(t0, expected)
    assert t1 == []
    # broadcast_buffers: each replica updates its BatchNorm statistics with its own rows,
    # and starts every training step from data-parallel rank 0's
    assert not torch.equal(r0["means"][1], r1["means"][1])
    assert torch.equal(r0["means"][2], r1["means"][2])
