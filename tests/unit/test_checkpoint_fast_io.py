"""The checkpoint writer and reader (fast_write, fast_read) keep DCP's files and values:
every kind of tensor and entry comes back, non-tensor entries still load without running
code, the CRC32 setting is restored, and an async save whose staging copy is reused is
never overwritten by the next one."""

import io
import os
import pickle
import threading
import warnings

import pytest
import torch
import torch.distributed.checkpoint as torch_dcp

from modelparallel.checkpoint import dcp, fast_read, storage
from modelparallel.checkpoint.fast_write import without_crc32
from modelparallel.checkpoint.staging import ReusedStaging


class Payload:
    def __reduce__(self):
        return (os.system, ("echo this must never run",))


def _state() -> dict:
    g = torch.Generator().manual_seed(0)
    return {"w": torch.randn(64, 32, generator=g),
            "transposed": torch.randn(32, 64, generator=g).t(),
            "bf16": torch.randn(10, generator=g).to(torch.bfloat16),
            "scalar": torch.tensor(3.5), "view": torch.arange(100.0)[10:20],
            "long": torch.arange(7), "empty": torch.zeros(0, 3),
            "settings": {"lr": 0.1, "nesterov": True, "name": "sgd", "betas": (0.9, 0.99)}}


def _zeros_like(sd: dict) -> dict:
    return {k: torch.zeros(v.shape, dtype=v.dtype) if isinstance(v, torch.Tensor) else
            {n: type(x)() for n, x in v.items()} for k, v in sd.items()}


def _save_and_load(tmp_path, sd: dict, into: dict) -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "assuming the intent is to save in a single process"
        torch_dcp.save(sd, storage_writer=storage.writer_for(tmp_path), no_dist=True)
        torch_dcp.load(into, storage_reader=storage.reader_for(tmp_path),
                       planner=storage.SafeLoadPlanner(), no_dist=True)


def test_every_entry_round_trips_and_tensors_are_read_in_place(tmp_path, monkeypatch):
    read = []
    original = fast_read._read_tensor
    monkeypatch.setattr(fast_read, "_read_tensor", lambda *a: read.append(original(*a))
                        or read[-1])
    crc = torch.serialization.get_crc32_options()
    sd = _state()
    got = _zeros_like(sd)
    _save_and_load(tmp_path, sd, got)
    for k, v in sd.items():
        if isinstance(v, torch.Tensor):
            assert torch.equal(got[k], v), k
        else:
            assert got[k] == v
    assert read == [True] * 6  # no tensor went through DCP's torch.load (none for "empty")
    assert torch.serialization.get_crc32_options() == crc


def test_a_narrowed_read_and_a_non_contiguous_destination(tmp_path):
    sd = {"w": torch.arange(48.0).reshape(6, 8)}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch_dcp.save(sd, storage_writer=storage.writer_for(tmp_path), no_dist=True)
    target = torch.zeros(8, 6).t()  # not contiguous: read into a buffer, then copied
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch_dcp.load({"w": target}, storage_reader=storage.reader_for(tmp_path),
                       planner=storage.SafeLoadPlanner(), no_dist=True)
    assert torch.equal(target, sd["w"])


def test_files_written_without_crc32_load_with_torch_load(tmp_path):
    before = torch.serialization.get_crc32_options()
    with without_crc32(), without_crc32():  # re-entrant
        assert torch.serialization.get_crc32_options() is False
        buffer = io.BytesIO()
        torch.save(torch.ones(3), buffer)
    assert torch.serialization.get_crc32_options() == before
    buffer.seek(0)
    assert torch.equal(torch.load(buffer, weights_only=True), torch.ones(3))


def _saved(value) -> io.BytesIO:
    buffer = io.BytesIO()
    torch.save(value, buffer)
    buffer.seek(0)
    return buffer


@pytest.mark.parametrize("value", [0.1, True, None, "s", b"xy", [1, 2.5], {"a": (1, 2)},
                                   {1, 2}, torch.ones(2), {"t": torch.ones(1)}])
def test_non_tensor_entries_load_as_torch_load_does(value):
    got = fast_read.load_bytes(_saved(value))
    expected = torch.load(_saved(value), weights_only=True)
    assert type(got) is type(expected)
    assert str(got) == str(expected)


def test_non_tensor_entries_never_run_code():
    buffer = io.BytesIO()
    torch.save(Payload(), buffer, pickle_module=pickle)
    buffer.seek(0)
    with pytest.raises(pickle.UnpicklingError):
        fast_read.load_bytes(buffer)


def test_async_save_waits_before_reusing_its_staging_copy(tmp_path, monkeypatch):
    """Two async saves in a row, the state changed in between, neither waited for: the
    second copies into the first's staging memory only once the first has written it
    (the first one's writing is held back for a while to make the race certain)."""
    release = threading.Event()

    class SlowWriter(storage.FastFileSystemWriter):
        def write_data(self, plan, planner):
            release.wait()
            return super().write_data(plan, planner)

    monkeypatch.setattr(dcp, "writer_for", SlowWriter)
    state = {"w": torch.full((64, 64), 1.0)}
    timer = threading.Timer(0.5, release.set)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        timer.start()
        first = dcp.async_save(state, checkpoint_id=tmp_path / "first", ctx=None)
        state["w"].fill_(2.0)
        second = dcp.async_save(state, checkpoint_id=tmp_path / "second", ctx=None)
        first.result()
        second.result()
        timer.join()
        for name, value in (("first", 1.0), ("second", 2.0)):
            got = {"w": torch.zeros(64, 64)}
            dcp.load(got, checkpoint_id=tmp_path / name, ctx=None)
            assert torch.equal(got["w"], torch.full((64, 64), value)), name


def test_reused_staging_copies_into_the_same_memory_until_the_structure_changes():
    stager = ReusedStaging()
    state = {"w": torch.ones(4, 4), "opt": {"lr": [0.1], "m": torch.zeros(3)}}
    first = stager.stage(state)
    state["w"].fill_(2.0)
    state["opt"]["lr"][0] = 0.2
    assert torch.equal(first["w"], torch.ones(4, 4)) and first["opt"]["lr"] == [0.1]
    second = stager.stage(state)
    assert second["w"].data_ptr() == first["w"].data_ptr()  # the same copy, refreshed
    assert torch.equal(second["w"], torch.full((4, 4), 2.0)) and second["opt"]["lr"] == [0.2]
    state["m2"] = torch.ones(2)  # another structure: a new copy
    third = stager.stage(state)
    assert set(third) == {"w", "opt", "m2"} and torch.equal(third["m2"], torch.ones(2))
    assert third["w"].data_ptr() != state["w"].data_ptr()
