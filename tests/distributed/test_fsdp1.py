"""SMP v2 scripts: ``mp.transform`` then an unchanged FSDP1 wrap, vs one process.

Gradient clipping, one data-parallel rank, the SMP v2 sharded and full checkpoints,
the full optimizer state, mp.save_checkpoint across layouts, mixed precision, and
models tensor parallelism leaves whole.
"""

import contextlib
import functools
import inspect
import os
import warnings

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

import modelparallel as mp
from modelparallel.data import replica_rank_and_size
from modelparallel.models import GPT, GPTConfig
from modelparallel.models.gpt import Block, lm_loss
from modelparallel.testing import (
    TrainResult,
    assert_parity,
    full_parameters,
    local_rows,
    parity_problems,
    token_batches,
    train,
)

STEPS = 3
GLOBAL_BATCH = 8
SEQ, VOCAB = 16, 64
GPT_CFG = GPTConfig(vocab_size=VOCAB, max_seq_len=SEQ, d_model=32, n_layers=2, n_heads=4)
TP2 = {"tensor_parallel_degree": 2}
TP2_HYBRID2 = {**TP2, "hybrid_shard_degree": 2}


def build() -> GPT:
    torch.manual_seed(0)
    return GPT(GPT_CFG)


def batches():
    return token_batches(STEPS, GLOBAL_BATCH, SEQ, VOCAB, seed=1)


def sgd(model):
    return torch.optim.SGD(model.parameters(), lr=0.5, momentum=0.9)


def fsdp1(model: nn.Module, **kwargs) -> nn.Module:
    """What an SMP v2 script writes after ``mp.transform``."""
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
    from torch.distributed.fsdp.wrap import ModuleWrapPolicy

    return FSDP(model, auto_wrap_policy=ModuleWrapPolicy({Block}), **kwargs)


def transformed(config: dict, **kwargs) -> nn.Module:
    mp.init(config)
    return fsdp1(mp.transform(build()), **kwargs)


@functools.cache
def reference(clip: float | None = None):
    before = (lambda m: torch.nn.utils.clip_grad_norm_(m.parameters(), clip)) if clip else None
    return train(build(), batches(), optimizer=sgd, loss_fn=lm_loss, before_step=before)


def parity_case(config: dict, use_orig_params: bool = True, clip: str = "", max_norm=0.05):
    model = transformed(config, use_orig_params=use_orig_params)
    before = {"": None, "mp": lambda m: mp.clip_grad_norm_(m, max_norm),
              "fsdp": lambda m: m.clip_grad_norm_(max_norm)}[clip]
    result = train(model, batches(), optimizer=sgd, loss_fn=lm_loss,
                   replica=replica_rank_and_size(), group=mp.get_dp_process_group(),
                   before_step=before)
    return parity_problems(result, reference(max_norm if clip else None))


# -- 1. gradient norm under tensor parallelism x FSDP1 ------------------------------------

def clip_norm_case(config: dict, use_orig_params: bool):
    model = transformed(config, use_orig_params=use_orig_params)
    inputs, targets = batches()[0]
    ref = build()
    lm_loss(ref(inputs), targets).backward()
    expected = {p: float(torch.nn.utils.clip_grad_norm_(ref.parameters(), 1e9, norm_type=p))
                for p in (2.0, float("inf"))}
    x, y = local_rows((inputs, targets), *replica_rank_and_size())
    lm_loss(model(x), y).backward()  # FSDP averages: the global-batch gradient
    got = {p: (float(mp.clip_grad_norm_(model, 1e9, norm_type=p)),
               float(model.clip_grad_norm_(1e9, norm_type=p))) for p in expected}
    return got, expected


@pytest.mark.parametrize("world, config, use_orig_params", [
    (4, TP2_HYBRID2, True),
    (4, TP2_HYBRID2, False),
    (4, TP2, True),  # hybrid_shard_degree 0
    (8, TP2_HYBRID2, False),  # 2 replicas x 2 shards x tp 2
], ids=["tp2-hybrid2", "tp2-hybrid2-flat-params", "tp2", "tp2-hybrid2-8ranks-flat-params"])
def test_clip_grad_norm_is_the_global_norm(workers, world, config, use_orig_params):
    """Both mp.clip_grad_norm_ and FSDP1's own clip_grad_norm_ count every split and
    every replicated parameter once."""
    for got, expected in workers(world).run(clip_norm_case, config=config,
                                            use_orig_params=use_orig_params):
        for p, (ours, fsdps) in got.items():
            assert ours == pytest.approx(expected[p], rel=1e-5), p
            assert fsdps == pytest.approx(expected[p], rel=1e-5), p


