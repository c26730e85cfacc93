"""``smp.optimizers`` (Apex's FusedAdam, FusedLAMB, FusedNovoGrad in plain PyTorch)
against steps computed by hand from Apex's kernels, element by element in Python
floats; and ``smp.amp.GradScaler`` in one process against torch's own."""

import math

import pytest
import torch

from modelparallel.smp.v1.amp import GradScaler
from modelparallel.smp.v1.fused_optimizers import FusedAdam, FusedLAMB, FusedLamb, FusedNovoGrad

P0 = [[0.5, -1.0, 2.0], [0.25, 0.0, -0.75]]  # two tensors: a weight and a bias-like one
GRADS = [  # gradients of each tensor at steps 1 and 2
    [[0.1, -0.2, 0.3], [0.05, 0.4, -0.1]],
    [[-0.3, 0.1, 0.2], [0.2, -0.05, 0.15]],
]


def _run(make, steps=2):
    params = [torch.nn.Parameter(torch.tensor(p, dtype=torch.float64)) for p in P0]
    opt = make(params)
    for step in range(steps):
        for p, g in zip(params, GRADS[step], strict=True):
            p.grad = torch.tensor(g, dtype=torch.float64)
        opt.step()
    return [p.detach().tolist() for p in params]


def _close(got, want, rel=1e-12):
    for a, b in zip(got, want, strict=True):
        assert a == pytest.approx(b, rel=rel, abs=1e-14)


def _l2(xs):
    return math.sqrt(sum(x * x for x in xs))


# -- Adam / AdamW ---------------------------------------------------------------------
def _adam_by_hand(adam_w, lr=0.1, b1=0.9, b2=0.99, eps=1e-8, wd=0.1):
    params = [list(p) for p in P0]
    m = [[0.0] * len(p) for p in P0]
    v = [[0.0] * len(p) for p in P0]
    for step in (1, 2):
        for t, p in enumerate(params):
            for i in range(len(p)):
                g = GRADS[step - 1][t][i]
                if not adam_w:
                    g += wd * p[i]
                m[t][i] = b1 * m[t][i] + (1 - b1) * g
                v[t][i] = b2 * v[t][i] + (1 - b2) * g * g
                update = (m[t][i] / (1 - b1 ** step)) / (math.sqrt(v[t][i] / (1 - b2 ** step))
                                                          + eps)
                if adam_w:
                    update += wd * p[i]
                p[i] -= lr * update
    return params


@pytest.mark.parametrize("adam_w", [True, False])
def test_fused_adam_matches_apex_adam_and_adamw_by_hand(adam_w):
    got = _run(lambda ps: FusedAdam(ps, lr=0.1, betas=(0.9, 0.99), weight_decay=0.1,
                                    adam_w_mode=adam_w))
    _close(got, _adam_by_hand(adam_w))


# -- LAMB ------------------------------------------------------------------------------
def _lamb_by_hand(adam_w, wd, nvlamb, max_norm, lr=0.1, b1=0.9, b2=0.99, eps=1e-6,
                  averaging=True, bias_correction=True):
    params = [list(p) for p in P0]
    m = [[0.0] * len(p) for p in P0]
    v = [[0.0] * len(p) for p in P0]
    beta3 = 1 - b1 if averaging else 1.0
    for step in (1, 2):
        grads = GRADS[step - 1]
        norm = _l2([g for t in grads for g in t])
        clip = norm / max_norm if norm > max_norm else 1.0
        bc1 = 1 - b1 ** step if bias_correction else 1.0
        bc2 = 1 - b2 ** step if bias_correction else 1.0
        for t, p in enumerate(params):
            update = []
            for i in range(len(p)):
                g = grads[t][i] / clip
                if not adam_w:
                    g += wd * p[i]
                m[t][i] = b1 * m[t][i] + beta3 * g
                v[t][i] = b2 * v[t][i] + (1 - b2) * g * g
                u = (m[t][i] / bc1) / (math.sqrt(v[t][i] / bc2) + eps)
                update.append(u + wd * p[i] if adam_w else u)
            ratio = lr
            if nvlamb or wd != 0:
                pn, un = _l2(p), _l2(update)
                if pn != 0 and un != 0:
                    ratio = lr * pn / un
            for i in range(len(p)):
                p[i] -= ratio * update[i]
    return params


