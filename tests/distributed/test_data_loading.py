"""mp.data: which samples each rank reads, and the microbatch divisibility checks."""

import pytest
import torch
from torch.utils.data import TensorDataset

import modelparallel as mp
from modelparallel.data import BatchSizeError, check_microbatches


def samples_case(config, epochs=2):
    mp.init(config)
    data = TensorDataset(torch.arange(32))
    loader = mp.data.DataLoader(data, batch_size=4, seed=7, drop_last=True)
    seen = []
    for epoch in range(epochs):
        loader.set_epoch(epoch)
        seen.append([x.tolist() for (x,) in loader])
    return {"seen": seen, "dp_rank": mp.dp_rank(), "rdp_rank": mp.rdp_rank()}


@pytest.mark.parametrize(("config", "key", "slices"), [
    ({"hybrid_shard_degree": 2}, "dp_rank", 4),  # every rank is its own replica
    ({"pipeline_parallel_degree": 2}, "dp_rank", 2),  # stages of a replica share samples
    ({"tensor_parallel_degree": 2}, "dp_rank", 4),  # SMP v1: each TP rank reads its own
    ({"tensor_parallel_degree": 2, "prescaled_batch": True}, "rdp_rank", 2),  # TP ranks share
])
def test_each_replica_reads_its_own_samples(workers, config, key, slices):
    results = workers(4).run(samples_case, config=config)
    by_slice = {}
    for got in results:
        by_slice.setdefault(got[key], []).append(got["seen"])
    assert len(by_slice) == slices
    for views in by_slice.values():
        assert all(v == views[0] for v in views), "ranks of one slice see the same batches"
    for epoch in range(2):
        union = sorted(i for views in by_slice.values() for b in views[0][epoch] for i in b)
        assert union == list(range(32)), "the slices partition the dataset every epoch"
    first = next(iter(by_slice.values()))[0]
    assert first[0] != first[1], "set_epoch reshuffles"


def test_batch_not_divisible_by_microbatches_is_explained():
    with pytest.raises(BatchSizeError) as e:
        check_microbatches(10, 4, where="batch_size=10")
    msg = str(e.value)
    assert "batch_size=10 has 10 samples" in msg and "microbatches=4" in msg
    assert "8 or 12" in msg and "drop_last=True" in msg
    check_microbatches(12, 4)


def loader_error_case(batch_size, drop_last):
    mp.init({"microbatches": 4})
    try:
        mp.data.DataLoader(TensorDataset(torch.arange(30)), batch_size=batch_size,
                           drop_last=drop_last)
    except BatchSizeError as e:
        return str(e)
    return None


def test_loader_checks_every_batch_up_front(workers):
    # 30 samples over 2 replicas = 15 each: batches of 8 leave a last batch of 7
    messages = workers(2).run(loader_error_case, batch_size=8, drop_last=False)
    assert all("last batch" in m and "7 samples" in m and "drop_last=True" in m
               for m in messages)
    assert workers(2).run(loader_error_case, batch_size=8, drop_last=True) == [None, None]
    messages = workers(2).run(loader_error_case, batch_size=6, drop_last=True)
    assert all("batch_size=6" in m and "microbatches=4" in m for m in messages)