@pytest.mark.parametrize("use_orig_params, clip", [(True, "mp"), (False, "fsdp")])
def test_clipped_training_matches_one_process(workers, use_orig_params, clip):
    for problems in workers(4).run(parity_case, config=TP2_HYBRID2,
                                   use_orig_params=use_orig_params, clip=clip):
        assert problems == []


# -- 2. tensor parallelism with one data-parallel rank (and hybrid_shard_degree 1) ---------

@pytest.mark.parametrize("world, config, use_orig_params", [
    (2, TP2, True),
    (2, TP2, False),
    (4, {**TP2, "hybrid_shard_degree": 1}, True),  # replicated over 2 data-parallel ranks
], ids=["tp2-dp1", "tp2-dp1-flat-params", "tp2-hybrid1"])
def test_unsharded_data_parallel_trains_like_one_process(workers, world, config,
                                                          use_orig_params):
    for problems in workers(world).run(parity_case, config=config,
                                       use_orig_params=use_orig_params):
        assert problems == []


def no_sync_case(config: dict, use_orig_params: bool) -> tuple[list[str], list[str]]:
    """Two backward passes per step, the first inside ``model.no_sync()``."""
    import logging

    messages: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda record: messages.append(record.getMessage())
    logging.getLogger("modelparallel").addHandler(handler)
    try:
        model = transformed(config, use_orig_params=use_orig_params)
        optimizer = sgd(model)
        group = mp.get_dp_process_group()
        losses = []
        for batch in batches():
            inputs, targets = local_rows(batch, *replica_rank_and_size())
            half = inputs.shape[0] // 2
            total = torch.zeros(())
            for part, rows in enumerate((slice(0, half), slice(half, None))):
                with model.no_sync() if part == 0 else contextlib.nullcontext():
                    loss = lm_loss(model(inputs[rows]), targets[rows]) / 2
                    loss.backward()
                total += loss.detach()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            dist.all_reduce(total, group=group)
            losses.append(float(total) / dist.get_world_size(group))
    finally:
        logging.getLogger("modelparallel").removeHandler(handler)
    result = TrainResult(losses, full_parameters(model))
    return parity_problems(result, reference()), messages


@pytest.mark.parametrize("use_orig_params", [True, False])
def test_no_sync_accumulation_of_a_tensor_parallel_model(workers, use_orig_params):
    """With use_orig_params, torch's FSDP1 cannot hold a tensor-parallel model's
    gradients in no_sync() (it failed the next forward with "invalid python storage"):
    every backward reduces them, they accumulate to the one-process gradient, and rank 0
    says so once. Flat parameters keep torch's no_sync(), without a word."""
    results = workers(4).run(no_sync_case, config=TP2, use_orig_params=use_orig_params)
    for rank, (problems, messages) in enumerate(results):
        assert problems == [], rank
        said = [m for m in messages if m.startswith("no_sync() has no effect")]
        assert len(said) == (1 if rank == 0 and use_orig_params else 0), (rank, messages)
        assert all("every backward reduces them" in m for m in said)


# -- 3. the SMP v2 sharded checkpoint: one directory per tp rank --------------------------

def _step(model, optimizer, batch) -> float:
    inputs, targets = local_rows(batch, *replica_rank_and_size())
    loss = lm_loss(model(inputs), targets)
    loss.backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return loss.item()


