"""The worker group the distributed tests share: when it restarts and when it need not."""

from pathlib import Path

import pytest

from modelparallel.testing import WorkerGroup
from modelparallel.testing.workers import WorkerError


def make_groups(count: int) -> int:
    import torch.distributed as dist

    for _ in range(count):
        dist.new_group([0, 1])
    return dist.get_rank()


def refuse() -> None:
    raise ValueError("refused on every rank")


@pytest.mark.skipif(not Path("/proc/self/task").is_dir(),
                    reason="gloo threads are counted from /proc (Linux)")
def test_a_refusal_on_every_rank_keeps_the_group_and_many_gloo_groups_restart_it():
    with WorkerGroup(2, max_gloo_groups=8) as group:
        pids = [p.pid for p in group._procs]
        with pytest.raises(WorkerError, match="refused on every rank"):
            group.run(refuse)
        assert group.alive and [p.pid for p in group._procs] == pids  # no restart
        assert group.run(make_groups, count=4) == [0, 1]
        assert group.alive  # 5 gloo groups (default included): under the budget
        assert group.run(make_groups, count=4) == [0, 1]
        assert not group.alive  # 9 > 8: closed, to restart on the next case
        assert group.run(make_groups, count=1) == [0, 1]
        assert group.alive and not {p.pid for p in group._procs} & set(pids)
