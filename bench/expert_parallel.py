"""Benchmark: expert parallelism's all-to-all bytes, and its step time.

    python bench/expert_parallel.py [--tokens 2048] [--hidden 256] [--experts 8]
                                    [--top-k 2] [--layers 2] [--steps 6]

Runs in real gloo processes on this machine (``expert_parallel_degree`` 2 on 2 ranks)
and prints, as its last line, ratios measured in this one run:

- ep_dispatch_bytes, ep_combine_bytes: a small Mixtral (random weights, fp32,
  ``--tokens`` tokens per rank) transformed with ``expert_parallel_degree`` 2, one
  forward: the bytes the all-to-alls of each experts module's dispatch and combine send
  (``CollectiveCounter``: the rows that leave the rank, counted from the tensors actually
  sent; the dispatch also sends each row's expert index, 8 B, and the counts), summed
  over the ranks of the group, over tokens x hidden x top_k x (ep - 1) / ep x 4 bytes
  with the routing that happened: the (token, k) choices whose expert another rank
  holds, counted from the router's choices (balanced routing sends ep x tokens x top_k
  x (ep - 1) / ep of them). Goal within 2%; the worst layer counts.
- ep_routing_balance: those choices over balanced routing's (a random model's routers
  do not spread tokens evenly; they are initialised with std 1 here, as Mixtral's own
  std 0.02 sends most tokens to few experts).
- ep_step_time: median step time of ``tsm.transform`` (expert parallel 2) +
  ``tsm.shard`` over the same model trained by plain data parallelism (``fully_shard``
  by hand on the 2 ranks, every rank holding every expert), the same rows per rank;
  the variants alternate step by step (``paired_timing``). Expert parallelism trades
  the experts' all-gathers and reduce-scatters for the tokens' all-to-alls; on this
  machine's loopback the ratio says what that costs here, not on a GPU cluster.

A GPU is not used (one device would mean ep = 1).
"""

from __future__ import annotations

import argparse

import torch
from paired_timing import compare_steps

from modelparallel.testing import WorkerGroup

VOCAB, SEQ = 1024, 256


def mixtral(args: dict) -> torch.nn.Module:
    """The same small Mixtral on every rank (random weights)."""
    import transformers

    torch.manual_seed(0)
    config = transformers.MixtralConfig(
        vocab_size=VOCAB, hidden_size=args["hidden"], intermediate_size=2 * args["hidden"],
        num_hidden_layers=args["layers"], num_attention_heads=4, num_key_value_heads=4,
        num_local_experts=args["experts"], num_experts_per_tok=args["top_k"],
        max_position_embeddings=SEQ, use_cache=False, router_jitter_noise=0.0)
    model = transformers.MixtralForCausalLM(config)
    for layer in model.model.layers:  # a router that spreads random tokens evenly: the
        torch.nn.init.normal_(layer.mlp.gate.weight, std=1.0)  # default init picks few
    return model