def _same(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def smp_sharded_case(config: dict, root: str, tp: bool, use_orig_params: bool):
    """checkpoints.py of the SMP v2 examples: ranks of replication rank 0 save over the
    model's process group (coordinated by its lowest rank, DCP's group rank 0) into a
    directory per tp rank; every rank loads from its tp rank's directory. (This torch's
    load_sharded_optimizer_state_dict takes no process_group, so the optimizer state
    loads into the layout of FSDP.optim_state_dict instead.)"""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
    from torch.distributed.fsdp import ShardedOptimStateDictConfig, StateDictType

    mp.init(config)
    model = fsdp1(mp.transform(build()) if tp else build(), use_orig_params=use_orig_params)
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.01)
    steps = batches()
    _step(model, optimizer, steps[0])
    coords = mp.state.topology.coordinate(mp.rank())
    directory = os.path.join(root, f"tp{mp.tp_size()}-{coords['tp']}")
    group = model.process_group
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)  # FSDP.state_dict_type
        with FSDP.state_dict_type(model, StateDictType.SHARDED_STATE_DICT):
            saved = {"model": model.state_dict(), "optimizer": FSDP.optim_state_dict(model,
                                                                                    optimizer)}
        if coords["dp_replicate"] == 0:
            dcp.save(saved, storage_writer=dcp.FileSystemWriter(directory), process_group=group)
        dist.barrier()
        at_save = full_parameters(model)
        _step(model, optimizer, steps[1])
        expected = full_parameters(model)

        with FSDP.state_dict_type(model, StateDictType.SHARDED_STATE_DICT,
                                  optim_state_dict_config=ShardedOptimStateDictConfig(
                                      offload_to_cpu=True)):
            loaded = {"model": model.state_dict(),
                      "optimizer": FSDP.optim_state_dict(model, optimizer)}
            dcp.load(loaded, storage_reader=dcp.FileSystemReader(directory), process_group=group)
            model.load_state_dict(loaded["model"])
            optimizer.load_state_dict(FSDP.optim_state_dict_to_load(model, optimizer,
                                                                    loaded["optimizer"]))
    restored = full_parameters(model)
    _step(model, optimizer, steps[1])  # the same step again, from the restored state
    return _same(restored, at_save), _same(full_parameters(model), expected)


@pytest.mark.parametrize("world, config, tp, use_orig_params", [
    (8, TP2_HYBRID2, True, True),
    (8, TP2_HYBRID2, True, False),
    (4, {"hybrid_shard_degree": 2}, False, True),
    (4, TP2, True, True),
    (2, TP2, True, True),  # one data-parallel rank
], ids=["tp2-hybrid2", "tp2-hybrid2-flat-params", "hybrid2", "tp2", "tp2-dp1"])
def test_smp_v2_sharded_checkpoint_round_trips(workers, tmp_path, world, config, tp,
                                              use_orig_params):
    for params_back, same_next_step in workers(world).run(
            smp_sharded_case, config=config, root=str(tmp_path), tp=tp,
            use_orig_params=use_orig_params):
        assert params_back, "the loaded parameters differ from the saved ones"
        assert same_next_step, "the optimizer state did not come back"
    if tp:  # each tp rank's directory is a complete checkpoint of its part
        assert sorted(os.listdir(tmp_path)) == ["tp2-0", "tp2-1"]


# -- 4. the SMP v2 full checkpoint: rank 0 gets the whole model ---------------------------

def smp_full_case(config: dict, tp: bool, use_orig_params: bool):
    from torch.distributed.fsdp import FullStateDictConfig, StateDictType
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

    mp.init(config)
    model = fsdp1(mp.transform(build()) if tp else build(), use_orig_params=use_orig_params)
    train(model, batches(), optimizer=sgd, loss_fn=lm_loss, replica=replica_rank_and_size())
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        with FSDP.state_dict_type(model, StateDictType.FULL_STATE_DICT,
                                  FullStateDictConfig(rank0_only=True, offload_to_cpu=True)):
            sd = model.state_dict()
    if mp.rank() != 0:
        return None
    assert all(type(v) is torch.Tensor and v.device.type == "cpu" for v in sd.values())
    return parity_problems(TrainResult([], dict(sd)), TrainResult([], reference().params))


