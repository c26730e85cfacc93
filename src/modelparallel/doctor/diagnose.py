"""From what every rank published (``board``), say what went wrong: ranks that issued
different calls, a rank that finished while others wait for it, ranks waiting for each
other, and, when a collective timed out, which ranks did not arrive and where they are.

Pure functions over the published states (dicts of ``Call.as_dict()``), so they are
tested without processes. Each returns a message, or None when it finds nothing.
"""

from __future__ import annotations

from collections import Counter, defaultdict
from typing import Any

State = dict[str, Any]  # {"rank", "current", "recent", "done", ...}


def _calls(state: State) -> list[dict[str, Any]]:
    calls = list(state.get("recent") or [])
    if state.get("current"):
        calls.append(state["current"])
    if state.get("failed"):
        calls.append(state["failed"])
    return calls


def _describe(call: dict[str, Any]) -> str:
    what = f"{call['op']}({call['shape']}, {call['dtype']})" if call.get("shape") else call["op"]
    if call.get("peer") is not None:
        what += f" {'to' if call['op'] in ('send', 'isend') else 'from'} rank {call['peer']}"
    return f"{what} at {call['site']}"


def _ranks(ranks: list[int]) -> str:
    return f"rank {ranks[0]}" if len(ranks) == 1 else "ranks " + ", ".join(map(str, ranks))


def _group(call: dict[str, Any]) -> str:
    """A process group by name and members (two groups may have the same members)."""
    return f"group {call['group']} (ranks {', '.join(map(str, call.get('ranks') or []))})"


# all-to-all exchanges may send each rank a different amount: their shapes differ by design
_ANY_SHAPE = ("all_to_all", "all_to_all_single")


def _fingerprint(call: dict[str, Any]) -> tuple[str, str, str]:
    shape = "" if call["op"] in _ANY_SHAPE else call["shape"]
    return call["op"], shape, call["dtype"]


def divergence(states: list[State]) -> str | None:
    """The first call number on a group where ranks called different operations, shapes
    or dtypes. The ranks outside the largest agreeing set are named as diverging."""
    by_key: dict[tuple[str, int], dict[int, dict[str, Any]]] = defaultdict(dict)
    for state in states:
        for call in _calls(state):
            if call["op"] in ("send", "recv", "isend", "irecv"):
                continue  # point-to-point calls differ by design (a send meets a recv)
            by_key[(call["group"], call["seq"])][state["rank"]] = call
    for (_, seq), calls in sorted(by_key.items(), key=lambda item: item[1][min(item[1])]["start"]):
        prints = Counter(_fingerprint(c) for c in calls.values())
        if len(prints) < 2:
            continue
        (majority, count), = prints.most_common(1)
        tie = list(prints.values()).count(count) > 1
        lines = [f"ranks diverged: collective #{seq} on {_group(next(iter(calls.values())))} "
                 "is not the same call on every rank"]
        for fingerprint, _ in prints.most_common():
            ranks = sorted(r for r, c in calls.items() if _fingerprint(c) == fingerprint)
            role = "" if tie else (" (the others)" if fingerprint == majority
                                   else " <- diverged")
            lines.append(f"  {_ranks(ranks)}: {_describe(calls[ranks[0]])}{role}")
        return "\n".join(lines)
    return None


def finished_early(states: list[State], me: int) -> str | None:
    """Ranks that finished while ``me`` waits in a call they belong to."""
    mine = next((s for s in states if s["rank"] == me), None)
    if mine is None:
        return None
    call = mine.get("current") or mine.get("failed")
    if call is None:
        return None
    done = [s for s in states if s.get("done") and s["rank"] in call["ranks"]
            and s["rank"] != me and not _arrived(s, call)]
    if not done:
        return None
    made = {s["rank"]: max((c["seq"] for c in _calls(s) if c["group"] == call["group"]),
                           default=0) for s in done}
    lines = [f"rank {me} waits in collective #{call['seq']} on {_group(call)}: "
             f"{_describe(call)}",
             f"  but {_ranks(sorted(made))} finished after "
             f"{', '.join(f'{n} calls' for n in sorted(set(made.values())))} on that group: "
             "one side skipped a call or made an extra one"]
    first = _first_site_difference(mine, done[0], call["group"])
    if first:
        lines.append(f"  first difference: {first}")
    return "\n".join(lines)


