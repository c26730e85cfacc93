"""examples/expert_parallel/train_mixtral.py: the experts split over 2 ranks, each rank
reading its own rows, train what one process trains on all the rows, so both print the
same losses and load-balancing losses."""

import re


def test_expert_parallel_example_prints_one_process_losses(modelparallel):
    printed = []
    for ranks, ep, batch in ((1, 1, 4), (2, 2, 2)):
        ran = modelparallel("run", "--nproc-per-node", ranks,
                            "examples/expert_parallel/train_mixtral.py", "--steps", 6,
                            "--log-every", 3, "--batch-size", batch,
                            "--expert-parallel-degree", ep, timeout=600)
        assert ran.code == 0, ran.all
        steps = re.findall(r"step +\d+ \| loss ([\d.]+) \| load balance ([\d.]+) \| this "
                           r"rank holds (\d) of 4 experts", ran.out)
        assert [int(held) for *_, held in steps] == [4 // ep] * 2, ran.out
        assert "Warning" not in ran.all, ran.all
        printed.append([(loss, balance) for loss, balance, _ in steps])
    assert printed[0] == printed[1], printed