@pytest.mark.parametrize("world, config, tp, use_orig_params", [
    (4, TP2_HYBRID2, True, True),
    (4, TP2_HYBRID2, True, False),
    (4, {"hybrid_shard_degree": 2}, False, True),
    (8, TP2_HYBRID2, True, True),
], ids=["tp2-hybrid2", "tp2-hybrid2-flat-params", "hybrid2", "tp2-hybrid2-8ranks"])
def test_smp_v2_full_checkpoint_is_the_whole_model(workers, world, config, tp,
                                                  use_orig_params):
    problems = workers(world).run(smp_full_case, config=config, tp=tp,
                                  use_orig_params=use_orig_params)[0]
    assert problems == []


def mp_checkpoint_case(config: dict, root: str):
    """mp.save_checkpoint/resume_from_checkpoint of an FSDP1 model whose flat parameter
    splits unevenly: a rank's optimizer holds no state for parameters outside its shard."""
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

    mp.init(config)
    torch.manual_seed(0)
    model = FSDP(nn.Sequential(nn.Linear(4, 8), nn.Linear(8, 2)), use_orig_params=True)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)

    def step() -> float:
        torch.manual_seed(1)
        loss = model(torch.randn(4, 4)).pow(2).mean()
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        return loss.item()

    step()
    mp.save_checkpoint(root, "sharded", model=model, optimizer=optimizer)
    expected = [step(), step()]
    mp.resume_from_checkpoint(root, model=model, optimizer=optimizer)
    return [step(), step()] == expected


@pytest.mark.parametrize("config", [{}, {"hybrid_shard_degree": 2}], ids=["full-shard", "hybrid2"])
def test_mp_checkpoint_of_unevenly_sharded_fsdp1_model(workers, tmp_path, config):
    assert workers(4).run(mp_checkpoint_case, config=config, root=str(tmp_path)) == [True] * 4


# -- 4b. the full optimizer state: whole tensors, the same on every rank --------------------

def one_process(steps: int, batches_: list) -> tuple[list[float], dict, dict]:
    """Losses, parameters and SGD-momentum state of one process after ``steps`` steps."""
    model = build()
    optimizer = sgd(model)
    losses = []
    for inputs, targets in batches_[:steps]:
        loss = lm_loss(model(inputs), targets)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(loss.item())
    state = {f"state.{name}.{key}": value.detach().clone()
             for name, p in model.named_parameters()
             for key, value in optimizer.state[p].items() if isinstance(value, torch.Tensor)}
    return losses, {n: p.detach().clone() for n, p in model.named_parameters()}, state


def _tensors(sd: dict) -> dict:
    return {k: v.detach().cpu() for k, v in sd.items() if isinstance(v, torch.Tensor)}


def full_optimizer_case(config: dict, use_orig_params: bool):
    """After STEPS steps: the full optimizer state (every rank, and rank 0 only), FSDP1's
    own FULL_STATE_DICT optimizer state with rank0_only, and the full parameters; then a
    full optimizer state loaded back with set_optimizer_state_dict."""
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        get_model_state_dict,
        get_optimizer_state_dict,
        set_optimizer_state_dict,
    )
    from torch.distributed.fsdp import (
        FullOptimStateDictConfig,
        FullStateDictConfig,
        StateDictType,
    )
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

    from modelparallel.checkpoint import states

    model = transformed(config, use_orig_params=use_orig_params)
    optimizer = sgd(model)
    for batch in batches():
        _step(model, optimizer, batch)
    every = _tensors(states.optimizer_state(model, optimizer, full=True, every_rank=True))
    on_rank0 = _tensors(states.optimizer_state(model, optimizer, full=True))
    params = _tensors(get_model_state_dict(model, options=StateDictOptions(
        full_state_dict=True, cpu_offload=False)))
    params0 = _tensors(states.model_state(model, full=True))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        with FSDP.state_dict_type(model, StateDictType.FULL_STATE_DICT,
                                  FullStateDictConfig(rank0_only=True, offload_to_cpu=True),
                                  FullOptimStateDictConfig(rank0_only=True,
                                                           offload_to_cpu=True)):
            own = FSDP.optim_state_dict(model, optimizer)
    own = {f"state.{fqn}.{k}": v for fqn, s in own.get("state", {}).items()
           for k, v in s.items() if isinstance(v, torch.Tensor)}
    # load the full state back (FSDP.optim_state_dict_to_load), step, compare
    full = get_optimizer_state_dict(model, optimizer, options=StateDictOptions(
        full_state_dict=True, flatten_optimizer_state_dict=True))
    for group in optimizer.param_groups:
        for p in group["params"]:
            for value in optimizer.state[p].values():
                value.zero_()
    set_optimizer_state_dict(model, optimizer, full, options=StateDictOptions(
        full_state_dict=True, flatten_optimizer_state_dict=True))
    back = _tensors(states.optimizer_state(model, optimizer, full=True, every_rank=True))
    return {"every": every, "rank0": on_rank0, "params": params, "params0": params0,
            "own": own, "back": back}


