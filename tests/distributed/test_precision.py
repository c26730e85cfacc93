"""bf16/fp16 from the configuration compute in that type on every path, or are refused.

Parity of the precision policy against one process is in the parity matrix (its
tolerances are written in tests/parity_matrix/compare.py); these tests read
what each path really computes in, the fp16 loss-scaling rules and their messages."""

import pytest
import torch
import torch.nn.functional as F

import modelparallel as mp
from modelparallel.models import GPT, GPTConfig
from modelparallel.models.gpt import lm_loss
from modelparallel.testing import WorkerError
from parity_matrix import run
from parity_matrix.space import Case, Layout

CFG = GPTConfig(vocab_size=64, max_seq_len=8, d_model=32, n_layers=2, n_heads=8)


def _gpt():
    torch.manual_seed(0)
    return GPT(CFG)


def dtype_case(path: str, half: str) -> dict:
    """The dtypes a linear layer computes with, and those of the stored parameters and
    their gradients, on one path."""
    config = {half: True, "tensor_parallel_degree": 2 if path in ("transform", "v1-tp") else 1,
              "hybrid_shard_degree": 1}
    mp.init(config)
    model = _gpt()
    if path == "transform":
        model = mp.transform(model)
    elif path == "replicate":
        model = mp.replicate(mp.transform(model))
    elif path == "fsdp1":
        from torch.distributed.fsdp import FullyShardedDataParallel

        model = FullyShardedDataParallel(model, use_orig_params=True)
    seen = {}
    target = (model.module if hasattr(model, "module") else model)

    def record(module, args, out):
        w = module.weight
        seen.setdefault("input", str(args[0].dtype))
        seen.setdefault("weight", str((w.to_local() if hasattr(w, "to_local") else w).dtype))
        seen.setdefault("output", str(out.dtype))

    x = torch.randint(64, (4, 8))
    if path.startswith("v1"):
        model = mp.DistributedModel(model)
        scaler = mp.LossScaler(2.0 ** 8) if half == "fp16" else None
        optimizer = mp.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                            loss_scaler=scaler)

        @mp.step
        def step(model, x):
            loss = lm_loss(model(x), x)
            model.backward(loss)
            return loss

        step(model, x)  # wraps the model: hook the layer afterwards, run again
        handle = model.module.blocks[0].mlp.fc_in.register_forward_hook(record, prepend=True)
        optimizer.zero_grad()
        step(model, x)
        handle.remove()
        params = list(model.local_parameters())
    else:
        target.blocks[0].mlp.fc_in.register_forward_hook(record, prepend=True)
        lm_loss(model(x), x).float().backward()
        params = list(model.parameters())
    seen["stored"] = sorted({str(p.dtype) for p in params})
    seen["grads"] = sorted({str(p.grad.dtype) for p in params if p.grad is not None})
    return seen


@pytest.mark.parametrize("path", ["transform", "replicate", "fsdp1", "v1", "v1-tp"])
def test_half_precision_computes_in_half_with_float32_masters(workers, path):
    for seen in workers(2).run(dtype_case, path=path, half="bf16"):
        assert seen["input"] == seen["weight"] == seen["output"] == "torch.bfloat16", seen
        assert seen["stored"] == ["torch.float32"] and seen["grads"] == ["torch.float32"]


def unscaled_fp16_case(path: str):
    mp.init({"fp16": True})
    model = _gpt()
    if path == "shard":
        model = mp.shard(model)
    elif path == "replicate":
        model = mp.replicate(model)
    else:
        model = mp.transform(model)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    x = torch.randint(64, (4, 8))
    lm_loss(model(x), x).backward()
    optimizer.step()


@pytest.mark.parametrize("path", ["shard", "replicate", "transform"])
def test_fp16_without_a_loss_scaler_is_an_error_that_says_what_to_do(workers, path):
    with pytest.raises(WorkerError) as err:
        workers(2).run(unscaled_fp16_case, path=path)
    msg = str(err.value)
    assert "fp16=True: the model computes in float16" in msg
    assert "scaler = mp.LossScaler(); scaler.scale(loss).backward(); scaler.step(optimizer); " \
           "scaler.update()" in msg


def v1_fp16_without_distributed_optimizer_case():
    mp.init({"fp16": True})
    model = mp.DistributedModel(_gpt())

    @mp.step
    def step(model, x):
        loss = lm_loss(model(x), x)
        model.backward(loss)
        return loss

    step(model, torch.randint(64, (4, 8)))


def test_fp16_distributed_model_needs_its_optimizer(workers):
    with pytest.raises(WorkerError) as err:
        workers(2).run(v1_fp16_without_distributed_optimizer_case)
    assert "fp16=True needs loss scaling, which mp.DistributedOptimizer does" in str(err.value)


def overflow_case(init_scale: float) -> dict:
    """DistributedModel in fp16 with a loss scale so large the first steps overflow: they
    are skipped on every rank alike and the scale comes down."""
    mp.init({"fp16": True, "hybrid_shard_degree": 2})
    model = mp.DistributedModel(_gpt())
    optimizer = mp.DistributedOptimizer(  # SMP v1's FP16_Optimizer arguments
        torch.optim.SGD(model.parameters(), lr=0.1), static_loss_scale=None,
        dynamic_loss_scale=True, dynamic_loss_args={"init_scale": init_scale})

    @mp.step
    def step(model, x):
        loss = F.cross_entropy(model(x).flatten(0, 1).float(), x.flatten())
        model.backward(loss)
        return loss

    before = None
    history = []
    for i in range(6):
        x = torch.randint(64, (4, 8), generator=torch.Generator().manual_seed(i))
        optimizer.zero_grad()
        step(model, x)
        if before is None:
            before = {k: v.clone() for k, v in model.state_dict().items()}
        optimizer.step()
        after = model.state_dict()
        changed = any(not torch.equal(before[k], after[k]) for k in after)
        history.append((optimizer.overflow, changed, optimizer.loss_scaler.scale_value))
        before = {k: v.clone() for k, v in after.items()}
    return {"history": history, "state": optimizer.state_dict()[0]["loss_scaler"]}


def test_fp16_overflow_skips_the_step_on_every_rank_and_lowers_the_scale(workers):
    # the logits' gradients are about scale / 32: past float16's 65504 at 2**22
    results = workers(4).run(overflow_case, init_scale=2.0 ** 22)
    for r in results:
        assert r == results[0]  # every rank took the same decisions
    history = results[0]["history"]
    assert history[0] == (True, False, 2.0 ** 21)  # overflow: not applied, scale halved
    assert any(not overflow and changed for overflow, changed, _ in history)  # later: trains
    assert results[0]["state"]["scale"] == history[-1][2]


def test_fp16_and_bf16_parity_on_each_path(workers):
    """One case per path in each half type (the matrix covers the rest)."""
    for precision in ("bf16", "fp16"):
        for case in (Case(Layout(4, 1, 2, 2), "shard", "llama", precision=precision),
                     Case(Layout(4, 1, 1, 1), "ddp", "gpt2", precision=precision),
                     Case(Layout(4, 2, 1, 1, schedule="interleaved"), "v1", "gpt",
                          precision=precision, ddp=True, microbatches=2),
                     Case(Layout(4, 1, 2, 2), "fsdp1", "gpt", precision=precision)):
            outcome = run.run_on_group(workers(4), case)
            assert outcome.ok, outcome.detail
