"""The workload the planner simulates: which model, batch, optimizer and options each
rank trains with, and the training script that runs it (the same script runs for real
in the planner's accuracy tests)."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from modelparallel.plan.fake_world import PlanError

OPTIMIZERS = ("adamw", "adam", "sgd")
ModelFactory = Callable[[], nn.Module]


@dataclass(frozen=True)
class Workload:
    """What one rank trains: the model, its batch, the optimizer and the options."""

    build: ModelFactory
    config: dict[str, Any]
    world_size: int
    batch_size: int  # rows this rank's data loader yields per step
    seq_len: int
    optimizer: str = "adamw"
    activation_checkpointing: bool = False
    api: str = "v1"  # "v1": DistributedModel + @step; "v2": transform + shard


class TrainingScript:
    """The training script a workload stands for, written as its API path's users
    write it: the planner runs it on fake tensors, the accuracy tests for real."""

    def __init__(self, work: Workload, mp: Any):
        self.work, self.mp = work, mp
        model = work.build()
        self.vocab = _vocab_size(model)
        if work.api == "v1":
            self.model = mp.DistributedModel(model)
            if work.activation_checkpointing:
                from modelparallel.parallel.blocks import find_blocks

                for block in find_blocks(self.model.module):
                    mp.set_activation_checkpointing(block)
            self.optimizer = mp.DistributedOptimizer(_optimizer(work.optimizer,
                                                                self.model.parameters()))

            @mp.step
            def train_step(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
                loss = lm_loss(model(x), y)
                model.backward(loss)  # type: ignore[operator]  # a DistributedModel's
                return loss

            self._train_step = train_step
        elif work.api == "v2":
            if work.config.get("pipeline_parallel_degree", 1) > 1:
                raise PlanError("--api v2 (transform + shard) has no pipeline: use --api v1")
            model = mp.transform(model, config=_moe_config(work.config))
            if work.activation_checkpointing:
                _checkpoint_blocks(model)
            self.model = mp.shard(model)
            self.optimizer = _optimizer(work.optimizer, self.model.parameters())
        else:
            raise PlanError(f"--api {work.api!r}: choose v1 or v2")
        self.held = {"param": 0, "grad": 0, "optimizer": 0}

    def step(self) -> None:
        shape, device = (self.work.batch_size, self.work.seq_len), self.mp.state.context.device
        x = torch.randint(0, self.vocab, shape, device=device)
        y = torch.randint(0, self.vocab, shape, device=device)
        if self.work.api == "v1":
            self._train_step(self.model, x, y)
        elif self.mp.state.context.topology.cp > 1:
            # each rank its chunks of the whole sequences; the labels go to the model,
            # which shifts them across chunks and normalises the loss over the group
            x, y = self.mp.split_for_context_parallel(x, y)
            self.model(input_ids=x, labels=y).loss.backward()
        else:
            lm_loss(self.model(x), y).backward()
        params = [p for g in self.optimizer.param_groups for p in g["params"]]
        self.held["param"] = _bytes(params)
        self.held["grad"] = _bytes(p.grad for p in params if p.grad is not None)
        self.optimizer.step()
        state = getattr(self.optimizer, "state", {})
        self.held["optimizer"] = _bytes(t for s in state.values() for t in s.values()
                                        if isinstance(t, torch.Tensor))
        self.optimizer.zero_grad()  # the gradients go with the step that made them


def _bytes(tensors: Iterable[torch.Tensor]) -> int:
    """Bytes of the distinct storages behind ``tensors`` (a DTensor's local shard)."""
    storages = {}  # by identity: torch keeps one Python object per storage
    for t in tensors:
        storage = getattr(t, "_local_tensor", t).untyped_storage()
        storages[id(storage)] = storage
    return sum(s.nbytes() for s in storages.values())


def _moe_config(config: dict[str, Any]) -> Any:
    """With expert parallelism, the ``MoEConfig`` SMP v2's scripts give ``transform``:
    the model's own router and experts, split (the one built); None otherwise."""
    if config.get("expert_parallel_degree", 1) == 1:
        return None
    from modelparallel.smp.v2.moe import MoEConfig

    return MoEConfig(smp_moe=False, moe_load_balancing="none")


def _optimizer(name: str, params: Iterable[nn.Parameter]) -> torch.optim.Optimizer:
    if name == "sgd":
        return torch.optim.SGD(params, lr=0.1, momentum=0.9)
    return (torch.optim.AdamW if name == "adamw" else torch.optim.Adam)(params, lr=1e-3)


def _checkpoint_blocks(model: nn.Module) -> None:
    """Activation checkpointing as SMP v2 scripts apply it (torch's wrapper on blocks)."""
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import (
        apply_activation_checkpointing,
    )

    from modelparallel.parallel.blocks import find_blocks

    blocks = {id(b) for b in find_blocks(model)}
    apply_activation_checkpointing(model, check_fn=lambda m: id(m) in blocks)


def _vocab_size(model: nn.Module) -> int:
    """Token ids are drawn below the model's first embedding's size."""
    vocab = getattr(getattr(model, "config", None), "vocab_size", None)
    if vocab:
        return int(vocab)
    for m in model.modules():
        if isinstance(m, nn.Embedding):
            return m.num_embeddings
    raise PlanError("the planner feeds token ids (batch, seq_len) and found no nn.Embedding "
                    "in the model to size them")


def lm_loss(output: Any, targets: torch.Tensor) -> torch.Tensor:
    """Cross entropy of the output's logits (a tensor, ``.logits`` or the first element)."""
    logits = getattr(output, "logits", None)
    if logits is None:
        logits = output[0] if isinstance(output, (tuple, list)) else output
    return nn.functional.cross_entropy(logits.reshape(-1, logits.size(-1)).float(),
                                       targets.reshape(-1))