@pytest.mark.parametrize("world, config, use_orig_params", [
    (2, TP2, True),  # one data-parallel rank
    (4, TP2_HYBRID2, True),
    (4, TP2_HYBRID2, False),
    (8, TP2_HYBRID2, True),  # 2 replicas x 2 shards x tp 2
], ids=["tp2-dp1", "tp2-hybrid2", "tp2-hybrid2-flat-params", "tp2-hybrid2-8ranks"])
def test_full_optimizer_state_is_the_one_process_state(workers, world, config,
                                                       use_orig_params):
    """The full optimizer state of an FSDP1 model tensor parallelism split holds whole
    tensors, the same on every rank: the one-process SGD-momentum state."""
    _, ref_params, ref_state = one_process(STEPS, batches())
    got = workers(world).run(full_optimizer_case, config=config,
                             use_orig_params=use_orig_params)
    for rank, result in enumerate(got):
        every = result["every"]
        assert parity_problems(TrainResult([], every), TrainResult([], ref_state)) == [], rank
        assert _same(every, got[0]["every"]), f"rank {rank} differs from rank 0"
        assert _same(result["back"], every), f"rank {rank}: the loaded state differs"
        assert parity_problems(TrainResult([], result["params"]),
                               TrainResult([], ref_params)) == [], rank
        assert _same(result["params"], got[0]["params"]), f"rank {rank} differs from rank 0"
        if rank == 0:
            assert _same(result["rank0"], every)
            assert _same(result["params0"], result["params"])
            assert _same(result["own"], every)
        else:
            assert result["rank0"] == {} and result["params0"] == {}


# -- 4c. mp.save_checkpoint / resume_from_checkpoint across layouts ------------------------

SAVE_AT, AFTER = 2, 3
CKPT_LAYOUTS = {  # name: (world size, config, how the model is built)
    "fsdp1-tp2": (4, TP2_HYBRID2, "fsdp1-tp"),
    "fsdp1-tp2-flat-params": (4, TP2_HYBRID2, "fsdp1-tp-flat"),
    "fsdp1-tp2-dp1": (2, TP2, "fsdp1-tp"),
    "fsdp1": (4, {}, "fsdp1"),
    "fsdp1-hybrid2": (4, {"hybrid_shard_degree": 2}, "fsdp1"),
    "shard": (4, {"hybrid_shard_degree": 2}, "shard"),
}


def ckpt_batches():
    return token_batches(SAVE_AT + AFTER, GLOBAL_BATCH, SEQ, VOCAB, seed=1)


def _ckpt_model(layout: str, seed: int) -> nn.Module:
    _, config, how = CKPT_LAYOUTS[layout]
    mp.init(config)
    torch.manual_seed(seed)
    model = GPT(GPT_CFG)
    if how == "shard":
        return mp.shard(model)
    if how.startswith("fsdp1-tp"):
        model = mp.transform(model)
    return fsdp1(model, use_orig_params=not how.endswith("flat"))


def _global_loss(model, optimizer, batch) -> float:
    loss = torch.tensor(_step(model, optimizer, batch), dtype=torch.float64)
    group = mp.get_dp_process_group()
    dist.all_reduce(loss, group=group)
    return float(loss) / dist.get_world_size(group)


def save_ckpt_case(layout: str, root: str, partial: bool) -> None:
    model = _ckpt_model(layout, seed=0)  # build()'s weights
    optimizer = sgd(model)
    for batch in ckpt_batches()[:SAVE_AT]:
        _step(model, optimizer, batch)
    mp.save_checkpoint(root, "step", partial=partial, model=model, optimizer=optimizer)


