"""Writes the checkpoints in this folder; run with the code of the commit the README names:

    PYTHONPATH=<checkout>/src python tests/data/old_checkpoints/write.py tests/data/old_checkpoints

One process (gloo, world size 1). The values are fixed so the test can check them.
"""

import sys
from pathlib import Path

import torch
from torch import nn

import modelparallel as mp
from modelparallel.parallel.precision import LossScaler


def model() -> nn.Module:
    m = nn.Linear(4, 3)
    with torch.no_grad():
        m.weight.copy_(torch.arange(12.0).reshape(3, 4) / 10)
        m.bias.copy_(torch.tensor([1.0, -1.0, 0.5]))
    return m


def main(out: Path) -> None:
    mp.init({})
    m = model()
    opt = torch.optim.Adam(m.parameters(), lr=0.1)
    m(torch.ones(2, 4)).sum().backward()
    opt.step()  # the optimizer has state (exp_avg, exp_avg_sq, step)
    scaler = LossScaler(dynamic=True, init_scale=2.0 ** 8)
    # SMP v1: smp.save of a state dict, the loss scaler's state and plain values
    mp.save({"model": m.state_dict(), "optimizer": opt.state_dict(),
             "loss_scaler": scaler.state_dict(), "step": 3},
            str(out / "smp_v1_save.pt"), partial=False)
    # modelparallel's own: mp.save_checkpoint (DCP, with user content)
    mp.save_checkpoint(str(out / "mp_checkpoint"), "step3", model=m, optimizer=opt,
                       user_content={"step": 3, "note": "3b3841b"})
    # SMP v2: torch.sagemaker.distributed.checkpoint.state_dict_saver.save
    from modelparallel.distributed.checkpoint import state_dict_saver
    state_dict_saver.save({"model": m.state_dict(), "step": 3},
                          checkpoint_id=str(out / "smp_v2_dcp"))
    mp.reset()


if __name__ == "__main__":
    main(Path(sys.argv[1]))