def batch(args: dict, rank: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(rank)
    return torch.randint(VOCAB, (args["tokens"] // SEQ, SEQ), generator=g)


def measure_bytes(args: dict) -> dict:
    """This rank's bytes per dispatch and combine of one forward, and what the routing of
    that forward sends."""
    import torch.distributed as dist

    import modelparallel as tsm
    from modelparallel.parallel.expert_parallel.hugging_face import find_experts
    from modelparallel.smp.v2.moe import MoEConfig

    tsm.reset()
    tsm.init({"expert_parallel_degree": 2})
    model = tsm.transform(mixtral(args), config=MoEConfig(smp_moe=False,
                                                          moe_load_balancing="none"))
    ep, me = tsm.state.ep_size, tsm.state.ep_rank
    counter = tsm.observe.CollectiveCounter(tsm.state.group_labels)
    marks: list[float] = []
    routed: list[list[int]] = []  # per module: choices whose expert each rank holds

    def mark(*_: object) -> None:
        marks.append(counter.total_bytes)

    def count_routing(module: torch.nn.Module, args_: tuple, kwargs: dict) -> None:
        index = (args_ + tuple(kwargs.values()))[1]
        held = module.num_experts * ep  # the module's experts before the split
        owner = index[index < held] // module.num_experts
        routed.append(torch.bincount(owner, minlength=ep).tolist())
        mark()

    for _, experts in find_experts(model):  # around the library's hooks
        experts.register_forward_pre_hook(count_routing, prepend=True, with_kwargs=True)
        experts.register_forward_pre_hook(mark)
        experts.register_forward_hook(mark)
    with torch.no_grad(), counter:
        model(input_ids=batch(args, dist.get_rank()))
    dispatch = [marks[i + 1] - marks[i] for i in range(0, len(marks), 3)]
    combine = [marks[i + 2] - marks[i + 1] for i in range(0, len(marks), 3)]
    return {"dispatch": dispatch, "combine": combine, "routed": routed, "rank": me}


def step_times(args: dict) -> dict:
    """Expert parallel 2 (tsm) against plain data parallelism (fully_shard by hand)."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    import modelparallel as tsm
    from modelparallel.smp.v2.moe import MoEConfig

    tsm.reset()
    tsm.init({"expert_parallel_degree": 2})
    rows = batch(args, dist.get_rank())

    def stepper(model: torch.nn.Module):
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4)

        def step() -> None:
            opt.zero_grad(set_to_none=True)
            model(input_ids=rows, labels=rows).loss.backward()
            opt.step()
        return step

    def ours():
        model = tsm.transform(mixtral(args), config=MoEConfig(smp_moe=False,
                                                              moe_load_balancing="none"))
        return stepper(tsm.shard(model))

    def hand():
        mesh = init_device_mesh("cpu", (dist.get_world_size(),))
        model = mixtral(args)
        for layer in model.model.layers:
            fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
        return stepper(model)

    return compare_steps(ours, hand, args["steps"])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tokens", type=int, default=2048, help="tokens per rank")
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--experts", type=int, default=8)
    ap.add_argument("--top-k", type=int, default=2)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--steps", type=int, default=6, help="timed steps per variant and round")
    args = vars(ap.parse_args())
    ep = 2
    balanced = args["tokens"] * args["hidden"] * args["top_k"] * (ep - 1) / ep * 4
    print(f"Mixtral, {args['layers']} layers of {args['hidden']}, {args['experts']} experts, "
          f"top-{args['top_k']}, {args['tokens']} tokens per rank, fp32, "
          f"expert_parallel_degree {ep} on 2 ranks")
    ratios: dict[str, float] = {}
    row = args["hidden"] * 4
    with WorkerGroup(2, case_timeout_s=1800) as group:
        got = group.run(measure_bytes, args=args)
        worst = {"dispatch": 1.0, "combine": 1.0, "balance": 1.0}
        for layer in range(args["layers"]):
            group_sent = {"dispatch": 0.0, "combine": 0.0}
            group_rows = 0  # rows the routing sends off their rank (so also back)
            for r in got:
                me = r["rank"]
                sent, back = r["dispatch"][layer], r["combine"][layer]
                leaving = sum(n for dest, n in enumerate(r["routed"][layer]) if dest != me)
                arriving = sum(o["routed"][layer][me] for o in got if o["rank"] != me)
                print(f"layer {layer} rank {me}: dispatch {sent:.0f} B ({sent / balanced:.4f} "
                      f"of balanced routing's {balanced:.0f} B; {sent / (leaving * row):.4f} "
                      f"of this routing's rows: + 8 B of expert index per row and the "
                      f"counts), combine {back:.0f} B ({back / balanced:.4f}; "
                      f"{back / (arriving * row):.4f} of the rows it received)")
                group_sent["dispatch"] += sent
                group_sent["combine"] += back
                group_rows += leaving
            balance = group_rows * row / (len(got) * balanced)
            found = {name: total / (group_rows * row) for name, total in group_sent.items()}
            found["balance"] = balance
            print(f"layer {layer}: the group's dispatch sends {found['dispatch']:.4f} and its "
                  f"combine {found['combine']:.4f} of tokens x hidden x top_k x (ep-1)/ep at "
                  f"this routing; the routing sends {balance:.4f} of balanced routing's rows")
            for name, ratio in found.items():
                if abs(ratio - 1) > abs(worst[name] - 1):
                    worst[name] = ratio
        ratios["ep_dispatch_bytes"] = worst["dispatch"]
        ratios["ep_combine_bytes"] = worst["combine"]
        ratios["ep_routing_balance"] = worst["balance"]
        times = group.run(step_times, args=args)[0]
        rounds = ", ".join(f"{x:.4f}" for x in times["rounds"])
        print(f"step: expert parallel {times['ours'] * 1e3:.0f} ms, plain data parallel "
              f"{times['hand'] * 1e3:.0f} ms; rounds {rounds}")
        ratios["ep_step_time"] = times["ratio"]
    print("RATIOS " + " ".join(f"{k}={v:.4f}" for k, v in ratios.items()))


if __name__ == "__main__":
    main()