def resume_ckpt_case(layout: str, root: str):
    from modelparallel.checkpoint import states

    model = _ckpt_model(layout, seed=1)  # other weights: the checkpoint must replace them
    optimizer = sgd(model)
    mp.resume_from_checkpoint(root, model=model, optimizer=optimizer)
    losses = [_global_loss(model, optimizer, batch) for batch in ckpt_batches()[SAVE_AT:]]
    state = _tensors(states.optimizer_state(model, optimizer, full=True, every_rank=True))
    return losses, full_parameters(model), state


@pytest.mark.parametrize("saved, resumed, partial", [
    ("fsdp1-tp2", "shard", True),
    ("shard", "fsdp1-tp2", True),
    ("fsdp1-tp2-flat-params", "fsdp1-tp2-dp1", True),
    ("fsdp1-tp2-dp1", "fsdp1-tp2-flat-params", True),
    ("fsdp1-tp2", "shard", False),
    ("shard", "fsdp1-tp2", False),
    ("fsdp1", "fsdp1-hybrid2", False),
    ("fsdp1-hybrid2", "fsdp1-tp2", False),
    ("fsdp1-tp2", "fsdp1", False),
])
def test_checkpoint_resumes_under_another_layout(workers, tmp_path, saved, resumed, partial):
    """Saved under one layout, resumed under another: the next steps' losses, the
    parameters and the optimizer state are those of one uninterrupted process."""
    ref_losses, ref_params, ref_state = one_process(SAVE_AT + AFTER, ckpt_batches())
    root = str(tmp_path / "ckpt")
    workers(CKPT_LAYOUTS[saved][0]).run(save_ckpt_case, layout=saved, root=root,
                                        partial=partial)
    for rank, (losses, params, state) in enumerate(workers(CKPT_LAYOUTS[resumed][0]).run(
            resume_ckpt_case, layout=resumed, root=root)):
        assert parity_problems(TrainResult(losses, params),
                               TrainResult(ref_losses[SAVE_AT:], ref_params)) == [], rank
        assert parity_problems(TrainResult([], state), TrainResult([], ref_state)) == [], rank


def own_mesh_checkpoint_case(saved: str, root: str) -> list[str]:
    """A script that gives FSDP1 its own device mesh keeps torch's sharded state (each
    tensor-parallel rank's part under the parameter's name): saving and resuming are
    refused before any collective."""
    mp.init(TP2_HYBRID2)
    model = fsdp1(mp.transform(build()), use_orig_params=True,
                  device_mesh=mp.state.meshes["dp_shard"])
    optimizer = sgd(model)
    _step(model, optimizer, batches()[0])
    errors = []
    for call in (lambda: mp.save_checkpoint(root, "own", model=model, optimizer=optimizer),
                 lambda: mp.resume_from_checkpoint(saved, model=model, optimizer=optimizer)):
        try:
            call()
            errors.append("")
        except mp.CheckpointError as e:
            errors.append(str(e))
    return errors


def test_checkpoint_of_fsdp1_on_the_scripts_own_mesh_is_refused(workers, tmp_path):
    saved = str(tmp_path / "saved")
    workers(4).run(save_ckpt_case, layout="shard", root=saved, partial=True)
    for errors in workers(4).run(own_mesh_checkpoint_case, saved=saved,
                                 root=str(tmp_path / "own")):
        for error in errors:
            assert "script's own process_group/device_mesh" in error
            assert "build FSDP1 without process_group/device_mesh" in error


def fused_checkpoint_case(root: str) -> str:
    """HF GPT-2's fused c_attn under FSDP1 + tensor parallelism: its checkpoint saves,
    and loading it back into FSDP1 is refused before any collective (the fused
    projection's load hook cannot take FSDP1's tensors)."""
    import transformers
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
    from torch.distributed.fsdp.wrap import ModuleWrapPolicy

    from parity_matrix import zoo

    mp.init(TP2_HYBRID2)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        # untied: FSDP1 refuses tied tensor-parallel models (fsdp1_limits)
        gpt2 = zoo.Keyed(transformers.GPT2LMHeadModel(transformers.GPT2Config(
            vocab_size=zoo.VOCAB, n_embd=32, n_layer=1, n_head=8, n_positions=2 * zoo.SEQ,
            use_cache=False, tie_word_embeddings=False)), zoo.VOCAB, hugging_face=True)
    blocks = {type(b) for b in zoo.blocks_of(gpt2)}
    model = FSDP(mp.transform(gpt2), auto_wrap_policy=ModuleWrapPolicy(blocks),
                 use_orig_params=True)
    optimizer = sgd(model)
    mp.save_checkpoint(root, "fused", model=model, optimizer=optimizer)
    try:
        mp.resume_from_checkpoint(root, model=model, optimizer=optimizer)
    except mp.CheckpointError as e:
        return str(e)
    return ""


