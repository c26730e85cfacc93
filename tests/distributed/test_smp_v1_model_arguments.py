"""What ``smp.DistributedModel``'s arguments without a counterpart here do, on 2 ranks:
each logs one line why it has no effect (rank 0, once), ``trace_device="gpu"`` traces on
the CPU of a machine without GPUs and says so, and ``broadcast_buffers`` starts every
step from data-parallel rank 0's buffers."""

import logging

import pytest
import torch
from torch import nn

import modelparallel as mp
from modelparallel.models import GPT, GPTConfig

SEQ, VOCAB = 8, 64
PP = {"pipeline_parallel_degree": 2, "microbatches": 2}


def gpt(seed: int = 0) -> GPT:
    torch.manual_seed(seed)
    return GPT(GPTConfig(vocab_size=VOCAB, max_seq_len=SEQ, d_model=64, n_layers=2, n_heads=4))


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
