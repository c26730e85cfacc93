"""Tokens to the ranks holding their experts and back: the dispatch and the combine.

Each rank routes its own tokens with the model's router (unchanged). Every (token, k)
choice travels to the rank holding its expert (one all-to-all of the rows, after one of
the counts), that rank computes its experts on what it received, the results travel back
(the reverse all-to-all) and each token sums its ``k`` results weighted by the router's
``top_k_weights``, as the model's own experts module does on one process. No token is
dropped (no capacity factor); the index ``num_experts`` (the models' "no expert"
sentinel) is skipped, as the model skips it.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist

from modelparallel.parallel.expert_parallel.exchange import all_to_all, exchange_counts
from modelparallel.parallel.expert_parallel.ownership import ExpertRange


@dataclass
class Routing:
    """One forward's routing on this rank: what was sent where, to bring it back."""

    tokens: int  # rows of the hidden states given to the experts module
    token_of: torch.Tensor  # the token of each sent row, in the order sent
    weight_of: torch.Tensor  # the router's weight of each sent row
    send: list[int]  # rows sent to each expert-parallel rank
    receive: list[int]  # rows received from each


@dataclass
class Received:
    """What this rank's experts compute on: rows and the local index of their expert."""

    hidden: torch.Tensor  # (rows, hidden)
    local_expert: torch.Tensor  # (rows,), in [0, experts held here)


CountsReader = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], tuple[list[int], list[int]]]


def read_counts(top_k_index: torch.Tensor, send: torch.Tensor,
                receive: torch.Tensor) -> tuple[list[int], list[int]]:
    """The rows this rank sends to each rank of the group and receives from each, read
    from the exchanged counts (``top_k_index``, the choices they were counted from, is
    for a reader that has no values to read: a simulation answering from shapes)."""
    return send.tolist(), receive.tolist()


def dispatch(hidden: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor,
             experts: ExpertRange, group: dist.ProcessGroup,
             counts: CountsReader = read_counts) -> tuple[Received, Routing]:
    """Send each (token, k) choice of ``hidden`` (tokens x hidden) to the rank holding its
    expert; return what this rank received and the routing to :func:`combine` with.
    Every shape but the exchanged rows' follows from the input's; those come from
    ``counts``."""
    top_k = top_k_index.shape[-1]
    choice = top_k_index.reshape(-1)
    token = torch.arange(hidden.shape[0], device=hidden.device).repeat_interleave(top_k)
    weight = top_k_weights.reshape(-1)
    # by expert, so by owning rank; the sentinel "no expert" (E) sorts last, owned by no
    # rank (ep), and is not sent
    order = torch.argsort(choice, stable=True)
    choice, token, weight = choice[order], token[order], weight[order]
    owner = torch.div(choice, experts.count, rounding_mode="floor")
    ep = dist.get_world_size(group)
    per_owner = torch.zeros(ep + 1, dtype=owner.dtype, device=owner.device)
    send_counts = per_owner.index_add_(0, owner, torch.ones_like(owner))[:ep]
    receive_counts = exchange_counts(send_counts, group)
    send, receive = counts(top_k_index, send_counts, receive_counts)
    kept = sum(send)
    choice, token, weight, owner = choice[:kept], token[:kept], weight[:kept], owner[:kept]
    rows = all_to_all(hidden[token], send, receive, group)
    local = all_to_all((choice - owner * experts.count)[:, None], send, receive, group)
    routing = Routing(tokens=hidden.shape[0], token_of=token, weight_of=weight,
                      send=send, receive=receive)
    return Received(rows, local[:, 0]), routing


def combine(computed: torch.Tensor, routing: Routing, group: dist.ProcessGroup,
            like: torch.Tensor) -> torch.Tensor:
    """Bring each received row's expert output (``computed``, in the order received) back
    to its token and sum a token's choices weighted by the router: the experts module's
    output on one process, of ``like``'s shape and dtype."""
    returned = all_to_all(computed, routing.receive, routing.send, group)
    weighted = returned * routing.weight_of[:, None]
    out = torch.zeros_like(like)
    return out.index_add(0, routing.token_of, weighted.to(out.dtype))