def test_fused_projections_under_fsdp1_refuse_to_load(workers, tmp_path):
    for error in workers(4).run(fused_checkpoint_case, root=str(tmp_path / "ckpt")):
        assert "FSDP1 cannot load the fused projections" in error
        assert "c_attn.weight" in error and "mp.shard" in error


# -- 5. bf16 / fp16 ------------------------------------------------------------------------

def precision_case(config: dict, policy: str | None):
    from torch.distributed.fsdp import MixedPrecision

    mp.init(config)
    kwargs = {}
    if policy is not None:
        dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}[policy]
        kwargs["mixed_precision"] = MixedPrecision(param_dtype=dtype, reduce_dtype=dtype)
    try:
        model = fsdp1(mp.transform(build()), use_orig_params=True, **kwargs)
    except mp.ConfigError as e:
        return {"error": e.keys}
    seen = {}
    fc_in = model.blocks[0].mlp.fc_in

    def record(module, inputs, output):
        weight = module.weight
        seen.update(weight=str(weight.dtype), out=str(output.dtype))

    fc_in.register_forward_hook(record)
    inputs, targets = local_rows(batches()[0], *replica_rank_and_size())
    lm_loss(model(inputs).float(), targets).backward()
    return {**seen, "stored": sorted({str(p.dtype) for p in model.parameters()}),
            "grads": sorted({str(p.grad.dtype) for p in model.parameters()
                             if p.grad is not None}),
            "reduce": str(model.mixed_precision.reduce_dtype)}


@pytest.mark.parametrize("config", [{"bf16": True}, {"bf16": True, **TP2}],
                         ids=["bf16", "bf16-tp2"])
def test_half_precision_config_reaches_fsdp1(workers, config):
    for got in workers(2).run(precision_case, config=config, policy=None):
        assert got == {"weight": "torch.bfloat16", "out": "torch.bfloat16",
                       "stored": ["torch.float32"], "grads": ["torch.float32"],
                       "reduce": "torch.float32"}


def test_script_mixed_precision_must_agree_with_the_config(workers):
    for got in workers(2).run(precision_case, config={"bf16": True}, policy="fp16"):
        assert got == {"error": ["bf16"]}
    for got in workers(2).run(precision_case, config={"fp16": True}, policy="bf16"):
        assert got == {"error": ["fp16"]}
    for got in workers(2).run(precision_case, config={"bf16": True}, policy="bf16"):
        assert got["out"] == "torch.bfloat16"
        assert got["reduce"] == "torch.bfloat16", "the script's own policy is kept"


# -- 6. a model tensor parallelism leaves whole: TP ranks are data-parallel replicas --------

def mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Linear(32, 32), nn.ReLU(),
                         nn.Linear(32, 4))


def mlp_batches():
    g = torch.Generator().manual_seed(2)
    return [(torch.randn(GLOBAL_BATCH, 8, generator=g), torch.randn(GLOBAL_BATCH, 4,
                                                                     generator=g))
            for _ in range(STEPS)]


@functools.cache
def mlp_reference():
    return train(mlp(), mlp_batches(), optimizer=sgd, loss_fn=F.mse_loss)


def unsplit_case(config: dict, use_orig_params: bool):
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

    mp.init(config)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # "no tensor-parallel plan"
        model = FSDP(mp.transform(mlp()), use_orig_params=use_orig_params)
    result = train(model, mlp_batches(), optimizer=sgd, loss_fn=F.mse_loss,
                   replica=(mp.dp_rank(), mp.dp_size()), group=mp.get_dp_process_group())
    assert_parity(result, mlp_reference())
    return mp.dp_size()


