"""Where parameters really live: shard sizes, meshes and groups for FSDP2 and FSDP1."""

import math

import pytest
import torch
from torch import nn

import modelparallel as mp
from modelparallel.models import GPT, GPTConfig

CFG = GPTConfig(vocab_size=64, max_seq_len=16, d_model=32, n_layers=2, n_heads=2)


def build_model() -> GPT:
    torch.manual_seed(0)
    return GPT(CFG)


# -- FSDP2 (mp.shard) ---------------------------------------------------------------------

def fsdp2_layout_case(config):
    from torch.distributed.fsdp import FSDPModule
    from torch.distributed.tensor import DTensor

    mp.init(config)
    model = mp.shard(build_model())
    w = model.blocks[0].mlp.fc_in.weight
    assert isinstance(w, DTensor)
    return {
        "mesh_dims": w.device_mesh.mesh_dim_names,
        "mesh_shape": tuple(w.device_mesh.shape),
        "placements": [str(p) for p in w.placements],
        "local_shape": tuple(w.to_local().shape),
        "full_shape": tuple(w.shape),
        "units": [isinstance(b, FSDPModule) for b in model.blocks] + [isinstance(model,
                                                                                  FSDPModule)],
        "mesh_ranks": w.device_mesh.mesh.reshape(-1, w.device_mesh.shape[-1]).tolist(),
    }


@pytest.mark.parametrize(("config", "dims", "shape", "placements"), [
    ({}, ("dp_shard",), (8,), ["S(0)"]),
    ({"hybrid_shard_degree": 2}, ("dp_replicate", "dp_shard"), (4, 2), ["R", "S(0)"]),
    ({"hybrid_shard_degree": 4}, ("dp_replicate", "dp_shard"), (2, 4), ["R", "S(0)"]),
    ({"hybrid_shard_degree": 1}, ("dp_replicate", "dp_shard"), (8, 1), ["R", "S(0)"]),
])
def test_fsdp2_shards_over_hybrid_shard_degree_ranks(workers, config, dims, shape, placements):
    results = workers(8).run(fsdp2_layout_case, config=config)
    shard = shape[-1]
    for rank, got in enumerate(results):
        assert got["mesh_dims"] == dims and got["mesh_shape"] == shape
        assert got["placements"] == placements
        rows, cols = got["full_shape"]
        assert got["local_shape"] == (math.ceil(rows / shard), cols)
        assert all(got["units"]), "every block and the root are FSDP units"
        # shard groups are contiguous ranks (D = replicate outer, shard inner)
        first = rank // shard * shard
        assert list(range(first, first + shard)) in got["mesh_ranks"]


def mixed_precision_case():
    mp.init({"bf16": True})
    model = mp.shard(build_model())
    seen = {}
    model.blocks[0].mlp.fc_in.register_forward_hook(
        lambda mod, inp, out: seen.update(weight=str(mod.weight.dtype), out=str(out.dtype)))
    model(torch.randint(CFG.vocab_size, (2, CFG.max_seq_len))).float().mean().backward()
    seen["stored"] = str(model.blocks[0].mlp.fc_in.weight.dtype)
    seen["grad"] = str(model.blocks[0].mlp.fc_in.weight.grad.dtype)
    return seen


def test_bf16_computes_in_bf16_and_keeps_fp32_parameters(workers):
    for got in workers(2).run(mixed_precision_case):
        assert got == {"weight": "torch.bfloat16", "out": "torch.bfloat16",
                       "stored": "torch.float32", "grad": "torch.float32"}


def blocks_override_case():
    from torch.distributed.fsdp import FSDPModule

    mp.init({})
    model = mp.shard(build_model(), blocks=[nn.Embedding])
    return [type(m).__name__ for m in model.modules() if isinstance(m, FSDPModule)]


def test_blocks_can_be_chosen(workers):
    for units in workers(2).run(blocks_override_case):
        assert units == ["FSDPGPT", "FSDPEmbedding", "FSDPEmbedding"]


# -- FSDP1, unchanged scripts ---------------------------------------------------------------

def fsdp1_layout_case(config, strategy=None, explicit_group=False):
    import torch.distributed as dist
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
    from torch.distributed.fsdp import ShardingStrategy
    from torch.distributed.fsdp.wrap import ModuleWrapPolicy

    from modelparallel.models.gpt import Block

    mp.init(config)
    kwargs = {"auto_wrap_policy": ModuleWrapPolicy({Block})}
    if strategy is not None:
        kwargs["sharding_strategy"] = ShardingStrategy[strategy]
    if explicit_group:
        kwargs["process_group"] = dist.group.WORLD
    model = FSDP(build_model(), **kwargs)  # exactly what an FSDP1 script writes
    inner = [m for m in model.modules() if isinstance(m, FSDP)]
    handle = inner[1]._handle  # the first Block's flat parameter
    flat = handle.flat_param
    inter = getattr(model, "_inter_node_pg", None)
    return {
        "strategy": model.sharding_strategy.name,
        "inner_strategies": sorted({m.sharding_strategy.name for m in inner}),
        "shard_group": dist.get_process_group_ranks(model.process_group),
        "replicate_group": dist.get_process_group_ranks(inter) if inter is not None else None,
        "local_numel": flat._sharded_size.numel(),
        "full_numel": flat._unpadded_unsharded_size.numel(),
    }


@pytest.mark.parametrize(("config", "strategy", "expected", "shard", "replicate"), [
    # hybrid_shard_degree 4 on 8 ranks: shard over 4 ranks, 2 replicas
    ({"hybrid_shard_degree": 4}, None, "HYBRID_SHARD", 4, 2),
    ({"hybrid_shard_degree": 4}, "_HYBRID_SHARD_ZERO2", "_HYBRID_SHARD_ZERO2", 4, 2),
    ({"hybrid_shard_degree": 4}, "FULL_SHARD", "HYBRID_SHARD", 4, 2),
    ({"hybrid_shard_degree": 4}, "SHARD_GRAD_OP", "_HYBRID_SHARD_ZERO2", 4, 2),
    ({"hybrid_shard_degree": 2}, None, "HYBRID_SHARD", 2, 4),
    ({"hybrid_shard_degree": 8}, None, "FULL_SHARD", 8, None),
    ({"hybrid_shard_degree": 1}, None, "NO_SHARD", 1, None),
    ({}, None, "FULL_SHARD", 8, None),  # 0: PyTorch's own behaviour
])
def test_fsdp1_script_follows_hybrid_shard_degree(workers, config, strategy, expected, shard,
                                                 replicate):
    results = workers(8).run(fsdp1_layout_case, config=config, strategy=strategy)
    for rank, got in enumerate(results):
        assert got["strategy"] == expected
        assert got["inner_strategies"] == [expected], "auto-wrapped children follow the root"
        first = rank // shard * shard
        if expected != "NO_SHARD":
            assert got["shard_group"] == list(range(first, first + shard))
            assert got["local_numel"] == math.ceil(got["full_numel"] / shard)
        else:
            assert got["shard_group"] == list(range(8))
            assert got["local_numel"] == got["full_numel"]
        if replicate:
            assert got["replicate_group"] == list(range(rank % shard, 8, shard))


def test_fsdp1_explicit_process_group_is_left_alone(workers):
    results = workers(8).run(fsdp1_layout_case, config={"hybrid_shard_degree": 4},
                             explicit_group=True)
    for got in results:
        assert got["strategy"] == "FULL_SHARD" and got["shard_group"] == list(range(8))