@pytest.mark.parametrize("adam_w,wd,nvlamb,max_norm", [
    (True, 0.1, False, 0.2),    # AdamW-style decay, trust ratio, clipped (norm ~0.55)
    (False, 0.1, False, 10.0),  # L2 decay in the gradient, not clipped
    (True, 0.0, True, 0.2),     # no decay: the trust ratio only with use_nvlamb
    (True, 0.0, False, 0.2),    # no decay, no nvlamb: plain lr
])
def test_fused_lamb_matches_apex_lamb_by_hand(adam_w, wd, nvlamb, max_norm):
    got = _run(lambda ps: FusedLAMB(ps, lr=0.1, betas=(0.9, 0.99), weight_decay=wd,
                                    adam_w_mode=adam_w, use_nvlamb=nvlamb,
                                    max_grad_norm=max_norm))
    _close(got, _lamb_by_hand(adam_w, wd, nvlamb, max_norm))


def test_fused_lamb_without_decay_clipping_or_trust_ratio_is_torch_adam():
    """A check against an implementation that is not ours."""
    got = _run(lambda ps: FusedLamb(ps, lr=0.1, betas=(0.9, 0.99), eps=1e-6, weight_decay=0.0,
                                    max_grad_norm=float("inf")))
    want = _run(lambda ps: torch.optim.Adam(ps, lr=0.1, betas=(0.9, 0.99), eps=1e-6))
    _close(got, want)


def test_fused_lamb_no_bias_correction_no_averaging():
    got = _run(lambda ps: FusedLAMB(ps, lr=0.1, betas=(0.9, 0.99), weight_decay=0.1,
                                    bias_correction=False, grad_averaging=False,
                                    max_grad_norm=10.0))
    _close(got, _lamb_by_hand(True, 0.1, False, 10.0, averaging=False, bias_correction=False))


def test_fused_lamb_uses_the_global_norm_it_is_given():
    """mp.DistributedOptimizer supplies the whole model's norm (other stages' gradients
    count); 4x this optimizer's own norm clips 4x harder here."""
    own = _l2([g for t in GRADS[0] for g in t])
    got = _run(lambda ps: _with_norm(FusedLAMB(ps, lr=0.1, weight_decay=0.0,
                                               max_grad_norm=0.2), 4 * own), steps=1)
    want = _run(lambda ps: FusedLAMB(ps, lr=0.1, weight_decay=0.0, max_grad_norm=0.05),
                steps=1)
    _close(got, want, rel=1e-9)  # 4n / 0.2 and n / 0.05 round apart in the last bits


def _with_norm(opt, norm):
    opt.grad_norm_fn = lambda: torch.tensor(norm, dtype=torch.float64)
    return opt


# -- NovoGrad --------------------------------------------------------------------------
def _novograd_by_hand(reg_inside, norm_type, init_zero, lr=0.1, b1=0.9, b2=0.98, eps=1e-8,
                      wd=0.01):
    params = [list(p) for p in P0]
    m = [[0.0] * len(p) for p in P0]
    v = [None] * len(P0)
    for step in (1, 2):
        bc1 = 1 - b1 ** step
        bc2 = math.sqrt(1 - b2 ** step)
        for t, p in enumerate(params):
            g = GRADS[step - 1][t]
            n = _l2(g) if norm_type == 2 else max(abs(x) for x in g)
            if v[t] is None:
                v[t] = 0.0 if init_zero else n
            v[t] = math.sqrt(b2 * v[t] ** 2 + (1 - b2) * n * n) if norm_type == 2 \
                else b2 * v[t] + (1 - b2) * n
            denom = v[t] / bc2 + eps
            for i in range(len(p)):
                if reg_inside:
                    m[t][i] = b1 * m[t][i] + (1 - b1) * (g[i] / denom + wd * p[i])
                    p[i] -= lr * m[t][i] / bc1
                else:
                    m[t][i] = b1 * m[t][i] + (1 - b1) * g[i]
                    p[i] -= lr * ((m[t][i] / bc1) / denom + wd * p[i])
    return params


@pytest.mark.parametrize("reg_inside,norm_type,init_zero", [
    (False, 2, False), (True, 2, False), (False, 0, False), (False, 2, True)])
def test_fused_novograd_matches_apex_novograd_by_hand(reg_inside, norm_type, init_zero):
    got = _run(lambda ps: FusedNovoGrad(ps, lr=0.1, betas=(0.9, 0.98), weight_decay=0.01,
                                        reg_inside_moment=reg_inside, norm_type=norm_type,
                                        init_zero=init_zero))
    _close(got, _novograd_by_hand(reg_inside, norm_type, init_zero))


# -- arguments --------------------------------------------------------------------------
def test_what_apex_refuses_is_refused_with_its_message():
    p = [torch.nn.Parameter(torch.ones(2))]
    with pytest.raises(RuntimeError, match="FusedLAMB does not support the AMSGrad variant"):
        FusedLAMB(p, amsgrad=True)
    with pytest.raises(RuntimeError, match="FusedNovoGrad only support l2/inf norm"):
        FusedNovoGrad(p, norm_type=1)
    with pytest.raises(ValueError, match=r"bias_correction=False\) is not supported"):
        FusedAdam(p, bias_correction=False)
    with pytest.raises(ValueError, match="master_weights=True"):
        FusedAdam([torch.nn.Parameter(torch.ones(2, dtype=torch.float16))], master_weights=True)


