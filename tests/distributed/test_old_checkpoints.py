"""Checkpoints written by older code load with this code (tests/data/old_checkpoints/:
SMP v1's ``smp.save``, ``mp.save_checkpoint`` and SMP v2's ``state_dict_saver.save``,
written at 3b3841b, before ``smp/`` was split by API). None of them pickles a module path
of this package, so moving modules cannot break them; this test fails if that changes."""

from __future__ import annotations

import re
import shutil
from pathlib import Path

import torch
from torch import nn

DATA = Path(__file__).resolve().parents[1] / "data" / "old_checkpoints"
WEIGHT = torch.arange(12.0).reshape(3, 4) / 10
BIAS = torch.tensor([1.0, -1.0, 0.5])


def _stepped() -> tuple[nn.Module, torch.optim.Optimizer]:
    """The writer's model after its one Adam step (tests/data/old_checkpoints/write.py)."""
    m = nn.Linear(4, 3)
    with torch.no_grad():
        m.weight.copy_(WEIGHT)
        m.bias.copy_(BIAS)
    opt = torch.optim.Adam(m.parameters(), lr=0.1)
    m(torch.ones(2, 4)).sum().backward()
    opt.step()
    return m, opt


def load_case(path: str) -> dict:
    from modelparallel.distributed.checkpoint import state_dict_loader

    import modelparallel as mp
    from modelparallel.parallel.precision import LossScaler

    mp.init({})
    try:
        expected, _ = _stepped()
        want = {k: v.detach().clone() for k, v in expected.state_dict().items()}
        root = Path(path)
        # SMP v1: smp.load of smp.save's file
        saved = mp.load(str(root / "smp_v1_save.pt"), partial=False)
        assert saved["step"] == 3
        for k, v in want.items():
            torch.testing.assert_close(saved["model"][k], v)
        assert saved["optimizer"]["state"][0]["step"] == 1
        scaler = LossScaler(dynamic=True)
        scaler.load_state_dict(saved["loss_scaler"])
        assert scaler.scale_value == 2.0 ** 8
        # mp.save_checkpoint / mp.resume_from_checkpoint
        m = nn.Linear(4, 3)
        opt = torch.optim.Adam(m.parameters(), lr=0.1)
        m(torch.ones(2, 4)).sum().backward()
        opt.step()  # the state exists before loading into it
        content = mp.resume_from_checkpoint(str(root / "mp_checkpoint"), model=m,
                                            optimizer=opt)
        assert content == {"step": 3, "note": "3b3841b"}
        for k, v in want.items():
            torch.testing.assert_close(m.state_dict()[k], v)
        _, ref_opt = _stepped()
        torch.testing.assert_close(opt.state_dict()["state"][0]["exp_avg"],
                                   ref_opt.state_dict()["state"][0]["exp_avg"])
        # SMP v2: torch.sagemaker.distributed.checkpoint.state_dict_loader.load
        target = {"model": {k: torch.zeros_like(v) for k, v in want.items()}, "step": 0}
        state_dict_loader.load(target, checkpoint_id=str(root / "smp_v2_dcp"))
        for k, v in want.items():
            torch.testing.assert_close(target["model"][k], v)
        return {"step": target["step"]}
    finally:
        mp.reset()


def test_checkpoints_written_before_the_split_load(workers, tmp_path):
    shutil.copytree(DATA, tmp_path / "old")
    (run,) = workers(1).run(load_case, path=str(tmp_path / "old"))
    assert run == {"step": 3}


def test_no_stored_checkpoint_names_a_module_of_this_package():
    """torch.save stores its pickles uncompressed, so a class or function pickled by
    module path would show as ``modelparallel.<module>`` in the bytes."""
    for f in DATA.rglob("*"):
        if f.is_file() and f.suffix not in (".py", ".md", ".json"):
            assert not re.search(rb"modelparallel\.", f.read_bytes()), f
