"""Every built-in tensor-parallel plan: one process's gradients, identical on every rank.

The rule under test (parallel/tensor/regions.py): a replicated tensor used inside a
split region gets a partial gradient on each tensor-parallel rank, which must be
summed; a model nothing splits is trained by the TP ranks as data-parallel replicas.
Qwen3 is the model that needs the first (its q_norm/k_norm act on each rank's heads).
"""

import pytest

from parity_matrix import run
from parity_matrix.space import Case, Layout
from parity_matrix.zoo import BUILTIN_PLAN_MODELS

TP2 = Layout(2, 1, 2, 0)            # 2 ranks: tp 2
TP2_FSDP2 = Layout(4, 1, 2, 2)      # 4 ranks: tp 2 x FSDP 2


@pytest.mark.parametrize("model", BUILTIN_PLAN_MODELS)
def test_every_builtin_plan_matches_one_process(workers, model):
    for case in (Case(TP2, "shard", model), Case(TP2_FSDP2, "shard", model, prescaled_batch=True)):
        outcome = run.run_on_group(workers(case.layout.processes), case)
        assert outcome.ok, outcome.detail


def summed_case(model: str):
    import modelparallel as mp
    from modelparallel.parallel.tensor.regions import split_regions
    from parity_matrix import zoo

    mp.init({"tensor_parallel_degree": 2})
    m = mp.transform(zoo.build(model, 2, False))
    x, y = zoo.batches(model, 1, 4)[0]
    zoo.loss_fn(model)(m(x), y).backward()
    return split_regions(m).summed_names()


def test_the_summed_parameters_are_those_split_heads_read(workers):
    for name in BUILTIN_PLAN_MODELS:
        summed = workers(2).run(summed_case, model=name)[0]
        if name == "qwen3":
            assert summed == [f"model.model.layers.{i}.self_attn.{n}.weight"
                              for i in (0, 1) for n in ("k_norm", "q_norm")]
        else:
            assert summed == [], name


def test_qwen3_without_the_sum_would_differ(workers):
    """The check can fail: with the sum turned off, Qwen3's norms drift from one process."""
    outcome = run.run_on_group(workers(2), Case(TP2, "v1", "qwen3", note="sum disabled"))
    assert outcome.ok
    broken = workers(2).run(unsummed_case)[0]
    assert broken > 1e-4


def unsummed_case() -> float:
    """Largest relative q_norm gradient error when the region sum is switched off."""
    import torch

    import modelparallel as mp
    import modelparallel.parallel.tensor.regions as regions
    from parity_matrix import zoo

    mp.init({"tensor_parallel_degree": 2, "prescaled_batch": True})
    ref = zoo.build("qwen3", 2, False)
    x, y = zoo.batches("qwen3", 1, 4)[0]
    zoo.loss_fn("qwen3")(ref(x), y).backward()
    original = regions._MAX_FOLLOWED_FORWARDS
    regions._MAX_FOLLOWED_FORWARDS = 0  # never follow the data flow: nothing is summed
    try:
        m = mp.transform(zoo.build("qwen3", 2, False))
        zoo.loss_fn("qwen3")(m(x), y).backward()
    finally:
        regions._MAX_FOLLOWED_FORWARDS = original
    got = m.model.model.layers[0].self_attn.q_norm.weight.grad
    want = ref.model.model.layers[0].self_attn.q_norm.weight.grad
    return float((got - want).abs().max() / want.abs().max()) if torch.isfinite(got).all() \
        else float("inf")


class Gated(__import__("torch").nn.Module):
    """An MLP whose split activation is scaled by a value computed from its replicated
    input: that value's gradient would be a partial sum on each rank."""

    def __init__(self):
        from torch import nn

        super().__init__()
        self.up, self.down = nn.Linear(8, 16), nn.Linear(16, 8)

    def forward(self, x):
        return self.down(self.up(x) * x.mean(-1, keepdim=True))


def refused_case() -> str:
    import torch
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    import modelparallel as mp

    mp.init({"tensor_parallel_degree": 2, "prescaled_batch": True})
    mp.tp_register_with_module(Gated, {"up": ColwiseParallel(), "down": RowwiseParallel()})
    try:
        torch.manual_seed(0)
        model = mp.transform(Gated())
        x = torch.randn(4, 8, generator=torch.Generator().manual_seed(0), requires_grad=True)
        model(x).sum().backward()
    except mp.ConfigError as e:
        return str(e)
    finally:
        mp.parallel.tensor.plans.unregister(Gated)
    return "trained"


def test_a_replicated_activation_meeting_a_split_one_is_refused(workers):
    for msg in workers(2).run(refused_case):
        assert "- tensor_parallel_degree: in the model (Gated): a replicated tensor that " \
               "needs a gradient (shape (4, 1), not a parameter" in msg, msg
        assert "meets a tensor-parallel split activation in op 'mul'" in msg