def _first_site_difference(a: State, b: State, group: str) -> str | None:
    calls_a = {c["seq"]: c for c in _calls(a) if c["group"] == group}
    calls_b = {c["seq"]: c for c in _calls(b) if c["group"] == group}
    for seq in sorted(set(calls_a) & set(calls_b)):
        if calls_a[seq]["site"] != calls_b[seq]["site"]:
            return (f"call #{seq}: rank {a['rank']} {_describe(calls_a[seq])}; "
                    f"rank {b['rank']} {_describe(calls_b[seq])}")
    return None


def _arrived(state: State, call: dict[str, Any]) -> bool:
    """Whether the rank of ``state`` has begun ``call`` (its group's calls are numbered,
    so a later number on that group means it has)."""
    if state.get("seqs", {}).get(call["group"], 0) >= call["seq"]:
        return True
    return (call["group"], call["seq"]) in {(c["group"], c["seq"]) for c in _calls(state)}


def _waits_for(state: State, by_rank: dict[int, State]) -> list[int]:
    """The ranks ``state``'s blocking call still needs."""
    call = state["current"]
    if call.get("peer") is not None:
        return [call["peer"]]
    return [m for m in call["ranks"] if m != state["rank"] and m in by_rank
            and not _arrived(by_rank[m], call)]


def cycle(states: list[State]) -> str | None:
    """Ranks each blocked in a call that needs the next one: a deadlock."""
    by_rank = {s["rank"]: s for s in states}
    blocked = {r: s for r, s in by_rank.items() if s.get("current")}
    edges = {r: [m for m in _waits_for(s, by_rank) if m in blocked] for r, s in blocked.items()}
    for start in sorted(edges):
        path, rank = [start], start
        while edges.get(rank):
            rank = edges[rank][0]
            if rank in path:
                loop = path[path.index(rank):]
                lines = ["deadlock: each of these ranks waits for the next"]
                for r in loop:
                    target = edges[r][0]
                    call = blocked[r]["current"]
                    lines.append(f"  rank {r} waits for rank {target} in {_describe(call)} "
                                 f"(#{call['seq']} on {_group(call)})")
                return "\n".join(lines)
            path.append(rank)
    return None


def timed_out(call: dict[str, Any] | None, me: int, states: list[State],
              stacks: dict[int, dict[str, Any]], waited: float | None) -> str:
    """A collective of ``me`` timed out: who waited where, who did not arrive, and where
    each of those is (their stacks)."""
    by_rank = {s["rank"]: s for s in states}
    if call is None:
        here = stacks.get(me, {}).get("site", "?")
        lines = [f"collective timeout on rank {me} at {here} (in a collective torch issued "
                 "itself)"]
        members = sorted(by_rank)
    else:
        lines = [f"collective timeout: rank {me} waited"
                 f"{f' {waited:g}s' if waited else ''} in {_describe(call)} "
                 f"(collective #{call['seq']} on {_group(call)})"]
        members = list(call["ranks"]) if call.get("peer") is None else [call["peer"]]
    for rank in members:
        if rank == me:
            continue
        state = by_rank.get(rank, {})
        arrived = call is not None and bool(state) and _arrived(state, call)
        if arrived or (call is None and state.get("timed_out")):
            lines.append(f"  rank {rank} arrived (waits too)" if arrived else
                         f"  rank {rank} waits too (its collective timed out)")
            continue
        where = stacks.get(rank)
        if state.get("done"):
            lines.append(f"  rank {rank} did not arrive: it finished")
        elif where is None:
            lines.append(f"  rank {rank} did not arrive and did not answer (its process "
                         "ended, or it holds the GIL in native code)")
        else:
            inside = where.get("call")
            doing = f"waits in {_describe(inside)}" if inside else \
                f"is at {where['site']} in {where['function']}()"
            lines.append(f"  rank {rank} did not arrive: it {doing}")
    return "\n".join(lines)
