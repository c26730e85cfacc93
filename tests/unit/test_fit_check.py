"""The appliers' check before the first step: a layout whose training state alone
exceeds what a rank can see is named on rank 0, with the numbers and the fix."""

import logging

import torch
from torch import nn

from modelparallel.observe.fit_check import local_parameter_bytes, warn_if_state_cannot_fit


def test_state_that_cannot_fit_is_named_on_rank_0(monkeypatch, caplog):
    model = nn.Linear(256, 256)  # 263 168 bytes of parameters
    assert local_parameter_bytes(model) == (256 * 256 + 256) * 4
    cpu = torch.device("cpu")
    with caplog.at_level(logging.WARNING, logger="modelparallel"):
        assert not warn_if_state_cannot_fit(model, 0, cpu, "mp.shard")
        # a node where each rank sees about a megabyte
        monkeypatch.setenv("LOCAL_WORLD_SIZE", str(_physical() // 2**20))
        assert not warn_if_state_cannot_fit(model, 1, cpu, "mp.shard"), "rank 0 alone warns"
        assert warn_if_state_cannot_fit(model, 0, cpu, "mp.shard")
    message = caplog.records[-1].getMessage()
    assert len(caplog.records) == 1
    assert "mp.shard: this layout will not fit on rank 0" in message
    assert "hybrid_shard_degree" in message and "modelparallel plan" in message


def test_meta_parameters_count_nothing():
    with torch.device("meta"):
        assert local_parameter_bytes(nn.Linear(1024, 1024)) == 0


def _physical() -> int:
    import os

    return os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
