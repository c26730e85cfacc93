"""The SMP rank API, process groups and object collectives in real processes."""

import pytest
import torch.distributed as dist

import modelparallel as mp
from modelparallel.topology import CommGroup, RankType

LAYOUTS = [
    {"tensor_parallel_degree": 2, "pipeline_parallel_degree": 2},  # cluster = DPT
    {"tensor_parallel_degree": 2, "pipeline_parallel_degree": 2, "placement_strategy": "spread"},
    {"tensor_parallel_degree": 2, "pipeline_parallel_degree": 2, "placement_strategy": "PTD"},
    {"hybrid_shard_degree": 2, "tensor_parallel_degree": 2},
    {"hybrid_shard_degree": 4},
]


def groups_case(config):
    mp.init(config)
    s = mp.state
    out = {"queries": {  # each call written out: the compatibility table cites them here
        "rank": mp.rank(), "size": mp.size(), "local_rank": mp.local_rank(),
        "local_size": mp.local_size(), "dp_rank": mp.dp_rank(), "dp_size": mp.dp_size(),
        "rdp_rank": mp.rdp_rank(), "rdp_size": mp.rdp_size(), "pp_rank": mp.pp_rank(),
        "pp_size": mp.pp_size(), "tp_rank": mp.tp_rank(), "tp_size": mp.tp_size(),
        "mp_rank": mp.mp_rank(), "mp_size": mp.mp_size()}}
    out["lists"] = {"DP_GROUP": mp.get_dp_group(), "MP_GROUP": mp.get_mp_group(),
                    "PP_GROUP": mp.get_pp_group(), "TP_GROUP": mp.get_tp_group(),
                    "RDP_GROUP": mp.get_rdp_group()}
    process_groups = {"WORLD": mp.get_world_process_group(),
                      "DP_GROUP": mp.get_dp_process_group(),
                      "MP_GROUP": mp.get_mp_process_group(),
                      "PP_GROUP": mp.get_pp_process_group(),
                      "TP_GROUP": mp.get_tp_process_group(),
                      "RDP_GROUP": mp.get_rdp_process_group()}
    out["named"] = {name: dist.get_process_group_ranks(pg) for name, pg in process_groups.items()}
    for group in CommGroup:
        pg = mp.get_process_group(group)
        out[group.name] = dist.get_process_group_ranks(pg)
        # the group really communicates: everyone in it agrees on its members
        out[group.name + "_gathered"] = mp.allgather(mp.rank(), group)
    out["dp_shard"] = dist.get_process_group_ranks(s.meshes["dp_shard"].get_group())
    out["dp_replicate"] = dist.get_process_group_ranks(s.meshes["dp_replicate"].get_group())
    return out


@pytest.mark.parametrize("config", LAYOUTS, ids=[str(c) for c in LAYOUTS])
def test_groups_match_the_rank_arithmetic(workers, config):
    results = workers(8).run(groups_case, config=config)
    topo = mp.Topology.from_config(mp.Config.load(config, environ={}), 8)
    for rank, got in enumerate(results):
        q = got["queries"]
        assert q["rank"] == rank and q["size"] == 8
        assert q["local_rank"] == rank and q["local_size"] == 8
        for group in CommGroup:
            expected = topo.group_ranks(rank, group)
            assert got[group.name] == expected, (rank, group)
            assert got[group.name + "_gathered"] == expected, (rank, group)
            assert got["named"][group.name] == expected, (rank, group)
            if group.name in got["lists"]:  # get_dp_group() & co.: the same ranks, listed
                assert got["lists"][group.name] == expected, (rank, group)
        assert set(got["lists"]) | {"WORLD"} == set(got["named"]) == {g.name for g in CommGroup}
        assert got["dp_shard"] == topo.group_ranks(rank, ["dp_shard"])
        assert got["dp_replicate"] == topo.group_ranks(rank, ["dp_replicate"])
        for name, group in [("tp", CommGroup.TP_GROUP), ("pp", CommGroup.PP_GROUP),
                            ("dp", CommGroup.DP_GROUP), ("rdp", CommGroup.RDP_GROUP),
                            ("mp", CommGroup.MP_GROUP)]:
            assert q[f"{name}_rank"] == topo.rank_in(rank, group)
            assert q[f"{name}_size"] == topo.size_of(group)


def point_to_point_case():
    mp.init({"tensor_parallel_degree": 2, "pipeline_parallel_degree": 2})
    got = {}
    # SMP broadcast: the sender calls broadcast, every receiver calls recv_from
    if mp.rank() == 0:
        mp.broadcast({"from": 0}, mp.WORLD)
    else:
        got["broadcast"] = mp.recv_from(0, RankType.WORLD_RANK)
    # send within the model-parallel group, addressed by mp_rank
    if mp.mp_rank() == 0:
        mp.send(("hello", mp.rank()), 3, RankType.MP_RANK)
    elif mp.mp_rank() == 3:
        got["send"] = mp.recv_from(0, RankType.MP_RANK)
    mp.barrier(mp.DP_GROUP)
    mp.dp_barrier()
    mp.mp_barrier()
    try:
        mp.send("x", 2, RankType.TP_RANK)
    except ValueError as e:
        got["bad_peer"] = str(e)
    return got


def test_object_send_broadcast_and_recv(workers):
    results = workers(4).run(point_to_point_case)
    for rank, got in enumerate(results):
        if rank:
            assert got["broadcast"] == {"from": 0}
        # mp groups (cluster, tp=pp=2, 4 ranks): one group [0,1,2,3]
        if rank == 3:
            assert got["send"] == ("hello", 0)
        assert "TP_RANK 2 does not exist" in got["bad_peer"]
        assert "ranks 0..1" in got["bad_peer"]


def not_initialized_case():
    mp.reset()
    try:
        mp.dp_rank()
    except mp.NotInitializedError as e:
        return str(e)
    return None


def test_calls_before_init_say_what_to_do(workers):
    for message in workers(2).run(not_initialized_case):
        assert message is not None and "call mp.init(config)" in message


def double_init_case():
    mp.init({})
    try:
        mp.init({})
    except RuntimeError as e:
        return str(e)
    return None


def test_second_init_is_refused(workers):
    for message in workers(2).run(double_init_case):
        assert "already called" in message and "mp.reset()" in message


def nccl_without_gpu_case():
    try:
        mp.init({"ddp_dist_backend": "nccl"})
    except mp.ConfigError as e:
        return str(e)
    return None


def test_nccl_without_gpus_is_a_config_error(workers):
    import torch

    if torch.cuda.is_available():
        pytest.skip("this machine has GPUs")
    for message in workers(2).run(nccl_without_gpu_case):
        assert "ddp_dist_backend: 'nccl' needs CUDA GPUs" in message and "'gloo'" in message
