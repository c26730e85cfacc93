"""Save under one layout, resume under another: the next 3 losses, every parameter and
optimizer-state tensor (gathered on every rank), the fp16 loss scale and the random
generators equal those of the run that was never interrupted.

Each run is built as a script on its API path builds it (``PathRun`` of the parity
matrix): the resumed one from other initial weights, which the checkpoint replaces.
"""

import pytest
import torch

from parity_matrix import compare, zoo
from parity_matrix.space import Case
from parity_matrix.space import Layout as L
from parity_matrix.train import PathRun, quiet

ROWS, SAVE_AT, AFTER = 16, 2, 3
PP2 = dict(schedule="interleaved")

PAIRS = [  # (saved under, resumed under)
    (Case(L(4, 2, 1, 1, **PP2), "v1", "tied", microbatches=2, ddp=True),
     Case(L(4, 1, 2, 2), "shard", "tied")),                       # pp 2 -> tp 2 x FSDP 2
    (Case(L(4, 1, 2, 0), "shard", "gpt"), Case(L(4, 2, 2, 0, **PP2), "v1", "gpt",
                                               microbatches=2)),   # tp 2 -> pp 2 x tp 2
    (Case(L(4, 1, 1, 2), "shard", "llama"), Case(L(4, 1, 1, 0), "shard", "llama")),  # hsd 2->0
    (Case(L(4, 1, 1, 2), "fsdp1", "gpt"), Case(L(4, 1, 1, 0), "shard", "gpt")),  # FSDP1 -> 2
    (Case(L(4, 1, 1, 0), "shard", "gpt"), Case(L(4, 1, 1, 2), "fsdp1", "gpt")),  # FSDP2 -> 1
    (Case(L(4, 1, 1, 1), "ddp", "qwen3"), Case(L(4, 2, 1, 2, **PP2), "v1", "qwen3",
                                               microbatches=2)),   # DDP -> pp 2 x FSDP 2
    (Case(L(4, 1, 4, 0), "v1", "gpt"), Case(L(4, 2, 2, 0, **PP2), "v1", "gpt",
                                          microbatches=2)),  # tp 4 -> pp 2 x tp 2
    (Case(L(4, 2, 1, 1, **PP2), "v1", "gpt", precision="fp16", microbatches=2, ddp=True),
     Case(L(4, 1, 1, 2), "shard", "gpt", precision="fp16")),      # fp16 loss scale carries on
    (Case(L(4, 1, 2, 2), "shard", "gpt2", precision="bf16"),
     Case(L(4, 1, 1, 1), "ddp", "gpt2", precision="bf16")),       # bf16, tp 2 -> DDP
    (Case(L(2, 1, 1, 0), "shard", "gpt"), Case(L(4, 1, 2, 2), "shard", "gpt")),  # 2 -> 4 ranks
    (Case(L(4, 1, 1, 0), "shard", "gpt2"), Case(L(4, 1, 2, 2), "shard", "gpt2")),  # into fused
    (Case(L(4, 1, 2, 2), "fsdp1", "llama"), Case(L(4, 1, 1, 0), "shard", "llama")),  # FSDP1 tp
]


def _batches(case: Case):
    return zoo.batches(case.model, SAVE_AT + AFTER, ROWS)


def save_case(case_dict: dict, path: str) -> dict:
    """Train, save after SAVE_AT steps, and go on without interruption."""
    with quiet():
        run = PathRun(Case.from_dict(case_dict))
        batches = _batches(run.case)
        for x, y in batches[:SAVE_AT]:
            run.step(x, y)
        run.save(path, f"step{SAVE_AT}")
        rng = torch.get_rng_state()
        losses = [run.step(x, y) for x, y in batches[SAVE_AT:]]
        return {"result": run.result(losses), "rng": rng}


def resume_case(case_dict: dict, path: str) -> dict:
    with quiet():
        run = PathRun(Case.from_dict(case_dict), seed=7)  # other weights: the load replaces them
        run.resume(path)
        rng = torch.get_rng_state()
        losses = [run.step(x, y) for x, y in _batches(run.case)[SAVE_AT:]]
        return {"result": run.result(losses), "rng": rng}


def _id(pair) -> str:
    return f"{pair[0].id}--to--{pair[1].id}"


@pytest.mark.parametrize("pair", PAIRS, ids=[_id(p) for p in PAIRS])
def test_resume_under_another_layout_continues_the_same_run(workers, tmp_path, pair):
    saved_under, resumed_under = pair
    path = str(tmp_path / "ckpt")
    saved = workers(saved_under.layout.processes).run(
        save_case, case_dict=saved_under.as_dict(), path=path)
    resumed = workers(resumed_under.layout.processes).run(
        resume_case, case_dict=resumed_under.as_dict(), path=path)
    uninterrupted = saved[0]["result"]
    found, _, _ = compare.problems(resumed_under, [r["result"] for r in resumed], uninterrupted)
    assert not found, "\n".join(found)
    if saved_under.precision == "fp16":
        assert resumed[0]["result"].scaler == uninterrupted.scaler
    if saved_under.layout.processes == resumed_under.layout.processes:
        for rank, (before, after) in enumerate(zip(saved, resumed, strict=True)):
            assert torch.equal(before["rng"], after["rng"]), f"rank {rank}'s generator"


def test_without_the_load_the_runs_differ(workers, tmp_path):
    """The comparison can fail: a run that does not load differs from the saved one."""
    saved_under, resumed_under = PAIRS[2]
    saved = workers(4).run(save_case, case_dict=saved_under.as_dict(),
                           path=str(tmp_path / "ckpt"))[0]["result"]
    fresh = workers(4).run(fresh_case, case_dict=resumed_under.as_dict())
    found, _, _ = compare.problems(resumed_under, fresh, saved)
    assert found


def fresh_case(case_dict: dict):
    with quiet():
        run = PathRun(Case.from_dict(case_dict), seed=7)
        losses = [run.step(x, y) for x, y in _batches(run.case)[SAVE_AT:]]
        return run.result(losses)
