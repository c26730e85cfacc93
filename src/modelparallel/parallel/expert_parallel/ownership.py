"""Which experts an expert-parallel rank holds: a contiguous range, the same size on every
rank (SMP's and torchtitan's layout: rank ``r`` of ``ep`` holds experts
``[r * E / ep, (r + 1) * E / ep)``)."""

from __future__ import annotations

from dataclasses import dataclass

from modelparallel.errors import ConfigError


@dataclass(frozen=True)
class ExpertRange:
    """The experts one rank holds, ``[first, first + count)``, of ``total``."""

    first: int
    count: int
    total: int

    def owner(self, expert: int) -> int:
        """The expert-parallel rank that holds ``expert``."""
        return expert // self.count


def local_experts(total: int, ep_rank: int, ep_size: int, where: str = "the model") -> ExpertRange:
    """The range of experts ``ep_rank`` of ``ep_size`` holds; a ConfigError when the
    experts do not split evenly."""
    if total % ep_size:
        valid = ", ".join(str(d) for d in range(1, total + 1) if total % d == 0)
        raise ConfigError([("expert_parallel_degree", (
            f"{ep_size} does not divide the {total} experts of {where}: every rank holds "
            f"the same number of experts; valid values: {valid}"))])
    count = total // ep_size
    return ExpertRange(first=ep_rank * count, count=count, total=total)