def test_set_grad_none_decides_what_zero_grad_does():
    p = torch.nn.Parameter(torch.ones(2))
    for opt, cleared in [(FusedLAMB([p]), None), (FusedNovoGrad([p], set_grad_none=False), 0)]:
        p.grad = torch.ones(2)
        opt.zero_grad()
        assert (p.grad is None) if cleared is None else torch.equal(p.grad, torch.zeros(2))


# -- smp.amp.GradScaler in one process ---------------------------------------------------
def _scaled_run(scaler_cls, bad_steps):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = scaler_cls(init_scale=2.0 ** 10, growth_interval=2)
    scales = []
    for step in range(6):
        x = torch.randn(5, 4, generator=torch.Generator().manual_seed(step))
        opt.zero_grad()
        loss = model(x).pow(2).mean()
        scaler.scale(loss).backward()
        if step in bad_steps:
            model[0].weight.grad[0, 0] = float("inf")
        scaler.step(opt)
        scaler.update()
        scales.append(scaler.get_scale())
    return scales, [p.detach().clone() for p in model.parameters()], scaler.state_dict()


def test_grad_scaler_in_one_process_is_torchs():
    ours = _scaled_run(lambda **kw: GradScaler(**kw, device="cpu"), bad_steps={1, 4})
    torchs = _scaled_run(lambda **kw: torch.amp.GradScaler("cpu", **kw), bad_steps={1, 4})
    assert ours[0] == torchs[0]
    assert ours[0][1] == 2.0 ** 9  # the overflow halved it
    for a, b in zip(ours[1], torchs[1], strict=True):
        assert torch.equal(a, b)
    assert ours[2] == torchs[2]


# -- DistributedOptimizer's loss-scaling arguments (SMP v1's FP16_Optimizer) -------------
def test_loss_scaling_arguments_choose_smp_v1s_scaler(caplog):
    from modelparallel.config import Config
    from modelparallel.parallel.precision import LossScaler
    from modelparallel.precision_policy import PrecisionPolicy
    from modelparallel.smp.v1.wrapped_optimizer import loss_scaler_for

    fp16, fp32 = (PrecisionPolicy.decide(Config.load(keys)) for keys in ({"fp16": True}, {}))
    static = loss_scaler_for(fp16, 1.0, False, {}, None, 0)  # SMP's default: static 1.0
    assert static is not None and static.scale_value == 1.0 and not static.dynamic
    dynamic = loss_scaler_for(fp16, None, True, {"scale_window": 10, "delayed_shift": 2},
                              None, 0)
    assert dynamic is not None and dynamic.dynamic and dynamic.scale_value == 2.0 ** 32
    assert (dynamic.scale_window, dynamic.delayed_shift) == (10, 2)
    mine = LossScaler(8.0)
    assert loss_scaler_for(fp16, 1.0, False, {}, mine, 0) is mine
    with pytest.raises(ValueError, match="static_loss_scale=None needs dynamic_loss_scale"):
        loss_scaler_for(fp16, None, False, {}, None, 0)
    with pytest.raises(TypeError, match="unknown dynamic_loss_args"):
        loss_scaler_for(fp16, None, True, {"window": 3}, None, 0)
    with caplog.at_level("WARNING", logger="modelparallel"):
        assert loss_scaler_for(fp32, None, True, {}, None, 0) is None
    assert "have no effect" in caplog.text and "fp32" in caplog.text


def test_shard_optimizer_state_with_sharded_data_parallelism_is_refused():
    from modelparallel.config import Config, ConfigError

    with pytest.raises(ConfigError, match="shards the optimizer state already"):
        Config.load({"shard_optimizer_state": True, "sharded_data_parallel_degree": 2})


def test_v1_utils_structures():
    from collections import namedtuple

    from modelparallel.smp.v1.nested_structures import (
        flatten_structure,
        map_structure,
        unflatten_structure,
    )

    Pair = namedtuple("Pair", "a b")
    nested = {"x": [1, (2, 3)], "p": Pair(4, {"y": 5})}
    assert map_structure(lambda v: v * 10, nested) == \
        {"x": [10, (20, 30)], "p": Pair(40, {"y": 50})}
    flat, sid = flatten_structure(nested)
    assert flat == [1, 2, 3, 4, 5]
    assert unflatten_structure([v + 1 for v in flat], sid) == \
        {"x": [2, (3, 4)], "p": Pair(5, {"y": 6})}