@pytest.mark.parametrize("world, config, use_orig_params", [
    (4, TP2_HYBRID2, True),  # shard over 2, replicate over the 2 tp ranks
    (4, TP2, False),
    (4, {**TP2, "hybrid_shard_degree": 1}, True),  # no sharding: 4 replicas
    (8, TP2_HYBRID2, True),  # shard over 2, replicate over 2 x tp 2
], ids=["tp2-hybrid2", "tp2-flat-params", "tp2-hybrid1", "tp2-hybrid2-8ranks"])
def test_unsplit_model_averages_over_tensor_parallel_ranks(workers, world, config,
                                                         use_orig_params):
    assert workers(world).run(unsplit_case, config=config,
                              use_orig_params=use_orig_params) == [world] * world


# -- torch internals the FSDP1 path relies on ----------------------------------------------

def internals_case():
    import torch.distributed.checkpoint.optimizer as dcp_optimizer
    import torch.distributed.fsdp._common_utils as fsdp_common_utils
    import torch.distributed.fsdp._optim_utils as fsdp_optim_utils
    from torch.distributed.fsdp import ShardingStrategy
    from torch.distributed.fsdp._flat_param import FlatParamHandle

    from modelparallel.parallel import fsdp1_limits, fsdp1_torch

    model = transformed(TP2, use_orig_params=True)  # one data-parallel rank
    units = [model, *model.blocks]
    flat = model.blocks[0]._handle.flat_param
    q = fsdp1_torch.split_params(model)["blocks.0.attn.q_proj.weight"]
    return {
        "FSDP1's strategy clamp found": fsdp1_torch._torch_init_core_state is not None,
        "DCP's optimizer unflattening found":
            fsdp1_torch._torch_unflatten_optim_state_dict is not None,
        "sharded over one rank": {u.sharding_strategy for u in units} ==
                                 {ShardingStrategy.FULL_SHARD},
        "FSDP1's optimizer state gathering found":
            fsdp1_torch._torch_gather_all_orig_param_state is not None
            and all(hasattr(fsdp_optim_utils, f) for f in fsdp1_torch._GATHER_STEPS)
            and fsdp_optim_utils._gather_all_orig_param_state
            is fsdp1_torch._gather_all_orig_param_state,
        "FSDP1's name cleaning found": hasattr(fsdp_common_utils, "clean_tensor_name"),
        "DCP's sharded optimizer loading steps found":
            dcp_optimizer._get_state_dict_2d_layout is fsdp1_torch._get_state_dict_2d_layout
            and dcp_optimizer._create_chunk_sharded_tensor
            is fsdp1_torch._create_chunk_sharded_tensor,
        "flat parameter metadata": all(hasattr(flat, a) for a in (
            "_shard_param_infos", "_param_extensions", "_params", "_fqns", "_shapes",
            "_shared_param_infos", "_param_infos")),
        "a unit's flat/original choice and mesh": all(
            u._use_orig_params is True and hasattr(u, "_device_mesh") for u in units),
        # FSDP1 marks a gradient it gathered on purpose with this attribute
        "gathered gradients marked": "_saved_grad_shard" in inspect.getsource(FlatParamHandle),
        "split parameters by name": (q.shape, q.local_shape, q.data_mesh is not None) ==
                                    ((32, 32), (16, 32), True),
        "tensor-parallel parameters flattened": fsdp1_torch.holds_split_params(model),
        "FSDP1's gradient views kept on one-rank shards (fsdp1_limits)":
            FlatParamHandle._use_unsharded_grad_views is fsdp1_limits._grad_views
            and callable(fsdp1_limits._torch_unsharded_grad_views)
            and all(u._handle in fsdp1_limits._ONE_RANK_SHARDS for u in units),
        "our state dict extension": all(isinstance(u._fsdp_extension,
                                                   fsdp1_torch._LocalShardExtensions)
                                        for u in units),
    }


def test_fsdp1_internals_we_rely_on(workers):
    """Fails, naming what moved, if a torch release changes the FSDP1 internals that
    modelparallel.parallel.fsdp1_torch uses."""
    for got in workers(2).run(internals_case):
        assert got == dict.fromkeys(got, True)
