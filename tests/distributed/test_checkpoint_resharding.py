"""Checkpoints in real processes: a run saved under one layout resumes under another and
computes exactly the losses the saving run computed next."""

import pytest
import torch
from torch import nn

import modelparallel as mp
from modelparallel.models import GPT, GPTConfig
from modelparallel.models.gpt import lm_loss
from modelparallel.testing import token_batches

GLOBAL_BATCH, SEQ, VOCAB = 8, 16, 64
SAVE_AT, AFTER = 2, 2  # train 2 steps, save, train 2 more
BATCHES = token_batches(SAVE_AT + AFTER, GLOBAL_BATCH, SEQ, VOCAB, seed=1)

LAYOUTS = {  # name: (world size, config)
    "fsdp4": (4, {"hybrid_shard_degree": 0}),
    "hybrid2x2": (4, {"hybrid_shard_degree": 2}),
    "ddp4": (4, {"hybrid_shard_degree": 1}),
    "ddp2": (2, {"hybrid_shard_degree": 1}),
    "fsdp2": (2, {"hybrid_shard_degree": 0}),
    "tp2dp2": (4, {"tensor_parallel_degree": 2, "hybrid_shard_degree": 2}),
    "pp2dp2": (4, {"pipeline_parallel_degree": 2, "microbatches": 2, "hybrid_shard_degree": 2}),
    "pp2tp2": (4, {"pipeline_parallel_degree": 2, "tensor_parallel_degree": 2,
                   "microbatches": 2}),
    "pp1fsdp4": (4, {"pipeline_parallel_degree": 1, "microbatches": 2,
                     "hybrid_shard_degree": 0}),
}


def gpt(seed: int, tied: bool) -> nn.Module:
    torch.manual_seed(seed)
    model = GPT(GPTConfig(vocab_size=VOCAB, max_seq_len=SEQ, d_model=32, n_layers=4,
                          n_heads=4))
    if tied:  # shared by the first and the last pipeline stage
        model.lm_head.weight = model.tok_emb.weight
    return model


@mp.step
def train_step(model, x, y):
    loss = lm_loss(model(x), y)
    model.backward(loss)
    return loss


class Trainer:
    """One layout's model, optimizer and LR schedule; SMP v1 style when the layout has a
    pipeline key, v2 style (transform + shard) otherwise."""

    def __init__(self, layout: str, seed: int, tied: bool):
        config = LAYOUTS[layout][1]
        mp.init(config)
        model = gpt(seed, tied)
        self.v1 = "pipeline_parallel_degree" in config
        if self.v1:
            self.model = mp.DistributedModel(model)
            self.optimizer = mp.DistributedOptimizer(
                torch.optim.SGD(self.model.parameters(), lr=0.5, momentum=0.9))
            self.scheduler = torch.optim.lr_scheduler.StepLR(self.optimizer.optimizer, 1, 0.5)
        else:
            if config.get("tensor_parallel_degree", 1) > 1:
                model = mp.transform(model)
            self.model = mp.shard(model)
            self.optimizer = torch.optim.SGD(self.model.parameters(), lr=0.5, momentum=0.9)
            self.scheduler = torch.optim.lr_scheduler.StepLR(self.optimizer, 1, 0.5)

    def step(self, x, y) -> float:
        rows = GLOBAL_BATCH // mp.dp_size()
        x, y = (t[mp.dp_rank() * rows:(mp.dp_rank() + 1) * rows] for t in (x, y))
        self.optimizer.zero_grad()
        if self.v1:
            loss = train_step(self.model, x, y).reduce_mean().detach()
        else:
            loss = lm_loss(self.model(x), y)
            loss.backward()
            loss = loss.detach()
        self.optimizer.step()
        self.scheduler.step()
        loss = loss.double()
        torch.distributed.all_reduce(loss, group=mp.get_dp_process_group())
        return float(loss) / mp.dp_size()

    def save(self, path: str, partial: bool) -> None:
        mp.save_checkpoint(path, f"step{SAVE_AT}", partial=partial, model=self.model,
                           optimizer=self.optimizer, lr_scheduler=self.scheduler,
                           user_content={"step": SAVE_AT, "note": "hello"}, step=SAVE_AT)

    def resume(self, path: str) -> dict:
        return mp.resume_from_checkpoint(path, model=self.model, optimizer=self.optimizer,
                                         lr_scheduler=self.scheduler)


def save_case(layout: str, path: str, partial: bool, tied: bool) -> list[float]:
    """Train, save, and return the losses of the steps after the save."""
    trainer = Trainer(layout, seed=0, tied=tied)
    for x, y in BATCHES[:SAVE_AT]:
        trainer.step(x, y)
    trainer.save(path, partial)
    return [trainer.step(x, y) for x, y in BATCHES[SAVE_AT:]]


def resume_case(layout: str, path: str, tied: bool) -> tuple[dict, list[float]]:
    trainer = Trainer(layout, seed=1, tied=tied)  # other weights: the checkpoint must replace them
    content = trainer.resume(path)
    return content, [trainer.step(x, y) for x, y in BATCHES[SAVE_AT:]]


CASES = [  # (saved under, resumed under, sharded, tied embeddings)
    *[(layout, layout, partial, True) for layout in ("ddp4", "fsdp4", "hybrid2x2")
      for partial in (True, False)],
    ("fsdp4", "hybrid2x2", True, True),
    ("hybrid2x2", "ddp2", True, True),
    ("fsdp4", "fsdp2", True, True),      # 4 ranks -> 2 ranks
    ("fsdp2", "fsdp4", True, True),      # and back up
    ("tp2dp2", "fsdp4", True, True),
    ("pp2dp2", "pp1fsdp4", True, True),
    ("fsdp4", "pp2tp2", True, True),
    ("pp2tp2", "pp2dp2", True, True),
    ("pp2tp2", "fsdp4", True, False),
    ("pp2dp2", "tp2dp2", False, True),   # full checkpoints reshard too
    ("tp2dp2", "pp2tp2", False, True),
]


def case_id(case) -> str:
    saved_under, resumed_under, partial, tied = case
    return (f"{saved_under}-to-{resumed_under}-{'sharded' if partial else 'full'}"
            f"{'-tied' if tied else ''}")


@pytest.mark.parametrize("case", CASES, ids=[case_id(c) for c in CASES])
def test_resume_under_another_layout_computes_the_same_next_losses(workers, tmp_path, case):
    saved_under, resumed_under, partial, tied = case
    path = str(tmp_path / "ckpt")
    saved = workers(LAYOUTS[saved_under][0]).run(save_case, layout=saved_under, path=path,
                                                 partial=partial, tied=tied)
    resumed = workers(LAYOUTS[resumed_under][0]).run(resume_case, layout=resumed_under,
                                                     path=path, tied=tied)
    expected = saved[0]
    for content, losses in resumed:
        assert content == {"step": SAVE_AT, "note": "hello"}
        assert len(losses) == AFTER
        for got, want in zip(losses, expected, strict=True):
            assert abs(got - want) <= 1e-5, (losses, expected)
    # and a fresh model that does not load would differ: the test can fail
    fresh = workers(LAYOUTS[resumed_under][0]).run(fresh_case, layout=resumed_under,
                                                   tied=tied)[0]
    assert abs(fresh - expected[0]) > 1e-3


def fresh_case(layout: str, tied: bool) -> float:
    return Trainer(layout, seed=1, tied=tied).step(*BATCHES[SAVE_AT])
