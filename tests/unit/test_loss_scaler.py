"""LossScaler in one process: scaling, unscaling, skipping and SMP v1's dynamic rules."""

import pytest
import torch

from modelparallel.parallel.precision import LossScaler


def _optimizer(grad: float):
    p = torch.nn.Parameter(torch.ones(3))
    p.grad = torch.full((3,), grad)
    return p, torch.optim.SGD([p], lr=1.0)


def test_scale_unscale_and_step():
    scaler = LossScaler(init_scale=8.0)
    loss = torch.tensor(2.0, dtype=torch.float16)
    assert scaler.scale(loss).dtype == torch.float32 and float(scaler.scale(loss)) == 16.0
    p, opt = _optimizer(8.0)
    scaler.step(opt)
    assert not scaler.overflow
    assert torch.equal(p.detach(), torch.zeros(3))  # 1 - lr * 8 / 8


@pytest.mark.parametrize("bad", [float("inf"), float("nan")])
def test_overflow_skips_the_step_and_halves_the_scale(bad):
    scaler = LossScaler(init_scale=8.0)
    p, opt = _optimizer(bad)
    assert scaler.step(opt) is None
    assert scaler.overflow and torch.equal(p.detach(), torch.ones(3))
    scaler.update()
    assert scaler.scale_value == 4.0


def test_growth_after_scale_window_good_steps():
    scaler = LossScaler(init_scale=4.0, scale_window=3)
    scales = []
    for overflow in [True, False, False, False, False, False, False]:
        scaler.overflow = overflow
        scaler.update()
        scales.append(scaler.scale_value)
    # halved at the overflow, doubled 3 good steps after it, and 3 after that
    assert scales == [2.0, 2.0, 2.0, 4.0, 4.0, 4.0, 8.0]


def test_delayed_shift_waits_for_several_overflows_and_min_scale_holds():
    scaler = LossScaler(init_scale=4.0, delayed_shift=2, min_scale=2.0)
    scales = []
    for _ in range(4):
        scaler.overflow = True
        scaler.update()
        scales.append(scaler.scale_value)
    assert scales == [4.0, 2.0, 2.0, 2.0]  # the first overflow only uses the hysteresis


def test_static_scale_keeps_its_value_and_still_skips():
    scaler = LossScaler(init_scale=16.0, dynamic=False)
    p, opt = _optimizer(float("inf"))
    assert scaler.step(opt) is None and torch.equal(p.detach(), torch.ones(3))
    scaler.update()
    assert scaler.scale_value == 16.0


def test_state_dict_round_trip():
    a = LossScaler(init_scale=64.0, scale_window=5, delayed_shift=3)
    for overflow in (True, False, True):
        a.overflow = overflow
        a.update()
    b = LossScaler()
    b.load_state_dict(a.state_dict())
    assert b.state_dict() == a.state_dict()


def test_bad_init_scale_is_refused():
    with pytest.raises(ValueError, match="init_scale must be a positive finite number"):
        LossScaler(init_scale=0.0)
