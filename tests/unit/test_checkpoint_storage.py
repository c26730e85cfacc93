"""Checkpoint files are read without running code from them."""

import io
import os
import pickle

import pytest
import torch
from torch.distributed.checkpoint.metadata import (
    ChunkStorageMetadata,
    Metadata,
    TensorProperties,
    TensorStorageMetadata,
)

from modelparallel.checkpoint import CheckpointError, storage
from modelparallel.checkpoint.states import check_safe, load_safe


class Payload:
    def __reduce__(self):
        return (os.system, ("echo this must never run",))


def unpickle(obj):
    return storage._MetadataUnpickler(io.BytesIO(pickle.dumps(obj))).load()


def test_metadata_loads_and_code_is_refused():
    meta = Metadata(state_dict_metadata={"w": TensorStorageMetadata(
        TensorProperties(dtype=torch.bfloat16), torch.Size([4, 2]),
        [ChunkStorageMetadata(torch.Size([0, 0]), torch.Size([4, 2]))])})
    assert unpickle(meta).state_dict_metadata["w"].size == torch.Size([4, 2])
    with pytest.raises(pickle.UnpicklingError, match=r"refusing to load posix\.system"):
        unpickle(Payload())
    with pytest.raises(pickle.UnpicklingError, match=r"refusing to load builtins\.eval"):
        unpickle(eval)


def test_small_state_must_load_without_unpickling():
    assert load_safe(check_safe("user_content", {"step": 3, "t": torch.ones(2)}))["step"] == 3
    with pytest.raises(CheckpointError, match=r"it holds posix\.system\."):
        check_safe("user_content", {"x": Payload()})


def test_paths_and_urls_are_joined_in_their_own_spelling(tmp_path):
    assert storage.Location("memory://ckpts").url("a", "b") == "memory://ckpts/a/b"
    local = storage.Location(tmp_path)
    assert local.url("a") == os.path.join(tmp_path, "a")
    local.write_atomically("step3", "newest")
    local.write_atomically("step6", "newest")
    assert local.read_text("newest") == "step6"
    assert local.children() == ["newest"]  # no temporary file left
